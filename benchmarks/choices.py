"""A request's n choices of one long prompt: prefilled once and copied (the batcher's sibling sharing),
against n prompts of the same length that share nothing.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/choices.py [FOLDER] [--rounds 3]
        [--choices 4] [--long-tokens 1000]

One engine (``start_local``, one CPU actor, 8-bit residual) and its batcher on its own thread, as the
server runs it, prefix reuse off. Per round, each mode in turn, ``--choices`` sequences submitted as one
group (``Batcher.submit_group``, as the server opens OpenAI's ``n``), sampled at temperature 0.8 with
seeds 0, 1, …, 32 new tokens each:

- ``same``: the one prompt (``prefill_stall.prompts``'s held-out text, ``--long-tokens`` tokens);
- ``distinct``: that prompt with its first token replaced by a different one per sequence, so no two
  share a prefix: the same work as before sharing existed.

Per mode, medians over rounds: the time until every sequence has its first token, and until all are done.

Writes benchmarks/results/choices.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from acceptance import RESULTS
from large_model import DEMO
from prefill_stall import prompts
from splitspec.config import EngineConfig, SamplingParams
from splitspec.gpu_actor.batcher import Batcher
from splitspec.scheduler.local import start_local

NEW_TOKENS = 32


def one_round(batcher: Batcher, group: list[list[int]]) -> dict:
    asks = [(p, NEW_TOKENS, SamplingParams(temperature=0.8, seed=i)) for i, p in enumerate(group)]
    start = time.perf_counter()
    tickets = batcher.submit_group(asks)
    firsts, done = {}, set()
    while len(done) < len(tickets):
        for got in batcher.next_many([t.id for t in tickets if t.id not in done]).values():
            ticket, new, finished = got
            if new and ticket.id not in firsts:
                firsts[ticket.id] = time.perf_counter()
            if finished:
                done.add(ticket.id)
    end = time.perf_counter()
    return {
        "all_first_tokens_ms": 1e3 * (max(firsts.values()) - start),
        "all_done_ms": 1e3 * (end - start),
        "reused_tokens": sum(t.reused for t in tickets),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=DEMO)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=1000)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    _, long = prompts(tokenizer, 0, args.long_tokens)
    others = [t for t in range(100, 100 + 4 * args.choices) if t != long[0]][: args.choices]
    groups = {"same": [long] * args.choices, "distinct": [[t, *long[1:]] for t in others]}
    runs: dict[str, list[dict]] = {mode: [] for mode in groups}
    started = time.perf_counter()
    with start_local(args.folder, 8, n_cpu_actors=1, config=EngineConfig()) as engine:
        batch = replace(engine.config.batch, prefix_cache_bytes=0, max_batch=max(args.choices, 1))
        for _ in range(args.rounds):
            for mode, group in groups.items():
                batcher = Batcher(engine, batch)
                batcher.start()
                try:
                    runs[mode].append(one_round(batcher, group))
                finally:
                    batcher.close()
                print(mode, json.dumps(runs[mode][-1]), flush=True)
    rows = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    out = {
        "folder": str(args.folder),
        "choices": args.choices,
        "long_tokens": len(long),
        "new_tokens": NEW_TOKENS,
        "rounds": args.rounds,
        "rows": rows,
        "first_tokens_same_over_distinct": rows["same"]["all_first_tokens_ms"]
        / rows["distinct"]["all_first_tokens_ms"],
        "done_same_over_distinct": rows["same"]["all_done_ms"] / rows["distinct"]["all_done_ms"],
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "choices.json").write_text(json.dumps(out, indent=2) + "\n")
    json.dump({k: v for k, v in out.items() if k != "runs"}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
