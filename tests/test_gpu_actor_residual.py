"""DeviceResidual (the residual on the engine's device, one product per group) against the CPU actors' kernel.

Both compute y_r = x'·Rᵀ from the same packed residual (on the CPU with the same kernel; on an accelerator
by a dequantized GEMM, whose arithmetic is checked here on CPU tensors); only the order of the fp32 sums
may differ, so they agree to fp32 rounding for every width, batch size and resident budget.
"""

from __future__ import annotations

import pytest
import torch

from splitspec.gpu_actor.residual import DeviceResidual, LocalResidual, dequantize, device_nbytes, resident_groups
from splitspec.quantize.activations import LEVELS, round_activations
from splitspec.quantize.format import ConvertedModel
from splitspec.quantize.packing import unpack_residual

RTOL = 1e-5  # max |Δy| ≤ RTOL × max |y|, per group


@pytest.fixture(scope="module")
def converted(converted_small):
    return ConvertedModel(converted_small)


def _group_bytes(model: ConvertedModel) -> list[int]:
    return [device_nbytes(g) for layer in model.layers for g in layer.values()]


@pytest.mark.parametrize(
    ("bits", "activations"), [(6, "int16"), (7, "int16"), (8, "int16"), (6, "int8"), (8, "int8"), (7, "fp32")]
)
@pytest.mark.parametrize("resident", ["none", "three groups", "all"])
def test_device_residual_equals_cpu_kernel(converted_small, converted, bits, resident, activations):
    sizes = _group_bytes(converted)
    budget = {"none": 0, "three groups": sum(sizes[:3]), "all": sum(sizes)}[resident]
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
    device.close()


def test_resident_budget_keeps_a_prefix_of_groups(converted):
    sizes = _group_bytes(converted)
    keys = [(layer, name) for layer, groups in enumerate(converted.layers) for name in groups]
    assert resident_groups(converted, 0) == []
    assert resident_groups(converted, sum(sizes[:3]) + sizes[3] - 1) == keys[:3]
    assert resident_groups(converted, sum(sizes)) == keys

    device = DeviceResidual(converted, 8, resident_bytes=sum(sizes[:4]))
    assert device.is_resident(0) and not device.is_resident(1)
    # on the CPU a resident group is its packed planes, as the file holds them
    planes = [converted.residual(8, layer, name) for layer, name in keys[:4]]
    assert device.resident_nbytes == sum(p.nbytes for group in planes for p in group.values())


@pytest.mark.parametrize(("bits", "activations"), [(6, "int16"), (8, "int8"), (7, "fp32")])
def test_dequantized_product_equals_cpu_kernel(converted_small, converted, bits, activations):
    """What DeviceResidual multiplies on an accelerator (int8 codes unpacked, dequantized, one GEMM of the
    rounded x'), computed here on CPU tensors against the CPU actors' kernel."""
    local = LocalResidual.load(converted_small, bits, activations=activations)
    levels = LEVELS.get(activations)
    torch.manual_seed(bits)
    for name, layout in converted.layers[0].items():
        codes, scale = unpack_residual(converted.residual(bits, 0, name), bits, layout.rows, d_in=layout.d_in)
        x = torch.randn(5, layout.d_in)
        got = (round_activations(x, levels) if levels else x) @ dequantize(
            torch.from_numpy(codes), torch.from_numpy(scale)
        ).T
        want = local.gather(local.submit(0, name, x))
        assert (got - want).abs().max().item() <= RTOL * want.abs().max().item(), name


def test_device_residual_refuses_a_missing_width(converted):
    with pytest.raises(ValueError, match="no 5-bit residual"):
        DeviceResidual(converted, 5)
