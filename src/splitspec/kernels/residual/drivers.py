"""The numba drivers: one call per product walks the tiles, groups and token blocks and picks the loop
(integer or fp32; the loops pick their width and block size from tables of specialisations)."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from splitspec.kernels import amx
from splitspec.kernels.ir import F32_PTR, I64_PTR, U8_PTR, U16_PTR, prefetch_at, stack, switch
from splitspec.kernels.residual.fp32 import fp32_products, unpack
from splitspec.kernels.residual.integer import many_dot, pair_products
from splitspec.kernels.residual.params import (
    BLOCKS,
    CODES_BYTES,
    MIN_WORK_PER_THREAD,
    PF_SCALE,
    STREAMED_TOKENS,
    U0,
    U1,
    U3,
    U4,
    UG,
    UT,
    UTB,
    WIDTHS,
)
from splitspec.kernels.residual.rounding import round_activations_into
from splitspec.kernels.residual.tiled import ACTIVATION_BYTES, AMX_TOKENS, BUFFER_BYTES, amx_row, prepare_digits
from splitspec.kernels.tile_rows import load_rows, store_rows
from splitspec.quantize.packing import GROUP, TILE


@intrinsic
def _block_dot(
    typingctx, w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, abase, bits, tb
):
    """acc[abase + 16k + r] += (products of a block of ``tb`` tokens, at most ``TB``), by ``x``'s dtype:
    integer activations (int32 words of int16 pairs; a pass of one block) take ``pair_products``, over a
    tile's row of groups, fp32 ones ``fp32_products``, over one (tile, group). Each block size (and for
    integer activations each width) has its own loop, entered through a table (``ir.switch``); the fp32
    loop does not depend on ``bits``, so it is compiled once for all widths."""
    integer = x.dtype == types.int32
    sig = types.void(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, abase, bits, tb)

    def codegen(context, builder, sig, args):
        bits_v, tb_v = args[16], args[17]
        if integer:

            def width(b: int) -> None:
                switch(builder, tb_v, BLOCKS, lambda k: pair_products(context, builder, sig, args, b, k))

            switch(builder, bits_v, WIDTHS, width)
        else:
            switch(builder, tb_v, BLOCKS, lambda k: fp32_products(context, builder, sig, args, k))
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", cache=True)
def _block(blocks, b):
    """(first token, size) of token block ``b`` of ``blocks = (count, size, larger)``: the first ``larger``
    blocks have ``size + 1`` tokens, the rest ``size`` (the split is computed once per call: a
    division per block would be a visible share of a one-token product)."""
    _, small, larger = blocks
    return b * small + min(b, larger), small + U1 if b < larger else small


@njit(inline="always", cache=True)
def _tokens(planes, step0, steps, cols, acts, x0, n, blocks, scale, sbase, xsbase, acc, bits):
    """All ``n`` tokens' products with one (tile, group or span of groups), block by block (``_block_dot``);
    ``x0``: the group's first column of x (a column pair for integer activations)."""
    w0, w1, w2 = planes
    x, xs, xb = acts
    for b in range(blocks[0]):
        k0, size = _block(blocks, b)
        xbase, xsk, abase = x0 * n + k0, xsbase + k0, k0 * UT
        _block_dot(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsk, acc, abase, bits, size)


@njit(inline="always", cache=True)
def _group(bits, weights, t, g, span, d, n, blocks, acts, integer, codes, acc):
    """Tile t's products over groups g .. g + span - 1, accumulated into ``acc``; ``acts`` (x, its scales
    and offset sums) as ``prepare`` made them, ``weights`` the three words planes, the scales and the tops. A span of
    several groups is for integer passes, whose loop nests walk them all. Up to ``STREAMED_TOKENS``
    integer tokens (one block) take the codes straight from the planes; more unpack them a group at a
    time into ``codes``, which each block reads from L1; fp32 activations get them unpacked to int8 there
    first."""
    w0, w1, w2, scales, _ = weights
    n_groups = (d + UG - U1) // UG
    c0 = g * UG
    cols = min(span * UG, d - c0)
    sbase = (t * n_groups + g) * UT
    if not integer:
        # the scales are a second, slow stream (1/64 of the bytes) that the hardware prefetcher may not
        # follow; the planes are prefetched by the loops that read them, and the integer loop nests
        # prefetch their scales too (_groups)
        prefetch_at(scales, sbase + np.uint64(PF_SCALE))
    # log2 of the columns per step: shifts, because a division by a value the compiler cannot see costs
    # tens of cycles, three times per (tile, group)
    shift = U4 if bits == 7 else U3
    steps = (cols + (U1 << shift) - U1) >> shift
    step0 = t * ((d + (U1 << shift) - U1) >> shift) + (c0 >> shift)
    xsbase = g * n
    if not integer:
        unpack(w0, w1, w2, step0, steps, codes, bits)
        _tokens((codes, w1, w2), U0, steps, cols, acts, c0, n, blocks, scales, sbase, xsbase, acc, bits)
    elif n <= STREAMED_TOKENS:
        _tokens((w0, w1, w2), step0, steps, cols, acts, c0 >> U1, n, blocks, scales, sbase, xsbase, acc, bits)
    else:
        x, xs, xb = acts
        xbase, tail = (c0 >> U1) * n, n % UTB
        many_dot(w0, w1, w2, codes, step0, steps, x, xbase, n, scales, sbase, xs, xb, xsbase, acc, bits, tail)


@njit(inline="always", cache=True)
def _product(bits, d_in, w0, w1, w2, scales, tops, x, levels, threads, tiled, out):
    """out[:, rows of tile t] = top_t · Σ_groups scale · (codes · x) for every tile: tile ranges in parallel in
    ``residual_kernel``, on the calling thread in ``serial_kernel``.

    The three words planes w0-w2 and the scale bytes are flat, ``tops`` the tiles' powers of two. ``x`` is
    [n, d_in] fp32. With ``levels`` (> 0) it is rounded here to codes in [-levels, levels]
    (``round_activations_into``), stored in int32 words of column pairs with their scales and offset sums;
    with levels = 0 (fp32) it is transposed. int8 and int16 codes take the same loop, which sums their
    integer products exactly. One call does it all, because a small group's product takes tens of
    microseconds and every call from Python adds several.

    Up to ``threads`` threads take contiguous ranges of tiles, fewer where ``MIN_WORK_PER_THREAD``
    says another would save nothing (the caller passes numba's count: ``get_num_threads`` here would keep
    the function out of numba's on-disk cache). With ``tiled`` (the process may use AMX, ``amx.enabled``),
    integer passes of ``AMX_TOKENS`` or more multiply on tiles (``amx_row``), to the same sums. Index
    arithmetic is uint64 on purpose: numba adds a negative-index fix-up to every signed index.
    """
    n = np.uint64(out.shape[0])
    rows = out.shape[1]
    d = np.uint64(d_in)
    integer = levels > 0
    count = max((n + UTB - U1) // UTB, U1)  # token blocks of near-equal size
    blocks = (count, n // count, n % count)
    chunks = np.uint64(max(1, min(threads, rows * d_in * out.shape[0] // MIN_WORK_PER_THREAD)))
    weights = (w0, w1, w2, scales, tops)
    # one branch per activation mode outside the loops, so that each mode's loop nest is its own
    if integer and tiled and n >= AMX_TOKENS:
        digits = prepare_digits(x, levels, 2 ** (bits - 1))
        for chunk in prange(chunks):
            amx_tiles(bits, weights, d, n, digits, np.uint64(chunk), chunks, out)
        return
    xq, xs, xb, xt = prepare(bits, x, levels)
    if integer:
        _tiles(bits, weights, d, n, blocks, (xq, xs, xb), True, chunks, out)
    else:
        _tiles(bits, weights, d, n, blocks, (xt, xs, xb), False, chunks, out)


# A product's int64 fields (``ResidualMatrix.fields``): its width and shape, then each plane's address and
# length (the three words planes, uint16; the scale bytes; the tiles' powers of two, float32). The kernels
# take the planes by address, not as arrays: numba unboxes an array argument in about half a microsecond,
# and a small group's whole product at one token takes tens.
# Then whether the process may multiply on AMX tiles.
BITS, D_IN, ROWS, W0, W1, W2, SCALES, TOPS, TILED = 0, 1, 2, 3, 5, 7, 9, 11, 13
MATRIX = 14


@njit(inline="always", cache=True)
def _product_at(fields_at, x, levels, threads, out):
    f = numba.carray(I64_PTR(fields_at), MATRIX)
    w0, w1, w2 = (numba.carray(U16_PTR(f[W0]), f[W0 + 1]), numba.carray(U16_PTR(f[W1]), f[W1 + 1]),
                  numba.carray(U16_PTR(f[W2]), f[W2 + 1]))  # fmt: skip
    scales, tops = numba.carray(U8_PTR(f[SCALES]), f[SCALES + 1]), numba.carray(F32_PTR(f[TOPS]), f[TOPS + 1])
    _product(f[BITS], f[D_IN], w0, w1, w2, scales, tops, x, levels, threads, f[TILED] != 0, out)


@njit(parallel=True, cache=True)
def residual_kernel(fields_at, x, levels, threads, out):
    """``_product`` of the matrix at ``fields_at`` for x [n, d_in] into out [n, rows], its tile ranges on
    numba's threads."""
    _product_at(fields_at, x, levels, threads, out)


@njit(cache=True)
def serial_kernel(fields_at, x, levels, threads, out):
    """``residual_kernel`` on the calling thread (outside a parallel function, prange is range), for products
    too small for two threads: starting a parallel region costs as much as a small group's whole product."""
    _product_at(fields_at, x, levels, 1, out)


@njit(cache=True)
def prepare(bits, x, levels):
    """x in the layout the loops read (``residual_kernel``): (codes, scales, offset sums, transposed fp32).

    A function of its own, not inlined: in the parallel kernel, numba would make each of these
    allocations a parallel region, and starting one costs about what a small group's product does."""
    n, d = x.shape
    integer = levels > 0
    m = n if integer else 0
    n_groups = (d + GROUP - 1) // GROUP
    # int32 column pairs to whole 16-column steps (the 7-bit plane's, which pads them), zero past d
    xq = np.zeros((d + 15) // 16 * 8 * m, np.int32)
    xs = np.empty(n_groups * m, np.float32)
    xb = np.empty(n_groups * m, np.int32)
    xt = np.empty(d * (n - m), np.float32)
    if integer:
        round_activations_into(x, xq, xs, xb, 2 ** (bits - 1), levels)
    else:
        for k in range(n):
            for c in range(d):
                xt[c * n + k] = x[k, c]
    return xq, xs, xb, xt


@njit(inline="always", cache=True)
def _tiles(bits, weights, d, n, blocks, acts, integer, chunks, out):
    """Every tile's rows of ``out``, ``chunks`` contiguous ranges of tiles in parallel. A range is a call,
    not inlined, so that the parallel and the serial kernel share the compiled loops (inlined, each
    compiled them all again); one function per activation kind, so that ``integer`` stays a constant in
    each and only its own branches are compiled."""
    for chunk in prange(chunks):
        c = np.uint64(chunk)
        if integer:
            integer_tiles(bits, weights, d, n, blocks, acts, c, chunks, out)
        else:
            fp32_tiles(bits, weights, d, n, blocks, acts, c, chunks, out)


@njit(cache=True)
def integer_tiles(bits, weights, d, n, blocks, acts, chunk, chunks, out):
    _tile_range(bits, weights, d, n, blocks, acts, True, chunk, chunks, out)


@njit(cache=True)
def fp32_tiles(bits, weights, d, n, blocks, acts, chunk, chunks, out):
    _tile_range(bits, weights, d, n, blocks, acts, False, chunk, chunks, out)


@njit(inline="always", cache=True)
def _tile_range(bits, weights, d, n, blocks, acts, integer, chunk, chunks, out):
    """Range ``chunk`` of ``chunks`` contiguous ranges of tiles: their rows of ``out``."""
    n_groups = (d + UG - U1) // UG
    n_tiles = np.uint64(weights[3].size) // (n_groups * UT)
    # integer passes walk all of a tile's groups in one loop nest (pair_products, many_dot)
    span = n_groups if integer else U1
    codes = stack(CODES_BYTES)  # one group's unpacked codes
    acc = np.empty(out.shape[0] * TILE, np.float32)
    for t in range(chunk * n_tiles // chunks, (chunk + U1) * n_tiles // chunks):
        acc[:] = 0
        for g in range(U0, n_groups, span):
            _group(bits, weights, t, g, span, d, n, blocks, acts, integer, codes, acc)
        _store_tile(acc, weights[4][t], t, out)


@njit(cache=True)
def amx_tiles(bits, weights, d, n, acts, chunk, chunks, out):
    """``_tile_range`` on AMX tiles (``amx_row``): ``acts`` the activations' byte planes, their scales and
    offset sums. Where the planes outgrow L2 (``ACTIVATION_BYTES``), the groups go in blocks that fit,
    each block through all the range's tiles, so that every tile reads the block's activations from L2;
    a tile's sums wait in ``out`` between blocks (as fp32, exactly), so the result is one sweep's."""
    w0, w1, w2, scales, tops = weights
    digits, xs, xb = acts
    n_groups = (d + UG - U1) // UG
    n_tiles = np.uint64(scales.size) // (n_groups * UT)
    shift = U4 if bits == 7 else U3
    steps, group_steps = (d + (U1 << shift) - U1) >> shift, UG >> shift
    plane, stride = np.uint64(digits.size // 2), n_groups * UG
    block = max(U1, np.uint64(ACTIVATION_BYTES) // (plane // stride * UG * np.uint64(2)))
    codes = stack(BUFFER_BYTES)
    sums = amx.zeros(2 * BUFFER_BYTES, np.uint8)  # two token tiles' sums of a group (``amx_row``)
    acc = np.zeros(out.shape[0] * TILE, np.float32)
    amx.begin(amx.CONFIG)
    for g0 in range(U0, n_groups, block):
        for t in range(chunk * n_tiles // chunks, (chunk + U1) * n_tiles // chunks):
            if g0 == 0:
                acc[:] = 0
            else:
                r0 = int(t) * TILE
                load_rows(acc, out, r0, min(TILE, out.shape[1] - r0))
            span = min(block * group_steps, steps - g0 * group_steps)
            where = (t * steps + g0 * group_steps, span, plane, stride, n, (t * n_groups + g0) * UT, g0)
            amx_row(w0, w1, w2, codes, sums, digits, scales, xs, xb, acc, where, bits)
            _store_tile(acc, tops[t] if g0 + block >= n_groups else np.float32(1), t, out)
    amx.end()


@njit(inline="always", cache=True)
def _store_tile(acc, top, t, out):
    """Tile t's rows of ``out``: its accumulators times ``top`` (the tile's power of two, or 1 for sums
    that are not done yet)."""
    r0 = int(t) * TILE
    store_rows(acc, out, r0, min(TILE, out.shape[1] - r0), top)
