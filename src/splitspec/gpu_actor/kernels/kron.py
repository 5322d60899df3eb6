"""``Rotation``'s product on the CPU: the two Kronecker factors applied with their sums held in registers
(explicit vectors), where torch's small matmuls and the views around them cost far more in their calls
than in their arithmetic (a decode step makes ~270 of these), and, at a prompt's hundreds of rows, still
more than this loop does (benchmarks/README.md).

Each row is a run of tiles of a·b elements (a = 1 for a one-factor plan); a tile X [a, b] becomes
F1 · (X ⊙ S_in) · F2ᵀ, and S_out multiplies the result. F2 is Sylvester's H_b (b in ``WIDTHS``, powers of
two, which no Paley order is), applied by butterflies (``butterflies``: log2(b) adds an element instead of
b multiply-adds), its 1/√b folded into F1: the wider F2, the narrower F1 and the fewer multiply-adds an
element (1536 = 12·128 takes 12, not the 24 of H_12 ⊗ H_2 before a 64-wide F2), and a Paley II F1 takes half
its width by its conference matrix (``_paley_pairs``: 576 = 36·16 takes 18). F1's product is a sum of rows
scaled by scalars (``axpy_rows``), so every output element takes its own sum: no reduction across lanes.
The result is the matmuls' up to the rounding of fp32 additions.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.kernels.cpu_base.perm import WIDE
from splitspec.kernels.ir import F32, F32_PTR, I32, c64, data, literals, splat

WIDTHS = (8, 16, 32, 64, 128)  # the last factor's sizes this form takes (a multiple of 8 lanes, up to 8 registers
# of 16 on AVX-512; a host without it spills some of 128's butterflies, and takes its F1 in halves of 64)

# rows ``axpy`` takes a call where they last, by width 16, 32 and 64: on AVX-512, 8 to 16 of its 32 registers
# of sums (the fastest measured on one core); elsewhere 8 of 16 registers, 8 lanes each, as for width 8
_WIDE_ROWS_16, _WIDE_ROWS_32, _WIDE_ROWS_64 = (8, 4, 4) if WIDE else (4, 2, 1)
ONE = np.float32(1.0)


@intrinsic
def axpy_rows(typingctx, out, out_at, coef, coef_at, coef_stride, src, src_at, src_stride, count, width, rows):
    """out[out_at + width·r + j] = Σ_{k < count} coef[coef_at + coef_stride·r + k] · src[src_at + src_stride·k
    + j] for j < ``width`` and r < ``rows`` (literals; width a multiple of 8): rows·width sums in registers
    while k runs, so that each sum's chain of fused multiply-adds has others to overlap with; 16-lane
    vectors where the width allows (two 8-lane ones on a host without AVX-512, the same sums either way)."""
    if not literals(width, rows):
        return None
    sig = types.void(out, out_at, coef, coef_at, coef_stride, src, src_at, src_stride, count, width, rows)

    def codegen(context, builder, sig, args):
        out_v, out_at_v, coef_v, coef_at_v, stride_v, src_v, src_at_v, src_stride_v, count_v = args[:9]
        size = 16 if width.literal_value % 16 == 0 else 8
        lanes, nr = width.literal_value // size, rows.literal_value
        f8 = ir.VectorType(F32, size)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f8, [f8, f8, f8]), f"llvm.fma.v{size}f32")
        coefs = data(context, builder, sig.args[2], coef_v)
        src_data = data(context, builder, sig.args[5], src_v)
        zero = ir.Constant(f8, [0.0] * size)
        sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(lanes)] for _ in range(nr)]
        firsts = [builder.add(coef_at_v, builder.mul(stride_v, c64(r))) for r in range(nr)]
        with cgutils.for_range(builder, count_v) as loop:
            row = builder.add(src_at_v, builder.mul(loop.index, src_stride_v))
            values = []
            for q in range(lanes):
                ptr = builder.gep(src_data, [builder.add(row, c64(size * q))])
                values.append(builder.load(builder.bitcast(ptr, f8.as_pointer()), align=4))
            for r in range(nr):
                c = splat(builder, builder.load(builder.gep(coefs, [builder.add(firsts[r], loop.index)])), size)
                for q in range(lanes):
                    builder.store(builder.call(fma, [c, values[q], builder.load(sums[r][q])]), sums[r][q])
        target = data(context, builder, sig.args[0], out_v)
        for r in range(nr):
            for q in range(lanes):
                ptr = builder.gep(target, [builder.add(out_at_v, c64(size * (lanes * r + q)))])
                builder.store(builder.load(sums[r][q]), builder.bitcast(ptr, f8.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def butterflies(typingctx, out, out_at, src, src_at, count, width):
    """out[out_at + width·k + i] = Σ_j (-1)^popcount(i & j) · src[src_at + width·k + j] for k < ``count``
    and i, j < ``width`` (a literal in ``WIDTHS``): the unnormalised Sylvester transform of each row, in
    registers, by radix-2 butterflies; across registers a sum and a difference, within one a shuffle that
    swaps the partners and a multiply-add with a vector of ±1."""
    if not literals(width):
        return None
    sig = types.void(out, out_at, src, src_at, count, width)

    def codegen(context, builder, sig, args):
        b = width.literal_value
        size = min(b, 16 if WIDE else 8)
        vf = ir.VectorType(F32, size)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{size}f32")
        out_d, src_d = data(context, builder, sig.args[0], args[0]), data(context, builder, sig.args[2], args[2])

        def at(base, first, k, q):
            index = builder.add(first, builder.add(builder.mul(k, c64(b)), c64(size * q)))
            return builder.bitcast(builder.gep(base, [index]), vf.as_pointer())

        with cgutils.for_range(builder, args[4]) as loop:
            v = [builder.load(at(src_d, args[3], loop.index, q), align=4) for q in range(b // size)]
            step = 1
            while step < b:
                if step < size:  # partners in one register
                    swap = ir.Constant(ir.VectorType(I32, size), [i ^ step for i in range(size)])
                    sign = ir.Constant(vf, [-1.0 if i & step else 1.0 for i in range(size)])
                    v = [builder.call(fma, [sign, r, builder.shuffle_vector(r, r, swap)]) for r in v]
                else:  # partners in two registers
                    apart, w = step // size, list(v)
                    for q in range(len(v)):
                        if not q & apart:
                            w[q], w[q + apart] = builder.fadd(v[q], v[q + apart]), builder.fsub(v[q], v[q + apart])
                    v = w
                step *= 2
            for q, r in enumerate(v):
                builder.store(r, at(out_d, args[1], loop.index, q), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lane_rows(typingctx, out, out_at, a, a_at, b, b_at, alpha, count, scaled):
    """out[out_at + m] = a[a_at + m] · b[b_at + m], or with ``scaled`` (a literal) a[a_at + m] + alpha ·
    b[b_at + m], for m < ``count`` (a multiple of 8), 8 lanes at a time: the signs' products and a Paley II
    factor's pairs of rows, which LLVM left scalar in loops over raw addresses (the signs' had cost as much
    as a 1536-wide rotation's factors)."""
    if not literals(scaled):
        return None
    sig = types.void(out, out_at, a, a_at, b, b_at, alpha, count, scaled)

    def codegen(context, builder, sig, args):
        f8 = ir.VectorType(F32, 8)
        out_d, a_d, b_d = (data(context, builder, sig.args[i], args[i]) for i in (0, 2, 4))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f8, [f8, f8, f8]), "llvm.fma.v8f32")
        alpha_v = splat(builder, args[6])

        def at(base, index, offset):
            ptr = builder.gep(base, [builder.add(index, offset)])
            return builder.bitcast(ptr, f8.as_pointer())

        with cgutils.for_range(builder, builder.sdiv(args[7], c64(8))) as loop:
            m = builder.mul(loop.index, c64(8))
            a_v, b_v = builder.load(at(a_d, args[3], m), align=4), builder.load(at(b_d, args[5], m), align=4)
            value = builder.call(fma, [alpha_v, b_v, a_v]) if scaled.literal_value else builder.fmul(a_v, b_v)
            builder.store(value, at(out_d, args[1], m), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", cache=True)
def axpy(out, out_at, coef, coef_at, coef_stride, src, src_at, src_stride, count, width, rows):
    """``rows`` output rows by ``axpy_rows`` for a run-time ``width`` in ``WIDTHS``, as a literal: as many at
    a time as ``_WIDE_ROWS_*`` while they last, then 64 sums at a time (``takes`` checks that those divide
    ``rows``); a 128-wide row as two of 64 where 16 registers hold 64 sums."""
    r = 0
    while r < rows:
        at, first = out_at + r * width, coef_at + r * coef_stride
        if width == 128 and WIDE and rows - r >= 2:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 128, 2)
            r += 2
        elif width == 128 and WIDE:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 128, 1)
            r += 1
        elif width == 128:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 64, 1)
            axpy_rows(out, at + 64, coef, first, coef_stride, src, src_at + 64, src_stride, count, 64, 1)
            r += 1
        elif width == 8:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 8, 8)
            r += 8
        elif width == 16 and rows - r >= _WIDE_ROWS_16:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 16, _WIDE_ROWS_16)
            r += _WIDE_ROWS_16
        elif width == 16:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 16, 4)
            r += 4
        elif width == 32 and rows - r >= _WIDE_ROWS_32:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 32, _WIDE_ROWS_32)
            r += _WIDE_ROWS_32
        elif width == 32:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 32, 2)
            r += 2
        elif rows - r >= _WIDE_ROWS_64:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 64, _WIDE_ROWS_64)
            r += _WIDE_ROWS_64
        else:
            axpy_rows(out, at, coef, first, coef_stride, src, src_at, src_stride, count, 64, 1)
            r += 1


def takes(a: int, b: int) -> bool:
    """Whether ``kron_rows`` takes factors of sizes a (1 for a one-factor plan) and b (a Sylvester factor,
    every plan's last whose size is a power of two)."""
    return b in WIDTHS and a % max(1, 64 // b) == 0


@njit(inline="always", cache=True)
def sylvester(z, x, at, a, b):
    """z = X · √b·H_b for the tile X [a, b] from x[at], by ``butterflies`` for a run-time ``b`` in
    ``WIDTHS``, as a literal."""
    if b == 8:
        butterflies(z, 0, x, at, a, 8)
    elif b == 16:
        butterflies(z, 0, x, at, a, 16)
    elif b == 32:
        butterflies(z, 0, x, at, a, 32)
    elif b == 64:
        butterflies(z, 0, x, at, a, 64)
    else:
        butterflies(z, 0, x, at, a, 128)


@njit(inline="always", cache=True)
def _paley_pairs(y, out, c, w, v, m, b):
    """y[out:] = H_p·Z/√(p·b) for a Paley II H_p = C ⊗ A + I ⊗ B (p = 2m, C [m, m] the symmetric conference
    matrix, A = [[1, 1], [1, -1]], B = [[1, -1], [-1, -1]] = J·A with J = [[0, 1], [-1, 0]]), ``c`` = C/√(p·b)
    and ``w`` = (I ⊗ A)·Z as [m, 2b] (each pair of Z's rows, its sum beside its difference: what the
    butterflies of width 2b give on that view): y's rows 2i and 2i + 1 are C·W's row i halves plus W[i]'s
    other half, so C's m multiply-adds an element replace H_p's 2m."""
    scale = np.float32(1.0 / math.sqrt(2 * m * b))
    axpy(v, 0, c, 0, m, w, 0, 2 * b, m, 2 * b, m)
    for i in range(0, 2 * b * m, 2 * b):
        lane_rows(y, out + i, v, i, w, i + b, scale, b, True)
        lane_rows(y, out + i + b, v, i + b, w, i, -scale, b, True)


@njit(cache=True)
def kron_rows(x_at, x_stride, rows, row_len, f1_at, a, b, s_in_at, s_out_at, s_len, pairs, y_at, y_stride):
    """y's rows (``row_len`` floats each, ``y_stride`` apart) = the transform of x's rows (``x_stride``
    apart), all fp32 by address: F1 [a, a] with F2's 1/√b in it, F2 = H_b (symmetric) by butterflies; the
    signs [s_len] (a multiple of a·b that divides ``row_len``) multiply the input (``s_in_at``) and the
    output (``s_out_at``) where their address is not 0. With ``pairs``, F1 is a Paley II factor given by its
    conference matrix [a/2, a/2] (``_paley_pairs``). Strided rows let a pass rotate one Linear's columns of
    all its tokens in one call."""
    if rows == 0:
        return
    m = a // 2 if pairs else a
    x = numba.carray(F32_PTR(x_at), (rows - 1) * x_stride + row_len)
    y = numba.carray(F32_PTR(y_at), (rows - 1) * y_stride + row_len)
    f1 = numba.carray(F32_PTR(f1_at), m * m)
    s_in = numba.carray(F32_PTR(s_in_at if s_in_at else f1_at), s_len if s_in_at else 1)
    s_out = numba.carray(F32_PTR(s_out_at if s_out_at else f1_at), s_len if s_out_at else 1)
    tile = a * b
    scratch = np.empty(3 * tile, np.float32)  # one allocation, not three: a decode step makes ~270 calls
    z, signed, v = scratch[:tile], scratch[tile : 2 * tile], scratch[2 * tile :]  # of one row each
    width = 2 * b if pairs else b  # Z's rows, or W's for a Paley II factor (``_paley_pairs``)
    for r in range(rows):
        for base in range(0, row_len, tile):
            at, sign_at = r * x_stride + base, base % s_len
            if s_in_at:
                lane_rows(signed, 0, x, at, s_in, sign_at, ONE, tile, False)
                sylvester(z, signed, 0, tile // width, width)
            else:
                sylvester(z, x, at, tile // width, width)
            out = r * y_stride + base
            if pairs:
                _paley_pairs(y, out, f1, z, v, m, b)
            else:
                axpy(y, out, f1, 0, a, z, 0, b, a, b, a)
            if s_out_at:
                lane_rows(y, out, y, out, s_out, sign_at, ONE, tile, False)
