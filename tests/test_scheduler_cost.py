"""The cost model's arithmetic: best-first trees, expected tokens per check, cost curves, the choice."""

from __future__ import annotations

import itertools

import pytest

from splitspec.scheduler.cost import (
    CostCurve,
    Costs,
    TreeShape,
    best_first,
    best_first_paths,
    chain,
    check_ms,
    choose,
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
