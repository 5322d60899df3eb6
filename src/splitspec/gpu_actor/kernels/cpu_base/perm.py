"""Few tokens on an AVX-512 host: 16 rows at a time, tables of 4 columns indexed by vpermps."""

from __future__ import annotations

import numba
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.gpu_actor.kernels.cpu_base.common import V8I, WORD_BYTES, WORDS, epilogue, lanes_at, widen
from splitspec.kernels.ir import F32, I16, I32, c64, data, literals, splat
from splitspec.quantize.format import CODE_WORD


def _host_is_wide() -> bool:
    """Whether numba compiles for a host with AVX-512 (16-lane vpermps, 16-entry tables). Code compiled for a
    named CPU (NUMBA_CPU_NAME) keeps to AVX2, which every target of this project has."""
    if numba.config.CPU_NAME:
        return False
    return "+avx512f" in llvm.get_host_cpu_features().flatten()


WIDE = _host_is_wide()

# rows per block, bits (columns) per table, tables per 32-column word, entries per table
SHAPE = (16, 4, 8, 16)

TOKENS = 4  # tokens whose sums rows_perm keeps in registers at a time


def _transpose(builder: ir.IRBuilder, rows: list) -> list:
    """8 × 8 int32 transpose within each 256-bit half of 8 vectors of 8 or 16 lanes (unpack, unpack and
    lane-swap stages): lane r of column k is lane k of row r, and with 16 lanes (row r's upper half
    holding another row) lane 8 + r is lane 8 + k of row r."""
    width = rows[0].type.count
    vector = ir.VectorType(I32, width)

    def mix(a, b, mask):
        return builder.shuffle_vector(a, b, ir.Constant(vector, mask))

    def per_lane(pattern):  # (dword, from b) for every 128-bit lane: b's lanes are offset by ``width``
        return [lane + (width if b else 0) + 4 * q for q in range(width // 4) for lane, b in pattern]

    lo, hi = per_lane([(0, 0), (0, 1), (1, 0), (1, 1)]), per_lane([(2, 0), (2, 1), (3, 0), (3, 1)])
    t = [mix(rows[i], rows[i + 1], m) for i in range(0, 8, 2) for m in (lo, hi)]
    even, odd = per_lane([(0, 0), (1, 0), (0, 1), (1, 1)]), per_lane([(2, 0), (3, 0), (2, 1), (3, 1)])
    s = [mix(t[i + k], t[i + k + 2], m) for i in (0, 4) for k in (0, 1) for m in (even, odd)]
    halves = range(0, width, 8)
    low = [i + h + o for h in halves for o in (0, width) for i in range(4)]
    high = [i + 4 + h + o for h in halves for o in (0, width) for i in range(4)]
    return [mix(s[k % 4], s[4 + k % 4], low if k < 4 else high) for k in range(8)]


@intrinsic
def rows_perm(typingctx, tri, codes, y, scale, offset, coef, strides, where, general, tokens):
    """y[yi + rows·t + (0 .. R-1)] += scale · (c2·Σ s0·x + c1·Σ s1·x [+ c3·Σ s1·s0·x] + offset[oi + t]) over
        one group of R = 16 rows, for each of ``repeat`` × ``tokens`` (a literal) tokens t;
        ``strides`` is (row_bytes, rows) and ``where`` (ti, at, words, shift, yi, si, oi, repeat). The
        sums of ``tokens`` tokens at a time stay in registers. The rows' group chunks (32 bytes each, from
        byte ``at`` of ``codes``, ``row_bytes`` apart) are transposed once so that a register holds
        one plane word of the R rows, and every B = 4 bits of it index, by vpermps, a 2^B-entry
        table of signed sums of x (``tri`` [t, word, chunk, 2^B] from element ti). 32 bytes are read per row
        even where the group has fewer ``words``: those ``shift`` words back, so that a short last group reads
        its row's end rather than past it. Scales are fp16 bits in block-major order (``block_scales``): the R
    rows' scales of the group are the R consecutive elements from ``si``, one load."""
    if not literals(general, tokens):
        return None
    sig = types.void(tri, codes, y, scale, offset, coef, strides, where, general, tokens)

    def codegen(context, builder, sig, args):
        nt, mixed = tokens.literal_value, general.literal_value
        block, bits, chunks, entries = SHAPE
        vi, vf = ir.VectorType(I32, block), ir.VectorType(F32, block)
        tri_t, codes_t, y_t, scale_t, offset_t = sig.args[:5]
        tri_v, codes_v, y_v, scale_v, offset_v, coef_v = args[:6]
        row_bytes_v, rows_v = (builder.extract_value(args[6], i) for i in range(2))
        tri_at_v, at_v, words_v, shift_v, yi_v, si_v, offset_at_v, repeat_v = (
            builder.extract_value(args[7], i) for i in range(8)
        )
        planes = 3 if mixed else 2
        code_data = data(context, builder, codes_t, codes_v)
        first = builder.sub(at_v, builder.mul(shift_v, c64(WORD_BYTES)))
        chunk = []
        for i in range(block):
            ptr = builder.gep(code_data, [builder.add(first, builder.mul(row_bytes_v, c64(i)))])
            chunk.append(builder.load(builder.bitcast(ptr, V8I.as_pointer()), align=1))
        # rows r and r + 8 side by side
        chunk = [builder.shuffle_vector(chunk[i], chunk[i + 8], ir.Constant(vi, list(range(16)))) for i in range(8)]
        cols = _transpose(builder, chunk)
        scale_at = builder.gep(data(context, builder, scale_t, scale_v), [si_v])
        scale_bits = builder.load(builder.bitcast(scale_at, ir.VectorType(I16, block).as_pointer()), align=2)
        scales = widen(builder, scale_bits)
        zero = ir.Constant(vf, [0.0] * block)
        sums = [
            [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(planes)] for _ in range(nt)
        ]
        permute = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vf, [vf, vi]), "llvm.x86.avx512.permvar.sf.512"
        )
        offsets = data(context, builder, offset_t, offset_v)
        end = builder.add(shift_v, words_v)
        with cgutils.for_range(builder, repeat_v) as loop:  # blocks of nt tokens, on the same transposed codes
            tri_at = builder.add(tri_at_v, builder.mul(loop.index, c64(nt * WORDS * chunks * entries)))
            for slot in (slot for token in sums for plane in token for slot in plane):
                builder.store(zero, slot)
            for w in range(WORDS):  # w: the word's place in the 32 bytes read
                inside = builder.and_(builder.icmp_signed("<=", shift_v, c64(w)), builder.icmp_signed(">", end, c64(w)))
                with builder.if_then(inside, likely=True):
                    words_bits = [cols[2 * w], cols[2 * w + 1]]
                    if mixed:  # + where the two bits agree
                        words_bits.append(builder.not_(builder.xor(words_bits[0], words_bits[1])))
                    word = builder.sub(c64(w), shift_v)
                    for p, plane in enumerate(words_bits):
                        for c in range(chunks):
                            index = builder.lshr(plane, ir.Constant(vi, [bits * c] * block)) if c else plane
                            for t in range(nt):
                                entry = builder.add(
                                    builder.mul(builder.add(word, c64(t * WORDS)), c64(chunks * entries)),
                                    builder.add(tri_at, c64(c * entries)),
                                )
                                table = builder.load(lanes_at(context, builder, tri_t, tri_v, entry, block), align=4)
                                slot = sums[t][p][c % 2]
                                value = builder.call(permute, [table, index])
                                builder.store(builder.fadd(builder.load(slot), value), slot)
            first_token = builder.mul(loop.index, c64(nt))
            for t in range(nt):
                token = builder.add(first_token, c64(t))
                parts = [builder.fadd(builder.load(a), builder.load(b)) for a, b in sums[t]]
                offset = builder.load(builder.gep(offsets, [builder.add(offset_at_v, token)]))
                dot = epilogue(builder, coef_v, parts, splat(builder, offset, block), block)
                out = lanes_at(context, builder, y_t, y_v, builder.add(yi_v, builder.mul(rows_v, token)), block)
                builder.store(builder.fadd(builder.load(out, align=4), builder.fmul(scales, dot)), out, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def build_tri(typingctx, x, col, words, tri, base):
    """tri[base + (w·chunks + c)·2^B + v] = Σ_j ±x[col + 32w + B·c + j] over the chunk's B = 4 columns, +
    where bit j of v is set: a table in one register, as the sum of the columns' x times constant sign
    vectors."""
    sig = types.void(x, col, words, tri, base)

    def codegen(context, builder, sig, args):
        _, bits, chunks, entries = SHAPE
        signs = [
            ir.Constant(ir.VectorType(F32, entries), [1.0 if v >> j & 1 else -1.0 for v in range(entries)])
            for j in range(bits)
        ]
        x_data = data(context, builder, sig.args[0], args[0])
        with cgutils.for_range(builder, args[2]) as loop:
            word = builder.add(args[1], builder.mul(loop.index, c64(CODE_WORD)))
            first = builder.add(args[4], builder.mul(loop.index, c64(chunks * entries)))
            for c in range(chunks):
                table = None
                for j in range(min(bits, CODE_WORD - bits * c)):
                    xj = builder.load(builder.gep(x_data, [builder.add(word, c64(bits * c + j))]))
                    term = builder.fmul(signs[j], splat(builder, xj, entries))
                    table = term if table is None else builder.fadd(table, term)
                out = lanes_at(context, builder, sig.args[3], args[3], builder.add(first, c64(c * entries)), entries)
                builder.store(table, out, align=4)
        return context.get_dummy_value()

    return sig, codegen
