"""The residual kernel against a float64 reference (dequantize, then matmul), for every layout and every
activation mode: fp32 against x itself, int16 and int8 against ``round_activations(x, levels)``, their
definition."""

from __future__ import annotations

import collections
import re

import llvmlite.binding as llvm
import numba
import numpy as np
import pytest
import torch

from splitspec.config import ACTIVATION_MODES
from splitspec.kernels import amx, tile_rows
from splitspec.kernels.residual import ResidualMatrix, drivers, residual_matmul, warmup
from splitspec.kernels.residual.rounding import round_activations_into
from splitspec.kernels.residual.tiled import ACTIVATION_BYTES, AMX_TOKENS, prepare_digits
from splitspec.quantize.activations import INT8_MAX, INT16_MAX, LEVELS, activation_scales, round_activations
from splitspec.quantize.gptq import to_scale_grid
from splitspec.quantize.packing import (
    dequantize_residual,
    num_groups,
    pack_residual,
    slice_tiles,
    tile_range,
)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile once (or load numba's on-disk cache) before the first timed-out test can see it."""
    return warmup()


def make(rows: int, d_in: int, bits: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    qm = 2 ** (bits - 1) - 1
    q = rng.integers(-qm, qm + 1, (rows, d_in)).astype(np.int8)
    scales = to_scale_grid(rng.random((rows, num_groups(d_in))) * 0.02 + 1e-4)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    return pack_residual(q, scales, bits), x


def check_close(planes, bits, rows, x, out, activations="int16"):
    w = dequantize_residual(planes, bits, rows, d_in=x.shape[1]).astype(np.float64)
    if activations in LEVELS:
        x = round_activations(torch.from_numpy(x), LEVELS[activations]).numpy()
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


@pytest.mark.parametrize("tiled", [False, None])
@pytest.mark.parametrize("activations", ACTIVATION_MODES)
@pytest.mark.parametrize("bits", [6, 7, 8])
def test_every_token_blocking(bits, activations, tiled):
    """Every n up to 4 blocks of tokens, on a last group of 3 columns (remainder loops everywhere, a last
    step mostly padding, an odd column count): the integer modes' passes of 1-5 tokens, which unpack the
    codes in registers, and of more, which unpack them once into a buffer (``tiled=False``: the vector
    loops, every tail of a block of tokens, even where AMX tiles would take those passes by default)."""
    for n in range(1, 25):
        planes, x = make(21, 131, bits, n, seed=n)
        out = np.empty((n, 21), np.float32)
        ResidualMatrix(planes, bits, 21, 131, tiled=tiled).matmul(x, out, activations)
        check_close(planes, bits, 21, x, out, activations)


@pytest.mark.parametrize("activations", ACTIVATION_MODES)
@pytest.mark.parametrize("bits", [6, 7, 8])
def test_short_rows_and_columns(bits, activations):
    planes, x = make(3, 5, bits, 9)  # one partial group, one partial tile
    out = np.empty((9, 3), np.float32)
    residual_matmul(planes, bits, x, out, activations)
    check_close(planes, bits, 3, x, out, activations)


@pytest.mark.parametrize("levels", [INT16_MAX, INT8_MAX])
@pytest.mark.parametrize("d_in", [1, 5, 128, 131, 576])
def test_kernel_rounds_activations_exactly_as_defined(d_in, levels):
    """The kernel's own rounding equals ``round_activations`` bit for bit (ties, zeros, wide ranges), in
    the column pairs the kernel multiplies, zero-padded to whole 16-column steps, with the offset sums it
    subtracts."""
    rng = np.random.default_rng(d_in)
    x = (rng.standard_normal((7, d_in)) * np.logspace(-30, 30, 7)[:, None]).astype(np.float32)
    x[0] = 0.0  # an all-zero token: scale 1, codes 0
    x[1, ::3] = np.float32(0.5) * np.abs(x[1]).max() / levels  # exact ties at ±0.5 of a step
    n, groups = x.shape[0], num_groups(d_in)
    pairs = -(-d_in // 16) * 8
    xq = np.zeros(pairs * n, np.int32)  # as the kernel allocates it
    xs, xb = np.empty(groups * n, np.float32), np.empty(groups * n, np.int32)
    round_activations_into(x, xq, xs, xb, 32, levels)
    codes = xq.view(np.int16).reshape(pairs, n, 2).transpose(1, 0, 2).reshape(n, -1)
    assert not codes[:, d_in:].any()  # the padding is zero
    codes = codes[:, :d_in]
    scales = xs.reshape(groups, n).T
    np.testing.assert_array_equal(scales, activation_scales(torch.from_numpy(x), levels).numpy())
    expect = round_activations(torch.from_numpy(x), levels).numpy()
    np.testing.assert_array_equal(codes * np.repeat(scales, 128, axis=1)[:, :d_in], expect)
    assert np.abs(codes).max() <= levels
    sums = np.add.reduceat(codes.astype(np.int64), np.arange(0, d_in, 128), axis=1)
    np.testing.assert_array_equal(xb.reshape(groups, n).T, 32 * sums)


@pytest.mark.parametrize("levels", [INT16_MAX, INT8_MAX])
@pytest.mark.parametrize("d_in", [1, 5, 128, 131, 576])
def test_tile_digits_are_the_defined_codes(d_in, levels):
    """The AMX loops' activations: 256 · high byte + low byte is ``round_activations``'s code bit for bit,
    with the vector loops' scales and offset sums, zero past the columns and the tokens."""
    rng = np.random.default_rng(d_in)
    x = (rng.standard_normal((7, d_in)) * np.logspace(-30, 30, 7)[:, None]).astype(np.float32)
    x[0] = 0.0
    x[1, ::3] = np.float32(0.5) * np.abs(x[1]).max() / levels
    n, groups = x.shape[0], num_groups(d_in)
    digits, xs, xb = prepare_digits(x, levels, 2**5)
    hi, lo = digits.reshape(2, 16, groups * 128)  # whole 16-token tiles, whole groups
    codes = (hi.view(np.int8).astype(np.int32) * 256 + lo).astype(np.int16)
    assert not codes[n:].any() and not codes[:, d_in:].any()
    want = round_activations(torch.from_numpy(x), levels).numpy()
    scales = xs.reshape(groups, n).T
    np.testing.assert_array_equal(codes[:n, :d_in] * np.repeat(scales, 128, axis=1)[:, :d_in], want)
    np.testing.assert_array_equal(scales, activation_scales(torch.from_numpy(x), levels).numpy())
    sums = np.add.reduceat(codes[:n, :d_in].astype(np.int64), np.arange(0, d_in, 128), axis=1)
    np.testing.assert_array_equal(xb.reshape(groups, n).T, 32 * sums)


@pytest.mark.skipif(not amx.enabled(), reason="this CPU (or kernel) gives no AMX tiles")
@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("bits", [6, 7, 8])
def test_tiles_give_the_vector_loops_sums_bit_for_bit(bits, activations):
    """The AMX loops against the vector loops on the same matrix: partial tiles of rows and tokens, a
    short last group, codes at their extremes (high bytes of ±32767 activations meet codes of 2^b − 1),
    and a product so wide that 40 tokens' activations outgrow ``ACTIVATION_BYTES`` (two blocks of groups,
    the sums kept in out between them)."""
    assert 48 * num_groups(11000) * 128 * 2 > ACTIVATION_BYTES > 32 * num_groups(11000) * 128 * 2
    for rows, d_in, seed in ((37, 576, 0), (21, 131, 1), (3, 5, 2), (21, 11000, 3)):
        planes, x = make(rows, d_in, bits, 40, seed)
        x[3] = np.where(np.arange(d_in) % 2, 1.0, -1.0)  # every code ±32767 (±127)
        tiled, vector = (ResidualMatrix(planes, bits, rows, d_in, tiled=t) for t in (True, False))
        assert tiled.tiled and not vector.tiled
        for n in (AMX_TOKENS, 16, 17, 40):
            outs = [np.full((n, rows), np.nan, np.float32) for _ in range(2)]
            tiled.matmul(x[:n], outs[0], activations)
            vector.matmul(x[:n], outs[1], activations)
            np.testing.assert_array_equal(outs[0], outs[1])
        check_close(planes, bits, rows, x[:n], outs[0], activations)


def test_integer_rounding_against_bf16_weights():
    """What the integer modes cost in the product: int16 ~1e-5 of |R·x|, far below bf16 weights' ~1.6e-3
    (why it may be the default); int8 ~6e-3, several times bf16 weights' (why it is not, unless
    ``benchmarks/quality.py`` shows the logits cannot tell)."""
    planes, x = make(64, 576, 8, 16)
    w = dequantize_residual(planes, 8, 64, d_in=576).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    w_bf16 = torch.from_numpy(w).to(torch.bfloat16).double().numpy()
    bf16_err = np.linalg.norm(x.astype(np.float64) @ w_bf16.T - exact) / np.linalg.norm(exact)
    err = {}
    for activations in LEVELS:
        out = np.empty((16, 64), np.float32)
        residual_matmul(planes, 8, x, out, activations)
        err[activations] = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert err["int16"] < 1e-4
    assert err["int16"] < bf16_err / 20
    assert 1e-3 < err["int8"] < 1e-2
    assert bf16_err < err["int8"] < 10 * bf16_err


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
            matrix = ResidualMatrix(planes, bits, rows, 576)
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
        residual_matmul({k: v for k, v in planes.items() if k != "words2"}, 6, x, out)
    with pytest.raises(ValueError, match="'words0' of a 8-bit residual"):  # 6-bit steps are not 8-bit ones
        residual_matmul(planes, 8, x, out)
    with pytest.raises(ValueError, match="'words0' of a 7-bit residual"):  # 6-bit steps are not 7-bit ones
        residual_matmul(planes, 7, x, out)
    with pytest.raises(ValueError, match="x must be"):
        ResidualMatrix(planes, 6, 20, 130).matmul(x[:, :128], out)
    with pytest.raises(ValueError, match="d_in = 128 must be"):  # x's width is not the planes'
        residual_matmul(planes, 6, x[:, :128], out)
    with pytest.raises(ValueError, match="x must be"):
        residual_matmul(planes, 6, x[:1], out)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        residual_matmul(planes, 6, x[0], out)
    with pytest.raises(ValueError, match="out must be"):
        residual_matmul(planes, 6, x, out.astype(np.float64))
    with pytest.raises(ValueError, match="out must be"):
        residual_matmul(planes, 6, x, np.empty((20, 2), np.float32).T)
    with pytest.raises(ValueError, match="do not fit"):
        residual_matmul(planes, 6, x, np.empty((2, 33), np.float32))
    with pytest.raises(ValueError, match="out must have 20 columns"):
        ResidualMatrix(planes, 6, 20, 130).matmul(x, np.empty((2, 19), np.float32))
    with pytest.raises(ValueError, match="activations must be"):
        residual_matmul(planes, 6, x, out, "int4")
    strided = {**planes, "words1": np.empty((2, 34, 1, 16), np.uint16)[:, ::2]}
    with pytest.raises(ValueError, match="contiguous"):
        residual_matmul(strided, 6, x, out)


def test_an_unknown_activation_mode_is_refused_by_the_configs():
    from splitspec.config import CpuActorConfig, EngineConfig

    with pytest.raises(ValueError, match=r"CpuActorConfig\.activations must be one of"):
        CpuActorConfig(activations="int4")
    with pytest.raises(ValueError, match=r"EngineConfig\.activations must be one of"):
        EngineConfig(activations="int4")


def _instructions(ir_text: str, cpu: str) -> collections.Counter:
    """Mnemonics in the assembly LLVM makes of ``ir_text`` for ``cpu`` (x86), without its function
    attributes' own target CPU and features."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    ir_text = re.sub(r'"target-(cpu|features)"="[^"]*"', "", ir_text)
    machine = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(cpu=cpu, opt=3)
    asm = machine.emit_assembly(llvm.parse_assembly(ir_text))
    lines = (line.split() for line in asm.splitlines())
    return collections.Counter(
        words[1] if words[0] == "{vex}" else words[0]
        for words in lines
        if words and not words[0].startswith((".", "#")) and not words[0].endswith(":")
    )


@pytest.mark.skipif(not llvm.get_process_triple().startswith("x86_64"), reason="x86 instruction names")
def test_integer_loops_become_vnni_where_the_cpu_has_it():
    """The loops are LLVM IR compiled for the host: on a CPU with VNNI (Zen 4 here) each vpmaddwd and the
    vpaddd that accumulates it become one vpdpwssd, halving the integer ops per product, with no change
    to the code. Compiled afresh (numba's cache keeps no IR) by a call as ``_tiles`` makes it, whose
    output must be the kernel's, then assembled for Zen 3 and Zen 4. (For Intel CPUs with VNNI, LLVM's
    cost model keeps some pairs: 42-53% of them become vpdpwssd for Ice Lake, Sapphire Rapids, Alder Lake.)"""
    planes, x = make(37, 300, 8, 2)
    matrix = ResidualMatrix(planes, 8, 37, 300)
    want, out = np.empty((2, 37), np.float32), np.empty((2, 37), np.float32)
    matrix.matmul(x, want)
    xq, xs, xb, _ = drivers.prepare(8, x, INT16_MAX)
    one = np.uint64(1)
    blocks = (one, np.uint64(2), np.uint64(0))  # one block of 2 tokens
    integer_tiles = numba.njit(drivers.integer_tiles.py_func)
    integer_tiles(8, matrix._args, np.uint64(300), np.uint64(2), blocks, (xq, xs, xb), np.uint64(0), one, out)
    np.testing.assert_array_equal(out, want)
    (ir_text,) = integer_tiles.inspect_llvm().values()
    zen3, zen4 = _instructions(ir_text, "znver3"), _instructions(ir_text, "znver4")
    assert zen3["vpmaddwd"] > 0
    assert zen4["vpdpwssd"] == zen3["vpmaddwd"] and zen4["vpmaddwd"] == 0


@numba.njit(cache=True)
def _rows_round_trip(acc, y, r0, count, top):
    tile_rows.store_rows(acc, y, r0, count, top)
    back = np.full(acc.size, np.float32(-1))
    tile_rows.load_rows(back, y, r0, count)
    return back


@pytest.mark.parametrize("count", [16, 5])
def test_tile_rows_move_only_the_tiles_rows(count):
    """A row tile's accumulators go to its columns of y times the tile's power of two, and come back,
    without touching the columns on either side (a last tile of fewer rows)."""
    rng = np.random.default_rng(1)
    n, rows, r0 = 7, 48, 16
    acc = rng.standard_normal(n * 16).astype(np.float32)
    y = np.full((n, rows), np.float32(3))
    back = _rows_round_trip(acc, y, r0, count, np.float32(0.25))
    want = np.full((n, rows), np.float32(3))
    want[:, r0 : r0 + count] = acc.reshape(n, 16)[:, :count] * np.float32(0.25)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(back.reshape(n, 16)[:, :count], want[:, r0 : r0 + count])
    np.testing.assert_array_equal(back.reshape(n, 16)[:, count:], 0)
