"""One verify pass of the split verifier for n = 1…16 tokens, through a real CPU actor process, and how much
of it the channel costs.

    .venv/bin/python benchmarks/verify_pass.py [FOLDER] [--bits 8] [--reps 7]

FOLDER is a converted model (default ``out/smollm2-135m``: ``splitspec convert default out/smollm2-135m
--residual-bits 6,7,8``). A truncated conversion works for a quick look (``splitspec convert default
/tmp/smollm2-2l --num-layers 2 --calib-sequences 4 --calib-seq-len 128``, ~4 minutes): the same per-layer
parts, with the fixed lm_head a larger share of the pass.

The engine and the CPU actor are pinned to different cores (``plan_cpus``), as ``scheduler.local.start_local`` does.
Per n, the median of ``--reps`` passes after a 32-token context:

- ``total_ms``: the pass; ``base_ms``: the 2-bit base product (engine side); ``residual_ms``: the CPU
  actor's compute for the pass (from its own counters, so it excludes the channel); it overlaps the base.
- ``channel_ms``: round trips × latency, with the latency measured for the same payloads in the same run:
  every group's request sent alone (posted to the leased slot and its reply awaited, as a CPU engine's
  pass does from compiled code; submit then gather at once where it cannot), minus what the actor
  computed meanwhile.
- ``other_ms``: the engine's own work outside the channel and the base: rotations, norms, attention and
  the lm_head (``head_ms``, a fixed per-pass cost that a deep model dilutes).
- ``wait_ms`` / ``submit_ms``: time blocked in ``gather`` (residual not hidden + latency) and in ``submit``.

Both ends spin on the slots before sleeping (``ChannelConfig.own_core_spin_us``, as the engine sets it
for pinned disjoint cores); ``block`` repeats the run with no spin, to show what spinning buys.

The goal is ``channel_ms`` ≤ 15% of a 16-token pass (``channel_share``); ``channel_share_layers`` leaves the
lm_head out, which is what the share tends to for a deep model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from splitspec.config import EngineConfig
from splitspec.cpu_actor.service import start_cpu_actor
from splitspec.gpu_actor.engine import pin_engine
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.model import PassStats, SplitModel
from splitspec.gpu_actor.residual import RemoteResidual
from splitspec.models.files import CorruptFileError
from splitspec.protocol import lane
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler.cpus import plan_cpus, spin_budget

RESULTS = Path(__file__).parent / "results"
TOKENS = (1, 2, 4, 8, 16)
CONTEXT = 32
GOAL = 0.15


def _channel_s(model: ConvertedModel, residual: RemoteResidual, x: dict[str, torch.Tensor]) -> float:
    """Seconds of pure channel cost for one pass's round trips: each request alone, minus actor compute;
    through the leased slots a CPU engine's pass posts to from compiled code (``protocol.lane``, its
    functions called here one by one), or ``submit`` and ``gather`` where the pass cannot take them."""
    groups = list(model.layers[0])
    n = next(iter(x.values())).shape[0]
    widths = [x[g].shape[1] for g in groups]
    before = sum(residual.actor_compute_s())
    with residual.lanes(n, groups, widths) as lanes:
        start = time.perf_counter()
        for layer in range(len(model.layers)):
            for g, group in enumerate(groups):
                if lanes is None:
                    residual.gather(residual.submit(layer, group, x[group]))
                    continue
                actors = lanes.count // lanes.chunks  # one lane per actor for each request's rows
                for k, address in enumerate(lanes.table.tolist()):
                    first = k // actors * lanes.chunk
                    lane.post(address, layer, g, x[group][first:].data_ptr(), min(lanes.chunk, n - first))
                if not all(lane.answered(address) for address in lanes.table.tolist()):
                    lanes.wait()
        wall = time.perf_counter() - start
    return wall - (sum(residual.actor_compute_s()) - before)


def measure(folder: Path, bits: int, reps: int, block: bool = False) -> dict:
    """The engine's own set-up (pinning and spin budget, as ``start_local``); ``block`` sets the
    spin to 0, so that both sides sleep on the doorbell at every wait."""
    converted = ConvertedModel(folder)
    config = EngineConfig()
    engine_cpus, (actor_cpus,) = plan_cpus(1, None, config)
    spin_us = 0.0 if block else spin_budget(engine_cpus, [actor_cpus], config.channel)
    with start_cpu_actor(folder, bits, cpus=actor_cpus, spin_us=spin_us) as actor:
        undo = pin_engine(engine_cpus) if engine_cpus else (lambda: None)
        residual = RemoteResidual(converted, [actor.endpoint], replace(config.channel, spin_us=spin_us))
        (transport,) = residual.transports
        try:
            split = SplitModel(converted)
            cache = split.new_cache(CONTEXT + max(TOKENS))
            split.forward(torch.arange(CONTEXT) + 100, cache, residual)  # context, and warms every path
            rows = verify_rows(converted, split, residual, cache, reps)
        finally:
            residual.close()
            undo()
        return {
            "folder": str(folder),
            "transport": transport,
            "load_average_1min": os.getloadavg()[0],  # other work on the machine inflates the latency
            "layers": len(converted.layers),
            "bits": bits,
            "reps": reps,
            "engine_cpus": engine_cpus,
            "spin_us": spin_us,
            "actor_cpus": actor.ready["cpus"],
            "goal_channel_share_16": GOAL,
            "rows": rows,
        }


def verify_rows(
    converted: ConvertedModel, split: SplitModel, residual: RemoteResidual, cache: KVCache, reps: int
) -> list[dict]:
    """One row per n in ``TOKENS``: the median of ``reps`` passes of n tokens after what ``cache`` holds
    (truncated back to it after each), run back to back as decoding runs them, then the channel's share
    measured by ``reps`` rounds of its own (``_channel_s``). The actor's compute is its counter over all the
    passes: a ping between passes would stand between them as nothing in decoding does."""
    context, rows = cache.length, []
    for n in TOKENS:
        tokens = torch.arange(n) + 1000
        x = {g.name: torch.randn(n, g.d_in) for g in converted.spec.groups}
        passes = []
        before = residual.actor_compute_s()[0]
        for _ in range(reps):
            cache.truncate(context)
            stats = PassStats()
            split.forward(tokens, cache, residual, stats=stats)
            passes.append(stats)
        actor_s = (residual.actor_compute_s()[0] - before) / reps
        passes = [(stats, actor_s) for stats in passes]
        channel = [_channel_s(converted, residual, x) for _ in range(reps)]
        cache.truncate(context)
        rows.append(_row(n, passes, statistics.median(channel)))
        print(json.dumps(rows[-1]))
    return rows


def _row(n: int, passes: list[tuple[PassStats, float]], channel_s: float) -> dict:
    def med(f) -> float:
        return round(statistics.median(f(s, c) for s, c in passes) * 1e3, 3)

    total = med(lambda s, c: s.total_s)
    head = med(lambda s, c: s.head_s)
    channel = round(channel_s * 1e3, 3)
    return {
        "n": n,
        "total_ms": total,
        "base_ms": med(lambda s, c: s.base_s),
        "residual_ms": med(lambda s, c: c),
        "channel_ms": channel,
        "other_ms": med(lambda s, c: s.total_s - s.base_s - s.wait_s - s.submit_s),
        "head_ms": head,
        "attention_ms": med(lambda s, c: s.attention_s),
        "wait_ms": med(lambda s, c: s.wait_s),
        "submit_ms": med(lambda s, c: s.submit_s),
        "round_trips": passes[0][0].round_trips,
        "latency_us": round(channel_s / passes[0][0].round_trips * 1e6, 1),
        "channel_share": round(channel / total, 4),
        "channel_share_layers": round(channel / (total - head), 4),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [str(r["n"]) for r in rows]
    parts = {
        "base (2-bit, engine)": [r["base_ms"] for r in rows],
        "waiting for residual, exposed": [max(r["wait_ms"] - r["channel_ms"], 0.0) for r in rows],
        "channel (round trips × latency)": [r["channel_ms"] for r in rows],
        "other: rotations, attention, norms": [r["other_ms"] - r["head_ms"] for r in rows],
        "lm_head (fixed per pass)": [r["head_ms"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rows)
    for name, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(labels, [r["residual_ms"] for r in rows], "k.--", label="CPU actor compute (overlaps base)")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['channel_share']:.0%}", (i, r["total_ms"]), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("tokens verified in one pass (label: channel share of the pass)")
    ax.set_ylabel("ms per verify pass (median)")
    ax.set_title(f"verify pass, {result['layers']} layers, {result['bits']}-bit residual, 1 CPU actor")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", nargs="?", type=Path, default=Path("out/smollm2-135m"))
    p.add_argument("--bits", type=int, default=8, choices=(6, 7, 8))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS / "verify_pass.json")
    args = p.parse_args()
    try:
        ConvertedModel(args.folder)  # the project's own check of the folder, before anything starts
    except CorruptFileError as exc:
        raise SystemExit(str(exc)) from None
    result = measure(args.folder, args.bits, args.reps)
    blocking = measure(args.folder, args.bits, args.reps, block=True)
    result["block"] = {"spin_us": 0.0, "rows": blocking["rows"]}  # spin vs block, same run
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    sixteen = result["rows"][-1]
    verdict = "meets" if sixteen["channel_share"] <= GOAL else "misses"
    print(f"channel {sixteen['channel_share']:.1%} of a 16-token pass: {verdict} the {GOAL:.0%} goal")


if __name__ == "__main__":
    main()
