"""Scaling: verify-pass time and tok/s with the residual on 1 vs 2 CPU actors, beside the cost model's
prediction from parts measured in the same run; and the model's predictions for two boxes not here.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/scaling.py [--prompts 2] [--new-tokens 16]

Two models, each with its 8-bit residual: the demo folder (SmolLM2-135M, fixed costs dominate a pass)
and a Llama-shaped model with random weights whose residual passes 1 GB (``large_model.py``, converted
once by round-to-nearest and cached). Per model and actor count, one engine as ``splitspec generate``
starts it (``scheduler.local.start_local``: the engine on the first CPU, the actors on the others) and
two rows: the verifier alone (1-token passes) and a 16-node draft (17-token passes): a best-first
tree, or a chain where the rank statistics hold too few paths (the random model's).

The prediction is ``PassParts`` (``scheduler.cost``) over parts, never over the pass or the decode it
predicts, each from passes shaped, positioned and masked as the row's checks are: per actor its kernel
time at 1 and 17 tokens (the actor's own compute counter; actors that
share cores take turns, so their times add), the engine's 2-bit base time, the engine's fixed work
(a draft forward, which runs the same layers without the residual, less its base product and its int8
head, plus the verifier's fp32 lm_head timed alone), the engine's sending time per request, the channel's
latency (a layer's requests sent one at a time, less what the actors computed meanwhile, sampled between
the decode's checks: on a machine others load, wake-up delays make it the part that drifts most) and
the loop's own time per check; the other parts are measured before and after the row's decode and
averaged; tok/s then comes from ``evaluate`` with the folder's rank statistics. The measured side is
the decode: tok/s over the checks' time (prefill excluded), and the checks' mean verify time.

Writes benchmarks/results/scaling.json and scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from e2e import heldout_prompts
from large_model import DEMO, large_folder
from splitspec.config import EngineConfig, SpecConfig
from splitspec.gpu_actor.check_costs import measure_check_costs
from splitspec.gpu_actor.engine import GenerationStats, SplitEngine
from splitspec.gpu_actor.model import PassStats
from splitspec.gpu_actor.residual import NoResidual
from splitspec.gpu_actor.speculative import StepStats
from splitspec.gpu_actor.tree import DraftTree
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler import cost
from splitspec.scheduler.local import start_local
from splitspec.scheduler.machine import machine_from_toml, model_from_toml
from splitspec.scheduler.plan import make_plan

RESULTS = Path(__file__).parent / "results"
MACHINES = Path(__file__).parent / "machines"
BITS = 8
TREE = 16
CONTEXT = 96  # about a held-out prompt and the tokens decoded after it
REPS = 3


def _median_pass(engine: SplitEngine, cache, shape: cost.TreeShape, draft: bool) -> dict[str, float | list[float]]:
    """Medians over ``REPS`` passes of a tree of this shape, positioned and masked as a check's: the pass,
    its base product, its head, each actor's compute."""
    tree = DraftTree([500 + i % 200 for i in range(shape.nodes + 1)], list(shape.parents), list(shape.depths))
    tokens = torch.tensor(tree.tokens)
    residual = NoResidual() if draft else engine.residual
    runs = []
    for _ in range(REPS):
        length = cache.length
        before = [] if draft else engine.residual.actor_compute_s()
        stats = PassStats()
        where = {"positions": tree.positions(length), "mask": tree.check_mask(length)}
        engine.model.forward(tokens, cache, residual, draft=draft, stats=stats, **where)
        after = [] if draft else engine.residual.actor_compute_s()
        cache.truncate(length)
        runs.append((stats, [b - a for a, b in zip(before, after, strict=True)]))
    med = statistics.median
    return {
        "total": med(r.total_s for r, _ in runs),
        "base": med(r.base_s for r, _ in runs),
        "head": med(r.head_s for r, _ in runs),
        "actors": [med(a[i] for _, a in runs) for i in range(len(runs[0][1]))],
    }


def _head_s(engine: SplitEngine, n: int) -> float:
    """The verifier's fp32 lm_head on n rows, alone (a draft step ranks with its own cheaper head)."""
    hidden = torch.randn(n, engine.model.lm_head.shape[1])
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        hidden @ engine.model.lm_head.T
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _latency_samples(
    engine: SplitEngine, converted: ConvertedModel, shared_core: bool, layer: int
) -> list[tuple[float, float]]:
    """(seconds the engine spends sending, seconds of latency) per round trip of one layer's 1-token
    requests sent one at a time: the latency is the wall time less the sending and the actors' compute
    (summed where the actors share a core, so their work runs one after the other, else the slowest).
    Taken between the checks of a decode, so that it is sampled under the same load."""
    residual = engine.residual
    before = residual.actor_compute_s()
    groups = converted.layers[layer % len(converted.layers)]
    wall = send = 0.0
    for group, layout in groups.items():
        x = torch.randn(1, layout.d_in)
        t0 = time.perf_counter()
        handle = residual.submit(layer % len(converted.layers), group, x)
        send += time.perf_counter() - t0
        residual.gather(handle)
        wall += time.perf_counter() - t0
    spent = [b - a for a, b in zip(before, residual.actor_compute_s(), strict=True)]
    latency = max(wall - send - (sum(spent) if shared_core else max(spent)), 0.0)
    return [(send / len(groups), latency / len(groups))]


def _decode(
    view: SplitEngine, prompts: list[list[int]], new_tokens: int, eos: int | None, probe
) -> tuple[list, int, list[float]]:
    """(checks, tokens made after the first, latency samples): the checks' own timings exclude the probes
    run between them."""
    checks, made, latencies = [], 0, []
    for prompt in prompts:
        stats = GenerationStats(0, "", StepStats(0, 0, 0, 0, 0, 0, 0))
        for new in view.stream(prompt, new_tokens, eos, stats=stats):
            made += len(new)
            latencies += probe(len(latencies))
        made -= 1  # the first token comes from the prefill
        checks += stats.checks
    return checks, made, latencies


def _parts(
    engine: SplitEngine, converted: ConvertedModel, cpus: list[tuple[int, ...]], big: cost.TreeShape
) -> tuple[cost.PassParts, float]:
    """The pass's parts and the loop's own ms per check, measured now on this engine (see the module doc)."""
    cache = engine.model.new_cache(CONTEXT + TREE + 2)
    context, chunk = torch.arange(CONTEXT) + 100, engine.config.prefill_chunk
    for i in range(0, CONTEXT, chunk):
        engine.model.forward(context[i : i + chunk], cache, engine.residual, last_only=True)
    raw = {}
    for n, shape in ((1, cost.chain(0)), (TREE + 1, big)):
        verify, draft = _median_pass(engine, cache, shape, draft=False), _median_pass(engine, cache, shape, draft=True)
        # the engine's own work: the draft pass less its base product and its head, plus the verifier's head
        engine_s = draft["total"] - draft["base"] - draft["head"] + _head_s(engine, n)
        raw[n] = (verify["base"], verify["actors"], engine_s)
    (b1, a1, e1), (b2, a2, e2) = raw[1], raw[TREE + 1]
    parts = cost.PassParts(
        base=cost.Term.fit(1, b1, TREE + 1, b2),
        actors=_by_cores([cost.Term.fit(1, x, TREE + 1, y) for x, y in zip(a1, a2, strict=True)], cpus),
        engine=cost.Term.fit(1, e1, TREE + 1, e2),
        round_trips=len(converted.layers) * len(converted.layers[0]),
        latency_s=0.0,  # sampled during the decode (``_decode``)
    )
    overhead_ms = measure_check_costs(engine.model, engine.residual, 2, engine.config.prefill_chunk).overhead_ms
    return parts, overhead_ms


def _by_cores(terms: list[cost.Term], cpus: list[tuple[int, ...]]) -> tuple[cost.Term, ...]:
    """One term per distinct CPU set: actors that share cores take turns on them, so their times add."""
    sets: dict[tuple[int, ...], cost.Term] = {}
    for term, cores in zip(terms, cpus, strict=True):
        was = sets.get(cores, cost.Term(0.0))
        sets[cores] = cost.Term(was.fixed_s + term.fixed_s, was.token_s + term.token_s)
    return tuple(sets.values())


def _mean_term(terms: list[cost.Term]) -> cost.Term:
    return cost.Term(statistics.mean(t.fixed_s for t in terms), statistics.mean(t.token_s for t in terms))


def _mean_parts(measured: list[tuple[cost.PassParts, float]]) -> tuple[cost.PassParts, float]:
    """Parts measured before and after the decode, averaged: the load of others drifts meanwhile."""
    parts = [p for p, _ in measured]
    mean = cost.PassParts(
        base=_mean_term([p.base for p in parts]),
        actors=tuple(_mean_term(list(a)) for a in zip(*(p.actors for p in parts), strict=True)),
        engine=_mean_term([p.engine for p in parts]),
        round_trips=parts[0].round_trips,
        latency_s=0.0,
    )
    return mean, statistics.mean(o for _, o in measured)


def _big_shape(stats: list[list[float]]) -> tuple[str, cost.TreeShape]:
    """A 16-node best-first tree; a chain of 16 where the statistics hold fewer paths the verifier ever
    took (a random model's), so that the row still verifies 17-token passes."""
    if len(cost.best_first_paths(stats, TREE)) == TREE:
        return "tree", cost.best_first(stats, TREE)
    return "chain", cost.chain(TREE)


def measure(
    label: str, folder: Path, n_actors: int, prompts: list[list[int]], new_tokens: int, eos: int | None
) -> tuple[list[dict], dict]:
    """Two rows (verifier alone, tree) for one model on ``n_actors`` CPU actors, and what they came from."""
    converted = ConvertedModel(folder)
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="off", draft_max=TREE))
    load = [os.getloadavg()[0]]
    with start_local(folder, BITS, n_cpu_actors=n_actors, config=config) as engine:
        cpus = [tuple(a.ready["cpus"]) for a in engine.actors]
        stats = engine.rank_stats()
        big = _big_shape(stats)
        measured = [_parts(engine, converted, cpus, big[1])]
        decoded = []
        for mode, shape in (("off", cost.chain(0)), big):
            spec = SpecConfig(mode=mode, draft_max=TREE)
            view = SplitEngine(engine.model, engine.residual, replace(config, spec=spec), tree_stats=stats)
            probe = partial(_latency_samples, engine, converted, len(set(cpus)) < len(cpus))
            checks, made, latencies = _decode(view, prompts, new_tokens, eos, probe)
            measured.append(_parts(engine, converted, cpus, big[1]))
            parts, overhead_ms = _mean_parts(measured[-2:])
            send, latency = (statistics.mean(x) for x in zip(*latencies, strict=True))
            parts = replace(parts, latency_s=latency, send_s=send)
            decoded.append((shape, checks, made, (parts, overhead_ms)))
        rows, accepted = [], {}
        for shape, checks, made, (parts, overhead_ms) in decoded:
            costs = cost.pass_costs(parts, TREE + 1, overhead_ms)
            predicted = cost.evaluate(shape, stats, costs)
            config_name = f"{label} r{BITS}, {n_actors} CPU actor{'s' * (n_actors > 1)}, {shape.name()}"
            rows.append(
                {
                    "config": config_name,
                    "measured_tok_s": round(1e3 * made / sum(c.total_ms for c in checks), 3),
                    "predicted_tok_s": round(predicted.tok_s, 3),
                    "measured_verify_ms": round(statistics.mean(c.verify_ms for c in checks), 3),
                    "predicted_verify_ms": round(costs.verify(shape.nodes + 1), 3),
                }
            )
            accepted[config_name] = {
                "verify_tokens": shape.nodes + 1,
                "parts_fixed_ms_and_per_token_ms": {
                    "base": [round(1e3 * parts.base.fixed_s, 3), round(1e3 * parts.base.token_s, 4)],
                    "actors": [[round(1e3 * a.fixed_s, 3), round(1e3 * a.token_s, 4)] for a in parts.actors],
                    "engine_fixed": [round(1e3 * parts.engine.fixed_s, 3), round(1e3 * parts.engine.token_s, 4)],
                },
                "latency_us": round(1e6 * parts.latency_s, 1),
                "send_us": round(1e6 * parts.send_s, 1),
                "loop_overhead_ms": round(overhead_ms, 3),
                "tokens_per_check": round(sum(c.accepted + 1 for c in checks) / len(checks), 3),
                "predicted_tokens_per_check": round(predicted.tokens_per_check, 3),
                "checks": len(checks),
                "decode_mean_ms": {  # where the decode's checks spent their time (the engine's own counters)
                    k: round(statistics.mean(getattr(c, k) for c in checks), 3)
                    for k in ("draft_ms", "verify_ms", "base_ms", "residual_wait_ms", "channel_ms", "head_ms")
                },
            }
            print(json.dumps(rows[-1]), flush=True)
        load.append(os.getloadavg()[0])
    detail = {
        "folder": str(folder),
        "residual_gb": round(_residual_bytes(converted) / 1e9, 3),
        "layers": len(converted.layers),
        "actor_cpus": cpus,
        "load_average_1min_before_after": load,
        "rows": accepted,
        "round_trips": len(converted.layers) * len(converted.layers[0]),
    }
    return rows, detail


def _residual_bytes(converted: ConvertedModel) -> int:
    return converted.manifest["files"][f"residual{BITS}.safetensors"]["bytes"]


def predictions() -> list[dict]:
    """The cost model's figures for the write-up's box and a 2-socket server: predictions, not runs."""
    model = model_from_toml(MACHINES / "model_31b.toml")
    out = []
    for file in ("writeup_box.toml", "two_socket.toml"):
        machine = machine_from_toml(MACHINES / file)
        plan = make_plan(machine, model)
        c = plan.choice
        out.append(
            {
                "box": machine.name,
                "tok_s": round(c.tok_s, 2),
                "assumptions": {
                    "machine_file": f"benchmarks/machines/{file}",
                    "model_file": "benchmarks/machines/model_31b.toml",
                    "model": model.name,
                    "residual_bits": model.residual_bits,
                    "residual_in_gpu_gb": round(plan.resident_bytes / 1e9, 2),
                    "residual_on_cpu_gb": round((model.residual_bytes() - plan.resident_bytes) / 1e9, 2),
                    "cpu_actors": len(plan.actors),
                    "draft": c.shape.name(),
                    "tokens_per_check": round(c.tokens_per_check, 3),
                    "verify_ms_1_token": round(plan.verify_ms(1), 2),
                    "check_ms": round(c.check_ms, 2),
                },
            }
        )
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(rows))
    for ax, key, unit in ((axes[0], "tok_s", "decode tok/s"), (axes[1], "verify_ms", "ms per verify pass")):
        ax.bar([x - 0.2 for x in xs], [r[f"measured_{key}"] for r in rows], width=0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [r[f"predicted_{key}"] for r in rows], width=0.4, label="cost model (parts)")
        ax.set_xticks(list(xs), [r["config"] for r in rows], fontsize=6, rotation=35, ha="right")
        ax.set_ylabel(unit)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("1 vs 2 CPU actors on this host: measured, and predicted from parts measured in the same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=2, help="held-out prompts decoded per row")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--actors", default="1,2", help="CPU actor counts to compare")
    p.add_argument("--models", default="demo,large", help="which models: demo, large or both")
    p.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    prompts = heldout_prompts(tokenizer, args.prompts)
    wanted = set(args.models.split(","))
    models = []
    if "demo" in wanted:
        models.append(("smollm2-135m demo", DEMO))
    if "large" in wanted:
        models.append(("llama random 1.1B", large_folder()))
    rows, configs = [], {}
    t0 = time.perf_counter()
    for label, folder in models:
        for n in map(int, args.actors.split(",")):
            got, detail = measure(label, folder, n, prompts, args.new_tokens, tokenizer.eos_token_id)
            rows += got
            configs[f"{label}, {n} CPU actors"] = detail
    errors = [
        max(
            abs(r["predicted_tok_s"] / r["measured_tok_s"] - 1),
            abs(r["predicted_verify_ms"] / r["measured_verify_ms"] - 1),
        )
        for r in rows
    ]
    result = {
        "rows": rows,
        "predictions": predictions(),
        "max_relative_error": round(max(errors), 3),
        "within_25pct": max(errors) <= 0.25,
        "host": {"cpus": len(os.sched_getaffinity(0)), "load_average_1min_end": os.getloadavg()[0]},
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "configs": configs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"max relative error {result['max_relative_error']:.1%}; predictions: {result['predictions']}")


if __name__ == "__main__":
    main()
