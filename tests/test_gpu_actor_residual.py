"""DeviceResidual (the residual on the engine's device, one GEMM per group) against the CPU actors' kernel.

Both compute y_r = x'·Rᵀ from the same packed residual; only the order of the fp32 sums differs, so they
agree to fp32 rounding for every width, batch size and resident budget.
"""

from __future__ import annotations

import pytest
import torch

from splitspec.gpu_actor.residual import DeviceResidual, LocalResidual, device_nbytes, resident_groups
from splitspec.quantize.format import ConvertedModel

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
    assert device.resident_nbytes == sum(sizes[:4])


def test_device_residual_refuses_a_missing_width(converted):
    with pytest.raises(ValueError, match="no 5-bit residual"):
        DeviceResidual(converted, 5)
