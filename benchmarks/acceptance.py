"""Tokens accepted per check, and the draft's recall, for the exact-KV draft and the 2-bit-KV draft.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/acceptance.py [FOLDER] [--prompts 8]

FOLDER is a converted model with fitted tree statistics (default: the one ``make demo`` converts). The
statistics were fitted on the tree split (``splitspec fit-tree``); everything here is measured on the
evaluation split's first-turn prompts, which neither calibration nor fitting saw. Per configuration
(chain γ = 4 and 8, best-first trees of 16 and 64 nodes; each with the exact-KV draft of the recipe's
section 5 and the 2-bit-KV draft whose trees are shaped by its own statistics), greedy generation of
``--new-tokens`` tokens per prompt through the split verifier (the residual computed in this process:
acceptance does not depend on where it runs), counting tokens per check (the bonus included).
``predicted`` is what the rank statistics alone predict for the same shape (the cost model's
acceptance term). Recall@P is the share of positions where the verifier's token is among the draft's
top P at depth 1, on the verifier's own continuations of the same prompts. The ``ngram16`` row is the
draft with no model (``--draft ngram``) proposing every token it finds, up to 16, replayed over the same
continuations (``lookup.replay``: greedy checks give the verifier's text whatever the draft, so its checks
are counted on that text rather than generated again); its ``predicted`` is the same replay on the tree
split, as ``fit-tree`` stored it. The ``tree16+ngram`` row is the exact-KV 16-node tree with the n-gram
draft's tokens grafted on as a branch (``--ngram-branch``), generated like the others.

Writes benchmarks/results/acceptance.json and acceptance.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from large_model import DEMO
from splitspec.config import DataConfig, EngineConfig, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.lookup import replay
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import LocalResidual
from splitspec.gpu_actor.tree_fit import rank_counts
from splitspec.models.data import first_turn_prompts, make_split
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler.cost import NgramStats, chain, expected_tokens

RESULTS = Path(__file__).parent / "results"
CONFIGS = [("chain4", "chain", 4), ("chain8", "chain", 8), ("tree16", "tree", 16), ("tree64", "tree", 64)]
RECALL_AT = (1, 2, 4, 8)
NGRAM = 16  # the n-gram row proposes every token it finds, up to this many
BRANCHED = "tree16+ngram"  # tree16 with an n-gram branch (``SpecConfig.ngram_branch``), exact KV only


def _ngram_predicted(fitted: dict) -> float | None:
    """Tokens per check of the same n-gram row on the tree split, from the fitted replay (a refit adds it)."""
    ngram = NgramStats.fitted(fitted)
    return None if ngram is None else round(ngram.tokens_per_check(NGRAM), 4)


def eval_prompts(folder: Path, n: int, max_tokens: int = 384) -> list[list[int]]:
    """The first ``n`` evaluation-split chats' first-turn prompts of at most ``max_tokens`` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = first_turn_prompts(make_split(DataConfig()).evaluation, tokenizer)
    return [p for p in prompts if len(p) <= max_tokens][:n]


def measure(folder: Path, bits: int, n_prompts: int, new_tokens: int) -> dict:
    converted = ConvertedModel(folder)
    fitted = converted.tree_stats()
    if fitted is None or "p_draft2bit" not in fitted:
        raise SystemExit(f"{folder} has no tree statistics of both drafts: run `splitspec fit-tree {folder}`")
    model, residual = SplitModel(converted), LocalResidual.load(folder, bits)
    prompts = eval_prompts(folder, n_prompts)
    rows, texts = [], {}

    def run(name: str, kv: str, spec: SpecConfig) -> None:
        p = fitted["p" if kv == "exact" else "p_draft2bit"]
        engine = SplitEngine(model, residual, EngineConfig(spec=spec), tree_stats=p)
        shape = engine.draft_shape()
        t0 = time.perf_counter()
        checks, outputs = [], []
        for prompt in prompts:
            tokens, stats = engine.generate(prompt, new_tokens)
            checks += stats.checks
            outputs.append(tokens)
        texts[(name, kv)] = outputs
        rows.append(
            {
                "mode": name,
                "kv": kv,
                "tokens_per_check": round(sum(c.accepted + 1 for c in checks) / len(checks), 4),
                # an n-gram branch is beyond what the rank statistics describe
                "predicted_tokens_per_check": None if spec.ngram_branch else round(expected_tokens(shape, p), 4),
                "checks": len(checks),
                "nodes_verified_per_check": round(sum(c.drafted for c in checks) / len(checks), 2),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(rows[-1], flush=True)

    for name, mode, size in CONFIGS:
        for kv in ("exact", "draft2bit"):
            run(name, kv, SpecConfig(mode=mode, draft_max=size, kv=kv))
    run(BRANCHED, "exact", SpecConfig(mode="tree", draft_max=16, ngram_branch=True))
    first = texts[(CONFIGS[0][0], "exact")]
    same = all(texts[(n, "exact")] == texts[(n, "draft2bit")] == first for n, _, _ in CONFIGS)
    same = same and texts[(BRANCHED, "exact")] == first
    recall = {}
    for kv in ("exact", "draft2bit"):
        counts = sum(
            rank_counts(model, residual, prompt, out, depth=1, kv=kv)
            for prompt, out in zip(prompts, texts[(CONFIGS[0][0], "exact")], strict=True)
        )
        first = counts[0].double() / counts[0].sum()
        recall[kv] = {str(k): round(float(first[:k].sum()), 4) for k in RECALL_AT}
    for row in rows:
        row["recall"] = recall[row["kv"]]
    by = {(r["mode"], r["kv"]): r["tokens_per_check"] for r in rows}
    counts = torch.zeros(NGRAM + 1, NGRAM + 1, dtype=torch.long)
    for prompt, text in zip(prompts, texts[(CONFIGS[0][0], "exact")], strict=True):
        counts += torch.tensor(replay(prompt, text, SpecConfig.ngram_max, SpecConfig.ngram_min, NGRAM))
    found, kept = torch.arange(NGRAM + 1)[:, None], torch.arange(NGRAM + 1)[None, :]
    checks = int(counts.sum())
    rows.append(
        {
            "mode": f"ngram{NGRAM}",
            "kv": "none",
            "tokens_per_check": round(float((counts * (1 + kept)).sum()) / checks, 4),
            "predicted_tokens_per_check": _ngram_predicted(fitted),
            "checks": checks,
            "nodes_verified_per_check": round(float((counts * found).sum()) / checks, 2),
            "recall": None,
        }
    )
    print(rows[-1], flush=True)
    return {
        "folder": str(folder),
        "bits": bits,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "fitted_on": {k: fitted[k] for k in ("prompts", "new_tokens", "bits", "seconds") if k in fitted},
        "rows": rows,
        "chain1_predicted": round(expected_tokens(chain(1), fitted["p"]), 4),
        "all_configs_same_text": same,
        "goals": {
            "tree16_exact_tokens_per_check": by[("tree16", "exact")],
            "tree16_exact_ge_2.5": by[("tree16", "exact")] >= 2.5,
            "exact_over_draft2bit_at_16": round(by[("tree16", "exact")] / by[("tree16", "draft2bit")], 4),
            "exact_ge_1.15x_draft2bit_at_16": by[("tree16", "exact")] >= 1.15 * by[("tree16", "draft2bit")],
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [name for name, _, _ in CONFIGS]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, kv in enumerate(("exact", "draft2bit")):
        vals = [next(r["tokens_per_check"] for r in result["rows"] if r["mode"] == m and r["kv"] == kv) for m in modes]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(modes))]
        ax.bar(xs, vals, width=0.38, label=f"{kv} KV draft")
        for x, v in zip(xs, vals, strict=True):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    extra = [("tree16+ngram", "tab:purple", "tree16 + n-gram branch"), ("ngram16", "tab:green", "n-gram (no model)")]
    for mode, color, label in extra:
        row = next((r for r in result["rows"] if r["mode"] == mode), None)
        if row is not None:
            v = row["tokens_per_check"]
            ax.bar([len(modes)], [v], width=0.38, color=color, label=label)
            ax.text(len(modes), v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
            modes = [*modes, mode]
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("tokens per check (bonus included)")
    ax.set_title(f"Acceptance on {result['prompts']} evaluation prompts x {result['new_tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_args(description: str, new_tokens: int, out: Path) -> argparse.ArgumentParser:
    """The arguments both speculative-decoding benchmarks take: a converted folder, the residual width,
    how many prompts and tokens each, and where the JSON goes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder", nargs="?", type=Path, default=DEMO)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--out", type=Path, default=out)
    return parser


def main() -> None:
    args = run_args(__doc__.splitlines()[0], 48, RESULTS / "acceptance.json").parse_args()
    torch.set_num_threads(1)
    result = measure(args.folder, args.bits, args.prompts, args.new_tokens)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["goals"], indent=2))


if __name__ == "__main__":
    main()
