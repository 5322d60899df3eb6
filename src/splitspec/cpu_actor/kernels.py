"""Numba kernels for the residual product ``Y[n, rows] = dequant(Q[rows, :]) · X[n, :]ᵀ``.

One pass over the weights serves all ``n`` tree tokens, because a verify pass is bound by how fast
the residual streams from RAM; reading it once per token would multiply that cost by ``n``.

Threads split the row tiles. Per (tile, 128-column group), 6/7-bit planes are first unpacked to
int8 codes in a stack buffer (word-wide shifts and masks, vectorized across columns). A token
block of up to ``_TB`` tokens keeps its ``TB × 16`` partial sums in a stack array whose indices
are all compile-time constants, so LLVM promotes it to registers and the SLP vectorizer turns each
16-lane tile column into two AVX2 FMAs per token. With ``n <= _TB`` (memory-bound) the block
converts codes to fp32 in registers; with more tokens the group is converted once into an fp32
scratch block in L1 that every block re-reads. Partial sums are multiplied by the group scale once
per group and added to the tile's fp32 accumulators, as the reference does up to rounding.

Numba has no fp16 arithmetic, so scales are read through a uint16 view and widened with integer
ops and a bit cast (exact for every finite half).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

from splitspec.quantize.packing import GROUP, PLANES, TILE, check_planes, pack_residual

# below this many weights per thread, waking another thread costs more than it saves
_MIN_WEIGHTS_PER_THREAD = 256 * 1024
_TB = 4  # tokens per register block: 4 × 16 lanes = 8 ymm accumulators, enough to hide FMA latency
_STACK = _TB * TILE
_W_SIZE = GROUP * TILE
# stack sizes in bytes, as module constants because _stack needs literals
_STACK_BYTES, _W_BYTES, _SC_BYTES, _CODES_BYTES = 4 * _STACK, 4 * _W_SIZE, 4 * TILE, _W_SIZE
_TWO_POW_112 = np.float32(2.0**112)
# FMA contraction but no reassociation: with reassociation LLVM's loop vectorizer turns the column
# loop into horizontal reductions over strided loads; without it, it leaves that loop alone and the
# SLP vectorizer packs the 16 lanes of a tile column instead.
_FM = {"contract"}
# uint64 constants: numba types mixed uint64/int64 arithmetic as float64
_U0, _U1, _U2, _U3, _U4, _U6, _U15, _U30, _U45 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 6, 15, 30, 45))
_UT, _UG, _UTB = np.uint64(TILE), np.uint64(GROUP), np.uint64(_TB)
_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_CRUMBS = np.uint64(0x3030303030303030)
_BITS = np.uint64(0x4040404040404040)
_SIGNS = np.uint64(0x8080808080808080)
_BIAS6 = np.uint64(0x6060606060606060)  # 128 - 32 per byte
_BIAS7 = np.uint64(0x4040404040404040)  # 128 - 64 per byte


@intrinsic
def _stack(typingctx, nbytes):
    """``nbytes`` (a literal) of 32-byte aligned stack memory, for ``carray``: unlike a heap array,
    LLVM can keep it in registers, and it costs nothing per tile."""
    if not isinstance(nbytes, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, ir.IntType(8), size=nbytes.literal_value)
        ptr.align = 32
        return ptr

    return types.voidptr(nbytes), codegen


@intrinsic
def _bits_to_f32(typingctx, v):
    """Reinterpret the low 32 bits of an integer as float32 (numba has no scalar view)."""
    if not isinstance(v, types.Integer) or v.bitwidth < 32:
        return None

    def codegen(context, builder, sig, args):
        low = args[0] if v.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(v), codegen


@njit(inline="always", fastmath=_FM, cache=True)
def _group_scale(scale_u16, base, sc):
    """fp16 bits -> fp32: move exponent+mantissa into place, then rescale by 2^112 (exact, also for
    subnormals); inf/nan halves come out as large finite values, which scales never are."""
    for l in range(_UT):
        h = np.uint32(scale_u16[base + l])
        sc[l] = _bits_to_f32(((h & np.uint32(0x8000)) << 16) | ((h & np.uint32(0x7FFF)) << 13)) * _TWO_POW_112


@njit(inline="always", fastmath=_FM, cache=True)
def _dequant_codes(q, base, cols, w):
    """w[c, :] = float(q[base + 16c : base + 16c + 16]): int8 codes of a group to fp32 lanes."""
    for c in range(cols):
        for l in range(_UT):
            w[c * _UT + l] = np.float32(q[base + c * _UT + l])


@njit(inline="always", cache=True)
def _unpack_codes(nib, crumb, bit, seven, col, cols, codes):
    """Rebuild the int8 codes of ``cols`` tile columns from their bit planes (see packing.py).

    Works on whole words so that LLVM vectorizes it across columns: a column's 16 codes are two
    uint64 words, lanes 0-7 and 8-15. nib (uint64) gives the low nibbles in place (& 0x0F per
    byte) and the high ones after >> 4; crumb (uint32) spreads to both words with one shift-or and
    a mask; bit (uint16) spreads with shifts by multiples of 15 (bit i -> position 16i, and bit
    8+i -> 8+16i). Finally u + (128 - 2^(b-1)) never carries across bytes, and ^ 0x80 turns it
    into the signed code u - 2^(b-1).
    """
    bias = _BIAS7 if seven else _BIAS6
    for c in range(cols):
        i = col + c
        nb = nib[i]
        cr = np.uint64(crumb[i])
        cr |= cr << _U30
        lo = (nb & _NIBBLES) | ((cr << _U4) & _CRUMBS)
        hi = ((nb >> _U4) & _NIBBLES) | (cr & _CRUMBS)
        if seven:
            b = np.uint64(bit[i])
            b |= (b << _U15) | (b << _U30) | (b << _U45)
            lo |= (b << _U6) & _BITS
            hi |= (b << _U2) & _BITS
        codes[c + c] = (lo + bias) ^ _SIGNS
        codes[c + c + _U1] = (hi + bias) ^ _SIGNS


@njit(inline="always", fastmath=_FM, cache=True)
def _fma_column(src, base, xt, n, c, c0, k0, tb, slot, p):
    """p[slot + k, :] += src[c, :] · xt[c0 + c, k0 + k] for the block's tb tokens.

    ``src`` is either the fp32 scratch or the int8 codes themselves: numba specialises on its
    type, and the conversion is a no-op for the former.
    """
    for k in range(tb):
        xv = xt[(c0 + c) * n + k0 + k]
        for l in range(_UT):
            p[(slot + k) * _UT + l] += np.float32(src[base + c * _UT + l]) * xv


@njit(fastmath=_FM, cache=True)
def _token_block(src, base, xt, n, c0, cols, k0, tag, sc, acc):
    """acc[k0 + k, :] += sc · Σ_c src[c, :] · xt[c0 + c, k0 + k] for k < len(tag).

    ``tag`` is a tuple whose length is the block size: tuple lengths are part of the type, so each
    block size gets its own fully unrolled code with constant stack indices. Small blocks split the
    columns over ``unroll`` independent partial sums, so that 8 FMA chains are in flight and FMA
    latency does not bound the loop.
    """
    tb = np.uint64(len(tag))
    unroll = np.uint64(max(1, _TB // len(tag)))
    p = carray(_stack(_STACK_BYTES), _STACK, np.float32)
    for i in range(_STACK):
        p[i] = 0.0
    main = cols - cols % unroll
    for c in range(_U0, main, unroll):
        for u in range(unroll):
            _fma_column(src, base, xt, n, c + u, c0, k0, tb, u * tb, p)
    for c in range(main, cols):
        _fma_column(src, base, xt, n, c, c0, k0, tb, _U0, p)
    for k in range(tb):
        for l in range(_UT):
            total = p[k * _UT + l]
            for u in range(_U1, unroll):
                total += p[(u * tb + k) * _UT + l]
            acc[(k0 + k) * _UT + l] += total * sc[l]


@njit(inline="always", fastmath=_FM, cache=True)
def _all_tokens(codes, base, w, xt, n, c0, cols, sc, acc):
    """All tokens for one (tile, group): codes are int8 at ``codes[base:]``, 16 per column.

    Up to ``_TB`` tokens form one block, which converts the codes in registers as it goes (the
    memory-bound case: no extra pass). More tokens convert the group once into the fp32 scratch
    ``w`` and run every block over it.
    """
    if n == _U1:
        _token_block(codes, base, xt, n, c0, cols, _U0, (0,), sc, acc)
    elif n == _U2:
        _token_block(codes, base, xt, n, c0, cols, _U0, (0, 0), sc, acc)
    elif n == _U3:
        _token_block(codes, base, xt, n, c0, cols, _U0, (0, 0, 0), sc, acc)
    elif n == _UTB:
        _token_block(codes, base, xt, n, c0, cols, _U0, (0, 0, 0, 0), sc, acc)
    else:
        _dequant_codes(codes, base, cols, w)
        full = n - n % _UTB
        for k0 in range(_U0, full, _UTB):
            _token_block(w, _U0, xt, n, c0, cols, k0, (0, 0, 0, 0), sc, acc)
        rest = n - full
        if rest == _U1:
            _token_block(w, _U0, xt, n, c0, cols, full, (0,), sc, acc)
        elif rest == _U2:
            _token_block(w, _U0, xt, n, c0, cols, full, (0, 0), sc, acc)
        elif rest == _U3:
            _token_block(w, _U0, xt, n, c0, cols, full, (0, 0, 0), sc, acc)


@njit(parallel=True, fastmath=_FM, cache=True)
def _residual_kernel(bits, d_in, q, nib, crumb, bit, scale_u16, xt, out):
    """out[:, rows of tile t] = Σ_groups scale · (codes · xt) for every tile, in parallel over tiles.

    Every array but ``out`` is flat: q/nib/crumb/bit/scale are the tile planes (nib, crumb and bit
    viewed as uint64, uint32 and uint16 words: one word per tile column), xt is x transposed.
    Index arithmetic is uint64 on purpose: numba adds a negative-index fix-up to every signed index,
    which turns vector loads into per-lane gathers.
    """
    n = np.uint64(out.shape[0])
    rows = out.shape[1]
    d = np.uint64(d_in)
    n_groups = (d + _UG - _U1) // _UG
    n_tiles = np.uint64(scale_u16.size) // (n_groups * _UT)
    for t in prange(n_tiles):
        w = carray(_stack(_W_BYTES), _W_SIZE, np.float32)
        sc = carray(_stack(_SC_BYTES), TILE, np.float32)
        codes_mem = _stack(_CODES_BYTES)  # one group's int8 codes, written as uint64 words
        codes = carray(codes_mem, 2 * GROUP, np.uint64)
        codes_i8 = carray(codes_mem, _W_SIZE, np.int8)
        acc = np.zeros(out.shape[0] * TILE, np.float32)
        for g in range(n_groups):
            c0 = g * _UG
            cols = min(_UG, d - c0)
            col = t * d + c0
            _group_scale(scale_u16, (t * n_groups + g) * _UT, sc)
            # one call site of _all_tokens for every layout keeps the compile time down
            src, base = q, col * _UT
            if bits != 8:
                # literal flags, so that each unpack loop is specialised and vectorized
                if bits == 7:
                    _unpack_codes(nib, crumb, bit, True, col, cols, codes)
                else:
                    _unpack_codes(nib, crumb, bit, False, col, cols, codes)
                src, base = codes_i8, _U0
            _all_tokens(src, base, w, xt, n, c0, cols, sc, acc)
        r0 = int(t) * TILE
        for k in range(out.shape[0]):
            for l in range(min(TILE, rows - r0)):
                out[k, r0 + l] = acc[k * TILE + l]


# placeholders for the planes a layout lacks: one signature serves every layout
_NO_I8 = np.zeros(0, np.int8)
_NO_U64 = np.zeros(0, np.uint64)
_NO_U32 = np.zeros(0, np.uint32)
_NO_U16 = np.zeros(0, np.uint16)
_WORD = {"nib": np.uint64, "crumb": np.uint32, "bit": np.uint16}  # one word per tile column


def _kernel_args(planes: dict[str, np.ndarray], bits: int, rows: int) -> tuple:
    """The planes as the flat arrays the kernel takes, without copying any of them."""
    check_planes(planes, bits, rows)
    stray = [name for name in (*PLANES[bits], "scale") if not planes[name].flags.c_contiguous]
    if stray:
        raise ValueError(f"planes {stray} are not C-contiguous (slice whole tiles with slice_tiles)")
    scale_u16 = planes["scale"].view(np.uint16).reshape(-1)
    if bits == 8:
        return (planes["q"].reshape(-1), _NO_U64, _NO_U32, _NO_U16, scale_u16)
    words = [planes[p].view(_WORD[p]).reshape(-1) for p in PLANES[bits]]
    return (_NO_I8, words[0], words[1], words[2] if bits == 7 else _NO_U16, scale_u16)


@contextmanager
def _slp_vectorizer() -> Iterator[None]:
    """Turn LLVM's SLP vectorizer on while numba compiles (or loads) the kernel.

    numba leaves it off by default (numba#8705, a miscompile elsewhere); these kernels depend on it
    for their 16-lane columns, and the tests check their results against a reference. Set around
    each call, so that it is on whenever the dispatcher compiles a new specialisation.
    """
    saved = numba_config.SLP_VECTORIZE
    numba_config.SLP_VECTORIZE = 1
    try:
        yield
    finally:
        numba_config.SLP_VECTORIZE = saved


def residual_matmul(planes: dict[str, np.ndarray], bits: int, x: np.ndarray, out: np.ndarray) -> None:
    """Write ``dequant(Q) · xᵀ`` for the planes' real rows into ``out`` [n, rows] (float32, in place).

    ``planes`` is (a tile slice of) the layout of ``splitspec.quantize.packing``; ``rows`` is taken
    from ``out`` and must fall in the last tile, so padded rows are never written. ``x`` is
    [n, d_in]. Threads: up to numba's (``numba.set_num_threads``), fewer for small matrices.
    """
    if out.ndim != 2 or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous float32 [n, rows] array, got {out.shape}")
    q, nib, crumb, bit, scale_u16 = _kernel_args(planes, bits, out.shape[1])
    d_in = planes[PLANES[bits][0]].shape[1]
    if x.shape != (out.shape[0], d_in):
        raise ValueError(f"x must be [n, d_in] = {(out.shape[0], d_in)} for these planes and out, got {x.shape}")
    if x.shape[0] == 0:
        return
    xt = np.ascontiguousarray(x.T, dtype=np.float32).reshape(-1)
    threads = numba.get_num_threads()
    useful = max(1, min(threads, out.shape[1] * d_in // _MIN_WEIGHTS_PER_THREAD))
    numba.set_num_threads(useful)
    try:
        with _slp_vectorizer():
            _residual_kernel(bits, d_in, q, nib, crumb, bit, scale_u16, xt, out)
    finally:
        numba.set_num_threads(threads)


def warmup() -> float:
    """Compile (or load from the cache) the kernel for every layout now; return the seconds it took.

    One specialisation serves all layouts and token counts, as long as the planes are writeable
    arrays (read-only ones, e.g. a read-only memmap, get a second specialisation on first use).
    """
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    for bits in PLANES:
        q = rng.integers(-31, 32, (17, 130)).astype(np.int8)
        planes = pack_residual(q, np.ones((17, 2), np.float16), bits)
        residual_matmul(planes, bits, np.ones((5, 130), np.float32), np.empty((5, 17), np.float32))
    return time.perf_counter() - start
