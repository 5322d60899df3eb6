"""The HTTP endpoint under a bounded load: throughput, latency and time to first token by concurrency, and
what prefix reuse saves on a chat's second turn.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/serve_load.py [FOLDER] [--requests 32]

One Ray cluster, one placement (the engine and one CPU actor serving the 8-bit residual), one Serve app on
loopback, and the same engine configuration at every level: ``--requests`` chat requests from the
held-out prompts (``prompts/heldout.jsonl``), ``--max-tokens`` greedy tokens each, sent by the ``openai``
client from ``concurrency`` threads at once, each streamed so that its first token is timed. Per level:
total tok/s (all completion tokens over the level's wall time), per-request tok/s (each request's tokens
over its own time, averaged), p50/p99 latency, p50 time to first token, errors.

The multi-turn row: a chat's first turn with a long user message, then its second turn (the first turn
and its answer re-sent with a short question), on a server that keeps finished sequences' K/V and on one
that does not (``BatchConfig.prefix_cache_bytes = 0``, a second placement in the same run): time to first
token of the second turn, median over a few chats.

Writes benchmarks/results/serve_load.json and serve_load.png.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from ray import serve

from large_model import DEMO
from splitspec.config import BatchConfig, EngineConfig
from splitspec.deploy.serve import build_app, start_server
from splitspec.scheduler.cluster import Deployment, SchedulerConfig, connect_or_start

HERE = Path(__file__).parent
RESULTS = HERE / "results"
LEVELS = (1, 2, 4, 8)
ALIAS = "splitspec"
LONG_TURN = (
    "I am planning a two-week trip through the north of Spain in October with my partner and our two "
    "children, who are eight and eleven. We will arrive in Bilbao and leave from Santiago de Compostela, "
    "we like museums, beaches when the weather allows, short hikes of two or three hours and good food, "
    "and we want to avoid driving more than three hours on any day. We have a budget of about four "
    "thousand euros for accommodation, food and activities, not counting the flights and the rental car. "
)
TURNS = ["Suggest a plan for the first three days.", "Which towns should we stay in?", "What should we eat?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ask(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """One streamed chat request: its seconds to first token and to the end, its tokens, or its error."""
    start, first, tokens = time.perf_counter(), None, 0
    try:
        stream = client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "latency_s": end - start, "tokens": tokens}


def level(client: openai.OpenAI, prompts: list[list[dict[str, str]]], concurrency: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda m: ask(client, m, max_tokens), prompts))
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "total_tok_s": sum(r["tokens"] for r in ok) / wall,
        "per_request_tok_s": statistics.mean(r["tokens"] / r["latency_s"] for r in ok) if ok else 0.0,
        "p50_ms": _pct([r["latency_s"] for r in ok], 0.5) * 1e3 if ok else None,
        "p99_ms": _pct([r["latency_s"] for r in ok], 0.99) * 1e3 if ok else None,
        "ttft_p50_ms": _pct([r["ttft_s"] for r in ok], 0.5) * 1e3 if ok else None,
        "errors": len(results) - len(ok),
        "error_messages": sorted({r["error"] for r in results if "error" in r})[:3],
        "wall_s": wall,
    }


def second_turn_ttft(client: openai.OpenAI, chats: int, max_tokens: int) -> list[float]:
    """Seconds to the first token of each chat's second turn (each chat's first turn asked just before)."""
    out = []
    for i in range(chats):
        first = [{"role": "user", "content": f"({i + 1}) " + LONG_TURN + TURNS[i % len(TURNS)]}]
        answer = client.chat.completions.create(model=ALIAS, messages=first, max_tokens=max_tokens, temperature=0)
        second = [*first, {"role": "assistant", "content": answer.choices[0].message.content}]
        second.append({"role": "user", "content": "Thanks. And what about the last day?"})
        out.append(ask(client, second, 8)["ttft_s"])
    return out


def serve_and(folder: Path, batch: BatchConfig, work) -> object:
    """Run ``work(client)`` against a fresh placement and Serve app with ``batch``; end both after."""
    with Deployment.start(folder, 8, EngineConfig(batch=batch)) as deployment:
        url = start_server(build_app(deployment.engine, folder, ALIAS), port=_free_port())
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            info = deployment.info()
            return work(client), info
        finally:
            serve.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=DEMO)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--chats", type=int, default=3)
    args = ap.parse_args()
    lines = [json.loads(s) for s in (HERE / "prompts" / "heldout.jsonl").read_text().splitlines() if s.strip()]
    chats = [p["messages"] for p in lines if p["kind"] == "chat"]
    prompts = [chats[i % len(chats)] for i in range(args.requests)]
    batch = BatchConfig(max_batch=max(LEVELS), max_queue=args.requests)
    cluster = connect_or_start(SchedulerConfig(address="local"))
    try:

        def sweep(client: openai.OpenAI) -> dict:
            ask(client, prompts[0], 4)  # warm-up: the engine measured its costs at start; this warms Serve
            rows = [level(client, prompts, c, args.max_tokens) for c in LEVELS]
            return {"rows": rows, "reuse_ttft_s": second_turn_ttft(client, args.chats, args.max_tokens)}

        measured, info = serve_and(args.folder, batch, sweep)
        without, _ = serve_and(
            args.folder,
            BatchConfig(max_batch=max(LEVELS), max_queue=args.requests, prefix_cache_bytes=0),
            lambda client: second_turn_ttft(client, args.chats, args.max_tokens),
        )
    finally:
        cluster.shutdown()
    rows = measured["rows"]
    multi = {
        "second_turn_ttft_ms_with_reuse": statistics.median(measured["reuse_ttft_s"]) * 1e3,
        "second_turn_ttft_ms_without_reuse": statistics.median(without) * 1e3,
        "chats": args.chats,
    }
    by = {r["concurrency"]: r for r in rows}
    out = {
        "folder": str(args.folder),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "batch": {"max_batch": batch.max_batch, "max_queue": batch.max_queue},
        "placement": info,
        "load_avg": os.getloadavg(),
        "cpus": len(os.sched_getaffinity(0)),
        "rows": rows,
        "multi_turn": multi,
        "speedup_8_over_1": by[8]["total_tok_s"] / by[1]["total_tok_s"],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_load.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(rows, multi)
    json.dump({k: out[k] for k in ("rows", "multi_turn", "speedup_8_over_1")}, sys.stdout, indent=2)
    print()


def plot(rows: list[dict], multi: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    c = [r["concurrency"] for r in rows]
    panels = ((a, "tokens / s", "total_tok_s", "per_request_tok_s"), (b, "ms", "p50_ms", "ttft_p50_ms"))
    for ax, unit, solid, dashed in panels:
        ax.plot(c, [r[solid] for r in rows], "o-", label=solid)
        ax.plot(c, [r[dashed] for r in rows], "s--", label=dashed)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.legend()
    with_, without = multi["second_turn_ttft_ms_with_reuse"], multi["second_turn_ttft_ms_without_reuse"]
    fig.suptitle(f"serving on loopback; chat 2nd turn TTFT {with_:.0f} ms with prefix reuse, {without:.0f} without")
    fig.tight_layout()
    fig.savefig(RESULTS / "serve_load.png", dpi=120)


if __name__ == "__main__":
    main()
