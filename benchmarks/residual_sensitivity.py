"""Which decoder Linears carry base2+r6's KL, and what mixed widths at ≤ 6.2 bits buy (issue 23).

All rows are dequantized in-process from one converted folder that holds the 6-, 7- and 8-bit residuals of
the same base (``quality.variants``) and scored as ``quality.py`` scores them, against the fp32 reference,
on the first ``--sequences`` conversations of the dev split (the fast subset):

1. base2+r6 with one layer's four groups swapped to their r8 planes, for each layer, and with one group
   kind (qkv, o, gate_up, down) swapped in every layer: the KL each carries;
2. each group alone swapped to r7 and to r8 in the ``--top`` layers whose swap gained most, and to r7 the
   group, in every other layer, of the kind whose all-layer swap gained most per residual byte;
3. a greedy allocation: the (group, width) steps with the largest measured KL reduction per extra byte of
   residual (the groups' real plane bytes, scales and padding included) while the residual's average
   stays within ``--budget`` bits a weight; the gains are assumed additive, so the allocation is then
   scored as one row, on the subset and on the whole dev split, beside int8 g32 and base2+r6;
4. the subset's ranking checked on the whole dev split with two of stage 1's rows (the best layer and
   the median one).

    nice -n 10 python benchmarks/residual_sensitivity.py --converted /tmp/convert_quiet [--sequences 3 --top 4]

The default subset, the dev split's first three conversations (1,935 scored tokens), ranks layers as the
whole split does (stage 4); single-group gains are near its noise, so an allocation chosen on it is
checked on the whole split, and on the sequences outside the subset, before it is believed.

``--widths residual_sensitivity.json --split dev|eval|heldout`` scores only that run's allocation, beside
int8 g32 and base2+r6, with per-sequence sums, the ratio outside the subset and per kind (chat, code).
``--allocate residual_sensitivity.json`` only allocates that run's measured gains again with this
splitspec's byte counts (after format 6 halved the scales' bytes) and writes the width map
``results/residual_widths.json`` that ``splitspec convert --residual-widths`` reads.

Writes benchmarks/results/residual_sensitivity.json and .png (KL reduction per layer), or with
``--widths`` residual_sensitivity_<split>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from quality import RESULTS, paired_bootstrap, score_rows, scored_sequences, token_counts, variants
from splitspec.config import DataConfig, ModelConfig, group_key
from splitspec.models.data import dev_sequences, make_split
from splitspec.models.loader import load_reference
from splitspec.quantize import format as fmt
from splitspec.quantize import packing

Weights = dict[str, torch.Tensor]
GroupKey = tuple[int, str]

# what a residual file's safetensors header adds to its planes, in bits a weight (about 60 kB for SmolLM2's
# 600 tensors, 0.0045 bits): the budget is the file's size, as quality.py counts it
HEADER_BITS = 0.0075


def group_keys(cm: fmt.ConvertedModel, layer: int, group: str) -> list[str]:
    return [f"model.layers.{layer}.{lin['name']}" for lin in cm.group(layer, group).linears]


def parse_key(key: str) -> GroupKey:
    """``group_key``'s "9.qkv" back to (9, "qkv")."""
    layer, _, group = key.partition(".")
    return int(layer), group


def mixed(rows: dict[str, Weights], widths: dict[GroupKey, int], cm: fmt.ConvertedModel) -> Weights:
    """base2+r6 with each listed group's Linears taken from its width's row."""
    out = dict(rows["base2+r6"])
    for (layer, group), bits in widths.items():
        out.update({k: rows[f"base2+r{bits}"][k] for k in group_keys(cm, layer, group)})
    return out


def plane_bytes(cm: fmt.ConvertedModel) -> dict[GroupKey, dict[int, int]]:
    """Each group's residual bytes at each width in this splitspec's layout, as a CPU actor holds them
    (codes, scales, padding)."""
    return {
        (i, g): {b: packing.residual_nbytes(lay.rows, lay.d_in, b) for b in packing.PLANES}
        for i, layer in enumerate(cm.layers)
        for g, lay in layer.items()
    }


def budget_bytes(budget_bits: float, params: int, nbytes: dict[GroupKey, dict[int, int]]) -> tuple[int, int]:
    """(extra bytes the wider groups may take, the 6-bit residual's bytes): ``budget_bits`` a weight counts
    the file as ``quality.py`` does, its header (``HEADER_BITS``) included."""
    r6_bytes = sum(b[6] for b in nbytes.values())
    return int((budget_bits - HEADER_BITS) * params / 8) - r6_bytes, r6_bytes


def reallocate(args: argparse.Namespace, cm: fmt.ConvertedModel) -> dict:
    """``--allocate``: a previous run's measured gains, allocated again with this splitspec's byte counts
    (after a format change: the same gains, other costs), as the width map ``splitspec convert
    --residual-widths`` reads."""
    prev = json.loads(Path(args.allocate).read_text())
    gains = {parse_key(k): {int(b[1:]): v for b, v in by.items()} for k, by in prev["group_gain"].items()}
    nbytes = plane_bytes(cm)
    params = sum(lay.rows * lay.d_in for layer in cm.layers for lay in layer.values())
    budget, r6_bytes = budget_bytes(args.budget, params, nbytes)
    widths = allocate(gains, nbytes, budget)
    used = r6_bytes + sum(nbytes[k][b] - nbytes[k][6] for k, b in widths.items())
    kl = prev["subset"]["kl"]
    predicted = kl["base2+r6"] - sum(gains[k][b] for k, b in widths.items())
    return {
        "model": prev["model"],
        "gains_from": str(args.allocate),
        "format_version": fmt.FORMAT_VERSION,
        "budget_bits": args.budget,
        "bits_ram_planes": 8 * used / params,
        "bits_ram_r6_planes": 8 * r6_bytes / params,
        "header_bits": HEADER_BITS,
        "subset_ratio_r6": kl["base2+r6"] / kl["int8_g32"],
        "subset_ratio_predicted": predicted / kl["int8_g32"],
        "widths": {group_key(*k): b for k, b in sorted(widths.items())},
    }


def allocate(
    gains: dict[GroupKey, dict[int, float]], nbytes: dict[GroupKey, dict[int, int]], budget: int
) -> dict[GroupKey, int]:
    """Greedy multiple-choice knapsack: repeatedly take the step (a group to a wider width) with the
    largest gain per extra byte that still fits ``budget`` extra bytes; a group may step up again."""
    chosen: dict[GroupKey, int] = {}
    spent = 0
    while True:
        best: tuple[float, GroupKey, int, int] | None = None
        for key, by_width in gains.items():
            cur = chosen.get(key, 6)
            for bits, gain in by_width.items():
                cost = nbytes[key][bits] - nbytes[key][cur]
                step = gain - by_width.get(cur, 0.0)
                if bits > cur and step > 0 and spent + cost <= budget and (best is None or step / cost > best[0]):
                    best = (step / cost, key, bits, cost)
        if best is None:
            return chosen
        _, key, bits, cost = best
        chosen[key] = bits
        spent += cost


def mean_kl(kl: dict[str, np.ndarray], counts: np.ndarray) -> dict[str, float]:
    return {name: float(v.sum() / counts.sum()) for name, v in kl.items()}


def ratio(name: str, kl: dict[str, np.ndarray], n: np.ndarray) -> dict:
    a, b = kl[name], kl["int8_g32"]
    return {"ratio": float(a.sum() / b.sum()), "ci95": paired_bootstrap(a, b, n, ratio=True)}


def measure(args: argparse.Namespace, cm: fmt.ConvertedModel, model, tokenizer, rows: dict[str, Weights]) -> dict:
    """``--widths``: a saved allocation against int8 g32 and base2+r6 on ``--split``, per sequence, and on
    the sequences outside the subset it was chosen on (the unbiased figure)."""
    prev = json.loads(Path(args.widths).read_text())
    widths = {parse_key(k): b for k, b in prev["allocation"]["widths"].items()}
    split = argparse.Namespace(prompts=None, split=args.split, sequences=None)
    with torch.no_grad():
        seqs, kinds = scored_sequences(split, model, tokenizer)
    named = {"int8_g32": rows["int8_g32"], "base2+r6": rows["base2+r6"], "mixed": mixed(rows, widths, cm)}
    kl = score_rows(model, seqs, {k: model.get_submodule(k).weight.data for k in rows["base2"]}, named)[0]
    n = token_counts(seqs)
    ids = [s.conversation_id for s in seqs]
    parts = {"all": np.ones(len(seqs), bool), "outside_subset": np.array([i not in prev["subset"]["ids"] for i in ids])}
    parts |= {f"kind_{k}": np.array([x == k for x in kinds]) for k in sorted(set(kinds)) if k != args.split}
    return {
        "widths": prev["allocation"]["widths"],
        "bits_ram": prev["allocation"]["bits_ram"],
        "split": args.split,
        "sequences": len(seqs),
        "tokens": int(n.sum()),
        "kl": mean_kl(kl, n),
        **{
            part: {
                "tokens": int(n[m].sum()),
                "r6_over_int8": ratio("base2+r6", {k: v[m] for k, v in kl.items()}, n[m]),
                "mixed_over_int8": ratio("mixed", {k: v[m] for k, v in kl.items()}, n[m]),
                "mixed_minus_r6_ci95": paired_bootstrap(kl["mixed"][m], kl["base2+r6"][m], n[m]),
            }
            for part, m in parts.items()
            if m.any() and (part == "all" or not m.all())
        },
        "per_sequence": {"ids": ids, "kinds": kinds, "tokens": n.astype(int).tolist()}
        | {"kl_sum": {k: v.tolist() for k, v in kl.items()}},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gains = result["layer_gain"]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([str(i) for i in range(len(gains))], gains, color="#37a")
    need = result["subset"]["kl"]["base2+r6"] - 1.2 * result["subset"]["kl"]["int8_g32"]
    ax.axhline(need, color="#a33", ls="--", label="reduction needed for 1.2× int8 g32")
    ax.set_xlabel("layer (all four groups r6 → r8)")
    ax.set_ylabel("KL reduction, nats/token")
    ax.set_title(f"{result['model']}: {result['subset']['tokens']} dev tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converted", default="out/smollm2-135m")
    parser.add_argument("--sequences", type=int, default=3, help="the fast subset: the dev split's first N")
    parser.add_argument("--top", type=int, default=4, help="layers refined group by group")
    parser.add_argument("--budget", type=float, default=6.2, help="average residual bits a weight")
    parser.add_argument("--dev", type=int, default=None, help="stage 4 on the first N only (smoke runs)")
    parser.add_argument("--widths", default=None, help="a previous run's JSON: score only its allocation")
    parser.add_argument("--split", choices=("dev", "eval", "heldout"), default="dev", help="with --widths")
    parser.add_argument(
        "--allocate",
        default=None,
        help="a previous run's JSON: only allocate its gains again (results/residual_widths.json)",
    )
    parser.add_argument("--out", default=None, help="default: results/residual_sensitivity[_<split>].json")
    args = parser.parse_args()
    name = f"residual_sensitivity_{args.split}" if args.widths else "residual_sensitivity"
    out = Path(args.out or RESULTS / f"{name}.json")
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    cm = fmt.ConvertedModel(args.converted)
    if args.allocate:
        result = reallocate(args, cm)
        Path(args.out or RESULTS / "residual_widths.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    if not {6, 7, 8} <= set(cm.residual_bits):
        parser.error(f"{args.converted} has residuals {cm.residual_bits}; this needs 6, 7 and 8")
    source = cm.manifest["source"]["path"]
    model, tokenizer, spec = load_reference(ModelConfig(source=source, num_layers=cm.spec.n_layers))
    rows = variants(cm, model)
    if args.widths:
        result = measure(args, cm, model, tokenizer, rows) | {"load_average": os.getloadavg()}
        out.write_text(json.dumps(result | {"seconds": time.perf_counter() - t0}, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "per_sequence"}, indent=1))
        return
    data = DataConfig()
    dev = dev_sequences(make_split(data), tokenizer, data)[: args.dev]
    subset = dev[: args.sequences]
    original = {k: model.get_submodule(k).weight.data for k in rows["base2"]}
    kinds = [g.name for g in cm.spec.groups]
    n_layers = len(cm.layers)
    counts = token_counts(subset)

    def score(named: dict[str, Weights], seqs=subset) -> dict[str, np.ndarray]:
        return score_rows(model, seqs, original, named)[0]

    # 1. one layer, or one group kind everywhere, at r8
    stage1 = {"int8_g32": rows["int8_g32"], "base2+r6": rows["base2+r6"]}
    stage1 |= {f"L{i}:r8": mixed(rows, {(i, g): 8 for g in kinds}, cm) for i in range(n_layers)}
    stage1 |= {f"{g}:r8": mixed(rows, {(i, g): 8 for i in range(n_layers)}, cm) for g in kinds}
    kl1 = mean_kl(score(stage1), counts)
    r6 = kl1["base2+r6"]
    layer_gain = [r6 - kl1[f"L{i}:r8"] for i in range(n_layers)]
    top = sorted(range(n_layers), key=lambda i: -layer_gain[i])[: args.top]

    # 2. each group of the top layers alone at r7 and at r8, and the densest kind's group in every layer
    nbytes = plane_bytes(cm)
    kind_bytes = {g: sum(nbytes[(i, g)][6] for i in range(n_layers)) for g in kinds}
    densest = max(kinds, key=lambda g: (r6 - kl1[f"{g}:r8"]) / kind_bytes[g])
    refined = {(i, g): (7, 8) for i in range(n_layers) for g in kinds if i in top}
    refined |= {(i, densest): (7,) for i in range(n_layers) if i not in top}
    stage2 = {f"L{i}.{g}:r{b}": mixed(rows, {(i, g): b}, cm) for (i, g), ws in sorted(refined.items()) for b in ws}
    kl2 = mean_kl(score(stage2), counts)
    gains = {key: {b: r6 - kl2[f"L{key[0]}.{key[1]}:r{b}"] for b in ws} for key, ws in sorted(refined.items())}

    # 3. the allocation within the budget
    params = spec.linear_params
    budget, r6_bytes = budget_bytes(args.budget, params, nbytes)
    widths = allocate(gains, nbytes, budget)
    used = r6_bytes + sum(nbytes[k][b] - nbytes[k][6] for k, b in widths.items())
    predicted = r6 - sum(gains[k][b] for k, b in widths.items())
    kl3 = mean_kl(score({"mixed": mixed(rows, widths, cm)}), counts)

    # 4. the whole dev split: the allocation, and the subset's ranking of two stage-1 rows
    by_gain = sorted(range(n_layers), key=lambda i: -layer_gain[i])
    check = [f"L{by_gain[0]}:r8", f"L{by_gain[n_layers // 2]}:r8"]
    full_rows = {"int8_g32": rows["int8_g32"], "base2+r6": rows["base2+r6"], "mixed": mixed(rows, widths, cm)}
    full_rows |= {name: stage1[name] for name in check}
    kl_full = score(full_rows, dev)
    full_counts = token_counts(dev)
    full = mean_kl(kl_full, full_counts)

    result = {
        "model": f"{Path(source).name} ({spec.family}, {spec.n_layers} layers)",
        "converted": str(cm.folder),
        "subset": {
            "sequences": len(subset),
            "ids": [s.conversation_id for s in subset],
            "tokens": int(counts.sum()),
            "kl": {"int8_g32": kl1["int8_g32"], "base2+r6": r6},
        },
        "layer_gain": layer_gain,
        "kind_gain": {g: r6 - kl1[f"{g}:r8"] for g in kinds},
        "top_layers": top,
        "densest_kind": densest,
        "group_gain": {group_key(*k): {f"r{b}": v for b, v in by.items()} for k, by in gains.items()},
        "allocation": {
            "budget_bits": args.budget,
            "widths": {group_key(*k): b for k, b in sorted(widths.items())},
            "bits_ram": 8 * used / params,
            "bits_ram_r6": 8 * r6_bytes / params,
            "subset_kl_predicted": predicted,
            "subset_kl_measured": kl3["mixed"],
            "subset_ratio_measured": kl3["mixed"] / kl1["int8_g32"],
        },
        "dev": {
            "sequences": len(dev),
            "tokens": int(full_counts.sum()),
            "kl": full,
            "r6_over_int8": ratio("base2+r6", kl_full, full_counts),
            "mixed_over_int8": ratio("mixed", kl_full, full_counts),
            "mixed_minus_r6_ci95": paired_bootstrap(kl_full["mixed"], kl_full["base2+r6"], full_counts),
            "rank_check": {
                name: {"subset_gain": r6 - kl1[name], "dev_gain": full["base2+r6"] - full[name]} for name in check
            },
        },
        "seconds": time.perf_counter() - t0,
        "load_average": os.getloadavg(),
    }
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("kind_gain", "top_layers", "allocation", "dev")}, indent=1))


if __name__ == "__main__":
    main()
