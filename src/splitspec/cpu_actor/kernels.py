"""Numba kernels for the residual product ``Y[n, rows] = dequant(Q[rows, :]) · X[n, :]ᵀ``.

One pass over the weights serves all ``n`` tree tokens, because a verify pass is bound by how fast
the residual streams from RAM; reading it once per token would multiply that cost by ``n``.

A shard makes one ``ResidualMatrix`` per group at load (planes checked and flattened once), and a
request is then a single call into numba that also rounds x: a small model's group streams in tens of
microseconds, and checking, rounding and switching thread counts from Python per call had cost about as
much (SmolLM2-135M passes took 1.5-1.6× as long).

Threads split the row tiles; a thread walks its tiles' 128-column groups in memory order. Per
(tile, group):

- 6/7-bit codes come out of their ``words`` planes (packing.py) as int16 vectors of 4 rows × 4
  columns, one 16-bit shift and/or mask each (``_step_codes``): for 1-4 tokens with integer
  activations straight into vpmaddwd (``_fused_dot``), else into a stack buffer that ``_dot`` reads.
- The tokens go in blocks: all of them if ``n <= _TB``, else near-equal blocks of 3-6, each keeping
  ``tb × 2`` ymm partial sums in registers, like a 6×16 sgemm micro-kernel.
- Three ways to multiply (``activations``). "int16" (the default): x' is rounded to int16 per (token,
  group) (``quantize/activations.py``), codes are widened to int16 column pairs (row r of columns
  2p, 2p+1 side by side) and one vpmaddwd multiplies a pair of columns for 4-8 rows, summing
  exactly in int32. "int8": the same with x' rounded to int8, which the same integer paths sum to
  the same exact result. "fp32": int8 codes are converted to fp32 in registers
  (vpmovsxbd + vcvtdq2ps) and FMA'd; blocks of 1-3 tokens spread columns over 2-4 sets of partial
  sums so that FMA latency does not bound the loop. The integer modes need no conversion per weight
  and half the multiplies, which is what kept the fp32 mode's 6/7-bit passes compute-bound at 1-2
  tokens.
- Partial sums are multiplied by the group's scales once per group and added to the tile's fp32
  accumulators, as the reference does up to rounding.

The loops that touch the weights are LLVM IR with explicit 8-lane vectors (numba intrinsics)
rather than numba code left to LLVM's auto-vectorizers, which gave these loops scalar per-group
epilogues, register spills and no prefetching. The loops that read a plane from RAM prefetch it
``_PF_COLS`` columns ahead: a core has only so many cache misses in flight, and without the
prefetches it alternated between waiting for memory and computing (an 8-bit pass at n = 1 took
about the sum of its memory time and its in-cache compute time).

Scales are fp16; numba has no fp16 arithmetic, so they are widened with integer ops and a bit
cast, exact for every finite half (no F16C needed).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.config import CpuActorConfig, check_activations
from splitspec.quantize.activations import LEVELS
from splitspec.quantize.packing import GROUP, PLANES, STEP, TILE, WORD_SPLIT, check_planes, pack_residual

# below this many weight × token products per thread, another thread saves nothing: a 576 × 576 group at
# n = 1 (331 K) took as long on 1 thread as on 2 in L3, and from RAM 2 threads stream faster
_MIN_WORK_PER_THREAD = 64 * 1024
# Largest token block: 6 tokens × 2 ymm = 12 accumulators, plus a column's 2 weight vectors and a
# broadcast activation, fit the 16 ymm registers of AVX2.
_TB = 6
# Up to this many tokens, integer passes over 6/7-bit planes unpack in registers (_fused_dot, which has a
# specialisation per count in _fused_tokens) instead of through the stack buffer. At 3 and 4 tokens its
# accumulators spill, and from RAM the buffer still took 1.32 / 1.18× as long with 6-bit codes and 1.17 /
# 1.01× with 7-bit ones (same buffers, same process).
_FUSED_TOKENS = 4
# Partial-sum sets per block size: at least 8 independent FMA chains (2 FMA pipes × 4 cycles).
_SETS = {1: 4, 2: 2, 3: 2}
# Columns per iteration of the column loop (a multiple of the sets): fewer loop instructions
# per column for the small blocks, whose loops are short (measured ~5% at n = 1, 2).
_UNROLL = {1: 8, 2: 4, 3: 2}
# How far ahead the streaming loops prefetch, in tile columns (8 KiB of 8-bit codes): at ~12 GB/s
# per core that is ~0.7 µs, several memory latencies (measured at n = 1: 4-8 KiB read ~10% faster
# than 2 KiB; 16 KiB was no better).
_PF_COLS = 512
_HALF = 8 * GROUP  # bytes of one half (rows 0-7 or 8-15) of a group's unpacked int8 codes
# a group's unpacked codes: int8 [2, _HALF] for fp32 activations, int16 column pairs [GROUP / 2, 2, 16]
# for int16 ones (the larger); a module constant because _stack needs a literal
_CODES_BYTES = TILE * GROUP * 2
# uint64 constants: numba types mixed uint64/int64 arithmetic as float64
_U0, _U1, _U2, _U3, _U4, _U5, _U8 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 5, 8))
_UT, _UG, _UTB = np.uint64(TILE), np.uint64(GROUP), np.uint64(_TB)
_UPF_SCALE = np.uint64(_PF_COLS // GROUP * TILE)

_I8, _I16, _I32, _I64 = (ir.IntType(b) for b in (8, 16, 32, 64))


_F32 = ir.FloatType()
_V8F = ir.VectorType(_F32, 8)  # one ymm: half a tile column (rows 0-7 or 8-15)
_V8I32 = ir.VectorType(_I32, 8)
_V16I16 = ir.VectorType(_I16, 16)  # one ymm of int16 codes: rows 0-7 (or 8-15) of a column pair
_ZERO8I = ir.Constant(_V8I32, [0] * 8)
_ZERO8 = ir.Constant(_V8F, [0.0] * 8)


@intrinsic
def _stack(typingctx, nbytes):
    """``nbytes`` (a literal) of 32-byte aligned stack memory, for ``carray``: unlike a heap array,
    it costs nothing per tile."""
    if not isinstance(nbytes, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, _I8, size=nbytes.literal_value)
        ptr.align = 32
        return ptr

    return types.voidptr(nbytes), codegen


# --- IR building blocks (called at compile time, from the intrinsics' codegen) -------------------


def _c64(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _element(context, builder, array_type, array, index):
    """Pointer to element ``index`` of a C-contiguous array (a flat index)."""
    return builder.gep(context.make_array(array_type)(context, builder, array).data, [index])


def _load(builder, ptr, ty, align: int):
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)


def _store(builder, value, ptr, align: int) -> None:
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=align)


def _call(builder, name: str, ret, args: list):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _fma(builder, a, b, c):
    return _call(builder, "llvm.fma.v8f32", _V8F, [a, b, c])


def _prefetch(builder, ptr) -> None:
    """Read prefetch into all cache levels; never faults, so running past an array's end is fine."""
    i32 = (ir.Constant(_I32, v) for v in (0, 3, 1))  # read, keep in all levels, data
    _call(builder, "llvm.prefetch.p0", ir.VoidType(), [builder.bitcast(ptr, _I8.as_pointer()), *i32])


def _broadcast(builder, scalar):
    """8 lanes of ``scalar`` (fp32 or int32)."""
    vector = ir.VectorType(scalar.type, 8)
    lane0 = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(lane0, ir.Constant(vector, ir.Undefined), ir.Constant(_V8I32, [0] * 8))


def _int8_to_f32(builder, ptr):
    """8 int8 codes at ``ptr`` as fp32 lanes (vpmovsxbd from memory + vcvtdq2ps)."""
    codes = _load(builder, ptr, ir.VectorType(_I8, 8), align=1)
    return builder.sitofp(builder.sext(codes, _V8I32), _V8F)


def _half_to_f32(builder, ptr):
    """8 fp16 bit patterns at ``ptr`` as fp32: move sign, exponent and mantissa into place, then
    rescale by 2^112 (exact, also for subnormals); inf/nan come out large finite, which scales
    never are."""
    h = builder.zext(_load(builder, ptr, ir.VectorType(_I16, 8), align=2), _V8I32)

    def field(mask: int, shift: int):
        return builder.shl(builder.and_(h, ir.Constant(_V8I32, [mask] * 8)), ir.Constant(_V8I32, [shift] * 8))

    bits = builder.or_(field(0x8000, 16), field(0x7FFF, 13))
    return builder.fmul(builder.bitcast(bits, _V8F), ir.Constant(_V8F, [2.0**112] * 8))


def _loop(builder, start, stop, step: int, carried: list, body: Callable) -> tuple:
    """Emit ``for (i = start; i + step <= stop; i += step) carried = body(i, carried)``.

    ``carried`` values (the partial sums) live in phi nodes, i.e. registers. Returns the final
    ``i`` and ``carried``, for a remainder loop.
    """
    entry = builder.block
    head = builder.append_basic_block("cols.head")
    loop = builder.append_basic_block("cols.body")
    done = builder.append_basic_block("cols.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(_I64)
    i.add_incoming(start, entry)
    phis = []
    for value in carried:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        phis.append(phi)
    after = builder.add(i, _c64(step))
    builder.cbranch(builder.icmp_unsigned("<=", after, stop), loop, done)
    builder.position_at_end(loop)
    new = body(i, phis)
    i.add_incoming(after, builder.block)
    for phi, value in zip(phis, new, strict=True):
        phi.add_incoming(value, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return i, phis


# --- intrinsics ----------------------------------------------------------------------------------


@intrinsic
def _prefetch_element(typingctx, array, index):
    """Prefetch the cache line holding ``array[index]`` (an index past the end is fine)."""
    sig = types.void(array, index)

    def codegen(context, builder, sig, args):
        _prefetch(builder, _element(context, builder, sig.args[0], args[0], args[1]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _dot(typingctx, src, base, x, xbase, n, cols, scale, sbase, xs, xsbase, acc, abase, tb):
    """acc[abase + 16k + r] += scale[sbase + r] · Σ_c q[c, r] · x_k[c], for the tokens k < tb (a literal).

    Where the codes are (a compile-time choice, by ``src``'s type): a 1-D ``src`` is the 8-bit plane,
    ``q[c, r] = src[base + 16c + r]``, streamed from RAM and prefetched ``_PF_COLS`` columns ahead; a
    pointer is a group's codes unpacked into L1 by ``_unpack``. The layout is a compile-time constant on
    purpose: runtime strides cost general registers, and the unrolled loops then spilled address offsets.

    How they are multiplied (by ``x``'s dtype):

    - float32 ``x`` (transposed, ``x_k[c] = x[xbase + c·n + k]``): int8 codes widened to fp32 and FMAs;
    - int32 ``x`` (int16 pairs: ``x[xbase + p·n + k]`` holds token k's codes of columns 2p, 2p + 1, and
      ``xs[xsbase + k]`` its scale for this group): one vpmaddwd per pair and row half multiplies two
      columns of 8 rows into int32 sums, exact within a group; the group's sums are then scaled by
      weight scale × activation scale. No int → fp32 conversion per weight, half the multiplies.

    The ``tb × 2`` ymm partial sums (times ``_SETS`` sets) stay in registers for the whole loop.
    """
    if not isinstance(tb, types.IntegerLiteral):
        return None
    block = tb.literal_value
    raw = isinstance(src, types.Array)
    paired = x.dtype == types.int32
    sig = types.void(src, base, x, xbase, n, cols, scale, sbase, xs, xsbase, acc, abase, tb)

    def codegen(context, builder, sig, args):
        src_v, base_v, x_v, xbase_v, n_v, cols_v, scale_v, sbase_v, xs_v, xsbase_v, acc_v, abase_v, _ = args
        if raw:
            src_p = builder.gep(context.make_array(sig.args[0])(context, builder, src_v).data, [base_v])
        else:
            src_p = builder.bitcast(src_v, (_I16 if paired else _I8).as_pointer())
        x_p = _element(context, builder, sig.args[2], x_v, xbase_v)
        if paired:
            sums, step_cols = _pair_products(builder, src_p, raw, x_p, n_v, cols_v, block)
        else:
            sums, step_cols = _fp32_products(builder, src_p, raw, x_p, n_v, cols_v, block)
        scale_p = _element(context, builder, sig.args[6], scale_v, sbase_v)
        scales = [_half_to_f32(builder, builder.gep(scale_p, [_c64(8 * h)])) for h in range(2)]
        acc_p = _element(context, builder, sig.args[10], acc_v, abase_v)
        xs_p = _element(context, builder, sig.args[8], xs_v, xsbase_v) if paired else None
        for k in range(block):
            for h in range(2):
                _accumulate(builder, acc_p, k, h, _sum_sets(builder, sums, k, h, block, step_cols), scales[h], xs_p)
        return context.get_dummy_value()

    return sig, codegen


def _sum_sets(builder, sums: list, k: int, h: int, block: int, sets: int):
    """The partial sums of token k, row half h, added over the sets that took alternate columns."""
    add = builder.add if sums[0].type == _V8I32 else builder.fadd
    total = sums[2 * k + h]
    for s in range(1, sets):
        total = add(total, sums[2 * (s * block + k) + h])
    return total


def _fp32_products(builder, src_p, raw: bool, x_p, n_v, cols_v, block: int) -> tuple[list, int]:
    """The fp32 column loop; returns its ``tb × 2 × sets`` partial sums and the number of sets."""
    sets, unroll = _SETS.get(block, 1), _UNROLL.get(block, 1)
    cstride, hoff = (TILE, 8) if raw else (8, _HALF)

    def fma_column(c, sums, slot: int) -> list:
        lo = builder.gep(src_p, [builder.mul(c, _c64(cstride))])
        w = [_int8_to_f32(builder, p) for p in (lo, builder.gep(lo, [_c64(hoff)]))]
        x_row = builder.gep(x_p, [builder.mul(c, n_v)])
        sums = list(sums)
        for k in range(block):
            xk = _broadcast(builder, builder.load(builder.gep(x_row, [_c64(k)])))
            for h in range(2):
                i = 2 * (slot * block + k) + h
                sums[i] = _fma(builder, w[h], xk, sums[i])
        return sums

    def step(c, sums) -> list:
        if raw:
            _prefetch_ahead(builder, src_p, c, max(unroll, 4))
        for j in range(unroll):
            sums = fma_column(builder.add(c, _c64(j)), sums, j % sets)
        return sums

    c, sums = _loop(builder, _c64(0), cols_v, unroll, [_ZERO8] * (2 * block * sets), step)
    if unroll > 1:
        _, sums = _loop(builder, c, cols_v, 1, sums, lambda c, sums: fma_column(c, sums, 0))
    return sums, sets


def _pair_products(builder, src_p, raw: bool, x_p, n_v, cols_v, block: int) -> tuple[list, int]:
    """The int16 column-pair loop; returns its int32 partial sums and the number of sets.

    A lone last column (odd ``cols``, only where d_in is odd) pairs with zero codes from the 8-bit
    plane (reading its neighbour could run past the array) and, unpacked, with whatever the buffer
    holds: its activation partner is the zero padding, so either way it adds nothing.
    """
    sets = 2 if block == 1 else 1  # vpaddd's 1-cycle chains: two sets keep a block of 1 off them
    unroll = {1: 4, 2: 2}.get(block, 1)

    def weights(p, lone: bool) -> list:
        if not raw:
            lo = builder.gep(src_p, [builder.mul(p, _c64(2 * TILE))])
            return [_load(builder, lo, _V16I16, align=32), _load(builder, builder.gep(lo, [_c64(TILE)]), _V16I16, 32)]
        v16 = ir.VectorType(_I8, 16)
        col = builder.gep(src_p, [builder.mul(p, _c64(2 * TILE))])
        a = _load(builder, col, v16, align=1)
        b = ir.Constant(v16, [0] * 16) if lone else _load(builder, builder.gep(col, [_c64(TILE)]), v16, align=1)
        return [
            builder.sext(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 16), mask)), _V16I16)
            for mask in ([r + j * 16 for r in range(8 * h, 8 * h + 8) for j in range(2)] for h in range(2))
        ]

    def madd_pair(p, sums, slot: int, lone: bool = False) -> list:
        w = weights(p, lone)
        x_row = builder.gep(x_p, [builder.mul(p, n_v)])
        sums = list(sums)
        for k in range(block):
            xk = builder.bitcast(_broadcast(builder, builder.load(builder.gep(x_row, [_c64(k)]))), _V16I16)
            for h in range(2):
                i = 2 * (slot * block + k) + h
                sums[i] = builder.add(sums[i], _madd(builder, w[h], xk))
        return sums

    def step(p, sums) -> list:
        if raw:
            _prefetch_ahead(builder, src_p, builder.mul(p, _c64(2)), max(2 * unroll, 4))
        for j in range(unroll):
            sums = madd_pair(builder.add(p, _c64(j)), sums, j % sets)
        return sums

    pairs = builder.lshr(cols_v, _c64(1))
    p, sums = _loop(builder, _c64(0), pairs, unroll, [_ZERO8I] * (2 * block * sets), step)
    if unroll > 1:
        p, sums = _loop(builder, p, pairs, 1, sums, lambda p, sums: madd_pair(p, sums, 0))
    # runs once when cols is odd
    lone_stop = builder.add(pairs, builder.and_(cols_v, _c64(1)))
    _, sums = _loop(builder, pairs, lone_stop, 1, sums, lambda p, sums: madd_pair(p, sums, 0, lone=True))
    return sums, sets


def _madd(builder, a, b):
    """vpmaddwd: int16 lanes multiplied, adjacent products added into int32 lanes (written as plain
    IR, which LLVM's x86 backend turns into the instruction, and other targets into their own)."""
    v16i32 = ir.VectorType(_I32, 16)
    prod = builder.mul(builder.sext(a, v16i32), builder.sext(b, v16i32))
    even, odd = (builder.shuffle_vector(prod, prod, ir.Constant(_V8I32, list(range(j, 16, 2)))) for j in range(2))
    return builder.add(even, odd)


def _prefetch_ahead(builder, src_p, c, cols: int) -> None:
    """Prefetch the 8-bit plane ``_PF_COLS`` columns past ``c``: one per 64-byte line (4 columns)."""
    for j in range(0, cols, 4):
        ahead = builder.add(c, _c64(_PF_COLS + j))
        _prefetch(builder, builder.gep(src_p, [builder.mul(ahead, _c64(TILE))]))


def _word_planes(context, builder, types_: tuple, arrays: tuple, step0, bits: int) -> list:
    """Pointers to step ``step0``'s words in each ``words`` plane (``WORD_SPLIT[bits]`` words per step each)."""
    return [
        _element(context, builder, ty, a, builder.mul(step0, _c64(16 * k)))
        for ty, a, k in zip(types_, arrays, WORD_SPLIT[bits], strict=True)
    ]


def _step_planes(builder, planes: list, s, bits: int) -> list:
    """The ``words`` planes' pointers moved ``s`` steps on, each prefetched ``_PF_COLS`` columns ahead
    (every 64-byte line of its share of a step)."""
    moved = []
    for p, k in zip(planes, WORD_SPLIT[bits], strict=True):
        p = builder.gep(p, [builder.mul(s, _c64(16 * k))])
        for offset in range(0, 32 * k, 64):
            _prefetch(builder, builder.gep(p, [_c64(_PF_COLS // STEP[bits] * 16 * k + offset // 2)]))
        moved.append(p)
    return moved


def _step_codes(builder, planes: list, bits: int) -> Callable:
    """``code(j)``: the unsigned codes j of the step whose words sit at ``planes`` (the ``words`` planes of
    packing.py, uint16), an int16 vector whose lane i is row 4·rq + (i % 8) // 2 of column 4·quad +
    2·(i // 8) + i % 2 (j = 4·quad + rq), so adjacent lanes pair two columns of one row, as vpmaddwd wants
    them. Code j is bits b·j .. b·j + b - 1 of each lane's words: one 16-bit shift and/or mask, or, where it
    straddles two words, two shifts, a mask and an OR; no byte shuffles. Each word is loaded where first
    needed."""
    loaded: dict[int, ir.Value] = {}
    where = [(p, 16 * i) for p, k in zip(planes, WORD_SPLIT[bits], strict=True) for i in range(k)]

    def word(w: int):
        if w not in loaded:
            p, offset = where[w]
            loaded[w] = _load(builder, builder.gep(p, [_c64(offset)]), _V16I16, align=2)
        return loaded[w]

    def k(value: int):
        return ir.Constant(_V16I16, [value] * 16)

    mask = (1 << bits) - 1

    def code(j: int):
        w, offset = divmod(bits * j, 16)
        value = builder.lshr(word(w), k(offset)) if offset else word(w)
        if offset + bits > 16:
            return builder.or_(value, builder.and_(builder.shl(word(w + 1), k(16 - offset)), k(mask)))
        return builder.and_(value, k(mask)) if offset + bits < 16 else value

    return code


@intrinsic
def _unpack(typingctx, w0, w1, w2, step0, steps, codes, x, bits):
    """Rebuild the signed codes of ``steps`` steps of the ``words`` planes (w0-w2) from step ``step0`` into
    the buffer ``codes``, in the layout ``_dot`` reads for activations like ``x``: for fp32 ones int8
    [2, _HALF], rows 0-7 of column c at [0, 8c], rows 8-15 at [1, 8c]; for int16 ones int16 column
    pairs, row r of column c at ``32·(c // 2) + 16·(r // 8) + 2·(r % 8) + c % 2``.

    Each 128-bit lane of a ``_step_codes`` vector is already 8 of those int16s (4 rows of a column
    pair), stored as it is; for int8, the low bytes of two vectors (rows 0-3 and 4-7) are gathered in
    lane into columns of 8 rows. A group's last step may run past its columns: the plane pads them
    with code 0. ``bits`` (a literal, 6 or 7) picks the step; the loop prefetches the plane from RAM.
    """
    if not isinstance(bits, types.IntegerLiteral):
        return None
    b = bits.literal_value
    paired = x.dtype == types.int32
    sig = types.void(w0, w1, w2, step0, steps, codes, x, bits)
    v32 = ir.VectorType(_I8, 32)
    # int8: lane L of a (rows 0-3) and b (rows 4-7) into column cc's 8 rows at byte 16L + 8cc + r
    gather = ir.Constant(
        ir.VectorType(_I32, 32),
        [
            (16 * lane + 4 * r + 2 * cc) if r < 4 else (32 + 16 * lane + 4 * (r - 4) + 2 * cc)
            for lane in range(2)
            for cc in range(2)
            for r in range(8)
        ],
    )

    def codegen(context, builder, sig, args):
        planes = _word_planes(context, builder, sig.args[:3], args[:3], args[3], b)
        out_p = builder.bitcast(args[5], (_I16 if paired else _I8).as_pointer())
        offset = ir.Constant(_V16I16, [1 << (b - 1)] * 16)

        def step(s, _) -> list:
            code = _step_codes(builder, _step_planes(builder, planes, s, b), b)
            first = builder.mul(s, _c64(STEP[b]))
            for quad in range(STEP[b] // 4):
                c = builder.add(first, _c64(4 * quad))
                codes = [builder.sub(code(4 * quad + rq), offset) for rq in range(4)]
                if paired:
                    for rq in range(4):
                        for lane in range(2):
                            half = builder.shuffle_vector(
                                codes[rq],
                                ir.Constant(_V16I16, ir.Undefined),
                                ir.Constant(_V8I32, list(range(8 * lane, 8 * lane + 8))),
                            )
                            pair = builder.add(builder.lshr(c, _c64(1)), _c64(lane))
                            dst = builder.gep(out_p, [builder.add(builder.mul(pair, _c64(2 * TILE)), _c64(8 * rq))])
                            _store(builder, half, dst, align=16)
                    continue
                for h in range(2):
                    low, high = (builder.bitcast(codes[2 * h + j], v32) for j in range(2))
                    dst = builder.gep(out_p, [builder.add(builder.mul(c, _c64(8)), _c64(h * _HALF))])
                    _store(builder, builder.shuffle_vector(low, high, gather), dst, align=1)
            return []

        _loop(builder, _c64(0), args[4], 1, [], step)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fused_dot(typingctx, w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, tb):
    """``_unpack`` then ``_dot`` in one loop, for integer activations and a block of 1-4 tokens (``tb``, a
    literal: all of n, at most ``_FUSED_TOKENS``). At 1-2 tokens the 6/7-bit passes are bound by the
    cores, not RAM: here the codes never leave registers (no store, reload or sign extension).

    Each ``_step_codes`` vector (4 rows of 4 columns) meets token k's x vector of its 4 columns, ``[x_0,
    x_1] × 4 | [x_2, x_3] × 4`` (32 bytes at ``x[xbase + 8·(c / 4 · n + k)]``, ``_round_activations``)
    in one vpmaddwd, summing exactly in int32. The codes stay unsigned (code + 2^(bits - 1)); their
    offset comes off once per group through ``xb[xsbase + k]``. A group's last step may run past its
    columns into the plane's padding, which meets x's zero padding.

    The sums of rows 4rq .. 4rq + 3 come out as one int32 vector per token and row quad rq, the two
    column pairs in its two 128-bit lanes, added up here once per group.
    """
    if not all(isinstance(v, types.IntegerLiteral) for v in (bits, tb)):
        return None
    b, block = bits.literal_value, tb.literal_value
    sig = types.void(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, tb)

    def codegen(context, builder, sig, args):
        steps_v, x_v, xbase_v, n_v, scale_v, sbase_v, xs_v, xb_v, xsbase_v, acc_v = args[4:14]
        planes = _word_planes(context, builder, sig.args[:3], args[:3], args[3], b)
        x_p = _element(context, builder, sig.args[5], x_v, xbase_v)
        # int32s of x per column (8n per 4 columns): linear in the column, so LLVM strength-reduces it
        x_stride = builder.mul(n_v, _c64(2))

        def step(s, sums, quads) -> list:
            code = _step_codes(builder, _step_planes(builder, planes, s, b), b)
            first = builder.mul(s, _c64(STEP[b]))
            sums = list(sums)
            for quad in quads:
                xk = _token_x(builder, x_p, x_stride, builder.add(first, _c64(4 * quad)), block, _V16I16)
                for rq in range(4):
                    codes = code(4 * quad + rq)
                    for k in range(block):
                        sums[4 * k + rq] = builder.add(sums[4 * k + rq], _madd(builder, codes, xk[k]))
            return sums

        # A 7-bit step's 16 code vectors and 4-8 tokens' sums do not fit the 16 ymm registers: at 3-4 tokens
        # the group's steps go twice, quads 0-1 then 2-3 (the second pass re-reads its words from L1), which
        # took 0.94 / 0.93× as long from RAM as one pass did (same buffers, same process).
        quads = range(STEP[b] // 4)
        passes = [quads[:2], quads[2:]] if b == 7 and block >= 3 else [quads]
        sums = [_ZERO8I] * (4 * block)
        for part in passes:
            _, sums = _loop(builder, _c64(0), steps_v, 1, sums, lambda s, sums, part=part: step(s, sums, part))

        scale_p = _element(context, builder, sig.args[8], scale_v, sbase_v)
        xs_p, xb_p = (_element(context, builder, sig.args[i], a, xsbase_v) for i, a in ((10, xs_v), (11, xb_v)))
        acc_p = _element(context, builder, sig.args[13], acc_v, _c64(0))
        for h in range(2):
            wscale = _half_to_f32(builder, builder.gep(scale_p, [_c64(8 * h)]))
            for k in range(block):
                a, b_ = sums[4 * k + 2 * h], sums[4 * k + 2 * h + 1]
                lanes = [
                    builder.shuffle_vector(a, b_, ir.Constant(_V8I32, [i + 4 * j + 4 * (i // 4) for i in range(8)]))
                    for j in range(2)
                ]
                total = builder.sub(
                    builder.add(*lanes), _broadcast(builder, builder.load(builder.gep(xb_p, [_c64(k)])))
                )
                _accumulate(builder, acc_p, k, h, total, wscale, xs_p)
        return context.get_dummy_value()

    return sig, codegen


def _token_x(builder, x_p, x_stride, c, block: int, vector: ir.VectorType) -> list:
    """Each token's 32-byte x vector for the 4 columns from c (``_round_activations``' fused layout)."""
    x_c = builder.gep(x_p, [builder.mul(c, x_stride)])
    return [_load(builder, builder.gep(x_c, [_c64(8 * k)]), vector, align=4) for k in range(block)]


def _accumulate(builder, acc_p, k: int, h: int, total, wscale, xs_p) -> None:
    """acc[16k + 8h ...] += total · weight scale: a group's sums of rows 8h..8h+7 for token k. With int16
    activations (``xs_p`` not None) total is int32, and the token's activation scale for the group
    folds into the weight scale here, once per group and token."""
    scale = wscale
    if xs_p is not None:
        total = builder.sitofp(total, _V8F)
        scale = builder.fmul(wscale, _broadcast(builder, builder.load(builder.gep(xs_p, [_c64(k)]))))
    p = builder.gep(acc_p, [_c64(TILE * k + 8 * h)])
    _store(builder, _fma(builder, total, scale, _load(builder, p, _V8F, align=4)), p, align=4)


# --- kernel --------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _tokens(src, base, x, xcol, xs, xsbase, n, blocks, cols, scale, sbase, acc):
    """All ``n`` tokens for one (tile, group), in ``blocks = (count, size, larger)`` blocks: the
    first ``larger`` have ``size + 1`` tokens, the rest ``size``. The split is computed once per
    call, because divisions here cost ~10% at n = 1. ``xcol``: the group's first column of ``x``
    (a column pair for int16 activations)."""
    count, small, larger = blocks
    k0 = _U0
    for b in range(count):
        size = small + _U1 if b < larger else small
        xbase = xcol * n + k0
        abase = k0 * _UT
        xsk = xsbase + k0
        if size == _U1:
            _dot(src, base, x, xbase, n, cols, scale, sbase, xs, xsk, acc, abase, 1)
        elif size == _U2:
            _dot(src, base, x, xbase, n, cols, scale, sbase, xs, xsk, acc, abase, 2)
        elif size == _U3:
            _dot(src, base, x, xbase, n, cols, scale, sbase, xs, xsk, acc, abase, 3)
        elif size == _U4:
            _dot(src, base, x, xbase, n, cols, scale, sbase, xs, xsk, acc, abase, 4)
        elif size == _U5:
            _dot(src, base, x, xbase, n, cols, scale, sbase, xs, xsk, acc, abase, 5)
        else:
            _dot(src, base, x, xbase, n, cols, scale, sbase, xs, xsk, acc, abase, 6)
        k0 += size


@njit(inline="always", cache=True)
def _fused(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits):
    """``_fused_dot`` with its literals: 6 or 7 bits, then 1 to ``_FUSED_TOKENS`` tokens."""
    if bits == 7:
        _fused_tokens(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, 7)
    else:
        _fused_tokens(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, 6)


@njit(inline="always", cache=True)
def _fused_tokens(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits):
    """Inlined, so ``bits`` stays the caller's literal."""
    if n == _U1:
        _fused_dot(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 1)
    elif n == _U2:
        _fused_dot(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 2)
    elif n == _U3:
        _fused_dot(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 3)
    else:
        _fused_dot(w0, w1, w2, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 4)


@njit(inline="always", cache=True)
def _group(bits, q, w0, w1, w2, scale_u16, t, g, d, n, blocks, x, xs, xb, pair_shift, fused, codes, acc):
    """Tile t's products over group g, accumulated into ``acc``; ``x`` in the layout ``pair_shift`` and
    ``fused`` say (see ``_product``)."""
    n_groups = (d + _UG - _U1) // _UG
    c0 = g * _UG
    cols = min(_UG, d - c0)
    sbase = (t * n_groups + g) * _UT
    # the scales are a second, slow stream (1/64 of the bytes) that the hardware prefetcher
    # may not follow; the planes are prefetched by the loops that read them
    _prefetch_element(scale_u16, sbase + _UPF_SCALE)
    if bits == 8:
        _tokens(q, (t * d + c0) * _UT, x, c0 >> pair_shift, xs, g * n, n, blocks, cols, scale_u16, sbase, acc)
        return
    # log2 of the columns per step: shifts, because a division by a value the compiler cannot see costs
    # tens of cycles, three times per (tile, group)
    shift = _U3 if bits == 6 else _U4
    steps = (cols + (_U1 << shift) - _U1) >> shift
    step0 = t * ((d + (_U1 << shift) - _U1) >> shift) + (c0 >> shift)
    if fused:
        _fused(w0, w1, w2, step0, steps, x, (c0 >> _U2) * n * _U8, n, scale_u16, sbase, xs, xb, g * n, acc, bits)
    else:
        # literal bits, so that each unpack loop is specialised
        if bits == 7:
            _unpack(w0, w1, w2, step0, steps, codes, x, 7)
        else:
            _unpack(w0, w1, w2, step0, steps, codes, x, 6)
        _tokens(codes, _U0, x, c0 >> pair_shift, xs, g * n, n, blocks, cols, scale_u16, sbase, acc)


@njit(inline="always", cache=True)
def _product(bits, d_in, q, w0, w1, w2, scale_u16, x, levels, threads, out):
    """out[:, rows of tile t] = Σ_groups scale · (codes · x) for every tile: tile ranges in parallel in
    ``_residual_kernel``, on the calling thread in ``_serial_kernel``.

    Every plane is flat: q (8 bits) or the three words planes w0-w2 (6/7 bits), and scale viewed as
    uint16. ``x`` is [n, d_in] fp32. With ``levels`` (> 0) it is rounded here to codes in [-levels,
    levels] (``_round_activations``), stored in int32 words with their scales and offset sums: in column
    pairs, or for 6/7 bits and n <= ``_FUSED_TOKENS`` in the 4-column vectors of ``_fused_dot``; with
    levels = 0 (fp32) it is transposed. int8 and int16 codes take the same paths, which sum their integer
    products exactly. One call does it all, because a small group's product takes tens of microseconds
    and every call from Python adds several.

    Up to ``threads`` threads take contiguous ranges of tiles, fewer where ``_MIN_WORK_PER_THREAD``
    says another would save nothing (the caller passes numba's count: ``get_num_threads`` here would keep
    the function out of numba's on-disk cache). Index arithmetic is uint64 on purpose: numba adds a
    negative-index fix-up to every signed index.
    """
    n = np.uint64(out.shape[0])
    rows = out.shape[1]
    d = np.uint64(d_in)
    count = max((n + _UTB - _U1) // _UTB, _U1)  # token blocks of near-equal size, at most _TB
    blocks = (count, n // count, n % count)
    integer = levels > 0
    fused = integer and bits != 8 and n <= _FUSED_TOKENS  # _fused_dot, whose codes are unsigned
    xq, xs, xb, xt = _prepare(bits, x, levels, fused)
    chunks = np.uint64(max(1, min(threads, rows * d_in * out.shape[0] // _MIN_WORK_PER_THREAD)))
    # one branch per activation mode outside the loops, so that each mode's loop nest is its own
    if integer:
        _tiles(bits, q, w0, w1, w2, scale_u16, d, n, blocks, xq, xs, xb, _U1, fused, chunks, out)
    else:
        _tiles(bits, q, w0, w1, w2, scale_u16, d, n, blocks, xt, xs, xb, _U0, False, chunks, out)


@njit(parallel=True, cache=True)
def _residual_kernel(bits, d_in, q, w0, w1, w2, scale_u16, x, levels, threads, out):
    """``_product`` with its tile ranges on numba's threads."""
    _product(bits, d_in, q, w0, w1, w2, scale_u16, x, levels, threads, out)


@njit(cache=True)
def _serial_kernel(bits, d_in, q, w0, w1, w2, scale_u16, x, levels, threads, out):
    """``_product`` on the calling thread (outside a parallel function, prange is range), for products too
    small for two threads: starting a parallel region costs 4-12 µs here, as much as a small group's whole
    product."""
    _product(bits, d_in, q, w0, w1, w2, scale_u16, x, levels, 1, out)


@njit(cache=True)
def _prepare(bits, x, levels, fused):
    """x in the layout the loops read (``_residual_kernel``): (codes, scales, offset sums, transposed fp32).

    A function of its own, not inlined: in the parallel kernel, numba would make each of these
    allocations a parallel region, and starting one costs 4-12 µs here (a small group streams in ~20)."""
    n, d = x.shape
    integer = levels > 0
    m = n if integer else 0
    n_groups = (d + GROUP - 1) // GROUP
    # fused: 8 words per 4 columns, to whole 16-column steps (the 7-bit plane's, which pads them)
    xq = np.zeros(((d + 15) // 16 * 32 if fused else (d + 1) // 2) * m, np.int32)
    xs = np.empty(n_groups * m, np.float32)
    xb = np.empty(n_groups * m, np.int32)
    xt = np.empty(d * (n - m), np.float32)
    if integer:
        _round_activations(x, xq, xs, xb, fused, 2 ** (bits - 1) if fused else 0, levels)
    else:
        for k in range(n):
            for c in range(d):
                xt[c * n + k] = x[k, c]
    return xq, xs, xb, xt


@njit(inline="always", cache=True)
def _tiles(bits, q, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, pair_shift, fused, chunks, out):
    """Every tile's rows of ``out``, ``chunks`` contiguous ranges of tiles in parallel."""
    rows = out.shape[1]
    n_groups = (d + _UG - _U1) // _UG
    n_tiles = np.uint64(scale_u16.size) // (n_groups * _UT)
    for chunk in prange(chunks):
        codes = _stack(_CODES_BYTES)  # one group's unpacked codes, in the layout x asks for
        acc = np.empty(out.shape[0] * TILE, np.float32)
        for t in range(chunk * n_tiles // chunks, (chunk + _U1) * n_tiles // chunks):
            acc[:] = 0
            for g in range(n_groups):
                _group(bits, q, w0, w1, w2, scale_u16, t, g, d, n, blocks, x, xs, xb, pair_shift, fused, codes, acc)
            r0 = int(t) * TILE
            for k in range(out.shape[0]):
                for r in range(min(TILE, rows - r0)):
                    out[k, r0 + r] = acc[k * TILE + r]


@njit(cache=True, fastmath=True)
def _amax(values):
    """max |values|; fast-math lets LLVM vectorize the reduction (max is exact in any order; only NaN
    inputs could come out differently, and they have no meaningful code either way)."""
    amax = np.float32(0.0)
    for c in range(values.size):
        amax = max(amax, abs(values[c]))
    return amax


@njit(cache=True, error_model="numpy")
def _round_activations(x, xq, xs, xb, fused, offset, levels):
    """``quantize.activations.round_activations(x, levels)`` in the kernel's layout, bit for bit: token k's
    scale at xs[(c // 128)·n + k] (fp32), ``offset`` × its codes' sum over the group at the same place in
    xb (int32; the share of unsigned codes' offset), and its codes in xq (int32 words; it starts zeroed,
    which pads the last columns), for the loop that reads them:

    - ``_pair_products``: int16 column pairs p = c // 2, word p·n + k;
    - ``_fused_dot`` (``fused``): the pair's word at (p // 2)·8n + 8k + 4·(p % 2) + j for j < 4.

    A group's codes are made in a buffer of their own, in loops that vectorize (the max, the rounding,
    the sum; ``error_model="numpy"`` drops the division's zero check, which kept the rounding scalar: the
    scale is never 0), then stored a word at a time."""
    n, d = x.shape
    codes = np.zeros(GROUP, np.int16)  # zero past a short last group: its padding
    pairs, words = codes.view(np.uint32), xq.view(np.uint32)
    for k in range(n):
        for c0 in range(0, d, GROUP):
            cols = min(GROUP, d - c0)
            seg = x[k, c0 : c0 + cols]
            amax = _amax(seg)
            scale = amax / np.float32(levels) if amax > 0 else np.float32(1.0)
            for c in range(cols):
                codes[c] = np.int16(np.rint(seg[c] / scale))
            total = 0
            for c in range(cols):
                total += codes[c]
            codes[cols:] = 0
            for p in range((cols + 1) // 2):
                pair = c0 // 2 + p
                if fused:
                    first = ((pair // 2) * n + k) * 8 + (pair % 2) * 4
                    for j in range(4):
                        words[first + j] = pairs[p]
                else:
                    words[pair * n + k] = pairs[p]
            xs[(c0 // GROUP) * n + k] = scale
            xb[(c0 // GROUP) * n + k] = offset * total


# placeholders for the planes a layout lacks: one signature serves every layout
_NO_I8 = np.zeros(0, np.int8)
_NO_U16 = np.zeros(0, np.uint16)


def _kernel_args(planes: dict[str, np.ndarray], bits: int) -> tuple:
    """The planes as the flat arrays the kernel takes, without copying any of them."""
    stray = [name for name in (*PLANES[bits], "scale") if not planes[name].flags.c_contiguous]
    if stray:
        raise ValueError(f"planes {stray} are not C-contiguous (slice whole tiles with slice_tiles)")
    scale_u16 = planes["scale"].view(np.uint16).reshape(-1)
    if bits == 8:
        return (planes["q"].reshape(-1), _NO_U16, _NO_U16, _NO_U16, scale_u16)
    return (_NO_I8, *(planes[name].reshape(-1) for name in PLANES[bits]), scale_u16)


class ResidualMatrix:
    """One Linear group's planes, checked and flattened once: a request then costs one kernel call.

    ``planes`` is (a tile slice of) the layout of ``splitspec.quantize.packing``, ``rows`` its real
    rows, which must fall in the last tile, so padded rows are never written, and ``d_in`` its real
    columns (the 6/7-bit plane pads them to whole steps; 8-bit planes hold it, so it may be left out).
    The arrays are viewed, never copied: the shard's first-touched memory is what the kernel streams.
    The product runs on up to numba's thread count at construction (``numba.set_num_threads``; asking
    again costs ~2 µs a call).
    """

    def __init__(self, planes: dict[str, np.ndarray], bits: int, rows: int, d_in: int | None = None) -> None:
        _, self.d_in = check_planes(planes, bits, rows, d_in=d_in)
        self._args = _kernel_args(planes, bits)
        self.bits, self.rows = bits, rows
        self.nbytes: int = sum(planes[p].nbytes for p in (*PLANES[bits], "scale"))
        self.threads = numba.get_num_threads()

    def matmul(self, x: np.ndarray, out: np.ndarray, activations: str = CpuActorConfig.activations) -> None:
        """Write ``dequant(Q) · xᵀ`` into ``out`` [n, rows] (float32, in place) for ``x`` [n, d_in].

        ``activations``: "int16" / "int8" multiply ``round_activations(x, levels)`` in integers (see
        ``quantize/activations.py``), "fp32" multiplies x as it is.
        """
        _check_out(out, self.rows)
        check_activations(activations)
        want = (out.shape[0], self.d_in)
        if x.shape != want:
            raise ValueError(f"x must be [n, d_in] = {want} for these planes and out, got {x.shape}")
        if out.shape[0]:
            x = np.ascontiguousarray(x, dtype=np.float32)
            if not x.flags.writeable:  # numba would compile the kernel anew (~30 s) for a read-only array
                x = x.copy()
            # the serial kernel's loops run up to 1.4× slower than the parallel one's outlined body (8-bit, 1
            # token, in L3, even on 1 thread), so it only takes work too small to pay a parallel region's start
            parallel = self.rows * self.d_in * out.shape[0] >= 2 * _MIN_WORK_PER_THREAD
            self._run(_residual_kernel if parallel else _serial_kernel, x, LEVELS.get(activations, 0), out)

    def _run(self, kernel: Callable, x: np.ndarray, levels: int, out: np.ndarray) -> None:
        kernel(self.bits, self.d_in, *self._args, x, levels, self.threads, out)


def _check_out(out: np.ndarray, rows: int | None = None) -> None:
    if out.ndim != 2 or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous float32 [n, rows] array, got {out.shape}")
    if rows is not None and out.shape[1] != rows:
        raise ValueError(f"out must have {rows} columns (the planes' rows), got {out.shape}")


def residual_matmul(
    planes: dict[str, np.ndarray],
    bits: int,
    x: np.ndarray,
    out: np.ndarray,
    activations: str = CpuActorConfig.activations,
) -> None:
    """``ResidualMatrix(planes, bits, rows, d_in).matmul(x, out, activations)`` with ``rows`` and ``d_in``
    taken from ``out`` and ``x``, for one product; a server builds its matrices once."""
    _check_out(out)
    d_in = x.shape[1] if np.ndim(x) == 2 else None
    ResidualMatrix(planes, bits, out.shape[1], d_in).matmul(x, out, activations)


def warmup() -> float:
    """Compile (or load from the cache) both kernels (parallel and serial) now; return the seconds it took.

    One specialisation of each serves all layouts, token counts and activation modes, as long as the planes
    are writeable arrays (read-only ones, e.g. a read-only memmap, get a second specialisation on first use).
    """
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    for bits in PLANES:
        q = rng.integers(-31, 32, (17, 130)).astype(np.int8)
        matrix = ResidualMatrix(pack_residual(q, np.ones((17, 2), np.float16), bits), bits, 17, 130)
        for levels in (*LEVELS.values(), 0):
            for kernel in (_residual_kernel, _serial_kernel):
                matrix._run(kernel, np.ones((5, 130), np.float32), levels, np.empty((5, 17), np.float32))
    return time.perf_counter() - start
