"""Few tokens on an AVX2 host: 32 rows at a time, 4-column tables looked up by vpshufb in byte planes.

On AVX2, vpermps (``perm``'s lookup) takes two cycles on some cores (Zen 2), where vpshufb and the unpacks
take half of one. vpshufb looks up bytes, not floats: a table of one 4-column chunk's 16 signed sums (fp32)
is kept as four 16-byte planes, byte k of every entry in plane k. One 32-byte register of 4-bit indices
(one nibble of 32 rows' plane byte) picks 32 entries' byte k from plane k; four lookups and two rounds of
unpacks (bytes, then 16-bit pairs) put the 32 fp32 sums back together, still unrounded. For that, the
codes are laid out once (``nibble_codes``) so that one load is one plane byte of the block's 32 rows, in
the order the unpacks leave the rows in (``POSITION``). Each plane's table holds its coefficient already
(c2 for plane 0, c1 for plane 1, c3 for their agreement), so all planes add into the same sums.
"""

from __future__ import annotations

import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.kernels.cpu_base.common import widen
from splitspec.kernels.ir import F32, I8, I16, I32, c64, call, data, literals, splat
from splitspec.quantize.format import CODE_WORD, GROUP

BLOCK = 32  # rows per block: one byte each in a 32-byte register

PLANE_BYTES = GROUP // 8  # bytes of one plane of one row in one group

CHUNKS = 2 * PLANE_BYTES  # 4-column chunks (nibbles) per group

TABLE = 64  # bytes of one chunk's table: 16 fp32 entries as 4 planes of 16 bytes

TOKENS = 2  # tokens whose sums stay in registers at a time

# After the unpacks, lane j of sum register a holds the row at byte 16·(j // 4) + 4·a + j % 4 of the loads.
POSITION = [16 * (j // 4) + 4 * a + j % 4 for a in range(4) for j in range(8)]  # row r = 8a + j -> byte


def nibble_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [rows, words, 2] int32 (bit j of a word is column 32w + j) as uint8 [blocks, groups, 2, 16, 32]:
    for each block of 32 rows, group and plane, byte b of the group's plane bits for every row of the
    block, the rows in ``POSITION`` order. Rows past the last and words past the last group are zero."""
    rows, words = codes.shape[:2]
    blocks, groups = -(-rows // BLOCK), -(-words * CODE_WORD // GROUP)
    padded = codes.new_zeros(blocks * BLOCK, groups * GROUP // CODE_WORD, 2)
    padded[:rows, :words] = codes
    as_bytes = padded.view(torch.uint8).view(blocks, BLOCK, groups, GROUP // CODE_WORD, 2, CODE_WORD // 8)
    # [block, row, group, word, plane, byte] -> [block, group, plane, word, byte, row]
    laid = as_bytes.permute(0, 2, 4, 3, 5, 1).reshape(blocks, groups, 2, PLANE_BYTES, BLOCK)
    order = torch.empty(BLOCK, dtype=torch.long)
    order[torch.tensor(POSITION)] = torch.arange(BLOCK)  # byte p holds row order[p]
    return laid[..., order].contiguous()


@intrinsic
def build_tables(typingctx, x, col, chunks, coef, tables, at):
    """tables[at + 64·c + 16·k + v] = byte k of c_p · Σ_j ±x[col + 4c + j] (+ where bit j of v is set), for
    chunks c = 0 .. ``chunks`` - 1 (4 columns each): one plane's tables, with its coefficient ``coef``."""
    sig = types.void(x, col, chunks, coef, tables, at)

    def codegen(context, builder, sig, args):
        x_v, col_v, chunks_v, coef_v, tables_v, at_v = args
        v16 = ir.VectorType(F32, 16)
        signs = [ir.Constant(v16, [1.0 if v >> j & 1 else -1.0 for v in range(16)]) for j in range(4)]
        planes = ir.Constant(ir.VectorType(I32, 64), [4 * v + k for k in range(4) for v in range(16)])
        x_data = data(context, builder, sig.args[0], x_v)
        out = data(context, builder, sig.args[4], tables_v)
        with cgutils.for_range(builder, chunks_v) as loop:
            first = builder.add(col_v, builder.mul(loop.index, c64(4)))
            table = None
            for j in range(4):
                xj = builder.fmul(builder.load(builder.gep(x_data, [builder.add(first, c64(j))])), coef_v)
                term = builder.fmul(signs[j], splat(builder, xj, 16))
                table = term if table is None else builder.fadd(table, term)
            raw = builder.bitcast(table, ir.VectorType(I8, 64))
            split = builder.shuffle_vector(raw, ir.Constant(raw.type, ir.Undefined), planes)
            ptr = builder.gep(out, [builder.add(at_v, builder.mul(loop.index, c64(TABLE)))])
            builder.store(split, builder.bitcast(ptr, split.type.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


def _mask(pattern) -> ir.Constant:
    return ir.Constant(ir.VectorType(I32, len(pattern)), pattern)


def _unpack(width: int, high: bool) -> list[int]:
    """vpunpckl/h of ``width``-lane-per-128-bit vectors as a shufflevector mask over (a, b)."""
    lanes = 2 * width
    half = width // 2
    return [
        q * width + i + (half if high else 0) + (lanes if s else 0)
        for q in range(2)
        for i in range(half)
        for s in (0, 1)
    ]


@intrinsic
def rows_nibbles(typingctx, tables, codes, y, scale, offsets, where, general, tokens):
    """y[t·stride + yi + (0 .. 31)] += scale · (Σ over the group's nibbles of the tables' sums + offsets[oi + t])
    for ``tokens`` (a literal, 1 .. ``TOKENS``) tokens t of one block of 32 rows and one group. ``where`` is (ti, at,
    bytes, stride, yi, si, oi, table_stride): the tokens' tables from byte ti of ``tables``, ``table_stride``
    bytes apart; the block's group codes from byte ``at`` of ``codes`` (``nibble_codes``: plane 0's 16 loads
    of 32 bytes, then plane 1's), of which the first ``bytes`` of each plane hold columns; the block's 32
    scales (fp16 bits, row order) from element ``si``. With ``general``, a third plane (where the two bits
    agree) follows the two in the tables."""
    if not literals(general, tokens):
        return None
    sig = types.void(tables, codes, y, scale, offsets, where, general, tokens)

    def codegen(context, builder, sig, args):
        nt, mixed = tokens.literal_value, general.literal_value
        tables_v, codes_v, y_v, scale_v, offsets_v = args[:5]
        ti_v, at_v, bytes_v, stride_v, yi_v, si_v, oi_v, tstride_v = (
            builder.extract_value(args[5], i) for i in range(8)
        )
        b32, f8, h16 = ir.VectorType(I8, 32), ir.VectorType(F32, 8), ir.VectorType(I16, 16)
        b16 = ir.VectorType(I8, 16)
        table_data = data(context, builder, sig.args[0], tables_v)
        code_data = data(context, builder, sig.args[1], codes_v)
        zero = ir.Constant(f8, [0.0] * 8)
        sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(4)] for _ in range(nt)]
        low = ir.Constant(b32, [15] * 32)
        four = ir.Constant(h16, [4] * 16)
        lo8, hi8, lo16, hi16 = _unpack(16, False), _unpack(16, True), _unpack(8, False), _unpack(8, True)

        def load_codes(plane, byte):
            offset = builder.add(at_v, builder.add(c64(plane * PLANE_BYTES * BLOCK), builder.mul(byte, c64(BLOCK))))
            ptr = builder.gep(code_data, [offset])
            return builder.load(builder.bitcast(ptr, b32.as_pointer()), align=32)

        def broadcast(offset):
            ptr = builder.bitcast(builder.gep(table_data, [offset]), b16.as_pointer())
            half = builder.load(ptr, align=16)
            return builder.shuffle_vector(half, half, _mask(list(range(16)) * 2))

        def lookup(index, first, slots):
            parts = [
                call(builder, "llvm.x86.avx2.pshuf.b", b32, [broadcast(builder.add(first, c64(16 * k))), index])
                for k in range(4)
            ]
            pairs = [
                builder.bitcast(builder.shuffle_vector(parts[a], parts[a + 1], _mask(m)), h16)
                for a in (0, 2)
                for m in (lo8, hi8)
            ]  # (lo01, hi01, lo23, hi23)
            for a, (u, m) in enumerate(((0, lo16), (0, hi16), (1, lo16), (1, hi16))):
                value = builder.bitcast(builder.shuffle_vector(pairs[u], pairs[u + 2], _mask(m)), f8)
                builder.store(builder.fadd(builder.load(slots[a]), value), slots[a])

        def byte_loop(planes_here):
            """The group's plane bytes in memory order: one plane, or both and their agreement (``general``)."""
            with cgutils.for_range(builder, bytes_v) as loop:
                words = [load_codes(p, loop.index) for p in planes_here[:2]]
                if mixed:
                    words.append(builder.not_(builder.xor(words[0], words[1])))
                for p, word in zip(planes_here, words, strict=True):
                    lookups(loop.index, p, word)

        def lookups(byte, p, word):
            nibbles = (
                builder.and_(word, low),
                builder.and_(builder.bitcast(builder.lshr(builder.bitcast(word, h16), four), b32), low),
            )
            for h, index in enumerate(nibbles):
                chunk = builder.add(builder.mul(byte, c64(2)), c64(h))
                for t in range(nt):
                    first = builder.add(
                        builder.add(ti_v, builder.mul(tstride_v, c64(t))),
                        builder.mul(builder.add(c64(p * CHUNKS), chunk), c64(TABLE)),
                    )
                    lookup(index, first, sums[t])

        if mixed:
            byte_loop((0, 1, 2))
        else:
            byte_loop((0,))
            byte_loop((1,))
        scale_data = data(context, builder, sig.args[3], scale_v)
        offset_data = data(context, builder, sig.args[4], offsets_v)
        y_data = data(context, builder, sig.args[2], y_v)
        for a in range(4):
            ptr = builder.gep(scale_data, [builder.add(si_v, c64(8 * a))])
            scales = widen(builder, builder.load(builder.bitcast(ptr, ir.VectorType(I16, 8).as_pointer()), align=2))
            for t in range(nt):
                offset = splat(builder, builder.load(builder.gep(offset_data, [builder.add(oi_v, c64(t))])), 8)
                at = builder.add(builder.add(yi_v, builder.mul(stride_v, c64(t))), c64(8 * a))
                out = builder.bitcast(builder.gep(y_data, [at]), f8.as_pointer())
                dot = builder.fadd(builder.load(sums[t][a]), offset)
                builder.store(builder.fadd(builder.load(out, align=4), builder.fmul(scales, dot)), out, align=4)
        return context.get_dummy_value()

    return sig, codegen
