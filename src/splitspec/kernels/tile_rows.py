"""A row tile's accumulators and its columns of the output, moved a token at a time in one masked vector.

The products keep a 16-row tile's sums as ``acc[16k + m]`` (token k, row m) and write them to ``y[k, r0 + m]``
at the end: 16 fp32 of each token's row of y, which a scalar loop moved one element at a time (with an index
check each), a store per element into lines that are not in cache. A masked vector load or store keeps to the
tile's real rows (a last tile may hold fewer than 16).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from splitspec.kernels.ir import F32, I32, c64, call, data, load, loop, splat, store

ROWS = 16  # rows of a tile: one vector of fp32 a token
V16I32, V16F32 = ir.VectorType(I32, ROWS), ir.VectorType(F32, ROWS)


def rows_mask(builder, count):
    """The lanes of a row tile's first ``count`` rows: a masked load or store of its 16 fp32 keeps to them."""
    lanes = ir.Constant(V16I32, list(range(ROWS)))
    return builder.icmp_unsigned("<", lanes, splat(builder, builder.trunc(count, I32), ROWS))


def _token_rows(context, builder, y_type, y, r0, count, body) -> None:
    """``body(k, y_k, mask)`` for every token k of y: y_k points at y[k, r0] as 16 fp32, mask its real rows."""
    y_array = context.make_array(y_type)(context, builder, y)
    n, rows = (builder.extract_value(y_array.shape, i) for i in (0, 1))
    y_p = builder.gep(y_array.data, [r0])
    mask = rows_mask(builder, count)

    def token(k, _) -> list:
        body(k, builder.bitcast(builder.gep(y_p, [builder.mul(k, rows)]), V16F32.as_pointer()), mask)
        return []

    loop(builder, c64(0), n, 1, [], token)


@intrinsic
def load_rows(typingctx, acc, y, r0, count):
    """acc[16k + m] = y[k, r0 + m] for every token k of y and rows m < count: a later block of groups adds to
    the sums the blocks before it left in y."""
    sig = types.void(acc, y, r0, count)

    def codegen(context, builder, sig, args):
        acc_p = data(context, builder, sig.args[0], args[0])
        zero, align = ir.Constant(V16F32, [0.0] * ROWS), ir.Constant(I32, 4)

        def body(k, y_k, mask) -> None:
            value = call(builder, "llvm.masked.load.v16f32.p0", V16F32, [y_k, align, mask, zero])
            store(builder, value, builder.gep(acc_p, [builder.mul(k, c64(ROWS))]), align=4)

        _token_rows(context, builder, sig.args[1], args[1], args[2], args[3], body)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_rows(typingctx, acc, y, r0, count, top):
    """y[k, r0 + m] = acc[16k + m] · top for every token k of y and rows m < count (``top`` fp32: a tile's
    power of two, or 1 for sums not done yet)."""
    sig = types.void(acc, y, r0, count, top)

    def codegen(context, builder, sig, args):
        acc_p = data(context, builder, sig.args[0], args[0])
        scale, align = splat(builder, args[4], ROWS), ir.Constant(I32, 4)

        def body(k, y_k, mask) -> None:
            value = builder.fmul(load(builder, builder.gep(acc_p, [builder.mul(k, c64(ROWS))]), V16F32, 4), scale)
            call(builder, "llvm.masked.store.v16f32.p0", ir.VoidType(), [value, y_k, align, mask])

        _token_rows(context, builder, sig.args[1], args[1], args[2], args[3], body)
        return context.get_dummy_value()

    return sig, codegen
