"""The cost model: from measured costs and the draft's rank statistics to expected tokens per second.

Pure functions (no torch, no Ray), so that the engine, the planner and the benchmarks predict with the
same arithmetic. A check drafts a tree level by level (one draft step per level that has children) and
verifies all of it in one pass, so its time is Σ draft(width of level) + verify(nodes + 1) + the loop's
own overhead, and it yields 1 + Σ over nodes of the probability that the verifier's tokens follow the
node's path (the bonus token always comes). With the rank statistics p_d(r) (the probability that the
verifier's token is the draft's rank-r candidate at depth d; recipe, section 6) that probability is the
product of p_d(r_d) along the path, and the best tree of N nodes is the first N paths of a best-first
expansion: a child's product never exceeds its parent's, so every prefix of that order is a tree.

A draft copied from the text (n-gram lookup, ``gpu_actor.lookup``) is weighed beside them: no draft step,
a chain of however many tokens the lookup found and ``best_length`` says pay, and the acceptance it had
when replayed over the verifier's text (``NgramStats``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TreeShape:
    """A draft tree by the draft's ranks: index 0 is the root (the last verified token, whose children the
    first draft step proposes); node i > 0 is its parent's ``ranks[i]``-th most likely draft token.
    Nodes are in level order (depth, then parent, then rank), the order they sit in a check's block."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]

    @property
    def nodes(self) -> int:
        """Drafted nodes, the root not counted."""
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self) -> list[list[int]]:
        """Each node's children in rank order."""
        out: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            out[self.parents[i]].append(i)
        return out

    def draft_levels(self) -> list[list[int]]:
        """Per draft step, the nodes it runs (those with children), shallowest first."""
        kids = self.children()
        levels: list[list[int]] = [[] for _ in range(self.depth)]
        for i, d in enumerate(self.depths):
            if kids[i]:
                levels[d].append(i)
        return levels

    def name(self) -> str:
        if self.nodes == 0:
            return "off"
        if all(r == 0 for r in self.ranks):
            return f"chain{self.nodes}"
        return f"tree{self.nodes}"

    @classmethod
    def from_paths(cls, paths: Sequence[tuple[int, ...]]) -> TreeShape:
        """The shape whose nodes are these rank paths (every path's prefixes must be among them)."""
        ordered = sorted(set(paths), key=lambda p: (len(p), p))
        index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
        missing = [p for p in ordered if p[:-1] not in index]
        if missing or any(len(p) == 0 for p in ordered):
            raise ValueError(f"paths must be non-empty and closed under prefixes; orphans: {missing[:3]}")
        return cls(
            parents=(-1, *(index[p[:-1]] for p in ordered)),
            ranks=(0, *(p[-1] for p in ordered)),
            depths=(0, *(len(p) for p in ordered)),
        )


def chain(gamma: int) -> TreeShape:
    """γ draft tokens in a line, each the draft's top choice; ``chain(0)`` is no speculation."""
    return TreeShape.from_paths([(0,) * d for d in range(1, gamma + 1)])


def _p(stats: Sequence[Sequence[float]], depth: int, rank: int) -> float:
    """p_depth(rank); depths past the statistics reuse the deepest row, ranks past it count as 0."""
    row = stats[min(depth, len(stats)) - 1]
    return row[rank] if rank < len(row) else 0.0


def best_first_paths(stats: Sequence[Sequence[float]], n: int) -> list[tuple[int, ...]]:
    """The ``n`` rank paths with the largest Π p_d(r_d), best first (recipe, section 6)."""
    if n < 1:
        return []
    heap = [(-_p(stats, 1, r), (r,)) for r in range(len(stats[0]))]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < n:
        neg, path = heapq.heappop(heap)
        if neg == 0:
            break  # nothing the verifier is ever seen to take: no node is worth a slot
        out.append(path)
        depth = len(path) + 1
        for r in range(len(stats[min(depth, len(stats)) - 1])):
            heapq.heappush(heap, (neg * _p(stats, depth, r), (*path, r)))
    return out


def best_first(stats: Sequence[Sequence[float]], n: int) -> TreeShape:
    return TreeShape.from_paths(best_first_paths(stats, n))


def expected_tokens(shape: TreeShape, stats: Sequence[Sequence[float]]) -> float:
    """Expected tokens a check of this shape yields: the bonus plus each node's path probability."""
    reach = [1.0] * len(shape.parents)
    for i in range(1, len(shape.parents)):
        reach[i] = reach[shape.parents[i]] * _p(stats, shape.depths[i], shape.ranks[i])
    return sum(reach)


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds by token count, measured at a few counts and linear between (and beyond) them."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points or any(n < 1 or ms < 0 for n, ms in self.points):
            raise ValueError(f"a cost curve needs (tokens >= 1, ms >= 0) points, got {self.points}")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    @classmethod
    def of(cls, ms_by_tokens: Mapping[int, float]) -> CostCurve:
        return cls(tuple((int(n), float(ms)) for n, ms in ms_by_tokens.items()))

    def __call__(self, n: int) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * n / pts[0][0] if n > pts[0][0] else pts[0][1]
        ns = [p[0] for p in pts]
        i = min(max(bisect_left(ns, n), 1), len(pts) - 1)
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        return max(t0 + (t1 - t0) * (n - n0) / (n1 - n0), 0.0)


@dataclass(frozen=True)
class Costs:
    """What a check costs on one machine: a verify pass by tokens, a draft step by its width, and the loop's
    own time per check (choosing tokens, building masks, compacting the cache)."""

    verify: CostCurve
    draft: CostCurve
    overhead_ms: float = 0.0


def check_ms(shape: TreeShape, costs: Costs, batch: int = 1) -> float:
    """One check of ``batch`` sequences drafting ``shape`` each: every sequence drafts in turn, and one
    verify pass carries all their trees."""
    drafting = sum(costs.draft(len(level)) for level in shape.draft_levels())
    return batch * (drafting + costs.overhead_ms) + costs.verify(batch * (shape.nodes + 1))


@dataclass(frozen=True)
class Choice:
    """A draft with its prediction: ``shape`` is what the 2-bit base drafts; with ``ngram`` it drafts
    nothing (``chain(0)``) and each check verifies the tokens copied from the text instead."""

    shape: TreeShape
    tokens_per_check: float
    check_ms: float
    ngram: bool = False

    @property
    def tok_s(self) -> float:
        return 1e3 * self.tokens_per_check / self.check_ms

    @property
    def name(self) -> str:
        return "ngram" if self.ngram else self.shape.name()


def evaluate(shape: TreeShape, stats: Sequence[Sequence[float]], costs: Costs, batch: int = 1) -> Choice:
    """The shape's expected tokens and time per check, over all ``batch`` sequences sharing it."""
    return Choice(shape, batch * expected_tokens(shape, stats), check_ms(shape, costs, batch))


def candidates(stats: Sequence[Sequence[float]], draft_min: int, draft_max: int) -> list[TreeShape]:
    """What ``choose`` weighs: no draft (when ``draft_min`` is 0), chains and best-first trees of
    ``draft_min``..``draft_max`` nodes."""
    sizes = range(max(draft_min, 1), draft_max + 1)
    paths = best_first_paths(stats, draft_max)
    trees = [TreeShape.from_paths(paths[:n]) for n in sizes if n <= len(paths)]
    return [chain(0)] * (draft_min == 0) + [chain(g) for g in sizes] + trees


def choose(
    stats: Sequence[Sequence[float]],
    costs: Costs,
    draft_min: int = 0,
    draft_max: int = 16,
    batch: int = 1,
    min_gain: float = 0.0,
    ngram: NgramStats | None = None,
) -> Choice:
    """The candidate with the most expected tokens per second for ``batch`` sequences sharing each check
    (ties: the smaller check). More sequences make each drafted node dearer in the shared pass, so the
    best shape shrinks as the batch grows. Where no draft is a candidate, a model's draft must beat it by
    more than ``min_gain`` (relative): it pays a draft step every check, and a smaller predicted gain is
    within the model's own error. Given ``ngram`` (and ``draft_min`` 0, as the lookup may find nothing),
    drafts copied from the text are a candidate too, which need only beat no draft: they cost nothing to
    make, and each check verifies only as many as its own sequence's acceptance says pay (``Lookup``), so
    a text that does not repeat costs next to nothing."""
    shapes = candidates(stats, draft_min, draft_max)
    if not shapes:
        raise ValueError(f"no draft shape between draft_min={draft_min} and draft_max={draft_max} nodes")
    choices = [evaluate(s, stats, costs, batch) for s in shapes]
    if ngram is not None and draft_min == 0:
        choices.append(evaluate_ngram(ngram, costs, draft_max, batch))
    if draft_min == 0:
        off = choices[0]
        choices = [c for c in choices if c is off or c.tok_s > off.tok_s * (1 + (0.0 if c.ngram else min_gain))]
    return max(choices, key=lambda c: (c.tok_s, -c.shape.nodes, -c.ngram))


# --------------------------------------------------------------------------- drafts copied from the text


def best_length(
    chances: Sequence[float], verify: Callable[[int], float], sizes: frozenset[int] | None = None, others: int = 0
) -> int:
    """How many proposed tokens to verify, where token i is accepted with probability ``chances[i]`` given
    all before it (one entry per token on offer): the k (of ``sizes``; None allows any) with the most
    expected tokens per millisecond of the check, in which ``others`` sequences verify one token each
    beside this one: (others + 1 + Σ_{i<k} Π_{j<=i} chances[j]) / verify(others + k + 1); 0 where none
    pays. A pass shared by many sequences is dearer per token, so each proposes less."""
    best, best_rate, expected, reach = 0, (others + 1.0) / verify(others + 1), others + 1.0, 1.0
    for i, chance in enumerate(chances):
        reach *= chance
        expected += reach
        rate = expected / verify(others + i + 2)
        if rate > best_rate and (sizes is None or i + 1 in sizes):
            best, best_rate = i + 1, rate
    return best


@dataclass(frozen=True)
class NgramStats:
    """The n-gram draft replayed over the verifier's greedy text (``gpu_actor.lookup.replay``):
    ``counts[f][a]`` is how many checks found f tokens to propose (f = ``limit``: that many or more) of
    which the text went on with the first a. Enough to predict any length policy: a check that verifies
    k of them keeps min(a, k)."""

    counts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.counts)
        ok = n >= 2 and all(len(row) == n and all(isinstance(c, int) and c >= 0 for c in row) for row in self.counts)
        if not ok or any(self.counts[f][a] for f in range(n) for a in range(f + 1, n)) or not self.checks:
            raise ValueError(
                "n-gram counts must be a square table of counts >= 0, counts[found][accepted] with accepted <= "
                f"found, and at least one check; got {self.counts!r:.200}"
            )

    @classmethod
    def of(cls, counts: Sequence[Sequence[int]]) -> NgramStats:
        return cls(tuple(tuple(int(c) for c in row) for row in counts))

    @classmethod
    def fitted(cls, stats: Mapping[str, Any] | None) -> NgramStats | None:
        """The replay in fitted statistics (``tree_stats.json``), or None where there are none or they
        predate it."""
        return cls.of(stats["ngram"]["counts"]) if stats and "ngram" in stats else None

    @property
    def limit(self) -> int:
        return len(self.counts) - 1

    @property
    def checks(self) -> int:
        return sum(map(sum, self.counts))

    def tokens_per_check(self, most: int | None = None) -> float:
        """Tokens a check yields (the bonus included) when it verifies every token found, up to ``most``."""
        cap = self.limit if most is None else most
        return sum(c * (1 + min(a, cap)) for row in self.counts for a, c in enumerate(row)) / self.checks

    def chances(self) -> list[float]:
        """Per position i, the chance that token i is accepted given the ones before it, estimated as the
        drafter estimates it from its own checks (``Lookup``): (kept + 1) / (reached + 2)."""
        out = []
        for i in range(self.limit):
            reached = sum(self.counts[f][a] for f in range(i + 1, self.limit + 1) for a in range(i, f + 1))
            kept = sum(self.counts[f][a] for f in range(i + 1, self.limit + 1) for a in range(i + 1, f + 1))
            out.append((kept + 1) / (reached + 2))
        return out


def evaluate_ngram(
    ngram: NgramStats, costs: Costs, draft_max: int, batch: int = 1, sizes: frozenset[int] | None = None
) -> Choice:
    """Expected tokens and time per check of drafts copied from the text: a check that finds f tokens
    verifies ``best_length`` of them under the chances the drafter converges to (beside ``batch`` - 1
    other sequences), and keeps as many as the replay's text followed. The pass verifies each sequence's
    root and its mean number of proposed tokens."""
    chances = ngram.chances()
    tokens = proposed = 0.0
    for found, row in enumerate(ngram.counts):
        k = best_length(chances[: min(found, draft_max)], costs.verify, sizes, batch - 1)
        tokens += sum(c * (1 + min(a, k)) for a, c in enumerate(row))
        proposed += k * sum(row)
    per_sequence = tokens / ngram.checks, proposed / ngram.checks
    ms = batch * costs.overhead_ms + costs.verify(batch * (1 + per_sequence[1]))
    return Choice(chain(0), batch * per_sequence[0], ms, ngram=True)


# --------------------------------------------------------------------------- a verify pass from its parts


@dataclass(frozen=True)
class Term:
    """Seconds a part of a pass takes for n tokens: a fixed part (bytes streamed once a pass, calls made
    once a pass) and a per-token part (the flops each token adds)."""

    fixed_s: float
    token_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.token_s < 0:
            raise ValueError(f"a cost term needs fixed_s >= 0 and token_s >= 0, got {self}")

    def __call__(self, n: int) -> float:
        return self.fixed_s + n * self.token_s

    @classmethod
    def streamed(cls, nbytes: float, bandwidth: float, flops_per_token: float = 0.0, flop_rate: float = 1.0) -> Term:
        """Reading ``nbytes`` at ``bandwidth`` bytes/s once a pass, plus each token's flops at ``flop_rate``."""
        if bandwidth <= 0 or flop_rate <= 0:
            raise ValueError(f"bandwidth and flop_rate must be > 0, got {bandwidth} and {flop_rate}")
        return cls(nbytes / bandwidth, flops_per_token / flop_rate)

    @classmethod
    def fit(cls, n0: int, s0: float, n1: int, s1: float) -> Term:
        """The line through two measured (tokens, seconds) points, clipped at zero slope and intercept."""
        if n0 == n1:
            raise ValueError("fitting a term needs two different token counts")
        slope = max((s1 - s0) / (n1 - n0), 0.0)
        return cls(max(s0 - slope * n0, 0.0), slope)


@dataclass(frozen=True)
class PassParts:
    """A verify pass as the split verifier runs it. Per Linear group the engine sends x' to every CPU actor,
    runs its own product (the 2-bit ``base``, and the ``resident`` residual rows it holds) meanwhile, then
    waits for the slowest actor's answer, which comes ``latency_s`` after the actor is done; both sides
    scale together over the groups, so the pass overlaps their totals: the engine's product against the
    residual plus ``round_trips`` latencies. ``engine`` is the rest of the engine's work (norms,
    rotations, attention, the lm_head, per-layer call overhead), ``send_s`` the engine's own work per
    request (writing x' out, reading the answers in), which nothing overlaps. A draft step is the same
    layers with the base alone."""

    base: Term
    actors: tuple[Term, ...]
    engine: Term
    round_trips: int
    latency_s: float
    resident: Term = Term(0.0)
    send_s: float = 0.0

    def residual_s(self, n: int) -> float:
        return max((a(n) for a in self.actors), default=0.0)

    def channel_s(self) -> float:
        return self.round_trips * self.latency_s if self.actors else 0.0

    def verify_s(self, n: int) -> float:
        if not self.actors:
            return self.engine(n) + self.base(n) + self.resident(n)
        residual = self.residual_s(n) + self.channel_s()
        return self.engine(n) + self.round_trips * self.send_s + max(self.base(n) + self.resident(n), residual)

    def draft_s(self, n: int) -> float:
        return self.engine(n) + self.base(n)


def _counts_up_to(largest: int) -> list[int]:
    return sorted({1, *(n for n in (2, 4, 8, 16, 32, 64) if n < largest), largest})


def pass_costs(parts: PassParts, max_tokens: int, overhead_ms: float = 0.0, draft: CostCurve | None = None) -> Costs:
    """``Costs`` for ``choose`` and ``evaluate`` from the parts: the verify curve, and the draft curve from
    the parts too unless a measured one is given."""
    counts = _counts_up_to(max_tokens)
    verify = CostCurve.of({n: 1e3 * parts.verify_s(n) for n in counts})
    draft = draft or CostCurve.of({n: 1e3 * parts.draft_s(n) for n in counts})
    return Costs(verify, draft, overhead_ms)
