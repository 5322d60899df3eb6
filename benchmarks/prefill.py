"""Prefill of 16, 64 and 256-token prompts through each path, and which one the engine's "auto" picks.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/prefill.py [FOLDER] [--bits 8 ...] [--reps 3]

FOLDER is a converted model (default ``out/smollm2-135m``: ``splitspec convert default out/smollm2-135m
--residual-bits 6,7,8``). The engine is started as ``scheduler.local.start_local`` does (a real CPU actor process,
engine and actor pinned to different cores). Per prompt length, the median of ``--reps`` prefills (after
one warm-up) on a fresh cache, through:

- ``split``: the CPU actors, in forwards of ``prefill_chunk`` tokens;
- ``device``: one forward with ``DeviceResidual`` streaming every group from the file (on an accelerator:
  host unpack, copy, dequantize, one GEMM; on the CPU: the CPU actors' kernel on the packed planes, in the
  engine's threads); the base product of a forward this long takes the decode + sgemm kernel
  (``cpu_base.DENSE_TOKENS``);
- ``device_resident``: the same with the whole residual kept on the device (``resident_bytes`` covering
  it), so no group is read (or unpacked) per prefill;
- ``split_whole``: the CPU actors, in one forward of the whole prompt (``prefill_chunk`` raised to the
  longest prompt, on the engine's side only): each group's rows still go to the actors in requests of at
  most ``channel.max_tokens`` (``SplitGroup``), while the base product runs at the prompt's full length,
  which from ``cpu_base.DENSE_TOKENS`` tokens on is a decode + sgemm. Not a path ``choose_prefill`` knows;
  what the split path would cost with forwards longer than one request.

``costs`` are what the engine measured (``measure_prefill_costs``: one layer's groups, times the layers,
plus the lm_head), as ms of one forward at each token count it timed, for the engine's own device residual (budget 0)
and for the resident one; ``estimate_ms`` is what they predict for a prompt (attention, norms and the
embedding come on top, alike on every path), and ``auto`` / ``auto_resident`` the path
``choose_prefill`` takes from them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from splitspec.config import EngineConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.prefill import MeasuredCost, choose_prefill, measure_prefill_costs
from splitspec.gpu_actor.residual import DeviceResidual
from splitspec.models.files import CorruptFileError
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler.local import start_local

RESULTS = Path(__file__).parent / "results"
TOKENS = (1, 16, 64, 256)


def prefill_once(engine: SplitEngine, prompt: torch.Tensor) -> tuple[float, dict[str, float]]:
    """Seconds of one prefill of ``prompt`` on a fresh cache, and the engine's own account of it
    (``StepStats``, ms): the base product, the wait for the residual, the channel's submit side, attention,
    the head, and ``other_ms``, the rest (rotations, norms, the MLP's activation, Python)."""
    cache = engine.new_cache()
    start = time.perf_counter()
    _, stats, _ = engine.prefill(prompt, cache)
    seconds = time.perf_counter() - start
    part = asdict(stats)
    del part["tokens"]
    total = part.pop("verify_ms")
    part["other_ms"] = total - sum(part.values())
    return seconds, part


def median_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(p[k] for p in parts), 2) for k in parts[0]}


def prefill_parts(engine: SplitEngine, prompt: torch.Tensor, reps: int) -> tuple[float, dict[str, float]]:
    """Median ms of ``reps`` prefills of ``prompt`` (``prefill_once``), after one warm-up, and the median of
    each part."""
    runs = [prefill_once(engine, prompt) for _ in range(reps + 1)][1:]
    return round(statistics.median(s for s, _ in runs) * 1e3, 2), median_parts([p for _, p in runs])


def prefill_ms(engine: SplitEngine, prompt: torch.Tensor, reps: int) -> float:
    """``prefill_parts``' median ms alone."""
    return prefill_parts(engine, prompt, reps)[0]


def _cost_ms(cost: MeasuredCost) -> dict[str, float]:
    """ms of one forward at each token count the engine timed."""
    return {str(tokens): round(seconds * 1e3, 4) for tokens, seconds in cost.points}


def measure(folder: Path, bits: int, reps: int) -> dict:
    converted = ConvertedModel(folder)
    config = EngineConfig(max_seq_len=max(TOKENS))
    chunk = config.prefill_chunk
    with start_local(folder, bits, config=config) as engine:
        start = time.perf_counter()
        costs = engine.prefill_costs()
        calibration_s = time.perf_counter() - start
        everything = converted.manifest["files"][f"residual{bits}.safetensors"]["bytes"]  # every row kept
        resident = DeviceResidual(converted, bits, config.device, resident_bytes=everything)
        try:
            resident_costs = measure_prefill_costs(engine.model, engine.residual, resident, chunk)
            paths = {
                "split": ("split", engine.device_residual, costs),
                "device": ("device", engine.device_residual, costs),
                "device_resident": ("device", resident, resident_costs),
            }
            views = {
                name: SplitEngine(engine.model, engine.residual, replace(config, prefill=p), device_residual=dev)
                for name, (p, dev, _) in paths.items()
            }
            whole = max(TOKENS)
            channel = replace(config.channel, max_tokens=max(whole, config.channel.max_tokens))
            views["split_whole"] = SplitEngine(
                engine.model, engine.residual, replace(config, prefill="split", prefill_chunk=whole, channel=channel)
            )
            rows = []
            for n in TOKENS:
                prompt = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n))
                row: dict = {"tokens": n}
                row.update({f"{name}_ms": prefill_ms(view, prompt, reps) for name, view in views.items()})
                row["estimate_ms"] = {
                    name: round(c.estimate(n, chunk)[p] * 1e3, 2) for name, (p, _, c) in paths.items()
                }
                row["auto"] = choose_prefill(n, costs, chunk)
                row["auto_resident"] = choose_prefill(n, resident_costs, chunk)
                rows.append(row)
                print(json.dumps(row))
        finally:
            resident.close()
        actor_cpus = engine.actors[0].ready["cpus"]
    return {
        "bits": bits,
        "layers": len(converted.layers),
        "device": config.device,
        "prefill_chunk": chunk,
        "actor_cpus": actor_cpus,
        "resident_bytes": everything,
        "calibration_s": round(calibration_s, 3),
        "costs": {"split": _cost_ms(costs.split), "device": _cost_ms(costs.device), "head_ms": 1e3 * costs.head_s},
        "costs_resident": {"device": _cost_ms(resident_costs.device)},
        "rows": rows,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        tokens = [r["tokens"] for r in result["rows"]]
        for name, color in (("split", "C0"), ("device", "C1"), ("device_resident", "C2")):
            ax.plot(tokens, [r[f"{name}_ms"] for r in result["rows"]], "o-", color=color, label=f"{name} (measured)")
            estimate = [r["estimate_ms"][name] for r in result["rows"]]
            ax.plot(tokens, estimate, "--", color=color, alpha=0.6, label=f"{name} (estimate)")
        whole = [r["split_whole_ms"] for r in result["rows"]]
        ax.plot(tokens, whole, "s-", color="C3", label="split, one forward (measured)")
        for r in result["rows"]:
            ax.annotate(f"auto: {r['auto']}", (r["tokens"], r["split_ms"]), fontsize=7, va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms per prefill (median)")
        ax.set_title(f"{result['layers']} layers, {result['bits']}-bit residual, device {result['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", nargs="?", type=Path, default=Path("out/smollm2-135m"))
    p.add_argument("--bits", type=int, nargs="+", default=[8], choices=(6, 7, 8))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "prefill.json")
    args = p.parse_args()
    try:
        ConvertedModel(args.folder)  # the project's own check of the folder, before anything starts
    except CorruptFileError as exc:
        raise SystemExit(str(exc)) from None
    results = [measure(args.folder, bits, args.reps) for bits in args.bits]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "folder": str(args.folder),
        "load_average_1min": os.getloadavg()[0],
        "reps": args.reps,
        "runs": results,
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
