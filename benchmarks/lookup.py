"""Drafts copied from the text (``--draft ngram``) against the verifier alone: where a CPU engine's drafts pay.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/lookup.py [FOLDER] [--prompts 8]
        [--new-tokens 128]

One engine as ``splitspec generate`` starts it (a real CPU actor process serving the 8-bit residual, the
engine and the actor pinned to different cores) and two sets of prompts: ``prompts/rewrite.jsonl``, tasks
whose answer repeats the prompt (fix the spelling of a paragraph, rename a variable, add a docstring: what
prompt-lookup drafting is for), and ``prompts/heldout.jsonl``, the chat and code questions of ``e2e.py``
(where the text seldom repeats). Each prompt is decoded greedily by the verifier alone and with n-gram
drafts, in turn (the order alternating), so that the machine's drift reaches both. Decode tok/s is the
tokens after the first over the time of the checks that made them (prefill excluded), as ``e2e.py``
counts it; ``speedup`` is the ratio of the two over the set. Every n-gram text is compared with the
verifier alone's: where they part, the verifier alone's top-2 logits decide whether it is a near-tie
(gap < 1e-4) or a mismatch.

Writes benchmarks/results/lookup.json and lookup.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from acceptance import RESULTS, run_args
from e2e import NEAR_TIE, _gap, heldout_prompts
from splitspec.config import EngineConfig, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.models.data import read_prompts
from splitspec.scheduler.local import start_local

REWRITE = Path(__file__).parent / "prompts" / "rewrite.jsonl"
DRAFT_MAX = 16


def load(path: Path, tokenizer, n: int) -> list[list[int]]:
    """The first ``n`` chats of a JSON-lines file (``models.data.read_prompts``), chat-templated."""
    return [
        tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True)["input_ids"]
        for p in read_prompts(path)[:n]
    ]


def _decode(engine: SplitEngine, prompt: list[int], new_tokens: int, eos: int) -> tuple[list[int], dict]:
    tokens, stats = engine.generate(prompt, new_tokens, eos)
    checks = stats.checks
    return tokens, {
        "tokens": len(tokens) - 1,
        "ms": sum(c.total_ms for c in checks),
        "checks": len(checks),
        "drafted": sum(c.drafted for c in checks),
        "accepted": sum(c.accepted for c in checks),
    }


def measure_set(alone: SplitEngine, ngram: SplitEngine, prompts: list[list[int]], new_tokens: int, eos: int) -> dict:
    sums = {name: {"tokens": 0, "ms": 0.0, "checks": 0, "drafted": 0, "accepted": 0} for name in ("alone", "ngram")}
    mismatches = near_ties = 0
    per_prompt = []
    for i, prompt in enumerate(prompts):
        runs = {}
        for name in ("alone", "ngram") if i % 2 == 0 else ("ngram", "alone"):
            runs[name] = _decode(alone if name == "alone" else ngram, prompt, new_tokens, eos)
            for key, value in runs[name][1].items():
                sums[name][key] += value
        ours, theirs = runs["ngram"][0], runs["alone"][0]
        part = next((t for t, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if part is not None:
            if _gap(alone, prompt + theirs[:part]) < NEAR_TIE:
                near_ties += 1
            else:
                mismatches += 1
        rates = {k: 1e3 * v[1]["tokens"] / v[1]["ms"] for k, v in runs.items()}
        speedup = rates["ngram"] / rates["alone"]
        per_prompt.append({"speedup": speedup, "tokens_per_check": _per_check(runs["ngram"][1])})
        print(f"  prompt {i}: {per_prompt[-1]}", flush=True)
    alone_tok_s, ngram_tok_s = (1e3 * sums[k]["tokens"] / sums[k]["ms"] for k in ("alone", "ngram"))
    return {
        "verifier_tok_s": alone_tok_s,
        "ngram_tok_s": ngram_tok_s,
        "speedup": ngram_tok_s / alone_tok_s,
        "tokens_per_check": _per_check(sums["ngram"]),
        "drafted_per_check": sums["ngram"]["drafted"] / sums["ngram"]["checks"],
        "accepted_of_drafted": sums["ngram"]["accepted"] / max(1, sums["ngram"]["drafted"]),
        "mismatches": mismatches,
        "near_ties": near_ties,
        "prompts": len(prompts),
        "per_prompt": per_prompt,
    }


def _per_check(s: dict) -> float:
    return (s["accepted"] + s["checks"]) / s["checks"]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(result["sets"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = range(len(sets))
    alone = [result["sets"][s]["verifier_tok_s"] for s in sets]
    ngram = [result["sets"][s]["ngram_tok_s"] for s in sets]
    ax.bar([i - 0.2 for i in x], alone, 0.4, label="verifier alone", color="tab:gray")
    ax.bar([i + 0.2 for i in x], ngram, 0.4, label=f"n-gram drafts (up to {DRAFT_MAX})", color="tab:green")
    for i, s in enumerate(sets):
        r = result["sets"][s]
        ax.text(i + 0.2, ngram[i], f"×{r['speedup']:.2f}\n{r['tokens_per_check']:.2f}/check", ha="center", va="bottom")
    ax.set_xticks(list(x), [f"{s} prompts" for s in sets])
    ax.set_ylabel("decode tok/s (greedy)")
    ax.set_title(f"n-gram drafts on a CPU engine, {result['bits']}-bit residual, {result['new_tokens']} new tokens")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = run_args(__doc__.splitlines()[0], 128, RESULTS / "lookup.json").parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    eos = tokenizer.eos_token_id
    sets = {"rewrite": load(REWRITE, tokenizer, args.prompts), "chat": heldout_prompts(tokenizer, args.prompts)}
    config = EngineConfig(spec=SpecConfig(mode="ngram", draft_max=DRAFT_MAX))
    with start_local(args.folder, args.bits, config=config) as engine:
        alone = SplitEngine(engine.model, engine.residual, EngineConfig(spec=SpecConfig(mode="off")))
        _decode(alone, sets["chat"][0], 8, eos)  # warm both paths before anything is timed
        _decode(engine, sets["chat"][0], 8, eos)
        results = {}
        for name, prompts in sets.items():
            print(f"{name}:", flush=True)
            results[name] = measure_set(alone, engine, prompts, args.new_tokens, eos)
            print({k: v for k, v in results[name].items() if k != "per_prompt"}, flush=True)
    result = {
        "folder": str(args.folder),
        "bits": args.bits,
        "new_tokens": args.new_tokens,
        "draft_max": DRAFT_MAX,
        "sets": results,
        "mismatches": sum(r["mismatches"] for r in results.values()),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for name, r in results.items():
        print(f"{name}: ×{r['speedup']:.2f}, {r['tokens_per_check']:.2f} tokens a check, {r['mismatches']} mismatches")


if __name__ == "__main__":
    main()
