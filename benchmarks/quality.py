"""Precision of the verifier (2-bit base + b-bit residual) against the float32 reference.

Every row quantizes only the decoder Linears; embeddings, norms and lm_head stay fp32 and the logits
are hidden @ lm_head in fp32 (recipe, section 9). Scored positions (``--split``): the evaluation split's
assistant tokens (``eval``, the default), the dev split's (``dev``: what remedies are chosen on), or the
reference's greedy continuation of the held-out chat and code prompts (``heldout``, never used to choose
anything) or of the prompts in ``--prompts FILE.jsonl`` (one ``{"messages": [...]}`` or ``{"text": ...}``
per line); none of them is ever seen by the calibration. Per-sequence KL sums are kept in the JSON so that
two runs on the same split (two conversions) can be compared pair by pair (``quality_compare.py``).

``base2+r{b}+int16`` and ``+int8`` rows: the CPU kernel's integer modes round the rotated activations x'
it receives to int16 or int8 (one scale per token and 128 columns, ``quantize/activations.py``) before
multiplying them by the residual R~. These rows are ``base2+r{b}`` with only that rounding added, so each
pair measures what an integer mode costs in the logits: y = W_eff·x + R·rot⁻¹(round(x') − x'), R the
residual in the original basis (the base's product is unaffected, the GPU multiplies it in fp32).
``base2+r{b}+int16tiles``: an engine without a GPU multiplies the base of a prompt's passes on AMX tiles
(``cpu_base.tiles``), with x' rounded as the residual's int16 mode rounds it, so the whole Linear takes the
rounded x': y = W_eff·x + W_eff·rot⁻¹(round(x') − x'). Usage::

    python benchmarks/quality.py [--converted out/smollm2-135m] [--split dev|eval|heldout | --prompts FILE]
        [--rows int8_g32,base2+r6] [--sequences N --out PATH]

Writes benchmarks/results/quality.json (``--split eval``), quality_dev.json, quality_heldout.json or
quality_prompts.json, each with its .png.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from splitspec.config import DataConfig, ModelConfig
from splitspec.gpu_actor.kernels.rotation import rotate_input, unrotate_output
from splitspec.models.data import (
    EvalSequence,
    Prompt,
    continuation_sequence,
    dev_sequences,
    evaluation_sequences,
    heldout_prompts,
    make_split,
    read_prompts,
)
from splitspec.models.loader import load_reference
from splitspec.quantize import format as fmt
from splitspec.quantize.activations import LEVELS, round_activations
from splitspec.quantize.gptq import int8_g32

RESULTS = Path(__file__).parent / "results"
ROUNDED = {f"+{mode}": levels for mode, levels in LEVELS.items()}  # row suffix -> the mode's largest code
ROUNDED["+int16tiles"] = LEVELS["int16"]
WHOLE_LINEAR = {"+int16tiles"}  # rows whose base takes the rounded x' too, not only the residual

# module path -> (R in the original basis, the group's input signs S_i): what a rounded row's hook needs
Residuals = dict[str, tuple[torch.Tensor, torch.Tensor]]


def bf16_round(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.bfloat16).float()


def bf16_floor(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Round to bf16, then move each nonzero weight one bf16 ulp up or down in magnitude at random."""
    bits = w.to(torch.bfloat16).view(torch.int16).clone()
    step = torch.randint(0, 2, bits.shape, generator=gen, dtype=torch.int16) * 2 - 1
    bits += torch.where(bits & 0x7FFF != 0, step, torch.zeros_like(step))
    return bits.view(torch.bfloat16).float()


def variants(cm: fmt.ConvertedModel, model) -> dict[str, dict[str, torch.Tensor]]:
    """Row name -> {module path: weight} for every decoder Linear.

    A ``+int16`` / ``+int8`` row shares its fp32 row's weights (the same dict): it differs only by its hooks.
    """
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, dict[str, torch.Tensor]] = {"int8_g32": {}, "bf16_round": {}, "bf16_floor": {}, "base2": {}}
    for b in cm.residual_bits:
        rows[f"base2+r{b}"] = {}
        for suffix in ROUNDED:
            rows[f"base2+r{b}{suffix}"] = rows[f"base2+r{b}"]
    for i, layer in enumerate(model.model.layers):
        for g in cm.spec.groups:
            for lin in g.linears:
                w = layer.get_submodule(lin.name).weight.detach()
                key = f"model.layers.{i}.{lin.name}"
                rows["int8_g32"][key] = int8_g32(w)
                rows["bf16_round"][key] = bf16_round(w)
                rows["bf16_floor"][key] = bf16_floor(w, gen)
            for bits, name in [(None, "base2")] + [(b, f"base2+r{b}") for b in cm.residual_bits]:
                for lin_name, w in cm.linear_weights(i, g.name, bits).items():
                    rows[name][f"model.layers.{i}.{lin_name}"] = w
    return rows


def rounded_residuals(cm: fmt.ConvertedModel, rows: dict[str, dict[str, torch.Tensor]]) -> dict[str, Residuals]:
    """Rounded row name -> its hooks' matrices, with the group's S_i for rotating x: R = W_eff(b) − W_eff(None),
    the residual in the original basis (rot⁻¹ is linear, so this is rot⁻¹(R~)), or W_eff(b) itself for a
    row whose base takes the rounded x' too (``WHOLE_LINEAR``)."""
    out: dict[str, Residuals] = {}
    for b in cm.residual_bits:
        res: Residuals = {}
        whole: Residuals = {}
        for i, layer in enumerate(cm.layers):
            for layout in layer.values():
                s_i = layout.signs()[0]
                for lin in layout.linears:
                    key = f"model.layers.{i}.{lin['name']}"
                    res[key] = (rows[f"base2+r{b}"][key] - rows["base2"][key], s_i)
                    whole[key] = (rows[f"base2+r{b}"][key], s_i)
        out.update({f"base2+r{b}{suffix}": whole if suffix in WHOLE_LINEAR else res for suffix in ROUNDED})
    return out


def rounding_error(x: torch.Tensor, s_i: torch.Tensor, kind: str, levels: int) -> torch.Tensor:
    """rot⁻¹(round(x') − x') for x' = H_i·S_i·x (the runtime's rotation), in x's shape.

    The same as rot⁻¹(round(x')) − x, but without fp32 round-trip noise (~2e-7 of x), which would be ~1%
    of the rounding itself (~2e-5). ``unrotate_output`` with S_i is S_i·H_iᵀ, the inverse of the input side.
    """
    flat = x.reshape(-1, x.shape[-1]).float()
    xr = rotate_input(flat, s_i, kind)
    return unrotate_output(round_activations(xr, levels) - xr, s_i, kind).reshape(x.shape)


def _add_rounding_error(
    r: torch.Tensor, s_i: torch.Tensor, kind: str, levels: int, module: torch.nn.Module, args: tuple, y: torch.Tensor
) -> torch.Tensor:
    """Forward hook: y + R·rot⁻¹(round(x') − x'), i.e. the residual's product taken on rounded x'."""
    return y + F.linear(rounding_error(args[0], s_i, kind, levels), r)


@contextmanager
def rounded_activations(model, residuals: Residuals, kind: str, levels: int) -> Iterator[None]:
    """Hooks on every decoder Linear while the row runs; removed after, even if the forward pass fails."""
    handles = [
        model.get_submodule(key).register_forward_hook(partial(_add_rounding_error, r, s_i, kind, levels))
        for key, (r, s_i) in residuals.items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def storage(cm: fmt.ConvertedModel, name: str, params: int) -> dict[str, float]:
    """Bits per weight on each side and the bytes one verify pass streams from RAM."""
    if name in ("bf16_round", "bf16_floor"):
        return {"bits_gpu": 16.0, "bits_ram": 0.0, "ram_bytes_per_check": 0}
    if name == "int8_g32":  # the whole Q8_0-like model read from RAM per check (layer offload)
        return {"bits_gpu": 0.0, "bits_ram": 8.5, "ram_bytes_per_check": int(params * 8.5 / 8)}
    base_bytes = (cm.folder / fmt.BASE_FILE).stat().st_size
    out = {"bits_gpu": 8 * base_bytes / params, "bits_ram": 0.0, "ram_bytes_per_check": 0}
    if name != "base2":
        bits = int(name.split("+r")[1].split("+")[0])
        resid = (cm.folder / fmt.residual_file(bits)).stat().st_size
        out.update(bits_ram=cm.residual_bits_per_weight(bits), ram_bytes_per_check=resid)
    return out


def swap(model, weights: dict[str, torch.Tensor]) -> None:
    for key, w in weights.items():
        model.get_submodule(key).weight.data = w


def scored_logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    hidden = model.model(ids[None]).last_hidden_state[0, mask]
    return torch.log_softmax(hidden.float() @ model.lm_head.weight.float().T, dim=-1)


def token_counts(seqs: list[EvalSequence]) -> np.ndarray:
    return np.array([int(s.score_mask.sum()) for s in seqs], dtype=np.float64)


def score_rows(
    model,
    seqs: list[EvalSequence],
    original: dict[str, torch.Tensor],
    rows: dict[str, dict[str, torch.Tensor]],
    hooked: dict[str, Residuals] | None = None,
    rotation: str = "",
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-sequence sums of KL(reference ‖ row) and of top-1 mismatches for every row, the reference's
    log-probs computed once per sequence (``original`` holds its weights) and shared by all rows."""
    hooked = hooked or {}
    kl = {name: np.zeros(len(seqs)) for name in rows}
    mism = {name: np.zeros(len(seqs)) for name in rows}
    counts = token_counts(seqs)
    with torch.no_grad():
        for j, seq in enumerate(seqs):
            swap(model, original)
            ref = scored_logprobs(model, seq.input_ids, seq.score_mask)
            ref_top = ref.argmax(-1)
            for name, weights in rows.items():
                swap(model, weights)
                if name in hooked:
                    with rounded_activations(model, hooked[name], rotation, ROUNDED["+" + name.split("+")[-1]]):
                        lp = scored_logprobs(model, seq.input_ids, seq.score_mask)
                else:
                    lp = scored_logprobs(model, seq.input_ids, seq.score_mask)
                kl[name][j] = float((ref.exp() * (ref - lp)).sum(-1).sum())
                mism[name][j] = float((lp.argmax(-1) != ref_top).sum())
            print(f"sequence {j + 1}/{len(seqs)}: " + ", ".join(f"{n}={kl[n][j] / counts[j]:.5f}" for n in rows))
    swap(model, original)
    return kl, mism


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n: np.ndarray, reps: int = 4000, ratio: bool = False) -> list[float]:
    """95% CI of mean-KL(a) − mean-KL(b) (or of their ratio), resampling whole sequences (tokens of one text
    are correlated)."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(n), (reps, len(n)))
    sa, sb = a[idx].sum(1), b[idx].sum(1)
    stat = sa / sb if ratio else (sa - sb) / n[idx].sum(1)
    return [float(np.percentile(stat, 2.5)), float(np.percentile(stat, 97.5))]


def continuations(model, tokenizer, prompts: list[Prompt], new_tokens: int) -> list[EvalSequence]:
    """Each prompt followed by the reference's greedy continuation (stopping early at end of sequence)."""
    seqs = []
    for prompt in prompts:
        ids = prompt.ids(tokenizer)
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(ids) :].tolist()
        seqs.append(continuation_sequence(prompt.id, ids, out))
    return seqs


def scored_sequences(args, model, tokenizer) -> tuple[list[EvalSequence], list[str]]:
    """The sequences to score and each one's kind (chat / code / the prompt file's label / the split)."""
    data = DataConfig()
    if args.prompts:
        prompts = read_prompts(args.prompts)[: args.sequences]
    elif args.split == "heldout":
        prompts = heldout_prompts(make_split(data))[: args.sequences]
    else:
        build = dev_sequences if args.split == "dev" else evaluation_sequences
        seqs = build(make_split(data), tokenizer, data)[: args.sequences]
        return seqs, [args.split] * len(seqs)
    return continuations(model, tokenizer, prompts, data.heldout_new_tokens), [p.kind for p in prompts]


def r6_ratio(kl: dict[str, np.ndarray], counts: np.ndarray) -> dict[str, float | list[float]]:
    """KL(base2+r6) / KL(int8 g32) with its bootstrap CI, the issue-23 goal (≤ 1.2)."""
    a, b = kl["base2+r6"], kl["int8_g32"]
    return {"ratio": float(a.sum() / b.sum()), "ci95": paired_bootstrap(a, b, counts, ratio=True)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(10, 4))
    names = [r["name"] for r in rows]
    colors = ["#888" if "bf16" in n else "#37a" if n.endswith(tuple(ROUNDED)) else "#3a7" for n in names]
    ax.bar(names, [r["kl"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        label = f"{r['bits_gpu']:.2f}+{r['bits_ram']:.2f} b/w" if r["bits_ram"] or r["bits_gpu"] != 16 else ""
        ax.text(i, r["kl"], label, ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("KL(reference ‖ row), nats/token")
    ax.set_title(f"{result['model']}: {result['tokens']} scored tokens")
    plt.xticks(rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converted", default="out/smollm2-135m")
    parser.add_argument("--split", choices=("dev", "eval", "heldout"), default="eval")
    parser.add_argument("--prompts", default=None, help="JSON-lines prompts to score instead of a split")
    parser.add_argument("--rows", default=None, help="comma-separated rows to score (default: all)")
    parser.add_argument("--out", default=None, help="default: results/quality.json, quality_<split>.json")
    parser.add_argument("--sequences", type=int, default=None, help="score only the first N (smoke runs)")
    args = parser.parse_args()
    if args.out is None:
        name = "prompts" if args.prompts else args.split
        args.out = str(RESULTS / ("quality.json" if name == "eval" else f"quality_{name}.json"))
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    cm = fmt.ConvertedModel(args.converted)
    source = cm.manifest["source"]["path"]
    model, tokenizer, spec = load_reference(ModelConfig(source=source, num_layers=cm.spec.n_layers))
    with torch.no_grad():
        seqs, kinds = scored_sequences(args, model, tokenizer)
    params = spec.linear_params
    every = variants(cm, model)
    wanted = args.rows.split(",") if args.rows else list(every)
    unknown = sorted(set(wanted) - set(every))
    if unknown:
        parser.error(f"unknown rows {unknown}; this folder has {sorted(every)}")
    rows = {name: w for name, w in every.items() if name in wanted}
    hooked = {name: r for name, r in rounded_residuals(cm, every).items() if name in rows}
    original = {k: model.get_submodule(k).weight.data for k in every["base2"]}
    counts = token_counts(seqs)
    kl, mism = score_rows(model, seqs, original, rows, hooked, cm.rotation)
    total = counts.sum()
    out_rows = [
        {"name": name, "kl": kl[name].sum() / total, "top1_mismatch": mism[name].sum() / total}
        | storage(cm, name, params)
        for name in rows
    ]
    by = {r["name"]: r["kl"] for r in out_rows}
    nan = float("nan")
    # the integer-activation rows of a width, where both it and its fp32 row were scored
    pairs = {s: [f"r{b}" for b in cm.residual_bits if {f"base2+r{b}{s}", f"base2+r{b}"} <= set(by)] for s in ROUNDED}
    has_r6 = {"base2+r6", "int8_g32"} <= set(by)
    result = {
        "model": f"{Path(source).name} ({spec.family}, {spec.n_layers} layers)",
        "converted": str(cm.folder),
        "split": "prompts" if args.prompts else args.split,
        "prompts_file": args.prompts,
        "rows": out_rows,
        "kl_diff_ci95": paired_bootstrap(kl["base2+r8"], kl["int8_g32"], counts)
        if {"base2+r8", "int8_g32"} <= set(by)
        else None,
        "tokens": int(total),
        "sequences": len(seqs),
        "ratios": {
            "r8_over_int8": by.get("base2+r8", nan) / by.get("int8_g32", nan),
            "r6_over_int8": by.get("base2+r6", nan) / by.get("int8_g32", nan),
            "r7_over_bf16_floor": by.get("base2+r7", nan) / by.get("bf16_floor", nan),
            **{
                f"{s[1:]}_kl_over_fp32": {w: by[f"base2+{w}{s}"] / by[f"base2+{w}"] for w in ws}
                for s, ws in pairs.items()
            },
        },
        "r6_over_int8": r6_ratio(kl, counts) if has_r6 else None,
        "r6_over_int8_by_kind": {
            k: r6_ratio({n: kl[n][mask] for n in ("base2+r6", "int8_g32")}, counts[mask])
            for k in sorted(set(kinds))
            if has_r6 and (mask := np.array([x == k for x in kinds])).any()
        },
        **{
            f"{s[1:]}_vs_fp32_ci95": {w: paired_bootstrap(kl[f"base2+{w}{s}"], kl[f"base2+{w}"], counts) for w in ws}
            for s, ws in pairs.items()
        },
        "per_sequence": {
            "ids": [s.conversation_id for s in seqs],
            "kinds": kinds,
            "tokens": counts.astype(int).tolist(),
            "kl_sum": {name: kl[name].tolist() for name in rows},
        },
        "seconds": time.perf_counter() - t0,
        "load_average": os.getloadavg(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    for r in out_rows:
        mb = r["ram_bytes_per_check"] / 1e6
        print(
            f"{r['name']:>16}  KL {r['kl']:.6f}  top1 {100 * r['top1_mismatch']:.2f}%  "
            f"gpu {r['bits_gpu']:.3f} b/w  ram {r['bits_ram']:.3f} b/w  {mb:.1f} MB"
        )
    print(json.dumps(result["ratios"]), "CI95(KL r8 - KL int8):", result["kl_diff_ci95"])
    print("r6 / int8:", json.dumps(result["r6_over_int8"]), json.dumps(result["r6_over_int8_by_kind"]))
    for mode in (s[1:] for s in ROUNDED):
        ratios, cis = result["ratios"][f"{mode}_kl_over_fp32"], result[f"{mode}_vs_fp32_ci95"]
        print(
            f"{mode} activations: "
            + ", ".join(
                f"{w} KL ×{ratios[w]:.4f} (CI95 of KL {mode} − fp32: [{lo:.2e}, {hi:.2e}])"
                for w, (lo, hi) in cis.items()
            )
        )


if __name__ == "__main__":
    main()
