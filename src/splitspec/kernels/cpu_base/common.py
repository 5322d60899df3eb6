"""What both kinds of table share: the packed base's word layout, fp16 scales, the epilogue that turns a
row's signed sums into its dot product."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from splitspec.kernels.ir import F32, data, splat
from splitspec.quantize.format import CODE_WORD, GROUP

WORDS = GROUP // CODE_WORD  # code words per group

WORD_BYTES = 8  # bytes of one code word across the two planes (4 of plane 0, then 4 of plane 1)


def lane_type(lanes: int) -> ir.Type:
    return F32 if lanes == 1 else ir.VectorType(F32, lanes)


def lanes_at(context, builder, ty, array, index, lanes: int):
    """Pointer to ``lanes`` floats from element ``index`` of a C-contiguous float32 array."""
    ptr = builder.gep(data(context, builder, ty, array), [index])
    return builder.bitcast(ptr, lane_type(lanes).as_pointer())


def widen(builder, bits):
    """fp16 bit patterns (i16 or a vector of them) as fp32."""
    if isinstance(bits.type, ir.IntType):
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)
    lanes = bits.type.count
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), ir.VectorType(F32, lanes))


def epilogue(builder, coef, sums: list, offset, lanes: int):
    """c2·(plane 0 sums) + c1·(plane 1 sums) [+ c3·(agreement sums)] + offset."""
    c1, c2, c3 = (splat(builder, builder.extract_value(coef, i), lanes) for i in (1, 2, 3))
    dot = builder.fadd(builder.fmul(c2, sums[0]), builder.fmul(c1, sums[1]))
    if len(sums) > 2:
        dot = builder.fadd(dot, builder.fmul(c3, sums[2]))
    return builder.fadd(dot, offset)


@intrinsic
def half(typingctx, bits):
    """One fp16 scale (its uint16 bits) as fp32."""
    if bits != types.uint16:
        return None
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        return widen(builder, args[0])

    return sig, codegen
