"""The integer product loops: codes times int16 (or int8) activations by vpmaddwd, exact in int32."""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from splitspec.kernels.ir import I16, I32, c64, load, loop, prefetch, splat, switch
from splitspec.kernels.residual.codes import (
    accumulate,
    operands,
    scale_to_f32,
    step_codes,
    step_planes,
    unpack_steps,
    word_planes,
)
from splitspec.kernels.residual.params import PF_SCALE, TAILS, TB, V8I32, V16I16, WIDTHS, ZERO8I
from splitspec.quantize.packing import GROUP, STEP, TILE


def pair_products(context, builder, sig, args, b: int, block: int) -> None:
    """The integer products of ``_block_dot``, for one block of tokens (a pass of at most ``STREAMED_TOKENS``):
    the codes of ``steps`` steps of the ``words`` planes w0-w2 from step ``step0`` (as many whole groups as
    that spans: a tile's whole row of them), streamed from RAM, prefetched and unpacked in registers
    (``step_codes``) straight into the products (``_pair``). One loop nest with the scaling between
    groups, because leaving the loop after every group cost more than the group's own products at n = 1.
    ``b`` (bits) picks the step.
    """
    steps_v, n_v = args[4], args[8]
    planes = word_planes(context, builder, sig.args[:3], args[:3], args[3], b)
    x_p, scale_p, xs_p, xb_p, acc_p = operands(context, builder, sig, args, args[15])

    def step(s, sums) -> list:
        code = step_codes(builder, step_planes(builder, planes, s, b), b)
        for p in range(STEP[b] // 2):
            first = builder.add(builder.mul(s, c64(STEP[b] // 2)), c64(p))
            sums = _pair(builder, x_p, n_v, first, lambda h, p=p: code(2 * p + h), sums, block)
        return sums

    def group(g, first, end) -> None:
        _, sums = loop(builder, first, end, 1, [ZERO8I] * (2 * block), step)
        _scaled(builder, scale_p, xs_p, xb_p, acc_p, n_v, g, sums, block)

    for_groups(builder, steps_v, b, scale_p, group)


def for_groups(builder, steps, b: int, scale_p, body: Callable) -> None:
    """``body(g, first, end)`` for every group g of ``steps`` steps (steps first .. end - 1; a short last
    group ends early), each after a prefetch of its scales ``PF_COLS`` columns ahead: they are a second,
    slow stream (1/64 of the bytes) that the hardware prefetcher may not follow."""
    per_group = GROUP // STEP[b]

    def group(g, _) -> list:
        prefetch(builder, builder.gep(scale_p, [builder.add(builder.mul(g, c64(TILE)), c64(PF_SCALE))]))
        first = builder.mul(g, c64(per_group))
        end = builder.add(first, c64(per_group))
        body(g, first, builder.select(builder.icmp_unsigned("<", end, steps), end, steps))
        return []

    loop(builder, c64(0), builder.udiv(builder.add(steps, c64(per_group - 1)), c64(per_group)), 1, [], group)


def _pair(builder, x_p, n_v, p, code: Callable, sums: list, block: int) -> list:
    """``sums`` plus column pair p's products (codes ``code(h)``, h = 0, 1: rows 8h .. 8h + 7 of the pair,
    its two columns side by side) with ``block`` tokens: each code vector meets a broadcast of token k's two
    int16 activations of the pair (the int32 ``x_p[p·n + k]``, ``round_activations_into``) in one vpmaddwd,
    8 rows' sums, exact in int32, added to the token's sums of row half h (2 ymm per token). Each token's
    broadcast is used at once, so that only one is live."""
    codes = [code(h) for h in range(2)]
    x_pair = builder.gep(x_p, [builder.mul(p, n_v)])
    sums = list(sums)
    for k in range(block):
        xk = builder.bitcast(splat(builder, builder.load(builder.gep(x_pair, [c64(k)]))), V16I16)
        for h in range(2):
            sums[2 * k + h] = _opaque(builder, builder.add(sums[2 * k + h], _madd(builder, codes[h], xk)))
    return sums


def _scaled(builder, scale_p, xs_p, xb_p, acc_p, n_v, g, sums: list, block: int) -> None:
    """Group g's integer sums of ``block`` tokens into acc (token k's rows at ``acc_p[16k ...]``): less the
    codes' offset (they stay unsigned, code + 2^(bits - 1); ``xb_p[g·n + k]`` is the offset times the token's
    codes' sum over the group), times the group's weight scales ``scale_p[16g ...]`` and the token's
    activation scale ``xs_p[g·n + k]``."""
    scale_g = builder.gep(scale_p, [builder.mul(g, c64(TILE))])
    xs_g, xb_g = (builder.gep(p, [builder.mul(g, n_v)]) for p in (xs_p, xb_p))
    for h in range(2):
        wscale = scale_to_f32(builder, builder.gep(scale_g, [c64(8 * h)]))
        for k in range(block):
            offset = splat(builder, builder.load(builder.gep(xb_g, [c64(k)])))
            accumulate(builder, acc_p, k, h, builder.sub(sums[2 * k + h], offset), wscale, xs_g)


@intrinsic
def many_dot(typingctx, w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, tail):
    """acc[16k + r] += the integer products of all ``n`` tokens (more than ``STREAMED_TOKENS``) with ``steps``
    steps of the ``words`` planes w0-w2 from step ``step0`` (a tile's whole row of groups). Per group, the
    codes are unpacked once into the buffer ``codes`` (int16, ``unpack_steps``), then every block of
    tokens reads them from L1: ``n // TB`` blocks of ``TB``, then one of ``tail`` (``n % TB``).
    One loop nest for the whole row, because a call per group cost a sizeable share of a group's products.
    Each width and tail has its own loop nest, entered through a table."""
    sig = types.void(w0, w1, w2, codes, step0, steps, x, xbase, n, scale, sbase, xs, xb, xsbase, acc, bits, tail)

    def codegen(context, builder, sig, args):
        def by_tail(b: int) -> None:
            switch(builder, args[16], TAILS, lambda rest: _many_products(context, builder, sig, args, b, rest))

        switch(builder, args[15], WIDTHS, by_tail)
        return context.get_dummy_value()

    return sig, codegen


def _many_products(context, builder, sig, args, b: int, rest: int) -> None:
    """``many_dot``'s loop nest for width ``b`` and a last block of ``rest`` tokens."""
    steps_v, n_v = args[5], args[8]
    planes = word_planes(context, builder, sig.args[:3], args[:3], args[4], b)
    buffer_p = builder.bitcast(args[3], I16.as_pointer())
    x_p, scale_p, xs_p, xb_p, acc_p = operands(context, builder, sig, args, c64(0))

    def group(g, first, end) -> None:
        unpack_steps(builder, planes, first, end, buffer_p, b)
        pair0 = builder.mul(first, c64(STEP[b] // 2))
        pairs = builder.mul(builder.sub(end, first), c64(STEP[b] // 2))

        def block(k0, size: int) -> None:
            x_k = builder.gep(x_p, [k0])

            def buffered(p, sums) -> list:
                at = builder.gep(buffer_p, [builder.mul(p, c64(2 * TILE))])

                def code(h):
                    return load(builder, builder.gep(at, [c64(TILE * h)]), V16I16, align=32)

                return _pair(builder, x_k, n_v, builder.add(pair0, p), code, sums, size)

            _, sums = loop(builder, c64(0), pairs, 1, [ZERO8I] * (2 * size), buffered)
            xs_k, xb_k = (builder.gep(p, [k0]) for p in (xs_p, xb_p))
            acc_k = builder.gep(acc_p, [builder.mul(k0, c64(TILE))])
            _scaled(builder, scale_p, xs_k, xb_k, acc_k, n_v, g, sums, size)

        full = builder.udiv(n_v, c64(TB))
        loop(builder, c64(0), full, 1, [], lambda kb, _: block(builder.mul(kb, c64(TB)), TB) or [])
        if rest:
            block(builder.mul(full, c64(TB)), rest)

    for_groups(builder, steps_v, b, scale_p, group)


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
    v16i32 = ir.VectorType(I32, 16)
    prod = builder.mul(builder.sext(a, v16i32), builder.sext(b, v16i32))
    even, odd = (builder.shuffle_vector(prod, prod, ir.Constant(V8I32, list(range(j, 16, 2)))) for j in range(2))
    return builder.add(even, odd)
