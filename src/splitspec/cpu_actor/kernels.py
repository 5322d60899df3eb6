"""Numba kernels for the residual product ``Y[n, rows] = dequant(Q[rows, :]) · X[n, :]ᵀ``.

One pass over the weights serves all ``n`` tree tokens, because a verify pass is bound by how fast
the residual streams from RAM; reading it once per token would multiply that cost by ``n``.

A shard makes one ``ResidualMatrix`` per group at load (planes checked and flattened once), and a
request is then a single call into numba that also rounds x: a small model's group streams in tens of
microseconds, and checking, rounding and switching thread counts from Python per call had cost about as
much (SmolLM2-135M passes took 1.5-1.6× as long).

Threads split the row tiles; a thread walks its tiles' 128-column groups in memory order. Per
(tile, group), the codes come out of the three ``words`` planes (packing.py, one layout for 6, 7 and 8
bits) as int16 vectors, each rows 8h .. 8h + 7 of one column pair with the pair's two columns side by
side, one 16-bit shift and/or mask each (``_step_codes``). Three ways to multiply (``activations``):

- "int16" (the default): x' is rounded to int16 per (token, group) (``quantize/activations.py``); one
  vpmaddwd multiplies a code vector by a broadcast of its pair's two activations, giving 8 rows' sums in
  int32, exactly (``_pair_products``), 2 ymm of sums per token in registers. The codes stay unsigned; their
  offset comes off once per group. One loop nest walks a tile's whole row of groups (a call per group cost
  more than the group's products at n = 1). Up to ``_STREAMED_TOKENS`` tokens, the codes never leave
  registers; with more (``_many_dot``), each group's codes are unpacked once into a buffer that blocks of
  ``_TB`` tokens and one smaller tail block read.
- "int8": the same with x' rounded to int8, which the same loop sums to the same exact result.
- "fp32": the group's codes are unpacked once to int8 (``_unpack``), then converted to fp32 in registers
  (vpmovsxbd + vcvtdq2ps) and FMA'd (``_fp32_products``) by blocks of at most ``_TB`` tokens; blocks of 1-3 tokens
  spread columns over 2-4 sets of partial sums so that FMA latency does not bound the loop. The integer
  modes need no conversion per weight and half the multiplies.

Partial sums are multiplied by the group's scales once per group and added to the tile's fp32
accumulators, as the reference does up to rounding.

The loops that touch the weights are LLVM IR with explicit vectors (numba intrinsics) rather than
numba code left to LLVM's auto-vectorizers, which gave these loops scalar per-group epilogues, register
spills and no prefetching. The loops that read the planes from RAM prefetch them ``_PF_COLS`` columns
ahead: a core has only so many cache misses in flight, and without the prefetches it alternated between
waiting for memory and computing (a pass took about the sum of its memory time and its in-cache compute
time).

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
# Largest token block: 6 tokens × 2 ymm = 12 accumulators, plus a column (pair)'s 2 code vectors and a
# broadcast activation, fit the 16 ymm registers of AVX2.
_TB = 6
# Up to this many tokens, integer passes unpack the codes in registers as they stream them (_pair_products, one
# block); more unpack each group once into a buffer that every block of tokens reads (_many_dot; unpacking
# again per block would cost 1-3 ops per 16 codes per block, against one load).
_STREAMED_TOKENS = 5
# Partial-sum sets per fp32 block size: at least 8 independent FMA chains (2 FMA pipes × 4 cycles).
_SETS = {1: 4, 2: 2, 3: 2}
# Columns per iteration of the fp32 column loop (a multiple of the sets): fewer loop instructions
# per column for the small blocks, whose loops are short (measured ~5% at n = 1, 2).
_UNROLL = {1: 8, 2: 4, 3: 2}
# How far ahead the streaming loops prefetch, in tile columns: at ~12 GB/s per core that is ~0.7 µs of
# 8-bit codes, several memory latencies (measured at n = 1: 4-8 KiB read ~10% faster than 2 KiB; 16 KiB
# was no better; 256-1024 columns of 6-bit words no different).
_PF_COLS = 512
_PF_SCALE = _PF_COLS // GROUP * TILE  # the same distance in the scale plane, in uint16
_HALF = 8 * GROUP  # bytes of one half (rows 0-7 or 8-15) of a group's unpacked int8 codes
# a group's unpacked codes: int16 for integer activations (the larger), int8 [2, _HALF] for fp32 ones; a
# module constant because _stack needs a literal
_CODES_BYTES = TILE * GROUP * 2
# uint64 constants: numba types mixed uint64/int64 arithmetic as float64
_U0, _U1, _U2, _U3, _U4, _U5 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 5))
_UT, _UG, _UTB = np.uint64(TILE), np.uint64(GROUP), np.uint64(_TB)


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


def _word_planes(context, builder, types_: tuple, arrays: tuple, step0, bits: int) -> list:
    """Pointers to step ``step0``'s words in each ``words`` plane (``WORD_SPLIT[bits]`` words per step each)."""
    return [
        _element(context, builder, ty, a, builder.mul(step0, _c64(16 * k)))
        for ty, a, k in zip(types_, arrays, WORD_SPLIT[bits], strict=True)
    ]


def _operands(context, builder, sig, args, abase) -> tuple:
    """Pointers (x, scale, xs, xb, acc) to where a product loop starts reading and writing: the intrinsics
    share argument positions 6-14 (x, xbase, n, scale, sbase, xs, xb, xsbase, acc), so x is at xbase, scale
    at sbase, xs and xb at xsbase, and acc at ``abase``."""
    ty = sig.args
    x_p = _element(context, builder, ty[6], args[6], args[7])
    scale_p = _element(context, builder, ty[9], args[9], args[10])
    xs_p, xb_p = (_element(context, builder, ty[i], args[i], args[13]) for i in (11, 12))
    return x_p, scale_p, xs_p, xb_p, _element(context, builder, ty[14], args[14], abase)


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
    packing.py, uint16), an int16 vector whose lanes 2r and 2r + 1 are row 8·(j % 2) + r of the step's
    columns 2·(j // 2) and 2·(j // 2) + 1, as vpmaddwd wants them. Code j is bits b·j .. b·j + b - 1 of
    each lane's words: one 16-bit shift and/or mask, or, where it straddles two words, two shifts, a mask
    and an OR; no byte shuffles. Each word is loaded where first needed."""
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
def _block_dot(
    typingctx, w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, abase, bits, tb
):
    """acc[abase + 16k + r] += (products of a block of ``tb`` tokens, a literal, at most ``_TB``), by ``x``'s
    dtype: integer activations (int32 words of int16 pairs; a pass of one block) take ``_pair_products``, over
    a tile's row of groups, fp32 ones ``_fp32_products``, over one (tile, group). One intrinsic for both, so
    that one ladder of literal block sizes (``_tokens``) serves both. ``bits`` must be a literal for integer
    activations only: the fp32 loop does not depend on it, so it is compiled once for all widths."""
    integer = x.dtype == types.int32
    if not isinstance(tb, types.IntegerLiteral) or (integer and not isinstance(bits, types.IntegerLiteral)):
        return None
    sig = types.void(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, abase, bits, tb)

    def codegen(context, builder, sig, args):
        if integer:
            _pair_products(context, builder, sig, args, bits.literal_value, tb.literal_value)
        else:
            _fp32_products(context, builder, sig, args, tb.literal_value)
        return context.get_dummy_value()

    return sig, codegen


def _pair_products(context, builder, sig, args, b: int, block: int) -> None:
    """The integer products of ``_block_dot``, for one block of tokens (a pass of at most ``_STREAMED_TOKENS``):
    the codes of ``steps`` steps of the ``words`` planes w0-w2 from step ``step0`` (as many whole groups as
    that spans: a tile's whole row of them), streamed from RAM, prefetched and unpacked in registers
    (``_step_codes``) straight into the products (``_pair``). One loop nest with the scaling between
    groups, because leaving the loop after every group cost more than the group's own products at n = 1
    (8-bit in L2: 22 cycles a step against the loop's 8). ``b`` (bits) picks the step.
    """
    steps_v, n_v = args[4], args[8]
    planes = _word_planes(context, builder, sig.args[:3], args[:3], args[3], b)
    x_p, scale_p, xs_p, xb_p, acc_p = _operands(context, builder, sig, args, args[15])

    def step(s, sums) -> list:
        code = _step_codes(builder, _step_planes(builder, planes, s, b), b)
        for p in range(STEP[b] // 2):
            first = builder.add(builder.mul(s, _c64(STEP[b] // 2)), _c64(p))
            sums = _pair(builder, x_p, n_v, first, lambda h, p=p: code(2 * p + h), sums, block)
        return sums

    def group(g, first, end) -> None:
        _, sums = _loop(builder, first, end, 1, [_ZERO8I] * (2 * block), step)
        _scaled(builder, scale_p, xs_p, xb_p, acc_p, n_v, g, sums, block)

    _groups(builder, steps_v, b, scale_p, group)


def _groups(builder, steps, b: int, scale_p, body: Callable) -> None:
    """``body(g, first, end)`` for every group g of ``steps`` steps (steps first .. end - 1; a short last
    group ends early), each after a prefetch of its scales ``_PF_COLS`` columns ahead: they are a second,
    slow stream (1/64 of the bytes) that the hardware prefetcher may not follow."""
    per_group = GROUP // STEP[b]

    def group(g, _) -> list:
        _prefetch(builder, builder.gep(scale_p, [builder.add(builder.mul(g, _c64(TILE)), _c64(_PF_SCALE))]))
        first = builder.mul(g, _c64(per_group))
        end = builder.add(first, _c64(per_group))
        body(g, first, builder.select(builder.icmp_unsigned("<", end, steps), end, steps))
        return []

    _loop(builder, _c64(0), builder.udiv(builder.add(steps, _c64(per_group - 1)), _c64(per_group)), 1, [], group)


def _pair(builder, x_p, n_v, p, code: Callable, sums: list, block: int) -> list:
    """``sums`` plus column pair p's products (codes ``code(h)``, h = 0, 1: rows 8h .. 8h + 7 of the pair,
    its two columns side by side) with ``block`` tokens: each code vector meets a broadcast of token k's two
    int16 activations of the pair (the int32 ``x_p[p·n + k]``, ``_round_activations``) in one vpmaddwd,
    8 rows' sums, exact in int32, added to the token's sums of row half h (2 ymm per token). Each token's
    broadcast is used at once, so that only one is live."""
    codes = [code(h) for h in range(2)]
    x_pair = builder.gep(x_p, [builder.mul(p, n_v)])
    sums = list(sums)
    for k in range(block):
        xk = builder.bitcast(_broadcast(builder, builder.load(builder.gep(x_pair, [_c64(k)]))), _V16I16)
        for h in range(2):
            sums[2 * k + h] = _opaque(builder, builder.add(sums[2 * k + h], _madd(builder, codes[h], xk)))
    return sums


def _scaled(builder, scale_p, xs_p, xb_p, acc_p, n_v, g, sums: list, block: int) -> None:
    """Group g's integer sums of ``block`` tokens into acc (token k's rows at ``acc_p[16k ...]``): less the
    codes' offset (they stay unsigned, code + 2^(bits - 1); ``xb_p[g·n + k]`` is the offset times the token's
    codes' sum over the group), times the group's weight scales ``scale_p[16g ...]`` and the token's
    activation scale ``xs_p[g·n + k]``."""
    scale_g = builder.gep(scale_p, [builder.mul(g, _c64(TILE))])
    xs_g, xb_g = (builder.gep(p, [builder.mul(g, n_v)]) for p in (xs_p, xb_p))
    for h in range(2):
        wscale = _half_to_f32(builder, builder.gep(scale_g, [_c64(8 * h)]))
        for k in range(block):
            offset = _broadcast(builder, builder.load(builder.gep(xb_g, [_c64(k)])))
            _accumulate(builder, acc_p, k, h, builder.sub(sums[2 * k + h], offset), wscale, xs_g)


@intrinsic
def _many_dot(typingctx, w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, tail):
    """acc[16k + r] += the integer products of all ``n`` tokens (more than ``_STREAMED_TOKENS``) with ``steps``
    steps of the ``words`` planes w0-w2 from step ``step0`` (a tile's whole row of groups). Per group, the
    codes are unpacked once into the buffer ``codes`` (int16, ``_unpack_steps``), then every block of
    tokens reads them from L1: ``n // _TB`` blocks of ``_TB``, then one of ``tail`` (a literal, ``n % _TB``).
    One loop nest for the whole row, because a call per group cost ~200 cycles a group here (~10-25% of
    a group's products at n = 6-16). ``bits`` (a literal) picks the step."""
    if not all(isinstance(v, types.IntegerLiteral) for v in (bits, tail)):
        return None
    b, rest = bits.literal_value, tail.literal_value
    sig = types.void(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, tail)

    def codegen(context, builder, sig, args):
        steps_v, n_v = args[5], args[8]
        planes = _word_planes(context, builder, sig.args[:3], args[:3], args[4], b)
        buffer_p = builder.bitcast(args[3], _I16.as_pointer())
        x_p, scale_p, xs_p, xb_p, acc_p = _operands(context, builder, sig, args, _c64(0))

        def group(g, first, end) -> None:
            _unpack_steps(builder, planes, first, end, buffer_p, b)
            pair0 = builder.mul(first, _c64(STEP[b] // 2))
            pairs = builder.mul(builder.sub(end, first), _c64(STEP[b] // 2))

            def block(k0, size: int) -> None:
                x_k = builder.gep(x_p, [k0])

                def buffered(p, sums) -> list:
                    at = builder.gep(buffer_p, [builder.mul(p, _c64(2 * TILE))])

                    def code(h):
                        return _load(builder, builder.gep(at, [_c64(TILE * h)]), _V16I16, align=32)

                    return _pair(builder, x_k, n_v, builder.add(pair0, p), code, sums, size)

                _, sums = _loop(builder, _c64(0), pairs, 1, [_ZERO8I] * (2 * size), buffered)
                xs_k, xb_k = (builder.gep(p, [k0]) for p in (xs_p, xb_p))
                acc_k = builder.gep(acc_p, [builder.mul(k0, _c64(TILE))])
                _scaled(builder, scale_p, xs_k, xb_k, acc_k, n_v, g, sums, size)

            full = builder.udiv(n_v, _c64(_TB))
            _loop(builder, _c64(0), full, 1, [], lambda kb, _: block(builder.mul(kb, _c64(_TB)), _TB) or [])
            if rest:
                block(builder.mul(full, _c64(_TB)), rest)

        _groups(builder, steps_v, b, scale_p, group)
        return context.get_dummy_value()

    return sig, codegen


def _opaque(builder, value):
    """``value``, through an empty inline asm that LLVM cannot see into: a token's sums pass through it
    after every add, because LLVM otherwise reassociated a step's chain of adds into a tree, which kept all
    the step's products live at once and spilled them (7-bit, 2 tokens: 42 stack references per step, 5
    tokens: 108; with it none and 15)."""
    return builder.asm(ir.FunctionType(value.type, [value.type]), "", "=x,0", [value], False)


def _madd(builder, a, b):
    """vpmaddwd: int16 lanes multiplied, adjacent products added into int32 lanes (written as plain
    IR, which LLVM's x86 backend turns into the instruction, and other targets into their own; on a CPU
    with VNNI it folds the add that accumulates the result in too, as vpdpwssd)."""
    v16i32 = ir.VectorType(_I32, 16)
    prod = builder.mul(builder.sext(a, v16i32), builder.sext(b, v16i32))
    even, odd = (builder.shuffle_vector(prod, prod, ir.Constant(_V8I32, list(range(j, 16, 2)))) for j in range(2))
    return builder.add(even, odd)


def _accumulate(builder, acc_p, k: int, h: int, total, wscale, xs_p) -> None:
    """acc[16k + 8h ...] += total · weight scale: a group's sums of rows 8h..8h+7 for token k. With integer
    activations (``xs_p`` not None) total is int32, and the token's activation scale for the group
    folds into the weight scale here, once per group and token."""
    scale = wscale
    if xs_p is not None:
        total = builder.sitofp(total, _V8F)
        scale = builder.fmul(wscale, _broadcast(builder, builder.load(builder.gep(xs_p, [_c64(k)]))))
    p = builder.gep(acc_p, [_c64(TILE * k + 8 * h)])
    _store(builder, _fma(builder, total, scale, _load(builder, p, _V8F, align=4)), p, align=4)


def _unpack_steps(builder, planes: list, first, end, out_p, b: int, wide: bool = True) -> None:
    """Store the codes of steps first .. end - 1 of the ``words`` planes at ``planes`` in the buffer ``out_p``
    (prefetching the planes ahead), for a loop that reads them again:

    - ``wide``: for ``_many_dot``, each ``_step_codes`` vector as it is (unsigned int16), code j of step
      first + s at int16 offset 16·(s·step + j);
    - otherwise, for ``_fp32_products``: signed int8 [2, _HALF], rows 0-7 of column c at [0, 8c], rows
      8-15 at [1, 8c]: a code vector (rows 8h .. 8h + 7 of a column pair, its two columns interleaved)
      gives its low bytes, de-interleaved, as the pair's 16 bytes at [h, 8·(first column)].

    A group's last step may run past its columns: the plane pads them with code 0."""
    v16i8 = ir.VectorType(_I8, 16)
    columns = ir.Constant(ir.VectorType(_I32, 16), [*range(0, 16, 2), *range(1, 16, 2)])
    offset = ir.Constant(_V16I16, [1 << (b - 1)] * 16)

    def step(s, _) -> list:
        code = _step_codes(builder, _step_planes(builder, planes, s, b), b)
        column0 = builder.mul(builder.sub(s, first), _c64(STEP[b]))
        for j in range(STEP[b]):
            if wide:
                dst = builder.gep(out_p, [builder.mul(builder.add(column0, _c64(j)), _c64(16))])
                _store(builder, code(j), dst, 32)
                continue
            signed = builder.trunc(builder.sub(code(j), offset), v16i8)
            column = builder.add(column0, _c64(2 * (j // 2)))
            dst = builder.gep(out_p, [builder.add(builder.mul(column, _c64(8)), _c64((j % 2) * _HALF))])
            _store(builder, builder.shuffle_vector(signed, signed, columns), dst, align=1)
        return []

    _loop(builder, first, end, 1, [], step)


@intrinsic
def _unpack(typingctx, w0, w1, w2, step0, steps, codes, bits):
    """Store the codes of ``steps`` steps of the ``words`` planes (w0-w2) from step ``step0`` in the buffer
    ``codes`` as ``_fp32_products`` reads them (``_unpack_steps``, int8). ``bits`` (a literal) picks the step."""
    if not isinstance(bits, types.IntegerLiteral):
        return None
    b = bits.literal_value
    sig = types.void(w0, w1, w2, step0, steps, codes, bits)

    def codegen(context, builder, sig, args):
        planes = _word_planes(context, builder, sig.args[:3], args[:3], args[3], b)
        _unpack_steps(builder, planes, _c64(0), args[4], builder.bitcast(args[5], _I8.as_pointer()), b, wide=False)
        return context.get_dummy_value()

    return sig, codegen


def _fp32_products(context, builder, sig, args, block: int) -> None:
    """The fp32 products of ``_block_dot``: ``cols`` columns of a group's codes that ``_unpack`` stored
    as int8 in the buffer ``w0`` (w1, w2, step0, steps, xs, xb, xsbase and bits unused), with ``x_k[c] =
    x[xbase + c·n + k]`` (transposed): int8 codes widened to fp32 in registers and FMA'd. The ``block × 2``
    ymm partial sums (times ``_SETS`` sets) stay in registers for the whole loop."""
    sets, unroll = _SETS.get(block, 1), _UNROLL.get(block, 1)
    cols_v, n_v = args[5], args[8]
    src_p = builder.bitcast(args[0], _I8.as_pointer())
    x_p, scale_p, _, _, acc_p = _operands(context, builder, sig, args, args[15])

    def fma_column(c, sums, slot: int) -> list:
        lo = builder.gep(src_p, [builder.mul(c, _c64(8))])
        w = [_int8_to_f32(builder, p) for p in (lo, builder.gep(lo, [_c64(_HALF)]))]
        x_row = builder.gep(x_p, [builder.mul(c, n_v)])
        sums = list(sums)
        for k in range(block):
            xk = _broadcast(builder, builder.load(builder.gep(x_row, [_c64(k)])))
            for h in range(2):
                i = 2 * (slot * block + k) + h
                sums[i] = _fma(builder, w[h], xk, sums[i])
        return sums

    def step(c, sums) -> list:
        for j in range(unroll):
            sums = fma_column(builder.add(c, _c64(j)), sums, j % sets)
        return sums

    c, sums = _loop(builder, _c64(0), cols_v, unroll, [_ZERO8] * (2 * block * sets), step)
    if unroll > 1:
        _, sums = _loop(builder, c, cols_v, 1, sums, lambda c, sums: fma_column(c, sums, 0))
    for h in range(2):
        wscale = _half_to_f32(builder, builder.gep(scale_p, [_c64(8 * h)]))
        for k in range(block):
            total = sums[2 * k + h]
            for s in range(1, sets):  # the sets took alternate columns
                total = builder.fadd(total, sums[2 * (s * block + k) + h])
            _accumulate(builder, acc_p, k, h, total, wscale, None)


# --- kernel --------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _block(blocks, b):
    """(first token, size) of token block ``b`` of ``blocks = (count, size, larger)``: the first ``larger``
    blocks have ``size + 1`` tokens, the rest ``size`` (the split is computed once per call, because
    divisions here cost ~10% at n = 1)."""
    _, small, larger = blocks
    return b * small + min(b, larger), small + _U1 if b < larger else small


@njit(inline="always", cache=True)
def _tokens(w0, w1, w2, step0, steps, cols, x, x0, n, blocks, scale, sbase, xs, xb, xsbase, acc, bits):
    """All ``n`` tokens' products with one (tile, group or span of groups), block by block (``_block_dot``);
    ``x0``: the group's first column of x (a column pair for integer activations). Inlined, so ``bits``
    stays the caller's literal."""
    for b in range(blocks[0]):
        k0, size = _block(blocks, b)
        xbase, xsk, abase = x0 * n + k0, xsbase + k0, k0 * _UT
        if size == _U1:
            _block_dot(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsk, acc, abase, bits, 1)
        elif size == _U2:
            _block_dot(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsk, acc, abase, bits, 2)
        elif size == _U3:
            _block_dot(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsk, acc, abase, bits, 3)
        elif size == _U4:
            _block_dot(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsk, acc, abase, bits, 4)
        elif size == _U5:
            _block_dot(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsk, acc, abase, bits, 5)
        else:
            _block_dot(w0, w1, w2, step0, steps, cols, x, xbase, n, scale, sbase, xs, xb, xsk, acc, abase, bits, 6)


@njit(inline="always", cache=True)
def _group(bits, w0, w1, w2, scale_u16, t, g, span, d, n, blocks, x, xs, xb, integer, codes, acc):
    """Tile t's products over groups g .. g + span - 1, accumulated into ``acc``; ``x`` as ``_prepare``
    made it. A span of several groups is for integer passes, whose loop nests walk them all."""
    n_groups = (d + _UG - _U1) // _UG
    c0 = g * _UG
    cols = min(span * _UG, d - c0)
    sbase = (t * n_groups + g) * _UT
    if not integer:
        # the scales are a second, slow stream (1/64 of the bytes) that the hardware prefetcher may not
        # follow; the planes are prefetched by the loops that read them, and the integer loop nests
        # prefetch their scales too (_groups)
        _prefetch_element(scale_u16, sbase + np.uint64(_PF_SCALE))
    # log2 of the columns per step: shifts, because a division by a value the compiler cannot see costs
    # tens of cycles, three times per (tile, group)
    shift = _U4 if bits == 7 else _U3
    steps = (cols + (_U1 << shift) - _U1) >> shift
    step0 = t * ((d + (_U1 << shift) - _U1) >> shift) + (c0 >> shift)
    # literal bits, so that each loop is specialised
    if bits == 8:
        _bits_group(
            w0, w1, w2, step0, steps, x, c0, n, blocks, cols, scale_u16, sbase, xs, xb, g * n, integer, codes, acc, 8
        )
    elif bits == 7:
        _bits_group(
            w0, w1, w2, step0, steps, x, c0, n, blocks, cols, scale_u16, sbase, xs, xb, g * n, integer, codes, acc, 7
        )
    else:
        _bits_group(
            w0, w1, w2, step0, steps, x, c0, n, blocks, cols, scale_u16, sbase, xs, xb, g * n, integer, codes, acc, 6
        )
    if not integer:  # outside the ladder: one fp32 loop serves every width
        _tokens(codes, w1, w2, _U0, steps, cols, x, c0, n, blocks, scale_u16, sbase, xs, xb, g * n, acc, bits)


@njit(inline="always", cache=True)
def _bits_group(
    w0, w1, w2, step0, steps, x, c0, n, blocks, cols, scale, sbase, xs, xb, xsbase, integer, codes, acc, bits
):
    """``_group``'s unpacking once ``bits`` is a literal (inlined, so it stays one), with the integer
    products. Up to ``_STREAMED_TOKENS`` integer tokens (one block) take the codes straight from the planes;
    more unpack them a group at a time into ``codes``, which each block reads from L1; fp32 activations only
    get them unpacked (``_group`` multiplies them)."""
    if not integer:
        _unpack(w0, w1, w2, step0, steps, codes, bits)
    elif n <= _STREAMED_TOKENS:
        _tokens(w0, w1, w2, step0, steps, cols, x, c0 >> _U1, n, blocks, scale, sbase, xs, xb, xsbase, acc, bits)
    else:
        _many(w0, w1, w2, codes, step0, steps, x, (c0 >> _U1) * n, n, scale, sbase, xs, xb, xsbase, acc, bits)


@njit(inline="always", cache=True)
def _many(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits):
    """``_many_dot`` with the size of its last block of tokens, ``n % _TB``, a literal."""
    tail = n % _UTB
    if tail == _U0:
        _many_dot(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 0)
    elif tail == _U1:
        _many_dot(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 1)
    elif tail == _U2:
        _many_dot(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 2)
    elif tail == _U3:
        _many_dot(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 3)
    elif tail == _U4:
        _many_dot(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 4)
    else:
        _many_dot(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, 5)


@njit(inline="always", cache=True)
def _product(bits, d_in, w0, w1, w2, scale_u16, x, levels, threads, out):
    """out[:, rows of tile t] = Σ_groups scale · (codes · x) for every tile: tile ranges in parallel in
    ``_residual_kernel``, on the calling thread in ``_serial_kernel``.

    The three words planes w0-w2 and scale (viewed as uint16) are flat. ``x`` is [n, d_in] fp32. With
    ``levels`` (> 0) it is rounded here to codes in [-levels, levels] (``_round_activations``), stored in
    int32 words of column pairs with their scales and offset sums; with levels = 0 (fp32) it is transposed.
    int8 and int16 codes take the same loop, which sums their integer products exactly. One call does it
    all, because a small group's product takes tens of microseconds and every call from Python adds several.

    Up to ``threads`` threads take contiguous ranges of tiles, fewer where ``_MIN_WORK_PER_THREAD``
    says another would save nothing (the caller passes numba's count: ``get_num_threads`` here would keep
    the function out of numba's on-disk cache). Index arithmetic is uint64 on purpose: numba adds a
    negative-index fix-up to every signed index.
    """
    n = np.uint64(out.shape[0])
    rows = out.shape[1]
    d = np.uint64(d_in)
    integer = levels > 0
    count = max((n + _UTB - _U1) // _UTB, _U1)  # token blocks of near-equal size
    blocks = (count, n // count, n % count)
    xq, xs, xb, xt = _prepare(bits, x, levels)
    chunks = np.uint64(max(1, min(threads, rows * d_in * out.shape[0] // _MIN_WORK_PER_THREAD)))
    # one branch per activation mode outside the loops, so that each mode's loop nest is its own
    if integer:
        _tiles(bits, w0, w1, w2, scale_u16, d, n, blocks, xq, xs, xb, True, chunks, out)
    else:
        _tiles(bits, w0, w1, w2, scale_u16, d, n, blocks, xt, xs, xb, False, chunks, out)


@njit(parallel=True, cache=True)
def _residual_kernel(bits, d_in, w0, w1, w2, scale_u16, x, levels, threads, out):
    """``_product`` with its tile ranges on numba's threads."""
    _product(bits, d_in, w0, w1, w2, scale_u16, x, levels, threads, out)


@njit(cache=True)
def _serial_kernel(bits, d_in, w0, w1, w2, scale_u16, x, levels, threads, out):
    """``_product`` on the calling thread (outside a parallel function, prange is range), for products too
    small for two threads: starting a parallel region costs 4-12 µs here, as much as a small group's whole
    product."""
    _product(bits, d_in, w0, w1, w2, scale_u16, x, levels, 1, out)


@njit(cache=True)
def _prepare(bits, x, levels):
    """x in the layout the loops read (``_residual_kernel``): (codes, scales, offset sums, transposed fp32).

    A function of its own, not inlined: in the parallel kernel, numba would make each of these
    allocations a parallel region, and starting one costs 4-12 µs here (a small group streams in ~20)."""
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
        _round_activations(x, xq, xs, xb, 2 ** (bits - 1), levels)
    else:
        for k in range(n):
            for c in range(d):
                xt[c * n + k] = x[k, c]
    return xq, xs, xb, xt


@njit(inline="always", cache=True)
def _tiles(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, integer, chunks, out):
    """Every tile's rows of ``out``, ``chunks`` contiguous ranges of tiles in parallel. A range is a call,
    not inlined, so that the parallel and the serial kernel share the compiled loops (inlined, each
    compiled them all again); one function per activation kind, so that ``integer`` stays a constant in
    each and only its own branches are compiled."""
    for chunk in prange(chunks):
        c = np.uint64(chunk)
        if integer:
            _integer_tiles(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, c, chunks, out)
        else:
            _fp32_tiles(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, c, chunks, out)


@njit(cache=True)
def _integer_tiles(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, chunk, chunks, out):
    _tile_range(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, True, chunk, chunks, out)


@njit(cache=True)
def _fp32_tiles(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, chunk, chunks, out):
    _tile_range(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, False, chunk, chunks, out)


@njit(inline="always", cache=True)
def _tile_range(bits, w0, w1, w2, scale_u16, d, n, blocks, x, xs, xb, integer, chunk, chunks, out):
    """Range ``chunk`` of ``chunks`` contiguous ranges of tiles: their rows of ``out``."""
    rows = out.shape[1]
    n_groups = (d + _UG - _U1) // _UG
    n_tiles = np.uint64(scale_u16.size) // (n_groups * _UT)
    # integer passes walk all of a tile's groups in one loop nest (_pair_products, _many_dot)
    span = n_groups if integer else _U1
    codes = _stack(_CODES_BYTES)  # one group's unpacked codes
    acc = np.empty(out.shape[0] * TILE, np.float32)
    for t in range(chunk * n_tiles // chunks, (chunk + _U1) * n_tiles // chunks):
        acc[:] = 0
        for g in range(_U0, n_groups, span):
            _group(bits, w0, w1, w2, scale_u16, t, g, span, d, n, blocks, x, xs, xb, integer, codes, acc)
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
def _round_activations(x, xq, xs, xb, offset, levels):
    """``quantize.activations.round_activations(x, levels)`` in the kernel's layout, bit for bit: token k's
    codes of columns 2p and 2p + 1 in the int32 word xq[p·n + k] (it starts zeroed, which pads the last
    columns), its scale at xs[(c // 128)·n + k] (fp32), and ``offset`` × its codes' sum over the group at
    the same place in xb (int32; the share of unsigned codes' offset).

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
                words[(c0 // 2 + p) * n + k] = pairs[p]
            xs[(c0 // GROUP) * n + k] = scale
            xb[(c0 // GROUP) * n + k] = offset * total


def _kernel_args(planes: dict[str, np.ndarray], bits: int) -> tuple:
    """The planes as the flat arrays the kernel takes, without copying any of them."""
    stray = [name for name in (*PLANES[bits], "scale") if not planes[name].flags.c_contiguous]
    if stray:
        raise ValueError(f"planes {stray} are not C-contiguous (slice whole tiles with slice_tiles)")
    return (*(planes[name].reshape(-1) for name in PLANES[bits]), planes["scale"].view(np.uint16).reshape(-1))


class ResidualMatrix:
    """One Linear group's planes, checked and flattened once: a request then costs one kernel call.

    ``planes`` is (a tile slice of) the layout of ``splitspec.quantize.packing``, ``rows`` its real
    rows, which must fall in the last tile, so padded rows are never written, and ``d_in`` its real
    columns (the planes pad them to whole steps).
    The arrays are viewed, never copied: the shard's first-touched memory is what the kernel streams.
    The product runs on up to numba's thread count at construction (``numba.set_num_threads``; asking
    again costs ~2 µs a call).
    """

    def __init__(self, planes: dict[str, np.ndarray], bits: int, rows: int, d_in: int) -> None:
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
            # both kernels run the same compiled loops (_tiles); the serial one only saves a parallel region's
            # start, which pays for work too small for two threads
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
    if np.ndim(x) != 2:
        raise ValueError(f"x must be a 2-D [n, d_in] array, got shape {np.shape(x)}")
    ResidualMatrix(planes, bits, out.shape[1], np.shape(x)[1]).matmul(x, out, activations)


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
