"""Scaling: verify-pass time and tok/s with the residual on 1 vs 2 CPU actors, beside the cost model's
prediction from parts measured in the same run; and the model's predictions for two boxes not here.

    flock /tmp/splitspec-bench.lock flock /tmp/splitspec-ray.lock .venv/bin/python benchmarks/scaling.py
        [--prompts 2] [--new-tokens 16] [--no-namespace-host]

Two models, each with its 8-bit residual: the demo folder (SmolLM2-135M, fixed costs dominate a pass)
and a Llama-shaped model with random weights whose residual passes 1 GB (``large_model.py``, converted
once by round-to-nearest and cached). Per model and actor count, one engine as ``splitspec generate``
starts it (``scheduler.local.start_local``: the engine on the first CPU, the actors on the others) and
two rows: the verifier alone (1-token passes) and a 16-node draft (17-token passes): a best-first
tree, or a chain where the rank statistics hold too few paths (the random model's). Then the demo
model's two rows again with its residual split between an actor on this host (shared memory) and one
on a second host simulated in a network namespace (``scheduler.netns``; TCP sealed with CURVE), placed
by the scheduler on Ray (``Deployment.place``) with the engine in this process; skipped, with the reason
recorded, where no namespace can be made (it needs root). And the demo model's two rows with the engine
keeping a share of the residual (``--resident-shares``; ``EngineConfig.resident_bytes``, the plan's VRAM
share, here on the engine's core) and one actor the rest.

The prediction is ``PassParts`` (``scheduler.cost``) over parts, never over the pass or the decode it
predicts. The parts are sampled by probes run between the decode's checks (excluded from the checks'
timings), so that they see the load the checks see on a machine others load too: each probe runs a
draft pass and then a verify pass (as in a check, whose verify pass comes after the actors waited out
the drafting) shaped, positioned and masked as the row's checks (at 1 token, and for a tree at its 17
too), and from the verify pass takes the engine's 2-bit base time, each actor's kernel
time (the actor's own compute counter; actors that share cores take turns, so their times add), the
engine's time on the residual rows it holds (``DeviceResidual.held_s``; the ``resident`` part) and the
engine's own work (norms, rotations, attention, the fp32 lm_head: the pass less its base product, its
sending and its waiting, so done beside the streaming actors, as in a check, whose memory traffic and
shared core slow it), and then the channel: a few layers' requests, each sent after as much busy time as the
engine's own work between two requests of that pass and gathered after its base product's share, so
that an actor that went to sleep meanwhile must be woken and, on a loaded machine, wait for a core as
it does in a pass (back-to-back requests would find it still spinning); the latency is what the round
trip took beyond the sending and the larger of the base product and the actors' compute. A draft step's
cost is the probes' draft pass itself (its own int8 head, no residual). The parts are the probes'
means (a line through the two token counts, for a tree), the loop's own time per check is measured
once per engine, and tok/s comes from ``evaluate`` with the folder's rank statistics. The
measured side is the decode: the tokens its checks decided over the checks' time (prefill excluded; the
surplus of a prompt's last check beyond --new-tokens, cut from the text, counts too, since the
prediction is the steady state: ``emitted_tok_s`` in the details leaves it out), and the checks' mean
verify time.

Writes benchmarks/results/scaling.json and scaling.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import ray
import torch

from e2e import heldout_prompts
from large_model import DEMO, large_folder
from splitspec.config import EngineConfig, SpecConfig
from splitspec.gpu_actor.check_costs import measure_check_costs
from splitspec.gpu_actor.engine import GenerationStats, SplitEngine
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.model import PassStats
from splitspec.gpu_actor.residual import NoResidual
from splitspec.gpu_actor.speculative import StepStats
from splitspec.gpu_actor.tree import DraftTree
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler import cost
from splitspec.scheduler.cluster import Deployment, SchedulerConfig, connect_or_start
from splitspec.scheduler.local import start_local
from splitspec.scheduler.machine import machine_from_toml, model_from_toml
from splitspec.scheduler.netns import RESOURCE, SecondHost, unavailable
from splitspec.scheduler.plan import make_plan

RESULTS = Path(__file__).parent / "results"
MACHINES = Path(__file__).parent / "machines"
BITS = 8
TREE = 16
CONTEXT = 96  # about a held-out prompt and the tokens decoded after it
LATENCY_LAYERS = 4  # layers of requests each probe times the channel on


def _context(engine: SplitEngine) -> KVCache:
    """A cache holding ``CONTEXT`` verified tokens, as a decode's is after its prompt: the probes' passes
    attend to it and roll back."""
    cache = engine.model.new_cache(CONTEXT + TREE + 2)
    context, chunk = torch.arange(CONTEXT) + 100, engine.config.prefill_chunk
    for i in range(0, CONTEXT, chunk):
        engine.model.forward(context[i : i + chunk], cache, engine.residual, last_only=True)
    return cache


def _held_s(engine: SplitEngine) -> float:
    """Seconds the engine has spent on the residual rows it holds (``EngineConfig.resident_bytes``)."""
    return engine.device_residual.held_s if engine.device_residual is not None else 0.0


def _pass(
    engine: SplitEngine, cache: KVCache, shape: cost.TreeShape, draft: bool
) -> tuple[PassStats, list[float], float]:
    """One pass of a tree of this shape, positioned and masked as a check's, rolled back: its stats, each
    actor's compute seconds in it and the engine's on the rows it holds."""
    tree = DraftTree([500 + i % 200 for i in range(shape.nodes + 1)], list(shape.parents), list(shape.depths))
    residual = NoResidual() if draft else engine.residual
    length = cache.length
    before, held = [] if draft else engine.residual.actor_compute_s(), _held_s(engine)
    stats = PassStats()
    where = {"positions": tree.positions(length), "mask": tree.check_mask(length)}
    engine.model.forward(torch.tensor(tree.tokens), cache, residual, draft=draft, stats=stats, **where)
    after = [] if draft else engine.residual.actor_compute_s()
    cache.truncate(length)
    return stats, [b - a for a, b in zip(before, after, strict=True)], _held_s(engine) - held


def _busy(seconds: float) -> None:
    """Keep this core busy for ``seconds``, as the engine's own work would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _latency(
    engine: SplitEngine,
    converted: ConvertedModel,
    layer: int,
    n: int,
    gaps: tuple[float, float],
    groups: list[list[int]],
) -> tuple[float, float]:
    """(seconds the engine spends sending, seconds of latency) per round trip of one layer's n-token
    requests, each sent after ``gaps[0]`` of the engine's own work and gathered after ``gaps[1]`` of its
    base product, as in a pass: an actor that waited that long may have gone to sleep, and on a loaded
    machine waking it (and the engine, when the answer comes) waits for a core. The latency is the wall
    time less the sending and the larger of the base product and the actors' compute (summed where the
    actors share cores, so their work runs one after the other, else the slowest: ``_core_groups``)."""
    residual = engine.residual
    layer %= len(converted.layers)
    linears = converted.layers[layer]
    xs = [torch.randn(n, layout.d_in) for layout in linears.values()]
    before, held = residual.actor_compute_s(), _held_s(engine)
    wall = send = 0.0
    for name, x in zip(linears, xs, strict=True):
        _busy(gaps[0])
        t0 = time.perf_counter()
        handle = residual.submit(layer, name, x)
        t1 = time.perf_counter()
        _busy(gaps[1])
        residual.gather(handle)
        wall += time.perf_counter() - t1
        send += t1 - t0
    spent = [b - a for a, b in zip(before, residual.actor_compute_s(), strict=True)]
    computed = max(sum(spent[i] for i in group) for group in groups)
    hidden = max(computed, gaps[1] * len(linears) + _held_s(engine) - held)  # the engine's rows: its own work
    return send / len(linears), max(wall - hidden, 0.0) / len(linears)


def _probe(
    engine: SplitEngine,
    converted: ConvertedModel,
    cache: KVCache,
    shapes: dict[int, cost.TreeShape],
    groups: list[list[int]],
    k: int,
) -> list[dict]:
    """One sample of every part per token count of the row, taken between two checks of the decode, so
    that it sees the load the checks see: a draft pass and then a verify pass, the verifier's head, and at
    the row's verify count the channel's latency (``_latency``) with the gaps that pass had."""
    samples = []
    round_trips = len(converted.layers) * len(converted.layers[0])
    for n, shape in sorted(shapes.items()):
        # the draft first, as in a check: its verify pass comes after the actors waited out the drafting
        draft, _, _ = _pass(engine, cache, shape, draft=True)
        verify, actors, held = _pass(engine, cache, shape, draft=False)
        # the engine's own work in the verify pass, done while the actors stream beside it: all but the
        # base product, the sending and the waiting
        engine_s = verify.total_s - verify.base_s - verify.submit_s - verify.wait_s
        sample = {"n": n, "base": verify.base_s, "actors": actors, "engine": engine_s, "draft": draft.total_s}
        samples.append(sample | {"resident": held})
    gaps = (engine_s / round_trips, verify.base_s / round_trips)  # the largest count's: the row's verify pass
    layers = [_latency(engine, converted, k * LATENCY_LAYERS + j, n, gaps, groups) for j in range(LATENCY_LAYERS)]
    samples[-1]["send"], samples[-1]["latency"] = (statistics.mean(x) for x in zip(*layers, strict=True))
    return samples


def _decode(
    view: SplitEngine, prompts: list[list[int]], new_tokens: int, eos: int | None, probe
) -> tuple[list, int, list[dict]]:
    """(checks, tokens made after the first, probe samples): the checks' own timings exclude the probes
    run between them."""
    checks, made, samples = [], 0, []
    for prompt in prompts:
        stats = GenerationStats(0, "", StepStats(0, 0, 0, 0, 0, 0, 0))
        for new in view.stream(prompt, new_tokens, eos, stats=stats):
            made += len(new)
            samples += probe(len(samples))
        made -= 1  # the first token comes from the prefill
        checks += stats.checks
    return checks, made, samples


def _term(by_n: dict[int, list[float]]) -> cost.Term:
    """The mean seconds at each probed token count as a term: a line through two counts, or a constant
    where the row verifies one count only."""
    means = {n: statistics.mean(v) for n, v in sorted(by_n.items())}
    if len(means) == 1:
        return cost.Term(next(iter(means.values())))
    (n0, s0), (n1, s1) = means.items()
    return cost.Term.fit(n0, s0, n1, s1)


def _row_costs(
    samples: list[dict], cpus: list[tuple[int, ...]], round_trips: int
) -> tuple[cost.PassParts, cost.CostCurve]:
    """The verify pass's parts and the draft step's cost curve from the probes' samples (see the module
    doc)."""

    def by_n(get) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for s in samples:
            out.setdefault(s["n"], []).append(get(s))
        return out

    actors = [_term(by_n(lambda s, i=i: s["actors"][i])) for i in range(len(cpus))]
    draft = cost.CostCurve.of({n: 1e3 * statistics.mean(v) for n, v in by_n(lambda s: s["draft"]).items()})
    parts = cost.PassParts(
        base=_term(by_n(lambda s: s["base"])),
        actors=_by_cores(actors, _core_groups(cpus)),
        engine=_term(by_n(lambda s: s["engine"])),
        resident=_term(by_n(lambda s: s["resident"])),
        round_trips=round_trips,
        latency_s=statistics.mean(s["latency"] for s in samples if "latency" in s),
        send_s=statistics.mean(s["send"] for s in samples if "send" in s),
    )
    return parts, draft


def _core_groups(cpus: list[tuple[int, ...]]) -> list[list[int]]:
    """The actors (by index) in groups whose CPU sets overlap: actors in one group take turns on the cores
    they share, so their times add; groups run side by side."""
    groups: list[tuple[set[int], list[int]]] = []
    for i, cores in enumerate(cpus):
        mine, members = set(cores), [i]
        for group in [g for g in groups if g[0] & mine]:
            groups.remove(group)
            mine |= group[0]
            members = group[1] + members
        groups.append((mine, members))
    return [sorted(members) for _, members in groups]


def _by_cores(terms: list[cost.Term], groups: list[list[int]]) -> tuple[cost.Term, ...]:
    """One term per group of actors sharing cores: the sum of its actors' terms."""
    return tuple(
        cost.Term(sum(terms[i].fixed_s for i in group), sum(terms[i].token_s for i in group)) for group in groups
    )


def _big_shape(stats: list[list[float]]) -> tuple[str, cost.TreeShape]:
    """A 16-node best-first tree; a chain of 16 where the statistics hold fewer paths the verifier ever
    took (a random model's), so that the row still verifies 17-token passes."""
    if len(cost.best_first_paths(stats, TREE)) == TREE:
        return "tree", cost.best_first(stats, TREE)
    return "chain", cost.chain(TREE)


CONFIG = EngineConfig(prefill="split", spec=SpecConfig(mode="off", draft_max=TREE))


@contextlib.contextmanager
def local_engine(
    folder: Path, n_actors: int, share: float = 0.0
) -> Iterator[tuple[SplitEngine, list[tuple[int, ...]], str]]:
    """(engine, each actor's CPUs, the row's label) as ``splitspec generate`` starts them on this host, the
    engine keeping ``share`` of the residual (``EngineConfig.resident_bytes``) and the actors the rest."""
    config = replace(CONFIG, resident_bytes=round(share * _residual_bytes(ConvertedModel(folder))))
    label = f"{n_actors} CPU actor{'s' * (n_actors > 1)}" + (f", engine holds {share:.0%}" if share else "")
    with start_local(folder, BITS, n_cpu_actors=n_actors, config=config) as engine:
        yield engine, [tuple(a.ready["cpus"]) for a in engine.actors], label


@contextlib.contextmanager
def namespace_engine(folder: Path) -> Iterator[tuple[SplitEngine, list[tuple[int, ...]], str]]:
    """Two CPU actors placed by the scheduler, one here (shared memory) and one on a second host simulated
    in a network namespace (``scheduler.netns``: TCP sealed with CURVE over a veth pair), the engine in
    this process on the endpoints they serve."""
    host = SecondHost()
    try:
        host.create()
        address = host.start_head()
        connect_or_start(SchedulerConfig(address=address, node_ip=host.host_ip))
        host.start_worker(address)
        host.wait_nodes(2)
        scheduler = SchedulerConfig(
            node_ip=host.host_ip, cpu_actors=2, actor_hosts=(None, RESOURCE), start_timeout_s=300
        )
        with Deployment.place(folder, BITS, CONFIG, scheduler) as deployment:
            cpus = [tuple(i["cpus"]) for i in ray.get([a.info.remote() for a in deployment.cpu_actors])]
            with SplitEngine.connect(folder, BITS, deployment.endpoints(), *deployment.engine_args) as engine:
                if engine.residual.transports != ["shm", "tcp"]:
                    raise RuntimeError(f"the actors are not one here and one there: {engine.residual.transports}")
                yield engine, cpus, "1 CPU actor here + 1 on a namespace host (TCP+CURVE)"
    finally:
        host.close()


def measure(
    label: str, folder: Path, started, prompts: list[list[int]], new_tokens: int, eos: int | None
) -> tuple[list[dict], dict]:
    """Two rows (verifier alone, tree) for one model on the engine ``started`` gives (``local_engine``,
    ``namespace_engine``), and what they came from."""
    converted = ConvertedModel(folder)
    load = [os.getloadavg()[0]]
    with started as (engine, cpus, actors_label):
        config = engine.config
        stats = engine.rank_stats()
        big = _big_shape(stats)
        cache = _context(engine)
        overhead_ms = measure_check_costs(engine.model, engine.residual, 2, config.prefill_chunk).overhead_ms
        round_trips = len(converted.layers) * len(converted.layers[0])
        groups = _core_groups(cpus)
        decoded = []
        for mode, shape in (("off", cost.chain(0)), big):
            spec = SpecConfig(mode=mode, draft_max=TREE)
            view = SplitEngine(engine.model, engine.residual, replace(config, spec=spec), tree_stats=stats)
            # the verify pass's count, and for a tree the 1-token passes its narrow draft steps are near
            shapes = {1: cost.chain(0)} | ({shape.nodes + 1: shape} if shape.nodes else {})
            probe = partial(_probe, engine, converted, cache, shapes, groups)
            checks, made, samples = _decode(view, prompts, new_tokens, eos, probe)
            decoded.append((shape, checks, made, *_row_costs(samples, cpus, round_trips), len(samples)))
        rows, accepted = [], {}
        for shape, checks, made, parts, draft, probes in decoded:
            decided = sum(c.accepted + 1 for c in checks)
            costs = cost.pass_costs(parts, TREE + 1, overhead_ms, draft)
            predicted = cost.evaluate(shape, stats, costs)
            config_name = f"{label} r{BITS}, {actors_label}, {shape.name()}"
            rows.append(
                {
                    "config": config_name,
                    "measured_tok_s": round(1e3 * decided / sum(c.total_ms for c in checks), 3),
                    "predicted_tok_s": round(predicted.tok_s, 3),
                    "measured_verify_ms": round(statistics.mean(c.verify_ms for c in checks), 3),
                    "predicted_verify_ms": round(costs.verify(shape.nodes + 1), 3),
                }
            )
            accepted[config_name] = {
                "verify_tokens": shape.nodes + 1,
                "parts_fixed_ms_and_per_token_ms": {
                    "base": [round(1e3 * parts.base.fixed_s, 3), round(1e3 * parts.base.token_s, 4)],
                    "resident": [round(1e3 * parts.resident.fixed_s, 3), round(1e3 * parts.resident.token_s, 4)],
                    "actors": [[round(1e3 * a.fixed_s, 3), round(1e3 * a.token_s, 4)] for a in parts.actors],
                    "engine_fixed": [round(1e3 * parts.engine.fixed_s, 3), round(1e3 * parts.engine.token_s, 4)],
                },
                "latency_us": round(1e6 * parts.latency_s, 1),
                "send_us": round(1e6 * parts.send_s, 1),
                "loop_overhead_ms": round(overhead_ms, 3),
                "probes": probes,
                "tokens_per_check": round(decided / len(checks), 3),
                "emitted_tok_s": round(1e3 * made / sum(c.total_ms for c in checks), 3),  # cut at --new-tokens
                "predicted_tokens_per_check": round(predicted.tokens_per_check, 3),
                "checks": len(checks),
                "decode_mean_ms": {  # where the decode's checks spent their time (the engine's own counters)
                    k: round(statistics.mean(getattr(c, k) for c in checks), 3)
                    for k in ("total_ms", "draft_ms", "verify_ms", "base_ms", "residual_wait_ms", "channel_ms")
                },
                "predicted_ms": {  # the same from the parts, beside them
                    "total_ms": round(predicted.check_ms, 3),
                    "draft_ms": round(sum(costs.draft(len(level)) for level in shape.draft_levels()), 3),
                    "verify_ms": round(costs.verify(shape.nodes + 1), 3),
                    "base_ms": round(1e3 * parts.base(shape.nodes + 1), 3),
                    "residual_and_latency_ms": round(1e3 * (parts.residual_s(shape.nodes + 1) + parts.channel_s()), 3),
                    "send_ms": round(1e3 * parts.round_trips * parts.send_s, 3),
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
        "round_trips": round_trips,
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
                    "draft": c.name,
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
    fig.suptitle("CPU actors here and on a namespace host: measured, and predicted from parts sampled in the same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=2, help="held-out prompts decoded per row")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--actors", default="1,2", help="CPU actor counts to compare")
    p.add_argument("--models", default="demo,large", help="which models: demo, large or both")
    p.add_argument("--no-namespace-host", dest="namespace_host", action="store_false", help="skip that row")
    p.add_argument(
        "--resident-shares",
        default="0.25",
        help="shares of the residual the engine keeps, one actor, on the first model (0 or empty: none)",
    )
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
    rows, configs, skipped = [], {}, {}
    t0 = time.perf_counter()
    eos = tokenizer.eos_token_id
    for label, folder in models:
        for n in map(int, args.actors.split(",")):
            got, detail = measure(label, folder, local_engine(folder, n), prompts, args.new_tokens, eos)
            rows += got
            configs[f"{label}, {n} CPU actors"] = detail
    for share in [float(x) for x in args.resident_shares.split(",") if x and float(x) > 0]:
        label, folder = models[0]
        got, detail = measure(label, folder, local_engine(folder, 1, share), prompts, args.new_tokens, eos)
        rows += got
        configs[f"{label}, 1 CPU actor, engine holds {share:.0%}"] = detail
    if args.namespace_host:
        if (why := unavailable()) is None:
            got, detail = measure(*models[0], namespace_engine(models[0][1]), prompts, args.new_tokens, eos)
            rows += got
            configs[f"{models[0][0]}, namespace host"] = detail
        else:
            skipped["namespace host"] = why
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
        "rows_within_25pct": f"{sum(e <= 0.25 for e in errors)} of {len(errors)}",
        "host": {"cpus": len(os.sched_getaffinity(0)), "load_average_1min_end": os.getloadavg()[0]},
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "configs": configs,
        "skipped": skipped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"max relative error {result['max_relative_error']:.1%}; predictions: {result['predictions']}")


if __name__ == "__main__":
    main()
