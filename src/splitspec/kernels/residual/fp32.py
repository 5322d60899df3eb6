"""The fp32 product loops: codes unpacked once to int8, widened to fp32 in registers and FMA'd."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from splitspec.kernels.ir import I8, c64, load, loop, splat, switch
from splitspec.kernels.residual.codes import accumulate, fma, operands, scale_to_f32, unpack_steps, word_planes
from splitspec.kernels.residual.params import HALF, V8F, V8I32, WIDTHS, ZERO8

# Partial-sum sets per fp32 block size: at least 8 independent FMA chains (2 FMA pipes × 4 cycles).
_SETS = {1: 4, 2: 2, 3: 2}

# Columns per iteration of the fp32 column loop (a multiple of the sets): fewer loop instructions
# per column for the small blocks, whose loops are short.
_UNROLL = {1: 8, 2: 4, 3: 2}


def _int8_to_f32(builder, ptr):
    """8 int8 codes at ``ptr`` as fp32 lanes (vpmovsxbd from memory + vcvtdq2ps)."""
    codes = load(builder, ptr, ir.VectorType(I8, 8), align=1)
    return builder.sitofp(builder.sext(codes, V8I32), V8F)


@intrinsic
def unpack(typingctx, w0, w1, w2, step0, steps, codes, bits):
    """Store the codes of ``steps`` steps of the ``words`` planes (w0-w2) from step ``step0`` in the buffer
    ``codes`` as ``fp32_products`` reads them (``unpack_steps``, int8), each width by its own loop."""
    sig = types.void(w0, w1, w2, step0, steps, codes, bits)

    def codegen(context, builder, sig, args):
        def width(b: int) -> None:
            planes = word_planes(context, builder, sig.args[:3], args[:3], args[3], b)
            unpack_steps(builder, planes, c64(0), args[4], builder.bitcast(args[5], I8.as_pointer()), b, wide=False)

        switch(builder, args[6], WIDTHS, width)
        return context.get_dummy_value()

    return sig, codegen


def fp32_products(context, builder, sig, args, block: int) -> None:
    """The fp32 products of ``_block_dot``: ``cols`` columns of a group's codes that ``unpack`` stored
    as int8 in the buffer ``w0`` (w1, w2, step0, steps, xs, xb, xsbase and bits unused), with ``x_k[c] =
    x[xbase + c·n + k]`` (transposed): int8 codes widened to fp32 in registers and FMA'd. The ``block × 2``
    ymm partial sums (times ``_SETS`` sets) stay in registers for the whole loop."""
    sets, unroll = _SETS.get(block, 1), _UNROLL.get(block, 1)
    cols_v, n_v = args[5], args[8]
    src_p = builder.bitcast(args[0], I8.as_pointer())
    x_p, scale_p, _, _, acc_p = operands(context, builder, sig, args, args[15])

    def fma_column(c, sums, slot: int) -> list:
        lo = builder.gep(src_p, [builder.mul(c, c64(8))])
        w = [_int8_to_f32(builder, p) for p in (lo, builder.gep(lo, [c64(HALF)]))]
        x_row = builder.gep(x_p, [builder.mul(c, n_v)])
        sums = list(sums)
        for k in range(block):
            xk = splat(builder, builder.load(builder.gep(x_row, [c64(k)])))
            for h in range(2):
                i = 2 * (slot * block + k) + h
                sums[i] = fma(builder, w[h], xk, sums[i])
        return sums

    def step(c, sums) -> list:
        for j in range(unroll):
            sums = fma_column(builder.add(c, c64(j)), sums, j % sets)
        return sums

    c, sums = loop(builder, c64(0), cols_v, unroll, [ZERO8] * (2 * block * sets), step)
    if unroll > 1:
        _, sums = loop(builder, c, cols_v, 1, sums, lambda c, sums: fma_column(c, sums, 0))
    for h in range(2):
        wscale = scale_to_f32(builder, builder.gep(scale_p, [c64(8 * h)]))
        for k in range(block):
            total = sums[2 * k + h]
            for s in range(1, sets):  # the sets took alternate columns
                total = builder.fadd(total, sums[2 * (s * block + k) + h])
            accumulate(builder, acc_p, k, h, total, wscale, None)
