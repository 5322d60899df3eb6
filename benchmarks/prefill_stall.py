"""How long a long prompt joining the batch holds up the sequences already decoding: chunked prefill (one
forward per round between their checks, the default) against the whole prompt before the next check.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/prefill_stall.py [FOLDER] [--rounds 3]
        [--streams 3] [--long-tokens 1500]

One engine (``start_local``, one CPU actor, 8-bit residual) and its batcher on its own thread, as the
server runs it, prefix reuse off. Per round, each mode in turn (``BatchConfig.prefill_per_round``: None,
then 10**6): ``--streams`` held-out chats decode 96 tokens each; 0.4 s in, a prompt of ``--long-tokens``
tokens (the held-out prompts' text, repeated) asks for 8. Per mode, medians over rounds: the long
prompt's time to first token, and the decoding streams' longest gap between two tokens while it was
prefilled, with how many tokens they got meanwhile.

Writes benchmarks/results/prefill_stall.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from acceptance import RESULTS
from large_model import DEMO
from splitspec.config import EngineConfig
from splitspec.gpu_actor.batcher import Batcher
from splitspec.models.data import read_prompts, render
from splitspec.scheduler.local import start_local

PROMPTS = Path(__file__).parent / "prompts" / "heldout.jsonl"
MODES = {"chunked": None, "whole": 10**6}


def prompts(tokenizer, streams: int, long_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The first ``streams`` held-out chats, and one user turn of all the held-out questions' text repeated,
    cut to ``long_tokens``, each chat-templated (``models.data.read_prompts``)."""
    held = read_prompts(PROMPTS)
    short = [p.ids(tokenizer) for p in held if p.kind == "chat"][:streams]
    body = " ".join(m["content"] for p in held for m in p.messages)
    repeats = 1 + long_tokens // max(1, len(tokenizer(body)["input_ids"]))
    text = [{"role": "user", "content": " ".join([body] * repeats)}]
    return short, render(text, tokenizer, add_generation_prompt=True)[:long_tokens]


def one_round(batcher: Batcher, short: list[list[int]], long: list[int]) -> dict:
    arrivals: dict[int, list[float]] = {}

    def decode(i: int) -> None:
        ticket, done, times = batcher.submit(short[i], 96, None), False, []
        while not done:
            ticket, new, done = batcher.next(ticket.id)
            if new:
                times.append(time.perf_counter())
        arrivals[i] = times

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(short))]
    for t in threads:
        t.start()
    time.sleep(0.4)
    start, ticket, done, first = time.perf_counter(), batcher.submit(long, 8, None), False, None
    while not done:
        ticket, new, done = batcher.next(ticket.id)
        first = first or (time.perf_counter() if new else None)
    for t in threads:
        t.join()
    gaps = [(a, b) for times in arrivals.values() for a, b in itertools.pairwise(times)]
    during = [b - a for a, b in gaps if a < first and b > start]
    return {
        "ttft_ms": 1e3 * (first - start),
        "prefill_ms": ticket.stats.prefill.verify_ms,
        "worst_gap_ms": 1e3 * max(during, default=0.0),
        "tokens_meanwhile": sum(start < t < first for times in arrivals.values() for t in times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=DEMO)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=1500)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    short, long = prompts(tokenizer, args.streams, args.long_tokens)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    started = time.perf_counter()
    with start_local(args.folder, 8, n_cpu_actors=1, config=EngineConfig()) as engine:
        base = replace(engine.config.batch, prefix_cache_bytes=0)
        for _ in range(args.rounds):
            for mode, per_round in MODES.items():
                batcher = Batcher(engine, replace(base, prefill_per_round=per_round))
                batcher.start()
                try:
                    runs[mode].append(one_round(batcher, short, long))
                finally:
                    batcher.close()
                print(mode, json.dumps(runs[mode][-1]))
    rows = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    out = {
        "folder": str(args.folder),
        "streams": args.streams,
        "long_tokens": len(long),
        "prefill_chunk": engine.config.prefill_chunk,
        "rounds": args.rounds,
        "rows": rows,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefill_stall.json").write_text(json.dumps(out, indent=2) + "\n")
    json.dump(rows, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
