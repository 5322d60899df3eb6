"""Many tokens on AMX tiles: the base's signed sums as int8 tile products, where the CPU has them.

With symmetric levels a group's dot is ``c1·Σ s1·x + c2·Σ s0·x`` (``coefficients``), and the signs are ±1:
exact bytes. x is rounded per 128-column group to int16 codes as the CPU actors round it for the residual
(``round_activations``, ``INT16_MAX`` a side: the verifier's whole Linear then sees one rounding of x'), and
split into a signed high and an unsigned low byte (``prepare_digits``), so that each plane's sums over
64 columns are two int8 tile products, exact in int32: four per 64 columns with both planes. A group's
four 16 × 16 blocks of sums (plane × byte) are then scaled in fp32, ``(c1·S1 + c2·S0)·scale·x_scale``,
into the tokens' accumulators.

A row tile is a block of the few-token tables' layouts (``perm.block_codes``, ``block_scales``), whose
copies the product keeps anyway. Its signs are made once per group, from the laid-out codes to ±1 bytes
in the layout of a tile product's second operand (four columns of each row side by side), one bit shuffle
a tile row (``laid_signs``), and stay in L1 while every 16-token tile of activations passes them. They
are made a group ahead, into the other half of a double buffer: a tile load takes no store forwarding,
and loads of signs just written had waited for their stores. Where the activations outgrow L2, the
groups go in blocks (``ACTIVATION_BYTES``), each block through all the row tiles.

The result differs from the fp32 products of the other paths by x's rounding (about 2^-16 of a group's
largest |x'|, the residual's own), not only by the order of additions.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.kernels import amx
from splitspec.kernels.cpu_base.common import WORD_BYTES, WORDS, half
from splitspec.kernels.cpu_base.perm import laid_group
from splitspec.kernels.ir import (
    F32,
    F32_PTR,
    I8,
    I32,
    U8_PTR,
    U16_PTR,
    c64,
    call,
    data,
    element,
    load,
    loop,
    splat,
    store,
)
from splitspec.kernels.residual.tiled import ACTIVATION_BYTES, prepare_digits
from splitspec.kernels.tile_rows import load_rows, rows_mask
from splitspec.quantize.activations import INT16_MAX
from splitspec.quantize.format import CODE_WORD, GROUP

# from this many tokens a product multiplies on tiles where it may (``Product.tiled``): fewer, the tables win
# (``base_tiles.py``: for SmolLM2's shapes the tiles were faster from 8 tokens, for a ~31B model's even at 10
# and faster from 12)
TILE_TOKENS = 12

V16I32, V16F32 = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
TILE_BYTES = amx.ROWS * amx.BYTES
SIGN_BYTES = 4 * TILE_BYTES  # a group's signs: 2 planes × 2 halves of 64 columns
SUM_BYTES = 4 * TILE_BYTES  # a token tile's sums of a group: S1 high, S1 low, S0 high, S0 low

# tile registers: the four sums, an activation tile's two bytes, the two planes' signs of one half
_S1_HI, _S1_LO, _S0_HI, _S0_LO, _ACT_HI, _ACT_LO, _SIGNS1, _SIGNS0 = range(8)


# a tile row's 64 sign bits as bits of a laid-out register's qwords (``perm.block_codes``: lane m is row m's
# 32 columns of one code word, two rows a qword): byte j = 4m + i of tile row q is column 4q + i of row m, bit
# 32·(m % 2) + 4·(q % 8) + i of qword m // 2, so the indices depend on q % 8 alone
_BIT_INDICES = [
    ir.Constant(ir.VectorType(I8, 64), [32 * (j % 8 // 4) + 4 * c + j % 4 for j in range(64)]) for c in range(8)
]


@intrinsic
def laid_signs(typingctx, laid, at, words, signs):
    """``signs`` (4 KiB, a cache line aligned) = the ±1 bytes of a block's group of 16 rows from its laid-out
    codes (``perm.block_codes``: from byte ``at`` of ``laid``, register 2w + p plane p of code word w), for
    plane p and half h at (2p + h)·1 KiB, as a tile product's second operand wants them: 64-byte row q holds
    columns 4q .. 4q + 3 of row m at bytes 4m .. 4m + 3. One bit shuffle (vpshufbitqmb) gathers a row's 64
    bits from the register that holds them, and a blend turns them into bytes: no transpose. A short last
    group's ``words`` are fewer than 4; the rest, as rows past the matrix's (zero in the layout), read as bit
    0: their products meet zero activations or are never stored."""
    sig = types.void(laid, at, words, signs)

    def codegen(context, builder, sig, args):
        v64i8 = ir.VectorType(I8, 64)
        first = builder.gep(data(context, builder, sig.args[0], args[0]), [args[1]])
        signs_p = data(context, builder, sig.args[3], args[3])
        plus, minus = ir.Constant(v64i8, [1] * 64), ir.Constant(v64i8, [-1] * 64)
        mask_t = ir.VectorType(ir.IntType(1), 64)
        gather = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(mask_t, [v64i8, v64i8]), "llvm.x86.avx512.vpshufbitqmb.512"
        )

        def word(w: int, present: bool) -> None:
            half, q0 = w // 2, 8 * (w % 2)
            for plane in (0, 1):
                codes = load(builder, builder.gep(first, [c64(64 * (2 * w + plane))]), v64i8, 1) if present else None
                for c in range(8):
                    bits = builder.call(gather, [codes, _BIT_INDICES[c]]) if present else None
                    value = builder.select(bits, plus, minus) if present else minus
                    at = c64((2 * plane + half) * TILE_BYTES + (q0 + c) * amx.BYTES)
                    store(builder, value, builder.gep(signs_p, [at]), align=64)

        word(0, True)  # every group has its first word
        for w in range(1, WORDS):
            with builder.if_else(builder.icmp_signed(">", args[2], c64(w)), likely=True) as (present, absent):
                with present:
                    word(w, True)
                with absent:
                    word(w, False)
        return context.get_dummy_value()

    return sig, codegen


def _products(builder, hi_p, lo_p, stride, column, t, signs_p, slot) -> None:
    """Token tile t's four 16 × 16 blocks of sums with the group's signs, stored at ``slot``."""
    for s in (_S1_HI, _S1_LO, _S0_HI, _S0_LO):
        amx.zero(builder, s)
    at = builder.add(builder.mul(builder.mul(t, c64(amx.ROWS)), stride), column)
    for side in (0, 1):
        cols = builder.add(at, c64(side * amx.BYTES))
        amx.load(builder, _ACT_HI, builder.gep(hi_p, [cols]), stride)
        amx.load(builder, _ACT_LO, builder.gep(lo_p, [cols]), stride)
        amx.load(builder, _SIGNS1, builder.gep(signs_p, [c64((2 + side) * TILE_BYTES)]), c64(amx.BYTES))
        amx.load(builder, _SIGNS0, builder.gep(signs_p, [c64(side * TILE_BYTES)]), c64(amx.BYTES))
        amx.dot(builder, "ss", _S1_HI, _ACT_HI, _SIGNS1)
        amx.dot(builder, "ss", _S0_HI, _ACT_HI, _SIGNS0)
        amx.dot(builder, "us", _S1_LO, _ACT_LO, _SIGNS1)
        amx.dot(builder, "us", _S0_LO, _ACT_LO, _SIGNS0)
    for i, s in enumerate((_S1_HI, _S1_LO, _S0_HI, _S0_LO)):
        amx.store(builder, s, builder.gep(slot, [c64(i * TILE_BYTES)]))


def _scaled(builder, slot, t, n, coefs, xs_p, acc_p, first, out) -> None:
    """acc[16k + m] (+)= (c1·S1 + c2·S0)·xs[k] for token tile t's tokens k < n, its sums at ``slot``; with
    ``out`` = (last, y pointer, y's row stride, rows mask), the group's last: the sum goes to y instead."""
    c1, c2 = coefs
    last, y_p, stride, mask = out
    eight = ir.Constant(V16I32, [8] * 16)
    zero = ir.Constant(V16F32, [0.0] * 16)
    k0, k1 = amx.tile_tokens(builder, t, n)

    def token(k, _) -> list:
        at = builder.gep(slot, [builder.mul(builder.sub(k, k0), c64(amx.BYTES))])
        part = [load(builder, builder.gep(at, [c64(i * TILE_BYTES)]), V16I32, 64) for i in range(4)]
        s1, s0 = (builder.sitofp(builder.add(builder.shl(part[i], eight), part[i + 1]), V16F32) for i in (0, 2))
        value = call(builder, "llvm.fma.v16f32", V16F32, [s0, c2, builder.fmul(s1, c1)])
        acc_k = builder.gep(acc_p, [builder.mul(k, c64(amx.ROWS))])
        old = builder.select(first, zero, load(builder, acc_k, V16F32, 64))
        scale = splat(builder, builder.load(builder.gep(xs_p, [k])), 16)
        new = call(builder, "llvm.fma.v16f32", V16F32, [value, scale, old])
        with builder.if_else(last) as (to_y, to_acc):
            with to_y:
                y_k = builder.bitcast(builder.gep(y_p, [builder.mul(k, stride)]), V16F32.as_pointer())
                call(builder, "llvm.masked.store.v16f32.p0", ir.VoidType(), [new, y_k, ir.Constant(I32, 4), mask])
            with to_acc:
                store(builder, new, acc_k, align=64)
        return []

    loop(builder, k0, k1, 1, [], token)


@intrinsic
def group_tiles(typingctx, digits, plane, stride, column, signs, sums, coef, xs, xs_at, acc, first, y, where):
    """acc[16k + m] (+)= (c1·S1 + c2·S0)·xs[xs_at + k] for tokens k < n and the tile's rows m: S1, S0 the
    group's exact int32 sums 256·high + low of the activations (``digits``: the high bytes, then the low
    ``plane`` bytes on; token k's column c at k·stride + c, this group's from ``column``) times the signs
    (``unpack_signs``); c1, c2 the rows' coefficients times their scales (``coef`` [32]: c1 for the 16 rows,
    then c2); ``first`` stores instead of adding; for n = y's tokens. ``where`` = (r0, count, last): the
    row tile's first row and rows, and whether this is its last group, whose sums go to y[k, r0 + m] (rows
    m < count) instead of acc. ``sums``: 8 KiB, two token tiles' blocks of sums, so that one tile's scaling
    overlaps the next one's products. The caller configures the tiles (``amx.begin``)."""
    sig = types.void(digits, plane, stride, column, signs, sums, coef, xs, xs_at, acc, first, y, where)

    def codegen(context, builder, sig, args):
        if not amx.compiles():
            return context.get_dummy_value()
        hi_p = data(context, builder, sig.args[0], args[0])
        plane_v, stride_v, column_v = args[1:4]
        lo_p = builder.gep(hi_p, [plane_v])
        signs_p, sums_p, coef_p = (data(context, builder, sig.args[i], args[i]) for i in (4, 5, 6))
        coefs = [load(builder, builder.gep(coef_p, [c64(o)]), V16F32, 4) for o in (0, 16)]
        xs_p = element(context, builder, sig.args[7], args[7], args[8])
        acc_p, first = data(context, builder, sig.args[9], args[9]), args[10]
        y_array = context.make_array(sig.args[11])(context, builder, args[11])
        n, y_stride = (builder.extract_value(y_array.shape, i) for i in (0, 1))
        r0, count, last = (builder.extract_value(args[12], i) for i in range(3))
        out = (last, builder.gep(y_array.data, [r0]), y_stride, rows_mask(builder, count))
        tiles = builder.udiv(builder.add(n, c64(amx.ROWS - 1)), c64(amx.ROWS))

        def slot(t):
            return builder.gep(sums_p, [builder.mul(builder.and_(t, c64(1)), c64(SUM_BYTES))])

        def tile(t, _) -> list:
            _products(builder, hi_p, lo_p, stride_v, column_v, t, signs_p, slot(t))
            with builder.if_then(builder.icmp_unsigned(">", t, c64(0))):
                before = builder.sub(t, c64(1))
                _scaled(builder, slot(before), before, n, coefs, xs_p, acc_p, first, out)
            return []

        loop(builder, c64(0), tiles, 1, [], tile)
        final = builder.sub(tiles, c64(1))
        _scaled(builder, slot(final), final, n, coefs, xs_p, acc_p, first, out)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", cache=True)
def _group_signs(laid, blocked, c1, c2, t, g, words, blocks, signs, coef):
    """Row tile t's signs (``laid_signs``) and coefficients (c1 then c2 times the rows' scales) of group g,
    from the few-token tables' layouts (``perm.block_codes``, ``block_scales`` in ``tile_order``)."""
    at, si = laid_group(t, g, words, blocks)
    for m in range(amx.ROWS):  # zero past the last row
        s = half(blocked[si + m])
        coef[m], coef[amx.ROWS + m] = c1 * s, c2 * s
    laid_signs(laid, at, min(WORDS, words - g * WORDS), signs)


@njit(cache=True)
def _row_tiles(laid, blocked, c1, c2, digits, xs, d_in, chunk, chunks, y):
    """y[:, tiles of chunk ``chunk`` of ``chunks``] from the rounded activations (``digits``, ``xs``), the
    codes and scales laid out for the few-token tables (``perm.block_codes``, ``block_scales`` in
    ``tile_order``): a row tile is one of their blocks, and their order is ``rows._rows_few``'s."""
    n, rows = y.shape
    words = d_in // CODE_WORD
    groups = (d_in + GROUP - 1) // GROUP
    blocks = (rows + amx.ROWS - 1) // amx.ROWS
    token_tiles = (n + amx.ROWS - 1) // amx.ROWS
    plane, stride = digits.size // 2, groups * GROUP
    block = max(1, ACTIVATION_BYTES // (token_tiles * amx.ROWS * GROUP * 2))
    signs = amx.zeros(2 * SIGN_BYTES, np.uint8)  # two groups' signs and coefficients, the next one made ahead
    sums = amx.zeros(2 * SUM_BYTES, np.uint8)
    acc = amx.zeros(token_tiles * amx.ROWS * amx.ROWS, np.float32)
    coef = np.zeros(4 * amx.ROWS, np.float32)
    amx.begin(amx.CONFIG)
    for g0 in range(0, groups, block):
        for t in range(chunk * blocks // chunks, (chunk + 1) * blocks // chunks):
            r0 = t * amx.ROWS
            count = min(amx.ROWS, rows - r0)
            if g0 > 0:
                load_rows(acc, y, r0, count)
            end = min(groups, g0 + block)
            _group_signs(laid, blocked, c1, c2, t, g0, words, blocks, signs[:SIGN_BYTES], coef[: 2 * amx.ROWS])
            for g in range(g0, end):
                k = (g - g0) % 2
                if g + 1 < end:  # the next group's, a group ahead: the tile loads never wait for their stores
                    nxt_signs, nxt_coef = signs[(1 - k) * SIGN_BYTES :], coef[(1 - k) * 2 * amx.ROWS :]
                    _group_signs(laid, blocked, c1, c2, t, g + 1, words, blocks, nxt_signs, nxt_coef)
                where = (r0, count, g + 1 == end)
                mine = signs[k * SIGN_BYTES :], coef[k * 2 * amx.ROWS :]
                group_tiles(digits, plane, stride, g * GROUP, mine[0], sums, mine[1], xs, g * n, acc, g == 0, y, where)
    amx.end()


@njit(parallel=True, cache=True)
def tiled_product(laid_at, blocked_at, c1, c2, x_at, y_at, n, rows, words, threads):
    """y [n, rows] = x · dequant(Q_base)ᵀ on tiles for symmetric levels (c1, c2 from ``coefficients``): the
    codes laid out by ``perm.block_codes`` and their fp16 scales by ``block_scales`` in ``tile_order``, x
    [n, 32·words] fp32, y [n, rows] fp32, all C-contiguous, given by address. Up to ``threads`` threads take
    contiguous ranges of row tiles."""
    d_in = words * CODE_WORD
    groups = (d_in + GROUP - 1) // GROUP
    blocks = (rows + amx.ROWS - 1) // amx.ROWS
    laid = numba.carray(U8_PTR(laid_at), blocks * amx.ROWS * words * WORD_BYTES + 64)  # and a zero register
    blocked = numba.carray(U16_PTR(blocked_at), blocks * amx.ROWS * groups)
    x = numba.carray(F32_PTR(x_at), (n, d_in))
    y = numba.carray(F32_PTR(y_at), (n, rows))
    digits, xs, _ = prepare_digits(x, INT16_MAX, 0)  # the signs are signed: no offset sums
    chunks = max(1, min(threads, (rows + amx.ROWS - 1) // amx.ROWS))
    for chunk in prange(chunks):
        _row_tiles(laid, blocked, c1, c2, digits, xs, d_in, chunk, chunks, y)
