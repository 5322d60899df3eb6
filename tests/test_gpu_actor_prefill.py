"""The prefill cost model on its own: the choice, the fit and the layer classes, against worked numbers.

The costs measured on a real engine, and the paths agreeing, are in ``test_gpu_actor_engine``.
"""

from __future__ import annotations

import pytest

from splitspec.gpu_actor.prefill import LinearCost, PrefillCosts, choose_prefill, layer_classes


def test_choose_prefill():
    costs = PrefillCosts(split=LinearCost(0.010, 0.001), device=LinearCost(0.050, 0.0001))
    assert costs.estimate(64, 64) == pytest.approx({"split": 0.074, "device": 0.0564})
    assert costs.estimate(65, 64)["split"] == pytest.approx(0.085)  # a second chunk, a second fixed cost
    assert choose_prefill(16, costs, 64) == "split"  # 0.026 s against 0.0516 s
    assert choose_prefill(64, costs, 64) == "device"
    assert choose_prefill(16, costs, 4) == "device"  # 4 chunks: 0.056 s against 0.0516 s
    tie = PrefillCosts(split=LinearCost(0.01, 0.001), device=LinearCost(0.01, 0.001))
    assert choose_prefill(10, tie, 64) == "split"
    headed = PrefillCosts(split=LinearCost(0.010, 0.001), device=LinearCost(0.050, 0.0001), head_s=0.005)
    assert headed.estimate(65, 64) == pytest.approx({"split": 0.090, "device": 0.0615})  # the head once a prompt
    assert all(choose_prefill(n, headed, c) == choose_prefill(n, costs, c) for n in (16, 64) for c in (4, 64))


def test_linear_cost_fit():
    cost = LinearCost.fit([(8, 0.02), (64, 0.076), (32, 0.044)])
    assert (cost.fixed_s, cost.per_token_s) == pytest.approx((0.012, 0.001))
    assert LinearCost.fit([(8, 0.03), (64, 0.02)]).per_token_s == 0  # noise, not a falling cost
    with pytest.raises(ValueError, match="two different sizes"):
        LinearCost.fit([(8, 0.02), (8, 0.03)])


def test_layer_classes():
    assert layer_classes(5, lambda _: None) == {0: 5}
    assert layer_classes(5, lambda layer: layer < 2) == {0: 2, 2: 3}
