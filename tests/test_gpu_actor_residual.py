"""DeviceResidual (the residual on the engine's device, one product per group) against the CPU actors' kernel.

Both compute y_r = x'·Rᵀ from the same packed residual (on the CPU with the same kernel; on an accelerator
by a dequantized GEMM, whose arithmetic is checked here on CPU tensors); only the order of the fp32 sums
may differ, so they agree to fp32 rounding for every width, batch size and resident budget.
"""

from __future__ import annotations

import pytest
import torch

from splitspec.gpu_actor.residual import DeviceResidual, LocalResidual
from splitspec.kernels.shard import held_rows, resident_rows
from splitspec.quantize.format import ConvertedModel
from splitspec.quantize.packing import TILE, residual_nbytes, unpack_residual

RTOL = 1e-5  # max |Δy| ≤ RTOL × max |y|, per group


@pytest.fixture(scope="module")
def converted(converted_small):
    return ConvertedModel(converted_small)


def _residual_bytes(model: ConvertedModel, bits: int) -> int:
    return sum(residual_nbytes(g.rows, g.d_in, bits) for layer in model.layers for g in layer.values())


@pytest.mark.parametrize(
    ("bits", "activations"), [(6, "int16"), (7, "int16"), (8, "int16"), (6, "int8"), (8, "int8"), (7, "fp32")]
)
@pytest.mark.parametrize("resident", [0.0, 0.3, 1.0])
def test_device_residual_equals_cpu_kernel(converted_small, converted, bits, resident, activations):
    """The whole product (``gather``, the prefill path) and the engine's own rows (``held``, beside the CPU
    actors in decoding) against the CPU actors' kernel, for no rows kept, a share, and all of them."""
    budget = round(resident * _residual_bytes(converted, bits))
    local = LocalResidual.load(converted_small, bits, activations=activations)
    device = DeviceResidual(converted, bits, resident_bytes=budget, activations=activations)
    torch.manual_seed(bits)
    for n in (1, 16):
        for layer, groups in enumerate(converted.layers):
            for name, layout in groups.items():
                x = torch.randn(n, layout.d_in)
                want = local.gather(local.submit(layer, name, x))
                got = device.gather(device.submit(layer, name, x))
                assert got.shape == want.shape == (n, layout.rows) and got.dtype == torch.float32
                err = (got - want).abs().max().item()
                assert err <= RTOL * want.abs().max().item(), f"layer {layer} {name} n={n}: max |Δy| {err:.3g}"
                held, rows = device.held(layer, name, x), device.rows[name]
                if rows == 0:
                    assert held is None
                    continue
                err = (held - want[:, :rows]).abs().max().item()
                assert held.shape == (n, rows) and err <= RTOL * want.abs().max().item(), (layer, name, n)
    device.close()


def test_resident_budget_keeps_the_same_share_of_every_group(converted):
    """A budget keeps the same fraction of every group's rows, in whole tiles, within the budget: the rule the
    CPU actors skip rows by, so that every layer's pass splits the same way."""
    total = _residual_bytes(converted, 8)
    rows = {name: g.rows for name, g in converted.layers[0].items()}
    assert resident_rows(converted, 8, 0) == dict.fromkeys(rows, 0)
    assert resident_rows(converted, 8, total) == rows
    third = resident_rows(converted, 8, total // 3)
    for name, kept in third.items():
        assert kept % TILE == 0 and 0 < kept < rows[name]
        assert abs(kept / rows[name] - 1 / 3) <= TILE / rows[name], (name, kept)
    assert held_rows({"a": 100}, 0.5) == {"a": 48}  # 7 tiles × 0.5 → 3 whole tiles
    with pytest.raises(ValueError, match=">= 0"):
        held_rows({"a": 100}, -0.1)

    device = DeviceResidual(converted, 8, resident_bytes=total // 3)
    assert not device.is_resident(0)
    assert 0.25 < device.resident_nbytes / total < 1 / 3 + 0.01  # on the CPU: the packed planes as stored
    assert DeviceResidual(converted, 8, resident_bytes=total).is_resident(0)


@pytest.mark.parametrize(("bits", "activations"), [(6, "int16"), (8, "int8"), (7, "fp32")])
def test_dequantized_product_equals_cpu_kernel(converted_small, converted, bits, activations):
    """What DeviceResidual multiplies on an accelerator (int8 codes unpacked, dequantized, one GEMM of the
    rounded x'): its own product of codes and scales, run here on CPU tensors, against the CPU actors' kernel."""
    local = LocalResidual.load(converted_small, bits, activations=activations)
    device = DeviceResidual(converted, bits, activations=activations)
    torch.manual_seed(bits)
    for name, layout in converted.layers[0].items():
        width = converted.residual_width(bits, 0, name)
        codes, scale = unpack_residual(converted.residual(bits, 0, name), width, layout.rows, d_in=layout.d_in)
        x = torch.randn(5, layout.d_in)
        got = device._product((torch.from_numpy(codes), torch.from_numpy(scale)), x)
        want = local.gather(local.submit(0, name, x))
        assert (got - want).abs().max().item() <= RTOL * want.abs().max().item(), name


def test_device_residual_refuses_a_missing_width(converted):
    with pytest.raises(ValueError, match="no 5-bit residual"):
        DeviceResidual(converted, 5)
