"""Cheap proxy for the rotation kinds: the 6-bit residual's weight error, before a full conversion.

For every decoder Linear group of the model, each rotation kind (``quantize.hadamard``) rotates the
weights as the converter does (same seeds), quantizes the 2-bit Lloyd–Max base (levels fitted to that
kind's rotated weights) and then the uniform 6-bit residual, and measures what is left:

- ``rtn``: round-to-nearest, plain squared error ‖W − Q‖² (rotation-invariant, so comparable);
- ``gptq``: GPTQ for base and residual against the reference stream's input Hessian H (a smaller
  calibration set than the converter's), error tr(E·H·Eᵀ): the output error on calibration inputs;
- ``gptq_held_out``: the same quantized weights scored with the Hessian of as many other calibration
  sequences, which GPTQ never saw (the quality benchmark's KL is out of sample too).

Both are summed over all groups and divided by the same sum for int8_g32 (in the original basis), the
quality goal's yardstick: a row that is lower here should have a lower KL(base2+r6) / KL(int8_g32).
Also reported: the excess kurtosis of the group-RMS-normalised rotated weights (0 for a Gaussian), the
shape the 4-level base grid assumes. Usage::

    python benchmarks/rotation_proxy.py [--sequences 4 --seq-len 512 --seed S --out PATH]

Writes benchmarks/results/rotation_proxy.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from splitspec.config import ROTATIONS, ConvertConfig, DataConfig, ModelConfig
from splitspec.models.data import calibration_tokens, make_split
from splitspec.models.loader import load_reference
from splitspec.models.stream import ResidentModel
from splitspec.quantize.convert import fit_base_levels, group_layouts, rotated_group_weight
from splitspec.quantize.gptq import LloydMaxQuantizer, UniformQuantizer, gptq, int8_g32, rtn
from splitspec.quantize.hadamard import rotate_hessian
from splitspec.quantize.lloyd_max import group_rms_normalize

RESULTS = Path(__file__).parent / "results"
RESIDUAL_BITS = 6
METRICS = ("rtn", "gptq", "gptq_held_out")


def reference_hessians(model, spec, calib: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, group) -> E[x xᵀ] of the group's input over the calibration tokens, original weights."""
    sums: dict[tuple[int, str], torch.Tensor] = {}

    def hook(key: tuple[int, str], x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        sums[key] = sums.get(key, 0) + x.T @ x

    handles = [
        layer.get_submodule(g.linears[0].name).register_forward_pre_hook(
            lambda _m, args, key=(i, g.name): hook(key, args[0])
        )
        for i, layer in enumerate(model.model.layers)
        for g in spec.groups
    ]
    try:
        with torch.no_grad():
            model(calib)
    finally:
        for h in handles:
            h.remove()
    return {k: (v / calib.numel()).float() for k, v in sums.items()}


def weighted(e: torch.Tensor, h: torch.Tensor) -> float:
    """tr(E·H·Eᵀ) in float64."""
    e = e.double()
    return float(((e @ h.double()) * e).sum())


def excess_kurtosis(x: torch.Tensor) -> float:
    x = x.double()
    return float((x**4).mean() / (x**2).mean() ** 2 - 3)


def measure_kind(model, spec, hessians: dict, held_out: dict, kind: str, cfg: ConvertConfig) -> dict:
    """Summed errors of base2 + r6 under one rotation kind, per group name and in total."""
    cfg = dataclasses.replace(cfg, rotation=kind)
    layouts = group_layouts(spec, cfg.seed)
    levels = fit_base_levels(ResidentModel(model, spec), layouts, cfg)
    base_q, resid_q = LloydMaxQuantizer(levels), UniformQuantizer(RESIDUAL_BITS)
    per_group: dict[str, dict[str, float]] = {}
    normalised = []
    for i, layer in enumerate(model.model.layers):
        for g in spec.groups:
            layout = layouts[i][g.name]
            w = rotated_group_weight(layer, g, layout, kind)
            s_i = layout.signs()[0]
            h = rotate_hessian(hessians[i, g.name], s_i, kind)
            normalised.append(group_rms_normalize(w))
            base = rtn(w, base_q).dequant
            rtn_err = w - base - rtn(w - base, resid_q).dequant
            base = gptq(w, h, base_q, block=cfg.gptq_block, damp=cfg.damp).dequant
            gptq_err = w - base - gptq(w - base, h, resid_q, block=cfg.gptq_block, damp=cfg.damp).dequant
            acc = per_group.setdefault(g.name, dict.fromkeys(METRICS, 0.0))
            acc["rtn"] += float(rtn_err.double().square().sum())
            acc["gptq"] += weighted(gptq_err, h)
            acc["gptq_held_out"] += weighted(gptq_err, rotate_hessian(held_out[i, g.name], s_i, kind))
    total = {m: sum(v[m] for v in per_group.values()) for m in METRICS}
    return {
        "levels": levels.tolist(),
        "excess_kurtosis": excess_kurtosis(torch.cat(normalised)),
        "total": total,
        "per_group": per_group,
    }


def int8_errors(model, spec, hessians: dict, held_out: dict) -> dict[str, float]:
    """The yardstick: int8_g32's plain and Hessian-weighted errors, in the original basis."""
    out = dict.fromkeys(METRICS, 0.0)
    for i, layer in enumerate(model.model.layers):
        for g in spec.groups:
            for lin in g.linears:
                w = layer.get_submodule(lin.name).weight.detach().float()
                e = int8_g32(w) - w
                out["rtn"] += float(e.double().square().sum())
                out["gptq"] += weighted(e, hessians[i, g.name])
                out["gptq_held_out"] += weighted(e, held_out[i, g.name])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=4, help="calibration sequences for GPTQ (and held out)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=ConvertConfig.seed, help="rotation seed (random signs)")
    parser.add_argument("--out", default=str(RESULTS / "rotation_proxy.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model, tokenizer, spec = load_reference(ModelConfig())
    cfg = ConvertConfig(seed=args.seed, data=DataConfig(calib_sequences=args.sequences, calib_seq_len=args.seq_len))
    data = dataclasses.replace(cfg.data, calib_sequences=2 * args.sequences)
    calib = calibration_tokens(make_split(data), tokenizer, data)
    hessians = reference_hessians(model, spec, calib[: args.sequences])
    held_out = reference_hessians(model, spec, calib[args.sequences :])
    int8 = int8_errors(model, spec, hessians, held_out)
    kinds = {}
    for kind in ROTATIONS:
        kinds[kind] = measure_kind(model, spec, hessians, held_out, kind, cfg)
        kinds[kind]["over_int8"] = {m: kinds[kind]["total"][m] / int8[m] for m in int8}
        print(kind, json.dumps({k: kinds[kind][k] for k in ("levels", "excess_kurtosis", "over_int8")}))
    result = {
        "model": f"{spec.family}, {spec.n_layers} layers",
        "calibration": {"sequences": args.sequences, "held_out_sequences": args.sequences, "seq_len": args.seq_len},
        "seed": args.seed,
        "residual_bits": RESIDUAL_BITS,
        "int8_g32": int8,
        "kinds": kinds,
        "kronecker_over_sylvester": {
            m: kinds["kronecker"]["total"][m] / kinds["sylvester"]["total"][m] for m in METRICS
        },
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["kronecker_over_sylvester"]), f"{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
