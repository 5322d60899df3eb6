"""``Rotation``'s product on the CPU for up to ``MAX_ROWS`` rows: the two Kronecker factors applied with
their sums held in registers (explicit 8-lane vectors), where torch's small matmuls and the views around
them cost far more in their calls than in their arithmetic (a decode step makes ~270 of these).

Each row is a run of tiles of a·b elements (a = 1 for a one-factor plan); a tile X [a, b] becomes
F1 · (X ⊙ S_in) · F2ᵀ, and S_out multiplies the result. Both products are sums of rows scaled by scalars
(``axpy_rows``), so every output element takes its own sum: no reduction across lanes, and the result is
the matmuls' up to the order of fp32 additions.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.gpu_actor.kernels.cpu_base.perm import WIDE
from splitspec.kernels.ir import F32, F32_PTR, c64, data, literals, splat

MAX_ROWS = 64  # above this many rows, torch's matmuls (the measured crossover on one core, d = 576 … 1536)

WIDTHS = (8, 16, 32, 64)  # the last factor's sizes this form takes (a multiple of 8 lanes, up to 8 registers)

# rows ``axpy`` takes a call where they last, by width 16, 32 and 64: on AVX-512, 8 to 16 of its 32 registers
# of sums (the fastest measured on one core); elsewhere 8 of 16 registers, 8 lanes each, as for width 8
_WIDE_ROWS_16, _WIDE_ROWS_32, _WIDE_ROWS_64 = (8, 4, 4) if WIDE else (4, 2, 1)


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
def mul_rows(typingctx, out, out_at, a, a_at, b, b_at, count):
    """out[out_at + m] = a[a_at + m] · b[b_at + m] for m < ``count`` (a multiple of 8), 8 lanes at a time:
    the signs' products, which LLVM left scalar in a loop over raw addresses (they had cost as much as a
    1536-wide rotation's factors)."""
    sig = types.void(out, out_at, a, a_at, b, b_at, count)

    def codegen(context, builder, sig, args):
        f8 = ir.VectorType(F32, 8)
        out_d, a_d, b_d = (data(context, builder, sig.args[i], args[i]) for i in (0, 2, 4))

        def at(base, index, offset):
            ptr = builder.gep(base, [builder.add(index, offset)])
            return builder.bitcast(ptr, f8.as_pointer())

        with cgutils.for_range(builder, builder.sdiv(args[6], c64(8))) as loop:
            m = builder.mul(loop.index, c64(8))
            product = builder.fmul(
                builder.load(at(a_d, args[3], m), align=4), builder.load(at(b_d, args[5], m), align=4)
            )
            builder.store(product, at(out_d, args[1], m), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", cache=True)
def axpy(out, out_at, coef, coef_at, coef_stride, src, src_at, src_stride, count, width, rows):
    """``rows`` output rows by ``axpy_rows`` for a run-time ``width`` in ``WIDTHS``, as a literal: as many at
    a time as ``_WIDE_ROWS_*`` while they last, then 64 sums at a time (``takes`` checks that those divide
    ``rows``)."""
    r = 0
    while r < rows:
        at, first = out_at + r * width, coef_at + r * coef_stride
        if width == 8:
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
    """Whether ``kron_rows`` takes factors of sizes a (1 for a one-factor plan) and b."""
    return b in WIDTHS and a % (64 // b) == 0


@njit(cache=True)
def kron_rows(x_at, x_stride, rows, row_len, f1_at, a, f2t_at, b, s_in_at, s_out_at, s_len, y_at, y_stride):
    """y's rows (``row_len`` floats each, ``y_stride`` apart) = the transform of x's rows (``x_stride``
    apart), all fp32 by address: F1 [a, a], F2ᵀ [b, b]; the signs [s_len] (a multiple of a·b that divides
    ``row_len``) multiply the input (``s_in_at``) and the output (``s_out_at``) where their address is not
    0. Strided rows let a pass rotate one Linear's columns of all its tokens in one call."""
    if rows == 0:
        return
    x = numba.carray(F32_PTR(x_at), (rows - 1) * x_stride + row_len)
    y = numba.carray(F32_PTR(y_at), (rows - 1) * y_stride + row_len)
    f1 = numba.carray(F32_PTR(f1_at), a * a)
    f2t = numba.carray(F32_PTR(f2t_at), b * b)
    s_in = numba.carray(F32_PTR(s_in_at if s_in_at else f2t_at), s_len if s_in_at else 1)
    s_out = numba.carray(F32_PTR(s_out_at if s_out_at else f2t_at), s_len if s_out_at else 1)
    tile = a * b
    z = np.empty(tile, np.float32)
    signed = np.empty(tile, np.float32)
    for r in range(rows):
        for base in range(0, row_len, tile):
            at, sign_at = r * x_stride + base, base % s_len
            if s_in_at:
                mul_rows(signed, 0, x, at, s_in, sign_at, tile)
                axpy(z, 0, signed, 0, b, f2t, 0, b, b, b, a)
            else:
                axpy(z, 0, x, at, b, f2t, 0, b, b, b, a)
            out = r * y_stride + base
            axpy(y, out, f1, 0, a, z, 0, b, a, b, a)
            if s_out_at:
                mul_rows(y, out, y, out, s_out, sign_at, tile)
