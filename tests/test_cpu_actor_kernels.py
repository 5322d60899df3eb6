"""The residual kernel against a float64 reference (dequantize, then matmul), for every layout."""

from __future__ import annotations

import numpy as np
import pytest

from splitspec.cpu_actor.kernels import residual_matmul, warmup
from splitspec.quantize.packing import dequantize_residual, num_groups, pack_residual, slice_tiles, tile_range


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile once (or load numba's on-disk cache) before the first timed-out test can see it."""
    return warmup()


def make(rows: int, d_in: int, bits: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    qm = 2 ** (bits - 1) - 1
    q = rng.integers(-qm, qm + 1, (rows, d_in)).astype(np.int8)
    scales = (rng.random((rows, num_groups(d_in))) * 0.02 + 1e-4).astype(np.float16)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    return pack_residual(q, scales, bits), x


def check_close(planes, bits, rows, x, out):
    w = dequantize_residual(planes, bits, rows).astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    # fp32 accumulation: error bounded by a few ulps of the sum of |terms|
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / bound)


@pytest.mark.parametrize("bits", [6, 7, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 16, 64])
@pytest.mark.parametrize("rows", [37, 1])
def test_matches_reference(bits, n, rows):
    planes, x = make(rows, 576, bits, n)  # 576 = 4.5 groups: the last group has 64 columns
    out = np.full((n, rows), np.nan, np.float32)
    residual_matmul(planes, bits, x, out)
    check_close(planes, bits, rows, x, out)


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_every_token_blocking(bits):
    """Every n up to 3 blocks of tokens, on a last group of 3 columns (remainder loops everywhere)."""
    for n in range(1, 20):
        planes, x = make(21, 131, bits, n, seed=n)
        out = np.empty((n, 21), np.float32)
        residual_matmul(planes, bits, x, out)
        check_close(planes, bits, 21, x, out)


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_short_rows_and_columns(bits):
    planes, x = make(3, 5, bits, 9)  # one partial group, one partial tile
    out = np.empty((9, 3), np.float32)
    residual_matmul(planes, bits, x, out)
    check_close(planes, bits, 3, x, out)


@pytest.mark.parametrize("bits", [6, 7, 8])
@pytest.mark.parametrize("n", [1, 16])
def test_tile_slice_equals_rows_of_the_whole(bits, n):
    rows = 75
    planes, x = make(rows, 300, bits, n, seed=1)
    whole = np.empty((n, rows), np.float32)
    residual_matmul(planes, bits, x, whole)
    for r0, r1 in [(0, 16), (16, 48), (48, 75), (64, 75)]:
        t0, t1 = tile_range(r0, r1)
        part = np.empty((n, r1 - r0), np.float32)
        residual_matmul(slice_tiles(planes, t0, t1), bits, x, part)
        np.testing.assert_array_equal(part, whole[:, r0:r1])


def test_writes_in_place_into_a_view():
    planes, x = make(20, 130, 8, 4)
    buffer = np.zeros((4 * 20 + 3,), np.float32)
    out = buffer[3:].reshape(4, 20)  # e.g. a view into a shared-memory slot
    residual_matmul(planes, 8, x, out)
    assert not buffer[:3].any()
    check_close(planes, 8, 20, x, out)


def test_bad_input():
    planes, x = make(20, 130, 6, 2)
    out = np.empty((2, 20), np.float32)
    with pytest.raises(ValueError, match="bits"):
        residual_matmul(planes, 5, x, out)
    with pytest.raises(ValueError, match="missing"):
        residual_matmul(planes, 7, x, out)
    with pytest.raises(ValueError, match="x must be"):
        residual_matmul(planes, 6, x[:, :128], out)
    with pytest.raises(ValueError, match="x must be"):
        residual_matmul(planes, 6, x[:1], out)
    with pytest.raises(ValueError, match="out must be"):
        residual_matmul(planes, 6, x, out.astype(np.float64))
    with pytest.raises(ValueError, match="out must be"):
        residual_matmul(planes, 6, x, np.empty((20, 2), np.float32).T)
    with pytest.raises(ValueError, match="do not fit"):
        residual_matmul(planes, 6, x, np.empty((2, 33), np.float32))
    strided = {**planes, "nib": np.empty((2, 260, 8), np.uint8)[:, ::2]}
    with pytest.raises(ValueError, match="contiguous"):
        residual_matmul(strided, 6, x, out)
