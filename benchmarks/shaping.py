"""What logit bias and penalties cost speculation: tokens per check and tok/s, shaped against plain.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/shaping.py [FOLDER] [--prompts 8]

Greedy generation of ``--new-tokens`` tokens per prompt (the evaluation split's first turns, as in
``acceptance.py``) through the split verifier with the exact-KV 16-node tree, the residual computed in
this process on the engine's one thread, under four configurations taken in turn for each prompt:

- ``plain``: no shaping;
- ``shaped``: ``SHAPED``'s penalties, each tree node shaped along its path, the draft's rows too;
- ``shaped, draft unshaped``: the same verifier and walk, the draft ranking its raw logits (an ablation:
  why ``draft_tree`` shapes its rows);
- ``shaped, verifier alone``: the reference each shaped text must equal (mismatches counted; a tree pass
  sums in another order, so a near-tie may part them).

Writes benchmarks/results/shaping.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import splitspec.gpu_actor.speculative as speculative
from acceptance import eval_prompts
from large_model import DEMO
from splitspec.config import EngineConfig, SamplingParams, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import LocalResidual
from splitspec.quantize.format import ConvertedModel

RESULTS = Path(__file__).parent / "results"
SHAPED = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3)
CONFIGS = ("plain", "shaped", "shaped, draft unshaped", "shaped, verifier alone")


def _draft_unshaped(model, cache, root, shape, p_min=0.0, shaping=None):
    return _DRAFT_TREE(model, cache, root, shape, p_min)


_DRAFT_TREE = speculative.draft_tree


def measure(folder: Path, bits: int, n_prompts: int, new_tokens: int) -> dict:
    converted = ConvertedModel(folder)
    fitted = converted.tree_stats()
    if fitted is None:
        raise SystemExit(f"{folder} has no tree statistics: run `splitspec fit-tree {folder}`")
    model, residual = SplitModel(converted), LocalResidual.load(folder, bits)
    config = EngineConfig(spec=SpecConfig(mode="tree", draft_max=16))
    tree = SplitEngine(model, residual, config, tree_stats=fitted["p"])
    alone = SplitEngine(model, residual, EngineConfig(spec=SpecConfig(mode="off")))
    prompts = eval_prompts(folder, n_prompts)
    tree.generate(prompts[0], 4)  # warm: compiled kernels, the measured draft shape
    seconds = dict.fromkeys(CONFIGS, 0.0)
    tokens, checks, accepted = (dict.fromkeys(CONFIGS, 0) for _ in range(3))
    texts: dict[str, list[list[int]]] = {c: [] for c in CONFIGS}
    for prompt in prompts:
        for config in CONFIGS:
            engine = alone if config.endswith("alone") else tree
            params = SamplingParams() if config == "plain" else SHAPED
            speculative.draft_tree = _draft_unshaped if config.endswith("unshaped") else _DRAFT_TREE
            t0 = time.perf_counter()
            out, stats = engine.generate(prompt, new_tokens, params=params)
            seconds[config] += time.perf_counter() - t0
            speculative.draft_tree = _DRAFT_TREE
            texts[config].append(out)
            tokens[config] += len(out)
            checks[config] += len(stats.checks)
            accepted[config] += sum(c.accepted + 1 for c in stats.checks)
    rows = [
        {
            "config": c,
            "tokens_per_check": round(accepted[c] / checks[c], 3) if checks[c] else None,
            "tok_s": round(tokens[c] / seconds[c], 2),
            "mismatches_vs_alone": sum(a != b for a, b in zip(texts[c], texts[CONFIGS[-1]], strict=True))
            if c != "plain"
            else None,
        }
        for c in CONFIGS
    ]
    by = {r["config"]: r for r in rows}
    return {
        "folder": str(folder),
        "bits": bits,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "draft": "tree16, exact KV",
        "shaping": {k: getattr(SHAPED, k) for k in ("repetition_penalty", "frequency_penalty", "presence_penalty")},
        "rows": rows,
        "shaped_texts_differ_from_plain": sum(a != b for a, b in zip(texts["plain"], texts["shaped"], strict=True)),
        "shaped_tok_s_over_plain": round(by["shaped"]["tok_s"] / by["plain"]["tok_s"], 3),
        "draft_shaping_gain_tokens_per_check": round(
            by["shaped"]["tokens_per_check"] / by["shaped, draft unshaped"]["tokens_per_check"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=DEMO)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "shaping.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.folder, args.bits, args.prompts, args.new_tokens)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
