"""The residual kernel against a float64 reference (dequantize, then matmul), for every layout and both
activation modes: fp32 against x itself, int16 against ``round_activations(x)``, its definition."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from splitspec.config import ACTIVATION_MODES
from splitspec.cpu_actor.kernels import ResidualMatrix, _round_activations, residual_matmul, warmup
from splitspec.quantize.activations import activation_scales, round_activations
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


def check_close(planes, bits, rows, x, out, activations="int16"):
    w = dequantize_residual(planes, bits, rows).astype(np.float64)
    if activations == "int16":
        x = round_activations(torch.from_numpy(x)).numpy()
    ref = x.astype(np.float64) @ w.T
    # fp32 accumulation: error bounded by a few ulps of the sum of |terms|
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / bound)


@pytest.mark.parametrize("activations", ACTIVATION_MODES)
@pytest.mark.parametrize("bits", [6, 7, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 16, 64])
@pytest.mark.parametrize("rows", [37, 1])
def test_matches_reference(bits, n, rows, activations):
    planes, x = make(rows, 576, bits, n)  # 576 = 4.5 groups: the last group has 64 columns
    out = np.full((n, rows), np.nan, np.float32)
    residual_matmul(planes, bits, x, out, activations)
    check_close(planes, bits, rows, x, out, activations)


@pytest.mark.parametrize("activations", ACTIVATION_MODES)
@pytest.mark.parametrize("bits", [6, 7, 8])
def test_every_token_blocking(bits, activations):
    """Every n up to 3 blocks of tokens, on a last group of 3 columns (remainder loops everywhere, and
    an odd column count: the int16 mode's lone last column)."""
    for n in range(1, 20):
        planes, x = make(21, 131, bits, n, seed=n)
        out = np.empty((n, 21), np.float32)
        residual_matmul(planes, bits, x, out, activations)
        check_close(planes, bits, 21, x, out, activations)


@pytest.mark.parametrize("activations", ACTIVATION_MODES)
@pytest.mark.parametrize("bits", [6, 7, 8])
def test_short_rows_and_columns(bits, activations):
    planes, x = make(3, 5, bits, 9)  # one partial group, one partial tile
    out = np.empty((9, 3), np.float32)
    residual_matmul(planes, bits, x, out, activations)
    check_close(planes, bits, 3, x, out, activations)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("d_in", [1, 5, 128, 131, 576])
def test_kernel_rounds_activations_exactly_as_defined(d_in, fused):
    """The kernel's own rounding equals ``round_activations`` bit for bit (ties, zeros, wide ranges),
    in the column pairs or the four-column vectors it multiplies, with the offset sums it subtracts."""
    rng = np.random.default_rng(d_in)
    x = (rng.standard_normal((7, d_in)) * np.logspace(-30, 30, 7)[:, None]).astype(np.float32)
    x[0] = 0.0  # an all-zero token: scale 1, codes 0
    x[1, ::3] = np.float32(0.5) * np.abs(x[1]).max() / 32767  # exact ties at ±0.5 of a step
    n, groups, width = x.shape[0], num_groups(d_in), 4 if fused else 2
    units = -(-d_in // width)
    xq = np.zeros(units * n * (16 if fused else 2), np.int16)
    xs, xb = np.empty(groups * n, np.float32), np.empty(groups * n, np.int32)
    _round_activations(x, xq, xs, xb, fused, 32)
    if fused:  # [unit, token, lane, copy, pair]: every copy equal
        vectors = xq.reshape(units, n, 2, 4, 2)
        assert (vectors == vectors[:, :, :, :1]).all()
        xq = vectors[:, :, :, 0].reshape(-1)
    codes = xq.reshape(units, n, width).transpose(1, 0, 2).reshape(n, units * width)
    assert not codes[:, d_in:].any()  # the padding is zero
    codes = codes[:, :d_in]
    scales = xs.reshape(groups, n).T
    np.testing.assert_array_equal(scales, activation_scales(torch.from_numpy(x)).numpy())
    expect = round_activations(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(codes * np.repeat(scales, 128, axis=1)[:, :d_in], expect)
    assert np.abs(codes).max() <= 32767
    sums = np.add.reduceat(codes.astype(np.int64), np.arange(0, d_in, 128), axis=1)
    np.testing.assert_array_equal(xb.reshape(groups, n).T, 32 * sums)


def test_int16_rounding_moves_the_product_far_less_than_bf16_weights():
    """Why the integer mode may be the default: its error is ~1e-5 of |R·x|, bf16 weights' ~1e-3."""
    planes, x = make(64, 576, 8, 16)
    w = dequantize_residual(planes, 8, 64).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    out = np.empty((16, 64), np.float32)
    residual_matmul(planes, 8, x, out, "int16")
    w_bf16 = torch.from_numpy(w).to(torch.bfloat16).double().numpy()
    int16_err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    bf16_err = np.linalg.norm(x.astype(np.float64) @ w_bf16.T - exact) / np.linalg.norm(exact)
    assert int16_err < 1e-4
    assert int16_err < bf16_err / 20


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


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_one_matrix_serves_every_request_size_and_thread_split(bits):
    """A shard builds each group's ResidualMatrix once and reuses it for every request; the threads
    split the tiles unevenly (11 tiles), and every split gives the same rows, bit for bit."""
    rows = 165
    planes, x = make(rows, 576, bits, 16, seed=2)
    threads = numba.get_num_threads()
    results = []
    try:
        for count in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(count)
            matrix = ResidualMatrix(planes, bits, rows)
            outs = []
            for n in (1, 2, 5, 16, 1):
                for activations in ACTIVATION_MODES:
                    out = np.full((n, rows), np.nan, np.float32)
                    matrix.matmul(x[:n], out, activations)
                    check_close(planes, bits, rows, x[:n], out, activations)
                    outs.append(out)
            results.append(outs)
    finally:
        numba.set_num_threads(threads)
    for outs in results[1:]:
        for a, b in zip(outs, results[0], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_read_only_x_is_served():
    """x may be a read-only buffer (a received frame, a memmap): the product is the same."""
    planes, x = make(20, 130, 7, 3)
    x.setflags(write=False)
    out = np.empty((3, 20), np.float32)
    residual_matmul(planes, 7, x, out)
    check_close(planes, 7, 20, x.copy(), out)  # the reference's torch wants a writeable array


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
    with pytest.raises(ValueError, match="out must have 20 columns"):
        ResidualMatrix(planes, 6, 20).matmul(x, np.empty((2, 19), np.float32))
    with pytest.raises(ValueError, match="activations must be"):
        residual_matmul(planes, 6, x, out, "int8")
    strided = {**planes, "nib": np.empty((2, 260, 8), np.uint8)[:, ::2]}
    with pytest.raises(ValueError, match="contiguous"):
        residual_matmul(strided, 6, x, out)


def test_an_unknown_activation_mode_is_refused_by_the_configs():
    from splitspec.config import CpuActorConfig, EngineConfig

    with pytest.raises(ValueError, match=r"CpuActorConfig\.activations must be one of"):
        CpuActorConfig(activations="int8")
    with pytest.raises(ValueError, match=r"EngineConfig\.activations must be one of"):
        EngineConfig(activations="int8")
