"""The prefill cost model on its own: the choice, the fit and the layer classes, against worked numbers,
and the sizes a model is timed at.

The costs measured on a real engine, and the paths agreeing, are in ``test_gpu_actor_engine``.
"""

from __future__ import annotations

import pytest

from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.prefill import MeasuredCost, PrefillCosts, choose_prefill, layer_classes, measure_prefill_costs
from splitspec.gpu_actor.residual import DeviceResidual, LocalResidual
from splitspec.quantize.format import ConvertedModel


def _line(fixed: float, per_token: float) -> MeasuredCost:
    return MeasuredCost.of([(1, fixed + per_token), (1000, fixed + 1000 * per_token)])


def test_choose_prefill():
    costs = PrefillCosts(split=_line(0.010, 0.001), device=_line(0.050, 0.0001))
    assert costs.estimate(64, 64) == pytest.approx({"split": 0.074, "device": 0.0564})
    assert costs.estimate(65, 64)["split"] == pytest.approx(0.085)  # a second chunk, a second fixed cost
    assert choose_prefill(16, costs, 64) == "split"  # 0.026 s against 0.0516 s
    assert choose_prefill(64, costs, 64) == "device"
    assert choose_prefill(16, costs, 4) == "device"  # 4 chunks: 0.056 s against 0.0516 s
    tie = PrefillCosts(split=_line(0.01, 0.001), device=_line(0.01, 0.001))
    assert choose_prefill(10, tie, 64) == "split"
    headed = PrefillCosts(split=_line(0.010, 0.001), device=_line(0.050, 0.0001), head_s=0.005)
    assert headed.estimate(65, 64) == pytest.approx({"split": 0.090, "device": 0.0615})  # the head once a prompt
    assert all(choose_prefill(n, headed, c) == choose_prefill(n, costs, c) for n in (16, 64) for c in (4, 64))


def test_a_fixed_cost_the_long_forwards_hide_is_read_at_one_token():
    # the device path as measured on a CPU engine: a transfer and dequantization of every group whatever the
    # token count, which a line through the long forwards (0 at 0 tokens) would miss by 20x at one token
    device = MeasuredCost.of([(1, 0.100), (32, 0.147), (256, 0.418), (1024, 1.908)])
    split = MeasuredCost.of([(1, 0.009), (32, 0.034), (256, 0.220)])
    costs = PrefillCosts(split, device, head_s=0.0035)
    assert [choose_prefill(n, costs, 256) for n in (1, 2, 32, 256, 1024, 4096)] == ["split"] * 6
    assert device(1) == 0.100 and device(2) == pytest.approx(0.100 + 0.047 / 31)
    assert device(2048) == pytest.approx(1.908 + 1024 * (1.908 - 0.418) / 768)  # along the last segment


def test_measured_cost():
    cost = MeasuredCost.of([(64, 0.076), (8, 0.02), (32, 0.044)])
    assert cost.points == ((8, 0.02), (32, 0.044), (64, 0.076))
    assert [cost(n) for n in (8, 20, 32, 48, 128)] == pytest.approx([0.02, 0.032, 0.044, 0.06, 0.14])
    assert cost(1) == pytest.approx(0.013)  # below the smallest size, along the first segment
    assert MeasuredCost.of([(8, 0.03), (64, 0.02)]).points == ((8, 0.03), (64, 0.03))  # noise, not a falling cost
    assert MeasuredCost.of([(1, 0.03), (64, 0.001)])(0) == 0.03  # never below what a smaller size took
    with pytest.raises(ValueError, match="two or more token counts"):
        MeasuredCost.of([(8, 0.02), (8, 0.03)])
    with pytest.raises(ValueError, match="two or more token counts"):
        MeasuredCost.of([(0, 0.02), (8, 0.03)])


def test_layer_classes():
    assert layer_classes(5, lambda _: None) == {0: 5}
    assert layer_classes(5, lambda layer: layer < 2) == {0: 2, 2: 3}


def test_forwards_of_one_token_are_timed_at_two_sizes(converted_small):
    """``prefill_chunk=1``: the split path's forwards carry one token, but its cost is still timed at two
    sizes (a cost needs two), and the prompts it prices go on either path."""
    converted = ConvertedModel(converted_small)
    split = LocalResidual.load(converted_small, 8)
    costs = measure_prefill_costs(SplitModel(converted), split, DeviceResidual(converted, 8), 1)
    assert [n for n, _ in costs.split.points] == [1, 2]
    assert [n for n, _ in costs.device.points] == [1, 2, 4]
    assert costs.estimate(3, 1)["split"] == pytest.approx(3 * costs.split(1) + costs.head_s)
    assert choose_prefill(3, costs, 1) in ("split", "device")
