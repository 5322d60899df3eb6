"""The cost model's arithmetic: best-first trees, expected tokens per check, cost curves, the choice."""

from __future__ import annotations

import itertools
import math

import pytest

from splitspec.scheduler.cost import (
    CostCurve,
    Costs,
    NgramStats,
    TreeShape,
    best_first,
    best_first_paths,
    best_length,
    chain,
    check_ms,
    choose,
    evaluate,
    evaluate_ngram,
    expected_tokens,
)

# p_d(r) for depths 1..3, ranks 0..3: a draft that is right 60-70% of the time at rank 0
STATS = [[0.7, 0.15, 0.05, 0.02], [0.65, 0.15, 0.06, 0.03], [0.6, 0.15, 0.07, 0.03]]


def _reach(path: tuple[int, ...]) -> float:
    out = 1.0
    for d, r in enumerate(path, start=1):
        out *= STATS[min(d, len(STATS)) - 1][r]
    return out


def test_best_first_takes_the_most_probable_paths():
    """Against brute force: the n best paths by Π p_d(r_d) among all paths up to depth 7."""
    everything = [p for depth in range(1, 8) for p in itertools.product(range(4), repeat=depth)]
    ranked = sorted(everything, key=_reach, reverse=True)
    for n in (1, 4, 16, 24):
        got = best_first_paths(STATS, n)
        assert len(got) == n
        assert sorted(map(_reach, got), reverse=True) == pytest.approx(list(map(_reach, ranked[:n])))
        assert all(p[:-1] in got or len(p) == 1 for p in got)  # a tree: every prefix is in it


def test_shape_is_in_level_order_with_parents_before_children():
    shape = best_first(STATS, 16)
    assert shape.nodes == 16 and shape.parents[0] == -1
    for i in range(1, len(shape.parents)):
        assert shape.parents[i] < i and shape.depths[i] == shape.depths[shape.parents[i]] + 1
    assert list(shape.depths) == sorted(shape.depths)
    levels = shape.draft_levels()
    assert levels[0] == [0] and sum(map(len, levels)) == sum(1 for k in shape.children() if k)


def test_expected_tokens():
    assert expected_tokens(chain(0), STATS) == 1.0
    assert expected_tokens(chain(2), STATS) == pytest.approx(1 + 0.7 + 0.7 * 0.65)
    paths = [(0,), (1,), (0, 0)]
    shape = TreeShape.from_paths(paths)
    assert expected_tokens(shape, STATS) == pytest.approx(1 + sum(map(_reach, paths)))
    with pytest.raises(ValueError, match="closed under prefixes"):
        TreeShape.from_paths([(0, 1)])


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve.of({1: 10.0, 4: 16.0, 16: 40.0})
    assert curve(1) == 10.0 and curve(2) == pytest.approx(12.0) and curve(10) == pytest.approx(28.0)
    assert curve(32) == pytest.approx(72.0)
    assert CostCurve.of({1: 5.0})(3) == pytest.approx(15.0)
    with pytest.raises(ValueError):
        CostCurve.of({0: 1.0})


def test_choose_weighs_draft_against_verify_cost():
    # a nearly free draft and a flat verify curve (a GPU beside a memory-bound CPU): a big tree pays
    gpu = Costs(CostCurve.of({1: 100.0, 64: 110.0}), CostCurve.of({1: 1.0, 32: 2.0}))
    big = choose(STATS, gpu, draft_max=32)
    assert big.shape.nodes >= 16 and big.tok_s > 1e3 / 100
    assert check_ms(big.shape, gpu) == pytest.approx(big.check_ms)
    # a draft step as dear as a verify pass (the engine on a CPU core): nothing pays
    cpu = Costs(CostCurve.of({1: 50.0, 16: 120.0}), CostCurve.of({1: 45.0, 16: 100.0}))
    assert choose(STATS, cpu, draft_max=16).shape.nodes == 0
    assert choose(STATS, cpu, draft_min=2, draft_max=16).shape.nodes >= 2
    with pytest.raises(ValueError, match="no draft shape"):
        choose(STATS, cpu, draft_min=2, draft_max=1)


def test_a_draft_must_beat_the_verifier_alone_by_min_gain():
    """A draft predicted a few percent faster than the verifier alone is within the model's error: with
    ``min_gain`` it is not chosen; a larger gain is; without a no-draft candidate it does not apply."""
    costs = Costs(CostCurve.of({1: 30.0, 2: 31.0, 17: 60.0}), CostCurve.of({1: 14.0, 16: 40.0}))
    best = choose(STATS, costs, draft_max=16)
    off = evaluate(chain(0), STATS, costs)
    gain = best.tok_s / off.tok_s - 1
    assert best.shape.nodes > 0 and 0 < gain < 1
    assert choose(STATS, costs, draft_max=16, min_gain=gain * 1.01).shape.nodes == 0
    assert choose(STATS, costs, draft_max=16, min_gain=gain * 0.99) == best
    assert choose(STATS, costs, draft_min=1, draft_max=16, min_gain=10.0).shape.nodes > 0


def test_a_batch_shares_the_verify_pass_and_shrinks_the_tree():
    """b sequences per check: each drafts in turn, one pass verifies all their trees; the choice is the
    brute-force best over the candidates, and a pass that grows with its tokens makes it smaller."""
    from splitspec.scheduler.cost import candidates, evaluate

    costs = Costs(CostCurve.of({1: 40.0, 17: 60.0, 136: 400.0}), CostCurve.of({1: 2.0, 16: 4.0}), 0.5)
    shape = best_first(STATS, 8)
    drafting = sum(costs.draft(len(level)) for level in shape.draft_levels())
    assert check_ms(shape, costs, 4) == pytest.approx(4 * (drafting + 0.5) + costs.verify(36))
    assert evaluate(shape, STATS, costs, 4).tokens_per_check == pytest.approx(4 * expected_tokens(shape, STATS))
    sizes = []
    for batch in (1, 8):
        best = choose(STATS, costs, draft_max=16, batch=batch)
        brute = max(evaluate(s, STATS, costs, batch).tok_s for s in candidates(STATS, 0, 16))
        assert best.tok_s == pytest.approx(brute)
        sizes.append(best.shape.nodes)
    assert sizes[1] < sizes[0]


# --------------------------------------------------------------------------- a verify pass from its parts

from dataclasses import replace  # noqa: E402

from splitspec.scheduler.cost import PassParts, Term, pass_costs  # noqa: E402


def test_term_fit_and_streamed():
    assert Term.fit(1, 0.012, 17, 0.044) == pytest.approx(Term(0.010, 0.002))
    assert Term.fit(1, 0.05, 16, 0.04) == Term(0.05, 0.0)  # a faster larger pass: noise, no negative slope
    t = Term.streamed(36e9, 36e9, flops_per_token=2e9, flop_rate=1e12)
    assert t(1) == pytest.approx(1.002) and t(16) == pytest.approx(1.032)
    with pytest.raises(ValueError):
        Term(-1.0)
    with pytest.raises(ValueError):
        Term.streamed(1.0, 0.0)


def _simulate(parts: PassParts, n: int, weights: list[float]) -> float:
    """Brute force, group by group: the engine runs its share of the base and waits for the slowest
    actor's share, whose answer lands one channel latency after it is done."""
    total = parts.engine(n)
    per_group_latency = parts.latency_s * parts.round_trips / len(weights)
    for w in weights:
        engine = w * (parts.base(n) + parts.resident(n))
        actors = max(w * a(n) for a in parts.actors) + per_group_latency
        total += max(engine, actors)
    return total


@pytest.mark.parametrize("residual_bound", [True, False])
def test_verify_time_matches_a_group_by_group_simulation(residual_bound):
    """Equal wherever one side is the slower in every group (the shares scale together)."""
    weights = [w / 3 for w in [0.1, 0.3, 0.2, 0.4] * 3]  # 3 layers of four groups: shares of the pass
    actors = (Term(0.040, 0.002), Term(0.030, 0.003)) if residual_bound else (Term(0.004, 0.0002),)
    parts = PassParts(Term(0.010, 0.001), actors, Term(0.005, 0.0005), 12, 20e-6)
    for n in (1, 4, 16):
        assert parts.verify_s(n) == pytest.approx(_simulate(parts, n, weights))
    assert parts.draft_s(3) == pytest.approx(parts.engine(3) + parts.base(3))
    no_actors = PassParts(Term(0.01), (), Term(0.001), 12, 1e-3)
    assert no_actors.channel_s() == 0 and no_actors.verify_s(1) == pytest.approx(0.011)
    hidden = PassParts(Term(0.100), (Term(0.010),), Term(0.0), 12, 1e-3)  # latency behind the base: free
    assert hidden.verify_s(1) == pytest.approx(0.100)
    sending = replace(hidden, send_s=50e-6)  # the engine's side of each request: never hidden
    assert sending.verify_s(1) == pytest.approx(0.100 + 12 * 50e-6)


def test_pass_costs_predict_tok_s_as_brute_force():
    """tok/s of the chosen shape equals tokens ÷ (draft steps + verify) computed by hand from the parts."""
    parts = PassParts(Term(0.002, 0.0001), (Term(0.050, 0.001),), Term(0.003, 0.0002), 120, 30e-6)
    costs = pass_costs(parts, 17, overhead_ms=0.5)
    for n in (1, 3, 17):
        assert costs.verify(n) == pytest.approx(1e3 * parts.verify_s(n))
    best = choose(STATS, costs, draft_max=16)
    by_hand = []
    for shape in [chain(0), *(chain(g) for g in range(1, 17)), *(best_first(STATS, k) for k in range(1, 17))]:
        steps = sum(1e3 * parts.draft_s(len(level)) for level in shape.draft_levels())
        ms = steps + 1e3 * parts.verify_s(shape.nodes + 1) + 0.5
        by_hand.append(1e3 * expected_tokens(shape, STATS) / ms)
    assert best.tok_s == pytest.approx(max(by_hand), rel=1e-9)
    assert evaluate(chain(0), STATS, costs).tok_s == pytest.approx(1e3 / (1e3 * parts.verify_s(1) + 0.5))


def test_best_length_against_brute_force():
    """The k of the most expected tokens per ms, against every k tried; ``sizes`` limits which k."""
    import random

    rng = random.Random(3)
    for _ in range(200):
        chances = [rng.random() for _ in range(rng.randrange(0, 12))]
        curve = CostCurve.of({1: 10.0, 4: 10 + rng.uniform(0, 30), 16: 40 + rng.uniform(0, 200)})
        sizes = frozenset(rng.sample(range(1, 13), 4)) if rng.random() < 0.5 else None

        others = rng.randrange(0, 9)  # sequences beside this one in the check, one token each
        allowed = [k for k in range(1, len(chances) + 1) if sizes is None or k in sizes]
        rates = {
            k: (others + 1 + sum(math.prod(chances[: i + 1]) for i in range(k))) / curve(others + k + 1)
            for k in [0, *allowed]
        }
        best = max(rates, key=lambda k: (rates[k], -k))
        assert best_length(chances, curve, sizes, others) == best
    assert best_length([], curve) == 0
    # a token that pays in a pass of its own may not in a pass shared by eight: its cost is the same, but
    # it adds less to a check that already yields eight tokens
    linear = CostCurve.of({1: 10.0, 16: 25.0})
    assert best_length([0.3], linear) == 1 and best_length([0.3], linear, others=7) == 0


# counts[found][accepted]: half the checks find nothing, a quarter find 4 and keep them all, a quarter find
# 4 and keep 1
NGRAM = NgramStats.of([[8, 0, 0, 0, 0], [0] * 5, [0] * 5, [0] * 5, [0, 4, 0, 0, 4]])


def test_ngram_chances_count_each_position_given_the_ones_before():
    # token 0 was on offer in 8 checks and kept in 8; token 1 reached in those 8 and kept in 4; tokens 2
    # and 3 reached in 4 and kept in 4; (kept + 1) / (reached + 2) each
    assert NGRAM.chances() == pytest.approx([9 / 10, 5 / 10, 5 / 6, 5 / 6])
    assert NGRAM.limit == 4 and NGRAM.checks == 16
    assert NGRAM.tokens_per_check() == (8 * 1 + 4 * 2 + 4 * 5) / 16
    assert NGRAM.tokens_per_check(2) == (8 * 1 + 4 * 2 + 4 * 3) / 16
    for bad in ([[1, 0], [1]], [[1, 2], [0, 0]], [[0, 0], [0, -1]], [[0, 0], [0, 0]], [[3]]):
        with pytest.raises(ValueError, match="n-gram counts"):
            NgramStats.of(bad)


def test_evaluate_ngram_follows_what_pays():
    # a flat verify curve: every found token pays, so a check keeps as many as the text followed
    flat = Costs(CostCurve.of({1: 10.0, 17: 10.0}), CostCurve.of({1: 50.0}), overhead_ms=1.0)
    got = evaluate_ngram(NGRAM, flat, draft_max=16)
    assert got.ngram and got.name == "ngram" and got.shape.nodes == 0
    assert got.tokens_per_check == pytest.approx((8 * 1 + 4 * 5 + 4 * 2) / 16)
    assert got.check_ms == pytest.approx(11.0)
    # draft_max caps what a check verifies; a batch shares one pass
    two = evaluate_ngram(NGRAM, flat, draft_max=2)
    assert two.tokens_per_check == pytest.approx((8 * 1 + 4 * 3 + 4 * 2) / 16)
    assert evaluate_ngram(NGRAM, flat, 16, batch=3).tokens_per_check == pytest.approx(3 * got.tokens_per_check)
    # each token a whole pass: nothing pays, and the check is the verifier alone's
    steep = Costs(CostCurve.of({1: 10.0, 2: 20.0}), CostCurve.of({1: 50.0}))
    none = evaluate_ngram(NGRAM, steep, draft_max=16)
    assert none.tokens_per_check == 1.0 and none.check_ms == pytest.approx(10.0)


def test_choose_weighs_ngram_drafts_beside_the_model_drafts():
    cpu = Costs(CostCurve.of({1: 10.0, 17: 12.0}), CostCurve.of({1: 9.0, 16: 100.0}))
    assert choose(STATS, cpu, draft_max=16).shape.nodes == 0  # a model draft as dear as a pass
    picked = choose(STATS, cpu, draft_max=16, ngram=NGRAM)
    assert picked == evaluate_ngram(NGRAM, cpu, 16) and picked.tok_s > 1.5 * 1e3 / 10
    assert choose(STATS, cpu, draft_min=1, draft_max=16, ngram=NGRAM).ngram is False  # it may find nothing
    gpu = Costs(CostCurve.of({1: 100.0, 64: 110.0}), CostCurve.of({1: 1.0, 32: 2.0}))
    assert choose(STATS, gpu, draft_max=32, ngram=NGRAM) == choose(STATS, gpu, draft_max=32)  # the tree wins
    # a model's draft must beat the verifier alone by min_gain; the n-gram draft, which proposes only what
    # pays as it goes, need only beat it
    gain = picked.tok_s / (1e3 / 10) - 1
    assert choose(STATS, cpu, draft_max=16, ngram=NGRAM, min_gain=gain * 2) == picked
    never = NgramStats.of([[5, 0], [0, 0]])  # it finds nothing: the same check as the verifier alone's
    assert choose(STATS, cpu, draft_max=16, ngram=never) == choose(STATS, cpu, draft_max=16)
    tie = Costs(CostCurve.of({1: 10.0, 17: 12.0}), CostCurve.of({1: 0.5, 16: 5.0}))
    chain_gain = evaluate(chain(1), STATS, tie).tok_s / (1e3 / 10) - 1
    assert choose(STATS, tie, draft_max=1, min_gain=chain_gain * 1.01).shape.nodes == 0
    assert choose(STATS, tie, draft_max=1, min_gain=chain_gain * 1.01, ngram=NGRAM).ngram
