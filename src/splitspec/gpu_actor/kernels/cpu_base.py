"""Numba 2-bit GEMM ``y[n, rows] = x · dequant(Q_base)ᵀ``: the GPU actor's kernel when no GPU is present.

The weights are never dequantized. With ``s0``, ``s1`` = ±1 for bits 0 and 1 of a code, any four levels
are ``levels[c] = c0 + c1·s1 + c2·s0 + c3·s1·s0``, so a row's dot with x over one 128-column group is
``c0·Σx + c1·Σ s1·x + c2·Σ s0·x + c3·Σ s1·s0·x``, and each signed sum splits into short runs of columns
whose signs are a few consecutive bits of a bit plane: they are looked up in tables of signed sums of x,
built once per call and shared by every row (T-MAC / LUT-GEMM style), instead of being multiplied out.
The converter's levels are symmetric (c0 = c3 = 0 exactly, see ``_coefficients``), so a group needs the
two planes' sums; other levels add the sums over ``~(b0 ^ b1)`` and the Σx term. x is not rounded: the
tables hold fp32 sums, and the result differs from the dequantized reference only in the order of fp32
additions.

Two kinds of table, by token count:

- Few tokens (up to ``_FEW``): a block of 8 rows (16 where the host has AVX-512) at a time. Their 32-byte
  group chunks are transposed so that a register holds one plane word of every row of the block; then
  every 3 bits of it (4 with AVX-512) index, by one vpermps, a table of one token's signed sums over
  those columns held in one register (``_rows_perm``): a block of rows × 3 (or 4) columns per
  instruction, with no per-row byte extraction, which made per-row lookups the slower at few tokens.
  Each further token costs its own vpermps and add per chunk. A block goes through all groups before
  the next, so the codes stream in memory order: every group's tables fit in L1 together.
- More tokens: per 8 columns, a table of the 256 signed sums of 8 tokens at once (an entry is one
  register), indexed by one byte of a row's plane (``_group_dot``): one 8-lane add per 8 columns, plane
  and 8 tokens. These tables take 128 KiB a group, so the loops go group by group, rows inner.

Either way the codes stream from memory once per call (prefetched ahead: the hardware prefetchers left
a pass from RAM well behind one from cache). The loops over codes are LLVM IR with explicit vectors
(numba intrinsics): numba leaves LLVM's SLP vectorizer off, and its loop vectorizer vectorized the wrong
loops. Scales are fp16, widened in the IR (F16C). Threads split the rows, each building its own tables:
with one thread, the engine's case, they are built once.

The Python wrapper hands numba the tensors' addresses rather than numpy views: a small layer's call takes
tens of microseconds, and converting the views had cost a large share of it.

AVX2 is required (vpermps): every machine this project targets has it.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.quantize.format import CODE_WORD, GROUP

_LANES = 8  # tokens per entry of the 8-column tables: one AVX2 register of fp32
_WORDS = GROUP // CODE_WORD  # code words per group
_WORD_BYTES = 8  # bytes of one code word across the two planes (4 of plane 0, then 4 of plane 1)
_MIN_ROWS_PER_THREAD = 64
# rows ahead whose codes the row loops prefetch: left to the hardware prefetchers, a pass with its codes in
# RAM took well longer than one with them in cache (the distance is the best measured at one token)
_PF_ROWS = 24
_ZERO = np.float32(0.0)
_F32, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V8I = ir.VectorType(_I32, 8)


# --- IR helpers (called at compile time, from the intrinsics' codegen) ----------------------------


def _c64(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _lane_type(lanes: int) -> ir.Type:
    return _F32 if lanes == 1 else ir.VectorType(_F32, lanes)


def _splat(builder: ir.IRBuilder, scalar: ir.Value, lanes: int) -> ir.Value:
    if lanes == 1:
        return scalar
    vector = ir.VectorType(_F32, lanes)
    first = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
    return builder.shuffle_vector(first, ir.Constant(vector, ir.Undefined), mask)


def _data(context, builder, ty, array):
    return context.make_array(ty)(context, builder, array).data


def _at(context, builder, ty, array, index, lanes: int):
    """Pointer to ``lanes`` floats from element ``index`` of a C-contiguous float32 array."""
    ptr = builder.gep(_data(context, builder, ty, array), [index])
    return builder.bitcast(ptr, _lane_type(lanes).as_pointer())


def _literals(*values) -> bool:
    return all(isinstance(v, types.IntegerLiteral | types.BooleanLiteral) for v in values)


def _widen(builder, bits):
    """fp16 bit patterns (i16 or a vector of them) as fp32."""
    if isinstance(bits.type, ir.IntType):
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)
    lanes = bits.type.count
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), ir.VectorType(_F32, lanes))


def _epilogue(builder, coef, sums: list, offset, lanes: int):
    """c2·(plane 0 sums) + c1·(plane 1 sums) [+ c3·(agreement sums)] + offset."""
    c1, c2, c3 = (_splat(builder, builder.extract_value(coef, i), lanes) for i in (1, 2, 3))
    dot = builder.fadd(builder.fmul(c2, sums[0]), builder.fmul(c1, sums[1]))
    if len(sums) > 2:
        dot = builder.fadd(dot, builder.fmul(c3, sums[2]))
    return builder.fadd(dot, offset)


def _pointer_to(dtype):
    @intrinsic
    def pointer(typingctx, address):
        """The address (an int) as a typed pointer, for ``numba.carray``."""
        sig = types.CPointer(dtype)(types.intp)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return sig, codegen

    return pointer


_F32_PTR, _U8_PTR, _U16_PTR = (_pointer_to(t) for t in (types.float32, types.uint8, types.uint16))


@intrinsic
def _prefetch(typingctx, array, index):
    """Prefetch the cache line holding byte ``index`` of ``array`` (past its end is fine: never faults)."""
    sig = types.void(array, index)

    def codegen(context, builder, sig, args):
        ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.bitcast(ptr, i8p), *(ir.Constant(_I32, v) for v in (0, 3, 1))])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _half(typingctx, bits):
    """One fp16 scale (its uint16 bits) as fp32."""
    if bits != types.uint16:
        return None
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        return _widen(builder, args[0])

    return sig, codegen


# --- few tokens: 8 or 16 rows at a time, tables of 3 or 4 columns indexed by vpermps -------------


def _host_is_wide() -> bool:
    """Whether numba compiles for a host with AVX-512 (16-lane vpermps, 16-entry tables). Code compiled for a
    named CPU (NUMBA_CPU_NAME) keeps to AVX2, which every target of this project has."""
    if numba.config.CPU_NAME:
        return False
    return "+avx512f" in llvm.get_host_cpu_features().flatten()


_WIDE = _host_is_wide()
# rows per block, bits (columns) per table, tables per 32-column word, entries per table
_NARROW_SHAPE, _WIDE_SHAPE = (8, 3, 11, 8), (16, 4, 8, 16)
_SHAPE = _WIDE_SHAPE if _WIDE else _NARROW_SHAPE
_TOKENS = 4  # tokens whose sums _rows_perm keeps in registers at a time
# up to this many tokens take the vpermps tables, more the 8-token byte tables (the faster for SmolLM2's
# shapes on one core, measured for each width)
_FEW = 16 if _WIDE else 3


def _transpose(builder: ir.IRBuilder, rows: list) -> list:
    """8 × 8 int32 transpose within each 256-bit half of 8 vectors of 8 or 16 lanes (unpack, unpack and
    lane-swap stages): lane r of column k is lane k of row r, and with 16 lanes (row r's upper half
    holding another row) lane 8 + r is lane 8 + k of row r."""
    width = rows[0].type.count
    vector = ir.VectorType(_I32, width)

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
def _rows_perm(typingctx, tri, codes, y, scale, offset, coef, strides, where, general, tokens, wide):
    """y[yi + rows·t + (0 .. R-1)] += scale · (c2·Σ s0·x + c1·Σ s1·x [+ c3·Σ s1·s0·x] + offset[oi + t]) over
    one group of R rows (8, or 16 if ``wide``), for each of ``repeat`` × ``tokens`` (a literal) tokens t;
    ``strides`` is (row_bytes, rows, groups) and ``where`` (ti, at, words, shift, yi, si, oi, repeat). The
    sums of ``tokens`` tokens at a time stay in registers. The rows' group chunks (32 bytes each, from
    byte ``at`` of ``codes``, ``row_bytes`` apart) are transposed once so that a register holds
    one plane word of the R rows, and every B bits of it (3, or 4 if wide) index, by vpermps, a 2^B-entry
    table of signed sums of x (``tri`` [t, word, chunk, 2^B] from element ti). 32 bytes are read per row
    even where the group has fewer ``words``: those ``shift`` words back, so that a short last group reads
    its row's end rather than past it. Scales are fp16 bits [rows, groups] from element ``si``."""
    if not _literals(general, tokens, wide):
        return None
    sig = types.void(tri, codes, y, scale, offset, coef, strides, where, general, tokens, wide)

    def codegen(context, builder, sig, args):
        nt, mixed = tokens.literal_value, general.literal_value
        block, bits, chunks, entries = _WIDE_SHAPE if wide.literal_value else _NARROW_SHAPE
        vi, vf = ir.VectorType(_I32, block), ir.VectorType(_F32, block)
        tri_t, codes_t, y_t, scale_t, offset_t = sig.args[:5]
        tri_v, codes_v, y_v, scale_v, offset_v, coef_v = args[:6]
        row_bytes_v, rows_v, groups_v = (builder.extract_value(args[6], i) for i in range(3))
        tri_at_v, at_v, words_v, shift_v, yi_v, si_v, offset_at_v, repeat_v = (
            builder.extract_value(args[7], i) for i in range(8)
        )
        planes = 3 if mixed else 2
        code_data = _data(context, builder, codes_t, codes_v)
        first = builder.sub(at_v, builder.mul(shift_v, _c64(_WORD_BYTES)))
        chunk = []
        for i in range(block):
            ptr = builder.gep(code_data, [builder.add(first, builder.mul(row_bytes_v, _c64(i)))])
            chunk.append(builder.load(builder.bitcast(ptr, _V8I.as_pointer()), align=1))
        if block == 16:  # rows r and r + 8 side by side
            chunk = [builder.shuffle_vector(chunk[i], chunk[i + 8], ir.Constant(vi, list(range(16)))) for i in range(8)]
        cols = _transpose(builder, chunk)
        scale_data = _data(context, builder, scale_t, scale_v)
        scale_bits = ir.Constant(ir.VectorType(_I16, block), ir.Undefined)
        for i in range(block):
            h = builder.load(builder.gep(scale_data, [builder.add(si_v, builder.mul(groups_v, _c64(i)))]))
            scale_bits = builder.insert_element(scale_bits, h, ir.Constant(_I32, i))
        scales = _widen(builder, scale_bits)
        zero = ir.Constant(vf, [0.0] * block)
        sums = [
            [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(planes)] for _ in range(nt)
        ]
        name = "llvm.x86.avx512.permvar.sf.512" if block == 16 else "llvm.x86.avx2.permps"
        permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi]), name)
        offsets = _data(context, builder, offset_t, offset_v)
        end = builder.add(shift_v, words_v)
        with cgutils.for_range(builder, repeat_v) as loop:  # blocks of nt tokens, on the same transposed codes
            tri_at = builder.add(tri_at_v, builder.mul(loop.index, _c64(nt * _WORDS * chunks * entries)))
            for slot in (slot for token in sums for plane in token for slot in plane):
                builder.store(zero, slot)
            for w in range(_WORDS):  # w: the word's place in the 32 bytes read
                inside = builder.and_(
                    builder.icmp_signed("<=", shift_v, _c64(w)), builder.icmp_signed(">", end, _c64(w))
                )
                with builder.if_then(inside, likely=True):
                    words_bits = [cols[2 * w], cols[2 * w + 1]]
                    if mixed:  # + where the two bits agree
                        words_bits.append(builder.not_(builder.xor(words_bits[0], words_bits[1])))
                    word = builder.sub(_c64(w), shift_v)
                    for p, plane in enumerate(words_bits):
                        for c in range(chunks):
                            index = builder.lshr(plane, ir.Constant(vi, [bits * c] * block)) if c else plane
                            for t in range(nt):
                                entry = builder.add(
                                    builder.mul(builder.add(word, _c64(t * _WORDS)), _c64(chunks * entries)),
                                    builder.add(tri_at, _c64(c * entries)),
                                )
                                table = builder.load(_at(context, builder, tri_t, tri_v, entry, block), align=4)
                                slot = sums[t][p][c % 2]
                                value = builder.call(permute, [table, index])
                                builder.store(builder.fadd(builder.load(slot), value), slot)
            first_token = builder.mul(loop.index, _c64(nt))
            for t in range(nt):
                token = builder.add(first_token, _c64(t))
                parts = [builder.fadd(builder.load(a), builder.load(b)) for a, b in sums[t]]
                offset = builder.load(builder.gep(offsets, [builder.add(offset_at_v, token)]))
                dot = _epilogue(builder, coef_v, parts, _splat(builder, offset, block), block)
                out = _at(context, builder, y_t, y_v, builder.add(yi_v, builder.mul(rows_v, token)), block)
                builder.store(builder.fadd(builder.load(out, align=4), builder.fmul(scales, dot)), out, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _build_tri(typingctx, x, col, words, tri, base, wide):
    """tri[base + (w·chunks + c)·2^B + v] = Σ_j ±x[col + 32w + B·c + j] over the chunk's B columns (B = 3,
    or 4 if ``wide``; a last chunk of 3-column tables has 2), + where bit j of v is set: a table in one
    register, as the sum of the columns' x times constant sign vectors."""
    if not _literals(wide):
        return None
    sig = types.void(x, col, words, tri, base, wide)

    def codegen(context, builder, sig, args):
        _, bits, chunks, entries = _WIDE_SHAPE if wide.literal_value else _NARROW_SHAPE
        signs = [
            ir.Constant(ir.VectorType(_F32, entries), [1.0 if v >> j & 1 else -1.0 for v in range(entries)])
            for j in range(bits)
        ]
        x_data = _data(context, builder, sig.args[0], args[0])
        with cgutils.for_range(builder, args[2]) as loop:
            word = builder.add(args[1], builder.mul(loop.index, _c64(CODE_WORD)))
            first = builder.add(args[4], builder.mul(loop.index, _c64(chunks * entries)))
            for c in range(chunks):
                table = None
                for j in range(min(bits, CODE_WORD - bits * c)):
                    xj = builder.load(builder.gep(x_data, [builder.add(word, _c64(bits * c + j))]))
                    term = builder.fmul(signs[j], _splat(builder, xj, entries))
                    table = term if table is None else builder.fadd(table, term)
                out = _at(context, builder, sig.args[3], args[3], builder.add(first, _c64(c * entries)), entries)
                builder.store(table, out, align=4)
        return context.get_dummy_value()

    return sig, codegen


# --- more tokens: 8-column tables of 8 tokens, indexed by a byte per lookup -----------------------


@intrinsic
def _build(typingctx, x, at, table, base, lanes):
    """table[base + L·v + i] = Σ_j ±x[at + L·j + i] over the 8 columns j, + where bit j of v is set
    (L = lanes, a literal): 255 L-lane adds, by doubling."""
    if not _literals(lanes):
        return None
    sig = types.void(x, at, table, base, lanes)

    def codegen(context, builder, sig, args):
        n = lanes.literal_value
        xs = [
            builder.load(_at(context, builder, sig.args[0], args[0], builder.add(args[1], _c64(n * j)), n), align=4)
            for j in range(8)
        ]
        total = xs[0]
        for value in xs[1:]:
            total = builder.fadd(total, value)

        def entry(v):
            return _at(context, builder, sig.args[2], args[2], builder.add(args[3], builder.mul(v, _c64(n))), n)

        builder.store(builder.fneg(total), entry(_c64(0)), align=4)
        for k in range(8):
            two = builder.fadd(xs[k], xs[k])
            with cgutils.for_range(builder, _c64(1 << k)) as loop:
                low = builder.load(entry(loop.index), align=4)
                builder.store(builder.fadd(low, two), entry(builder.add(loop.index, _c64(1 << k))), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _group_dot(typingctx, table, codes, at, words, acc, ai, scale, coef, offset, general, lanes):
    """acc[ai : ai + L] += scale · (c2·Σ s0·x + c1·Σ s1·x [+ c3·Σ s1·s0·x] + offset[0 : L]) for one row's
    group: ``words`` code words of 8 bytes (4 of plane 0, 4 of plane 1) from byte ``at`` of ``codes``, each
    byte one lookup in ``table`` [pieces, 256, L] (L = lanes, a literal). A chain of sums per byte of a word,
    so that the adds' latency does not bound a row."""
    if not _literals(general, lanes):
        return None
    sig = types.void(table, codes, at, words, acc, ai, scale, coef, offset, general, lanes)

    def codegen(context, builder, sig, args):
        n, mixed = lanes.literal_value, general.literal_value
        vt = _lane_type(n)
        zero = ir.Constant(vt, 0.0 if n == 1 else [0.0] * n)
        sums = [cgutils.alloca_once_value(builder, zero) for _ in range(9 if mixed else 8)]
        code_data = _data(context, builder, sig.args[1], args[1])
        table_data = builder.bitcast(_data(context, builder, sig.args[0], args[0]), ir.IntType(8).as_pointer())
        shift = (4 * n).bit_length() - 1  # bytes per entry = 2^shift
        with cgutils.for_range(builder, args[3]) as loop:
            first = builder.add(args[2], builder.mul(loop.index, _c64(_WORD_BYTES)))
            word = builder.load(builder.bitcast(builder.gep(code_data, [first]), _I64.as_pointer()), align=1)
            pieces = builder.gep(table_data, [builder.mul(loop.index, _c64(4 << (8 + shift)))])

            def lookup(value, k: int, piece: int):
                """The entry indexed by byte k of ``value``, its offset cut out already scaled (2 ops)."""
                if 8 * k >= shift:
                    scaled = builder.lshr(value, _c64(8 * k - shift))
                else:
                    scaled = builder.shl(value, _c64(shift - 8 * k))
                offset = builder.and_(scaled, _c64(255 << shift))
                ptr = builder.gep(pieces, [builder.add(offset, _c64(piece << (8 + shift)))])
                return builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4)

            for k in range(8):
                builder.store(builder.fadd(builder.load(sums[k]), lookup(word, k, k & 3)), sums[k])
            if mixed:  # the bytes ~(b0 ^ b1): + where the two bits agree
                same = builder.not_(builder.xor(word, builder.lshr(word, _c64(32))))
                for j in range(4):
                    builder.store(builder.fadd(builder.load(sums[8]), lookup(same, j, j)), sums[8])
        part = [builder.load(slot) for slot in sums]
        planes = [
            builder.fadd(builder.fadd(part[4 * p], part[4 * p + 1]), builder.fadd(part[4 * p + 2], part[4 * p + 3]))
            for p in range(2)
        ]
        offset = builder.load(_at(context, builder, sig.args[8], args[8], _c64(0), n), align=4)
        dot = _epilogue(builder, args[7], planes + part[8:], offset, n)
        out = _at(context, builder, sig.args[4], args[4], args[5], n)
        total = builder.fadd(builder.load(out, align=4), builder.fmul(_splat(builder, args[6], n), dot))
        builder.store(total, out, align=4)
        return context.get_dummy_value()

    return sig, codegen


# --- the row loops ---------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _coefficients(levels: np.ndarray) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """(c0, c1, c2, c3) of the bilinear form; sums of opposite levels first, so that exactly symmetric
    levels give c0 = c3 = 0 exactly."""
    l0, l1, l2, l3 = np.float64(levels[0]), np.float64(levels[1]), np.float64(levels[2]), np.float64(levels[3])
    outer, inner = l0 + l3, l1 + l2
    c0 = (outer + inner) / 4
    c1 = ((l3 - l0) + (l2 - l1)) / 4
    c2 = ((l3 - l0) - (l2 - l1)) / 4
    c3 = (outer - inner) / 4
    return np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3)


@njit(inline="always", cache=True)
def _perm_tokens(tri, c8, y, scale, offsets, coef, strides, where, general, tokens):
    if tokens == 4:
        _rows_perm(tri, c8, y, scale, offsets, coef, strides, where, general, 4, _WIDE)
    elif tokens == 3:
        _rows_perm(tri, c8, y, scale, offsets, coef, strides, where, general, 3, _WIDE)
    elif tokens == 2:
        _rows_perm(tri, c8, y, scale, offsets, coef, strides, where, general, 2, _WIDE)
    else:
        _rows_perm(tri, c8, y, scale, offsets, coef, strides, where, general, 1, _WIDE)


@njit(inline="always", cache=True)
def _perm_call(tri, c8, y, scale, offsets, coef, strides, where, general, tokens):
    """``_rows_perm`` for a run-time count of tokens (1 .. 4) and ``general``, as literals."""
    if general:
        _perm_tokens(tri, c8, y, scale, offsets, coef, strides, where, True, tokens)
    else:
        _perm_tokens(tri, c8, y, scale, offsets, coef, strides, where, False, tokens)


@njit(cache=True)
def _rows_few(c8, scale, coef, x, y, r_lo, r_hi, general):
    """y[:, r] for rows r_lo .. r_hi - 1: blocks of 8 or 16 rows (``_SHAPE``) by ``_rows_perm``, 4 tokens at a
    time, each block through all groups, so that the codes stream in memory order (every group's tables
    fit in L1 together); the rows left over by one-token byte tables."""
    block, _, chunks, entries = _SHAPE
    n, d_in = x.shape
    rows = y.shape[1]
    words, groups = d_in // CODE_WORD, -(-d_in // GROUP)
    size = _WORDS * chunks * entries  # one token's tables for a group
    tri = np.empty(groups * n * size, np.float32)  # [group, token, word, chunk, entry]
    offsets = np.empty(groups * n, np.float32)
    for g in range(groups):
        w0 = g * _WORDS
        nw = min(_WORDS, words - w0)
        for t in range(n):
            base = (g * n + t) * size
            _build_tri(x[t], w0 * CODE_WORD, nw, tri, base, _WIDE)
            total = _ZERO
            for k in range(nw * chunks):
                total += tri[base + (k + 1) * entries - 1]
            offsets[g * n + t] = coef[0] * total
    y[:, r_lo:r_hi] = 0
    # a short last group reads the 32 bytes that end it; with no group before it (d_in < 128), a block
    # holding the last row would read past the codes
    limit = r_hi - 1 if words < _WORDS and r_hi == rows else r_hi
    row_bytes = words * _WORD_BYTES
    strides = (row_bytes, rows, groups)
    r = r_lo
    while r + block <= limit:
        ahead = (r + _PF_ROWS) * row_bytes
        for line in range(0, block * row_bytes, 64):
            _prefetch(c8, ahead + line)
        for g in range(groups):
            w0 = g * _WORDS
            nw = min(_WORDS, words - w0)
            shift = _WORDS - nw if g else 0
            at, si = (r * words + w0) * _WORD_BYTES, r * groups + g
            where = ((g * n) * size, at, nw, shift, r, si, g * n, n // _TOKENS)
            if n >= _TOKENS:
                _perm_call(tri, c8, y, scale, offsets, coef, strides, where, general, _TOKENS)
            if n % _TOKENS:
                t = n - n % _TOKENS
                where = ((g * n + t) * size, at, nw, shift, t * rows + r, si, g * n + t, 1)
                _perm_call(tri, c8, y, scale, offsets, coef, strides, where, general, n % _TOKENS)
        r += block
    table = np.empty(_WORDS * 4 * 256, np.float32)
    for g in range(groups if r < r_hi else 0):
        w0 = g * _WORDS
        nw = min(_WORDS, words - w0)
        for t in range(n):
            for q in range(nw * 4):
                _build(x[t], w0 * CODE_WORD + 8 * q, table, q * 256, 1)
            for i in range(r, r_hi):
                at, s, og = (i * words + w0) * _WORD_BYTES, _half(scale[i * groups + g]), offsets[g * n + t :]
                if general:
                    _group_dot(table, c8, at, nw, y[t], i, s, coef, og, True, 1)
                else:
                    _group_dot(table, c8, at, nw, y[t], i, s, coef, og, False, 1)


@njit(cache=True)
def _rows_many(c8, scale, coef, x, y, r_lo, r_hi, general):
    """y[:, r] for rows r_lo .. r_hi - 1, tokens in blocks of 8 (the last zero-padded): per group and block,
    8-column tables of the block's tokens, then every row's lookups into them."""
    n, d_in = x.shape
    words, groups = d_in // CODE_WORD, -(-d_in // GROUP)
    blocks = -(-n // _LANES)
    xs = np.zeros((blocks, d_in, _LANES), np.float32)  # token fastest: a table entry's lanes
    for t in range(n):
        xs[t // _LANES, :, t % _LANES] = x[t]
    flat = xs.reshape(-1)
    acc = np.zeros((r_hi - r_lo) * blocks * _LANES, np.float32)
    table = np.empty(_WORDS * 4 * 256 * _LANES, np.float32)
    offset = np.empty(_LANES, np.float32)
    for g in range(groups):  # groups outermost: a group's codes serve every block from cache
        w0 = g * _WORDS
        nw = min(_WORDS, words - w0)
        for block in range(blocks):
            for q in range(nw * 4):
                _build(flat, (block * d_in + w0 * CODE_WORD + 8 * q) * _LANES, table, q * 256 * _LANES, _LANES)
            for i in range(_LANES):
                total = _ZERO
                for q in range(nw * 4):
                    total += table[(q * 256 + 255) * _LANES + i]
                offset[i] = coef[0] * total
            for r in range(r_lo, r_hi):
                _prefetch(c8, ((r + _PF_ROWS) * words + w0) * _WORD_BYTES)
                at, ai, s = (
                    (r * words + w0) * _WORD_BYTES,
                    (block * (r_hi - r_lo) + r - r_lo) * _LANES,
                    _half(scale[r * groups + g]),
                )
                if general:
                    _group_dot(table, c8, at, nw, acc, ai, s, coef, offset, True, _LANES)
                else:
                    _group_dot(table, c8, at, nw, acc, ai, s, coef, offset, False, _LANES)
    for r in range(r_lo, r_hi):
        for t in range(n):
            y[t, r] = acc[((t // _LANES) * (r_hi - r_lo) + r - r_lo) * _LANES + t % _LANES]


@njit(inline="always", cache=True)
def _chunk(c8, scale, coef, general, x, y, chunk, chunks):
    """Rows of one thread's share (whole row blocks but the last)."""
    block = _SHAPE[0]
    blocks = -(-y.shape[1] // block)
    r_lo = min(y.shape[1], chunk * blocks // chunks * block)
    r_hi = min(y.shape[1], (chunk + 1) * blocks // chunks * block)
    if x.shape[0] <= _FEW:
        _rows_few(c8, scale, coef, x, y, r_lo, r_hi, general)
    else:
        _rows_many(c8, scale, coef, x, y, r_lo, r_hi, general)


@njit(cache=True, parallel=True)
def _parallel(c8, scale, coef, general, x, y, chunks):
    for chunk in prange(chunks):
        _chunk(c8, scale, coef, general, x, y, chunk, chunks)


@njit(cache=True)
def _kernel(codes_at, scale_at, levels_at, x_at, y_at, n, rows, words, threads):
    """The product over raw addresses: codes [rows, words, 2] int32 (read as bytes), scale [rows, groups]
    fp16 bits, levels [4] fp32, x [n, 32·words] fp32, y [n, rows] fp32, all C-contiguous. ``threads`` comes
    from Python: numba.get_num_threads() inside would keep this function out of the cache."""
    d_in = words * CODE_WORD
    groups = -(-d_in // GROUP)
    c8 = numba.carray(_U8_PTR(codes_at), rows * words * _WORD_BYTES)
    scale = numba.carray(_U16_PTR(scale_at), rows * groups)
    coef = _coefficients(numba.carray(_F32_PTR(levels_at), 4))
    x = numba.carray(_F32_PTR(x_at), (n, d_in))
    y = numba.carray(_F32_PTR(y_at), (n, rows))
    general = coef[3] != 0
    chunks = min(threads, max(1, rows // _MIN_ROWS_PER_THREAD))
    if chunks == 1:
        _chunk(c8, scale, coef, general, x, y, 0, 1)
    else:
        _parallel(c8, scale, coef, general, x, y, chunks)


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ on the CPU; arguments as ``gpu_actor.kernels.base_matmul``, which checks them."""
    n, rows = x.shape[0], codes.shape[0]
    y = out if out is not None and out.is_contiguous() else torch.empty(n, rows)
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    if levels.dtype is not torch.float32 or not levels.is_contiguous():
        levels = levels.to(torch.float32).contiguous()
    codes, scale = codes.contiguous(), scale.contiguous()  # the tensors stay alive through the call
    threads = numba.get_num_threads()
    _kernel(
        codes.data_ptr(),
        scale.data_ptr(),
        levels.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        n,
        rows,
        codes.shape[1],
        threads,
    )
    if out is None:
        return y
    if y is not out:  # a column slice: one kernel specialization (C layout) is worth a small copy
        out.copy_(y)
    return out
