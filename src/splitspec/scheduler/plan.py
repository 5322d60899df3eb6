"""The plan: from a machine and a model's shape to who streams which residual rows, and what that buys.

The GPU holds as much of the residual as its memory budget leaves after the 2-bit base and the dense
lm_head: those rows cost it its own bandwidth, far more than any CPU's. It leaves every CPU actor some
rows of each group even where it could hold them all, since the engine never runs without its CPU actors
(``SchedulerConfig.cpu_actors``). The rest of every group's rows is split over one CPU actor per NUMA
node (and per extra host) in proportion to each node's read bandwidth, on whole 16-row tiles (the
residual file's layout), so that the actors finish a group together and the slowest does not hold up the
pass. The prediction is the cost model's (``scheduler.cost``) over the parts this plan implies; it is a
prediction, and says so when printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitspec.config import EngineConfig, SpecConfig
from splitspec.kernels.shard import held_rows, shard_rows
from splitspec.quantize import packing
from splitspec.scheduler import cost
from splitspec.scheduler.machine import Engine, Machine, ModelShape

GROUPS_PER_LAYER = 4  # channel round trips per layer: qkv, o, gate_up, down
DENSE_BYTES_GPU = 2  # a bf16 lm_head on a GPU
DENSE_BYTES_CPU = 4  # the converted folder's float32 dense tensors, as the CPU engine holds them
BUDGET_STEP = 10**7  # bytes: the resident budget in hundredths of a GB, as ``--resident-gb`` is printed


@dataclass(frozen=True)
class ActorPlan:
    """One CPU actor: where it runs, the bandwidth its share was sized by, and its rows of every group."""

    host: str
    node: int
    bandwidth: float
    flops: float
    rows: dict[str, tuple[int, int]]
    link_bandwidth: float | None
    link_latency: float | None

    def weights(self, model: ModelShape) -> int:
        """Residual weights this actor streams per pass."""
        return model.weights({g: b - a for g, (a, b) in self.rows.items()})


@dataclass(frozen=True)
class Plan:
    machine: Machine
    model: ModelShape
    resident_rows: dict[str, int]  # the first rows of each group, held beside the base by the engine
    resident_budget: int  # bytes of residual the engine is given (``EngineConfig.resident_bytes``) to hold them
    actors: tuple[ActorPlan, ...]
    parts: cost.PassParts
    choice: cost.Choice
    kv_bytes: float = 0.0  # K/V the engine keeps on its GPU for requests, left out of the resident residual
    kv_element: int = 4  # bytes of one K/V element (EngineConfig.kv_dtype)

    @property
    def resident_bytes(self) -> float:
        return self.model.residual_weight_bits / 8 * self.model.weights(self.resident_rows)

    def verify_ms(self, n: int) -> float:
        return 1e3 * self.parts.verify_s(n)


def resident_budget(engine: Engine, model: ModelShape, kv_bytes: float = 0.0) -> float:
    """Bytes of residual the GPU can hold: its memory less the reserve, the base, the lm_head (the
    embedding table stays in host RAM: a token needs one row of it) and ``kv_bytes`` of K/V for the
    requests (``BatchConfig.kv_budget_bytes``, serve's ``--kv-budget-mb``)."""
    if not engine.is_gpu:
        return 0.0
    taken = engine.reserve + model.base_bytes() + model.head_bytes(DENSE_BYTES_GPU) + kv_bytes
    return max(engine.memory - taken, 0.0)


def _resident_rows(budget: int, model: ModelShape) -> dict[str, int]:
    """The same fraction of every group's rows, rounded down to tiles, within ``budget``: the rule the engine
    and the CPU actors split a folder's rows by (``kernels.shard.held_rows``)."""
    return held_rows({g: rows for g, rows, _ in model.groups}, budget / model.residual_bytes())


def _engine_budget(budget: float, model: ModelShape, bandwidths: list[float]) -> int:
    """The residual bytes the engine is given: ``budget`` less what would leave a CPU actor a group without a
    whole tile (the engine never runs without its actors), in whole ``BUDGET_STEP``s, so that the
    ``--resident-gb`` the plan prints gives the engine these very rows. An actor keeps a tile of a group
    when the group's tiles left exceed the bandwidths' total over the slowest's: every share is then over
    one tile before ``shard_rows`` rounds it. A group with too few tiles for that leaves the engine none, and
    ``shard_rows`` says whether the actors can split it at all."""
    need = math.floor(sum(bandwidths) / min(bandwidths)) + 1
    tiles = [packing.num_tiles(rows) for _, rows, _ in model.groups]
    most = max(min((t - need) / t for t in tiles), 0.0)
    return math.floor(min(budget, most * model.residual_bytes()) / BUDGET_STEP) * BUDGET_STEP


def _bandwidths(machine: Machine) -> list[float]:
    """One per CPU actor: the bandwidth of each NUMA node of each host, in the order the actors are started."""
    return [node.bandwidth for h in machine.hosts for node in h.nodes]


def _actors(machine: Machine, model: ModelShape, resident: dict[str, int]) -> tuple[ActorPlan, ...]:
    nodes = [(h, i, node) for h in machine.hosts for i, node in enumerate(h.nodes)]
    bandwidths = _bandwidths(machine)
    n = len(bandwidths)  # each actor's rows as it will take them (``shard_rows``, by the same weights)
    shares = {g: [shard_rows(rows, n, k, bandwidths, resident[g]) for k in range(n)] for g, rows, _ in model.groups}
    return tuple(
        ActorPlan(
            h.name,
            i,
            node.bandwidth,
            node.flops,
            {g: s[k] for g, s in shares.items()},
            h.link_bandwidth,
            h.link_latency,
        )
        for k, (h, i, node) in enumerate(nodes)
    )


def _actor_term(actor: ActorPlan, model: ModelShape, engine: Engine) -> cost.Term:
    """Streaming its rows and their flops, plus moving each token's x' out and its rows' outputs back over
    the PCIe bus (a GPU engine) and the link (an extra host)."""
    weights = actor.weights(model)
    nbytes = weights * model.residual_weight_bits / 8
    term = cost.Term.streamed(nbytes, actor.bandwidth, 2 * weights, actor.flops)
    d_in = {name: d for name, _, d in model.groups}
    floats = sum(4 * model.layers_of(g) * (d_in[g] + b - a) for g, (a, b) in actor.rows.items())
    for bandwidth in (engine.pcie, actor.link_bandwidth):
        if bandwidth is not None:
            term = cost.Term(term.fixed_s, term.token_s + floats / bandwidth)
    return term


def make_plan(
    machine: Machine,
    model: ModelShape,
    budget: float | None = None,
    draft_min: int = 0,
    draft_max: int = 16,
    overhead_ms: float = 0.0,
    min_gain: float = SpecConfig.min_gain,
    kv_bytes: float = 0.0,
    kv_element: int = 4,
) -> Plan:
    """The plan and its prediction; ``budget`` caps the residual bytes the GPU may hold (None: all that
    fits beside ``kv_bytes`` of K/V, 0: none). Without rank statistics the prediction is the verifier alone,
    one token a pass."""
    engine = machine.engine
    kv_bytes = kv_bytes if engine.is_gpu else 0.0  # a CPU engine's K/V sits in host RAM
    fits = resident_budget(engine, model, kv_bytes)
    given = _engine_budget(fits if budget is None else min(budget, fits), model, _bandwidths(machine))
    resident = _resident_rows(given, model)
    actors = _actors(machine, model, resident)
    resident_weights = model.weights(resident)
    per_weight = model.residual_weight_bits / 8
    base = cost.Term.streamed(model.base_bytes(), engine.bandwidth, 2 * model.linear_params, engine.flops)
    held = cost.Term.streamed(resident_weights * per_weight, engine.bandwidth, 2 * resident_weights, engine.flops)
    dense = DENSE_BYTES_GPU if engine.is_gpu else DENSE_BYTES_CPU
    head = cost.Term.streamed(model.head_bytes(dense), engine.bandwidth, 2 * model.vocab * model.hidden, engine.flops)
    fixed = cost.Term(model.layers * engine.layer_overhead + head.fixed_s, head.token_s)
    latency = max(engine.round_trip + (a.link_latency or 0.0) for a in actors)
    parts = cost.PassParts(
        base=base,
        actors=tuple(_actor_term(a, model, engine) for a in actors),
        engine=fixed,
        round_trips=GROUPS_PER_LAYER * model.layers,
        latency_s=latency,
        resident=held,
    )
    costs = cost.pass_costs(parts, draft_max + 1, overhead_ms)
    if model.rank_stats is None:
        choice = cost.evaluate(cost.chain(0), [[0.0]], costs)
    else:
        choice = cost.choose(model.rank_stats, costs, draft_min, draft_max, min_gain=min_gain, ngram=model.ngram)
    return Plan(machine, model, resident, given, actors, parts, choice, kv_bytes, kv_element)


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def describe(plan: Plan) -> str:
    """The plan as lines of text, the prediction labelled as one."""
    m, model, parts = plan.machine, plan.model, plan.parts
    kind = "GPU" if m.engine.is_gpu else "CPU core"
    lines = [
        f"machine: {m.name} (engine on a {kind}; {sum(len(h.nodes) for h in m.hosts)} NUMA nodes on {len(m.hosts)} "
        f"host(s))",
        f"model: {model.name}: {model.layers} layers, {model.linear_params / 1e9:.2f} B quantized weights, "
        f"2-bit base {_gb(model.base_bytes())}, {model.residual_bits}-bit residual {_gb(model.residual_bytes())}",
        f"residual in the engine's memory: {_gb(plan.resident_bytes)} (generate/serve --resident-gb "
        f"{plan.resident_budget / 1e9:.2f}); on CPU actors: {_gb(model.residual_bytes() - plan.resident_bytes)}",
    ]
    if plan.kv_bytes and model.kv_token_values:
        tokens = model.context_tokens(plan.kv_bytes, plan.kv_element, 0)
        line = (
            f"K/V kept on the GPU for requests: {_gb(plan.kv_bytes)} (serve --kv-budget-mb "
            f"{round(plan.kv_bytes / 2**20)}): {tokens} tokens of context across the requests at once "
            f"({8 * plan.kv_element}-bit K/V)"
        )
        if model.state_bytes:
            state = _gb(model.state_bytes)
            line += f"; each sequence also keeps a recurrent state of {state} (linear-attention layers)"
        if model.sliding_window:
            slack = EngineConfig(kv_window="ring").ring_slack
            line += (
                f"; one sequence up to {model.context_tokens(plan.kv_bytes, plan.kv_element, slack)} with the "
                f"sliding layers' K/V in rings of {model.sliding_window + slack} slots (--kv-window ring, a GPU's)"
            )
        lines.append(line)
    for k, a in enumerate(plan.actors):
        rows = ", ".join(f"{g} {lo}:{hi}" for g, (lo, hi) in a.rows.items())
        share = a.weights(model) * model.residual_weight_bits / 8
        lines.append(f"  actor {k}: {a.host} node {a.node}, {a.bandwidth / 1e9:.1f} GB/s, {_gb(share)}; rows {rows}")
    c = plan.choice
    lines += [
        "PREDICTION (cost model, not a measurement):",
        f"  verify pass: {plan.verify_ms(1):.1f} ms for 1 token, {plan.verify_ms(c.shape.nodes + 1):.1f} ms for "
        f"{c.shape.nodes + 1} (base {1e3 * parts.base(1):.1f} ms, slowest actor {1e3 * parts.residual_s(1):.1f} ms, "
        f"channel {1e3 * parts.channel_s():.1f} ms, engine fixed {1e3 * parts.engine(1):.1f} ms)",
        f"  draft: {c.name}, {c.tokens_per_check:.2f} tokens per check, {c.check_ms:.1f} ms per check",
        f"  decode: {c.tok_s:.1f} tok/s",
    ]
    return "\n".join(lines)
