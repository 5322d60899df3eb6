"""More tokens: 8-column tables of a block of tokens (a register of them), indexed by a byte per lookup."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.kernels.cpu_base.common import WORD_BYTES, epilogue, lane_type, lanes_at
from splitspec.kernels.ir import I64, c64, call, data, literals, splat


@intrinsic
def build(typingctx, x, at, table, base, lanes):
    """table[base + L·v + i] = Σ_j ±x[at + L·j + i] over the 8 columns j, + where bit j of v is set
    (L = lanes, a literal): 255 L-lane adds, by doubling."""
    if not literals(lanes):
        return None
    sig = types.void(x, at, table, base, lanes)

    def codegen(context, builder, sig, args):
        n = lanes.literal_value
        xs = [
            builder.load(lanes_at(context, builder, sig.args[0], args[0], builder.add(args[1], c64(n * j)), n), align=4)
            for j in range(8)
        ]
        total = xs[0]
        for value in xs[1:]:
            total = builder.fadd(total, value)

        def entry(v):
            return lanes_at(context, builder, sig.args[2], args[2], builder.add(args[3], builder.mul(v, c64(n))), n)

        builder.store(builder.fneg(total), entry(c64(0)), align=4)
        for k in range(8):
            two = builder.fadd(xs[k], xs[k])
            with cgutils.for_range(builder, c64(1 << k)) as loop:
                low = builder.load(entry(loop.index), align=4)
                builder.store(builder.fadd(low, two), entry(builder.add(loop.index, c64(1 << k))), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def group_dot(typingctx, table, codes, at, words, acc, ai, scale, coef, offset, general, lanes):
    """acc[ai : ai + L] += scale · (c2·Σ s0·x + c1·Σ s1·x [+ c3·Σ s1·s0·x] + offset[0 : L]) for one row's
    group: ``words`` code words of 8 bytes (4 of plane 0, 4 of plane 1) from byte ``at`` of ``codes``, each
    byte one lookup in ``table`` [pieces, 256, L] (L = lanes, a literal). A chain of sums per byte of a word,
    so that the adds' latency does not bound a row."""
    if not literals(general, lanes):
        return None
    sig = types.void(table, codes, at, words, acc, ai, scale, coef, offset, general, lanes)

    def codegen(context, builder, sig, args):
        n, mixed = lanes.literal_value, general.literal_value
        vt = lane_type(n)
        zero = ir.Constant(vt, 0.0 if n == 1 else [0.0] * n)
        sums = [cgutils.alloca_once_value(builder, zero) for _ in range(9 if mixed else 8)]
        code_data = data(context, builder, sig.args[1], args[1])
        table_data = builder.bitcast(data(context, builder, sig.args[0], args[0]), ir.IntType(8).as_pointer())
        shift = (4 * n).bit_length() - 1  # bytes per entry = 2^shift
        with cgutils.for_range(builder, args[3]) as loop:
            first = builder.add(args[2], builder.mul(loop.index, c64(WORD_BYTES)))
            word = builder.load(builder.bitcast(builder.gep(code_data, [first]), I64.as_pointer()), align=1)
            pieces = builder.gep(table_data, [builder.mul(loop.index, c64(4 << (8 + shift)))])

            def lookup(value, k: int, piece: int):
                """The entry indexed by byte k of ``value``, its offset cut out already scaled (2 ops)."""
                if 8 * k >= shift:
                    scaled = builder.lshr(value, c64(8 * k - shift))
                else:
                    scaled = builder.shl(value, c64(shift - 8 * k))
                offset = builder.and_(scaled, c64(255 << shift))
                ptr = builder.gep(pieces, [builder.add(offset, c64(piece << (8 + shift)))])
                return builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4)

            for k in range(8):
                builder.store(builder.fadd(builder.load(sums[k]), lookup(word, k, k & 3)), sums[k])
            if mixed:  # the bytes ~(b0 ^ b1): + where the two bits agree
                same = builder.not_(builder.xor(word, builder.lshr(word, c64(32))))
                for j in range(4):
                    builder.store(builder.fadd(builder.load(sums[8]), lookup(same, j, j)), sums[8])
        part = [builder.load(slot) for slot in sums]
        planes = [
            builder.fadd(builder.fadd(part[4 * p], part[4 * p + 1]), builder.fadd(part[4 * p + 2], part[4 * p + 3]))
            for p in range(2)
        ]
        offset = builder.load(lanes_at(context, builder, sig.args[8], args[8], c64(0), n), align=4)
        dot = epilogue(builder, args[7], planes + part[8:], offset, n)
        out = lanes_at(context, builder, sig.args[4], args[4], args[5], n)
        total = builder.fadd(builder.load(out, align=4), builder.fmul(splat(builder, args[6], n), dot))
        builder.store(total, out, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def transpose(typingctx, src, src_at, src_stride, src_rows, dst, dst_at, dst_stride, dst_rows, lanes):
    """dst.flat[dst_at + dst_stride·i + j] = src.flat[src_at + src_stride·j + i] for i, j < L (L = lanes, a
    literal), rows j ≥ ``src_rows`` of src read as zeros and rows i ≥ ``dst_rows`` of dst left as they are:
    an L × L block of fp32 turned in registers, by log2(L) rounds of shuffles. The byte tables' tokens go
    in (a block of tokens' columns into a register of tokens per column) and come out (a register of
    tokens per row into the tokens' rows of y) through it: moved an element at a time, each side's stores
    went to L lines a whole row apart (4 KiB aliases of each other for most shapes), a large share of a long
    pass (benchmarks/README.md)."""
    if not literals(lanes):
        return None
    sig = types.void(src, src_at, src_stride, src_rows, dst, dst_at, dst_stride, dst_rows, lanes)

    def codegen(context, builder, sig, args):
        n = lanes.literal_value
        vt = lane_type(n)
        width, align = f"v{n}f32", ir.Constant(ir.IntType(32), 4)

        def mask(row: int, count):
            return splat(builder, builder.icmp_signed("<", c64(row), count), n)

        def at(k: int, array: int, first: int, stride: int):
            return lanes_at(
                context,
                builder,
                sig.args[array],
                args[array],
                builder.add(args[first], builder.mul(args[stride], c64(k))),
                n,
            )

        zero = ir.Constant(vt, [0.0] * n)
        rows = [
            call(builder, f"llvm.masked.load.{width}.p0", vt, [at(j, 0, 1, 2), align, mask(j, args[3]), zero])
            for j in range(n)
        ]
        d = 1
        while d < n:  # swap bit d of the row index with bit d of the lane index, for each bit: the transpose
            for i in range(n):
                if i & d:
                    continue
                low = [c if c & d == 0 else n + c - d for c in range(n)]
                high = [c + d if c & d == 0 else n + c for c in range(n)]
                picks = [ir.Constant(ir.VectorType(ir.IntType(32), n), v) for v in (low, high)]
                rows[i], rows[i | d] = (builder.shuffle_vector(rows[i], rows[i | d], p) for p in picks)
            d *= 2
        for i in range(n):
            call(
                builder,
                f"llvm.masked.store.{width}.p0",
                ir.VoidType(),
                [rows[i], at(i, 4, 5, 6), align, mask(i, args[7])],
            )
        return context.get_dummy_value()

    return sig, codegen
