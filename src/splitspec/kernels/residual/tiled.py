"""The integer product on AMX tiles, for passes of many tokens: the same int32 sums as ``many_dot``, bit
for bit, in fewer cycles (``benchmarks/residual_tiles.py``).

Each token's int16 codes q = 256·hi + lo are split into a signed high byte and an unsigned low byte
(``prepare_digits``), so that a group's Σ u·q (u the unsigned weight codes) is 256·Σ u·hi + Σ u·lo: two
int8 tile products per 64 columns (``kernels/amx.py``), exact in int32 (|Σ u·q| < 2^30 over 128
columns). The group's codes are unpacked once into two tiles (``unpack_quads``), which stay in their
registers while every 16-token tile of activations passes them; the sums then take the vector loops'
scaling, the same operations in the same order, so the result is theirs bit for bit.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from splitspec.kernels import amx
from splitspec.kernels.ir import I32, c64, data, element, load, loop, splat, switch
from splitspec.kernels.residual.codes import add_scaled, scale_to_f32, unpack_quads, word_planes
from splitspec.kernels.residual.integer import for_groups
from splitspec.kernels.residual.params import WIDTHS
from splitspec.kernels.residual.rounding import round_digits_into
from splitspec.quantize.packing import GROUP, TILE

# from this many tokens a pass multiplies on tiles where the process may (``amx.enabled``): below it the
# vector loops win (benchmarks/README, "AMX tiles for passes of many tokens")
AMX_TOKENS = 5

# the most bytes of activations (both byte planes) that one sweep of a range's tiles reads: more would
# fall out of L2 between one tile and the next, so wider products go in blocks of groups that fit
ACTIVATION_BYTES = 1 << 20

V16I32 = ir.VectorType(I32, 16)

# tile registers: the group's codes (two 64-column halves); two pairs of sums (high and low bytes), so
# that one token tile's products need not wait for the last one's sums to be stored; an activation tile's
# high and low bytes
_CODES, _SUMS, _ACT_HI, _ACT_LO = (0, 1), ((2, 3), (4, 5)), 6, 7
TILE_BYTES = amx.ROWS * amx.BYTES
BUFFER_BYTES = 2 * TILE_BYTES  # a group's codes, or a token tile's sums: two tiles (a literal, for stack)


@njit(cache=True)
def prepare_digits(x, levels, offset):
    """x rounded as ``prepare`` rounds it, as the two byte planes that AMX's activation tiles read,
    [tokens, stride] each, one after the other (``round_digits_into``; zero past x's columns and past its
    tokens up to whole 16-token tiles), with the scales and ``offset`` × the codes' sums: (digits, xs, xb).
    The residual's unsigned codes take offset 2^(bits - 1) (``amx_row``); the base's signs take 0."""
    n, d = x.shape
    n_groups = (d + GROUP - 1) // GROUP
    plane = (n + amx.ROWS - 1) // amx.ROWS * amx.ROWS * n_groups * GROUP
    digits = amx.zeros(2 * plane, np.uint8)
    xs, xb = np.empty(n_groups * n, np.float32), np.empty(n_groups * n, np.int32)
    round_digits_into(x, digits, plane, xs, xb, offset, levels, n_groups * GROUP)
    return digits, xs, xb


@intrinsic
def amx_row(typingctx, w0, w1, w2, codes, sums, digits, scale, xs, xb, acc, where, bits):
    """acc[16k + r] += the integer products of all n tokens with ``steps`` steps of the ``words`` planes
    w0-w2 from step ``step0`` (a tile's groups from group ``g0``), on AMX tiles, ``where`` = (step0, steps,
    plane, stride, n, sbase, g0): ``digits`` the activations' two byte planes, ``plane`` bytes apart
    (``prepare_digits``, rows ``stride`` bytes apart), ``codes`` a 2 KiB buffer, ``sums`` 4 KiB (two token
    tiles' sums); the scales (from ``sbase``, group g0's), offsets and sums as ``many_dot``'s. The caller
    configures the tiles (``amx.begin``). A token tile's sums are scaled while the next tile's products
    run: the scaling's loads never wait for the tile just stored, and the sums stay in L1 (a prompt's
    sums, all stored before any was scaled, had taken most of it)."""
    sig = types.void(w0, w1, w2, codes, sums, digits, scale, xs, xb, acc, where, bits)

    def codegen(context, builder, sig, args):
        if amx.compiles():
            switch(builder, args[11], WIDTHS, lambda b: _row(context, builder, sig, args, b))
        return context.get_dummy_value()

    return sig, codegen


def _row(context, builder, sig, args, b: int) -> None:
    """``amx_row``'s loop nest for width ``b``: per group, its codes unpacked into two tiles, then every
    16-token tile's four tile products and the sums' scaling into acc."""
    ty = sig.args
    step0, steps, plane, stride, n, sbase, g0 = (builder.extract_value(args[10], i) for i in range(7))
    planes = word_planes(context, builder, ty[:3], args[:3], step0, b)
    codes_p, sums_p = args[3], data(context, builder, ty[4], args[4])
    hi_p = data(context, builder, ty[5], args[5])
    lo_p = builder.gep(hi_p, [plane])
    scale_p = element(context, builder, ty[6], args[6], sbase)
    xs_p, xb_p, acc_p = (data(context, builder, ty[i], args[i]) for i in (7, 8, 9))
    token_tiles = builder.udiv(builder.add(n, c64(amx.ROWS - 1)), c64(amx.ROWS))

    def group(g, first, end) -> None:
        unpack_quads(builder, planes, first, end, codes_p, b)
        for half, tmm in enumerate(_CODES):
            amx.load(builder, tmm, builder.gep(codes_p, [c64(half * TILE_BYTES)]), c64(amx.BYTES))
        scale_g = builder.gep(scale_p, [builder.mul(g, c64(TILE))])
        wscale = builder.shuffle_vector(
            scale_to_f32(builder, scale_g),
            scale_to_f32(builder, builder.gep(scale_g, [c64(8)])),
            ir.Constant(V16I32, list(range(16))),
        )
        column = builder.mul(builder.add(g0, g), c64(GROUP))
        xs_g, xb_g = (builder.gep(p, [builder.mul(builder.add(g0, g), n)]) for p in (xs_p, xb_p))

        def products(t, pair: int) -> None:
            """Token tile t's tile products, into sum tiles ``pair`` and then its slot of ``sums``."""
            at = builder.add(builder.mul(builder.mul(t, c64(amx.ROWS)), stride), column)
            high, low = _SUMS[pair]
            amx.zero(builder, high)
            amx.zero(builder, low)
            for half in (0, 1):
                cols = builder.add(at, c64(half * amx.BYTES))
                amx.load(builder, _ACT_HI, builder.gep(hi_p, [cols]), stride)
                amx.load(builder, _ACT_LO, builder.gep(lo_p, [cols]), stride)
                amx.dot(builder, "su", high, _ACT_HI, _CODES[half])
                amx.dot(builder, "uu", low, _ACT_LO, _CODES[half])
            slot = builder.gep(sums_p, [c64(pair * BUFFER_BYTES)])
            amx.store(builder, high, slot)
            amx.store(builder, low, builder.gep(slot, [c64(TILE_BYTES)]))

        def scaled(t) -> None:
            """Token tile t's tokens, from its slot of ``sums``."""
            k0, k1 = amx.tile_tokens(builder, t, n)
            loop(builder, k0, k1, 1, [], lambda k, _: _scaled(builder, k, wscale, xs_g, xb_g, sums_p, acc_p))

        def two(j, _) -> list:
            for pair in (0, 1):
                t = builder.add(builder.mul(j, c64(2)), c64(pair))
                products(t, pair)
                if pair:
                    scaled(builder.sub(t, c64(1)))
                else:
                    with builder.if_then(builder.icmp_unsigned("!=", j, c64(0))):
                        scaled(builder.sub(t, c64(1)))
            return []

        loop(builder, c64(0), builder.udiv(token_tiles, c64(2)), 1, [], two)
        last = builder.sub(token_tiles, c64(1))
        odd = builder.icmp_unsigned("!=", builder.and_(token_tiles, c64(1)), c64(0))
        with builder.if_then(odd):
            products(last, 0)
            with builder.if_then(builder.icmp_unsigned("!=", last, c64(0))):
                scaled(builder.sub(last, c64(1)))
        scaled(last)

    for_groups(builder, steps, b, scale_p, group)


def _scaled(builder, token, wscale, xs_g, xb_g, sums_p, acc_p) -> list:
    """A token's sums of the group (from its tile's slot of ``sums``), 256·high + low − offset, into its 16
    accumulators (``add_scaled``, as the vector loops)."""
    tile, row = builder.udiv(token, c64(amx.ROWS)), builder.urem(token, c64(amx.ROWS))
    at = builder.add(builder.mul(builder.and_(tile, c64(1)), c64(BUFFER_BYTES)), builder.mul(row, c64(amx.BYTES)))
    high, low = (load(builder, builder.gep(sums_p, [builder.add(at, c64(o))]), V16I32, 4) for o in (0, TILE_BYTES))
    total = builder.add(builder.shl(high, ir.Constant(V16I32, [8] * 16)), low)
    total = builder.sub(total, splat(builder, builder.load(builder.gep(xb_g, [token])), 16))
    xs = builder.load(builder.gep(xs_g, [token]))
    add_scaled(builder, builder.gep(acc_p, [builder.mul(token, c64(TILE))]), total, wscale, xs)
    return []
