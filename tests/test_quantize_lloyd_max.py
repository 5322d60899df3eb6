"""The fitted levels must be the Gaussian Lloyd–Max quantizer on Gaussian data, and be reproducible."""

import pytest
import torch

from splitspec.quantize.lloyd_max import fit_levels, group_rms_normalize

GAUSS_4 = torch.tensor([-1.510418, -0.452780, 0.452780, 1.510418])


def gaussian_quantiles(n: int) -> torch.Tensor:
    """n samples that are exactly the Gaussian's quantiles: Gaussian data without sampling noise."""
    return torch.special.ndtri((torch.arange(n, dtype=torch.float64) + 0.5) / n)


def test_group_rms_normalize_short_last_group_and_zero_groups():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 576, generator=g) * torch.logspace(-3, 1, 6)[:, None]
    W[2, 128:256] = 0.0  # a zero group: skipped
    out = group_rms_normalize(W)
    assert out.dtype == torch.float32 and out.ndim == 1
    assert out.numel() == 6 * 576 - 128
    # Rebuild the groups in the same order (group by group, row by row) and check each has RMS 1.
    sizes = []
    for start in range(0, 576, 128):
        width = min(128, 576 - start)
        sizes += [width] * (6 - (start == 128))
    rms = torch.stack([p.square().mean().sqrt() for p in out.split(sizes)])
    torch.testing.assert_close(rms, torch.ones_like(rms))
    assert sizes[-1] == 64


def test_group_rms_normalize_rejects_non_matrix():
    with pytest.raises(ValueError, match="2-D"):
        group_rms_normalize(torch.randn(128))


def test_fit_levels_reproduces_gaussian_quantizer():
    levels = fit_levels(gaussian_quantiles(2_000_000))
    assert levels.dtype == torch.float32
    torch.testing.assert_close(levels, GAUSS_4, atol=1e-3, rtol=0)


def test_fit_levels_two_levels_is_mean_abs():
    levels = fit_levels(gaussian_quantiles(400_000), n_levels=2)
    expected = (2 / torch.pi) ** 0.5
    torch.testing.assert_close(levels, torch.tensor([-expected, expected]), atol=1e-3, rtol=0)


def test_fit_levels_subsamples_deterministically_and_symmetrically():
    x = torch.randn(3_000_000, generator=torch.Generator().manual_seed(1)) * 3 + 0.05
    a = fit_levels(x, max_samples=500_000, seed=5)
    assert torch.equal(a, fit_levels(x, max_samples=500_000, seed=5))
    assert not torch.equal(a, fit_levels(x, max_samples=500_000, seed=6))
    assert torch.equal(a, -a.flip(0))
    assert bool((a[1:] > a[:-1]).all())
    torch.testing.assert_close(a, 3 * GAUSS_4, atol=2e-2, rtol=0)


def test_fit_levels_on_rotated_gaussian_weights():
    W = torch.randn(256, 576, generator=torch.Generator().manual_seed(2)) * 0.02
    levels = fit_levels(group_rms_normalize(W))
    # Group-RMS normalisation of 128 (or 64) values slightly narrows the distribution: near, not equal.
    torch.testing.assert_close(levels, GAUSS_4, atol=2e-2, rtol=0)


def test_fit_levels_rejects_too_few_samples():
    with pytest.raises(ValueError, match="samples"):
        fit_levels(torch.tensor([1.0, float("nan"), 2.0, 3.0]))
