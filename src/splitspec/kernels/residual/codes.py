"""IR that reads the packed residual: the ``words`` planes' codes of a step, unpacked in registers, and
what every product loop does with a group's sums (the scale bytes, the accumulators)."""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from splitspec.kernels.ir import I8, I32, c64, call, element, load, loop, prefetch, splat, store
from splitspec.kernels.residual.params import HALF, PF_COLS, V8F, V8I32, V16I16
from splitspec.quantize.packing import SCALE_MANTISSA, SCALE_SPAN, STEP, TILE, WORD_SPLIT

V32I = ir.VectorType(I32, 32)  # shuffle masks of 32 lanes


def fma(builder, a, b, c):
    return call(builder, f"llvm.fma.v{a.type.count}f32", a.type, [a, b, c])


def scale_to_f32(builder, ptr):
    """8 scale bytes at ``ptr`` (``packing``, "scale") as fp32, relative to their tile's top: the byte's 2
    octave bits and 6 mantissa bits shifted into an fp32's exponent and mantissa, plus the exponent's bias
    (exact; the tile's power of two is applied to its sums at the end)."""
    b = builder.zext(load(builder, ptr, ir.VectorType(I8, 8), align=1), V8I32)
    shifted = builder.shl(b, ir.Constant(V8I32, [23 - SCALE_MANTISSA] * 8))
    bits = builder.add(shifted, ir.Constant(V8I32, [(127 - SCALE_SPAN + 1) << 23] * 8))
    return builder.bitcast(bits, V8F)


def word_planes(context, builder, types_: tuple, arrays: tuple, step0, bits: int) -> list:
    """Pointers to step ``step0``'s words in each ``words`` plane (``WORD_SPLIT[bits]`` words per step each)."""
    return [
        element(context, builder, ty, a, builder.mul(step0, c64(16 * k)))
        for ty, a, k in zip(types_, arrays, WORD_SPLIT[bits], strict=True)
    ]


def operands(context, builder, sig, args, abase) -> tuple:
    """Pointers (x, scale, xs, xb, acc) to where a product loop starts reading and writing: the intrinsics
    share argument positions 6-14 (x, xbase, n, scale, sbase, xs, xb, xsbase, acc), so x is at xbase, scale
    at sbase, xs and xb at xsbase, and acc at ``abase``."""
    ty = sig.args
    x_p = element(context, builder, ty[6], args[6], args[7])
    scale_p = element(context, builder, ty[9], args[9], args[10])
    xs_p, xb_p = (element(context, builder, ty[i], args[i], args[13]) for i in (11, 12))
    return x_p, scale_p, xs_p, xb_p, element(context, builder, ty[14], args[14], abase)


def step_planes(builder, planes: list, s, bits: int) -> list:
    """The ``words`` planes' pointers moved ``s`` steps on, each prefetched ``PF_COLS`` columns ahead
    (every 64-byte line of its share of a step)."""
    moved = []
    for p, k in zip(planes, WORD_SPLIT[bits], strict=True):
        p = builder.gep(p, [builder.mul(s, c64(16 * k))])
        for offset in range(0, 32 * k, 64):
            prefetch(builder, builder.gep(p, [c64(PF_COLS // STEP[bits] * 16 * k + offset // 2)]))
        moved.append(p)
    return moved


def _word_at(builder, planes: list, bits: int, w: int, ty=V16I16):
    """Word w of a step (the ``words`` planes' words in order, ``WORD_SPLIT[bits]`` from each), loaded as
    ``ty``: each lane's words one after the other are one number, code j its bits bits·j .. ."""
    where = [(p, 16 * i) for p, k in zip(planes, WORD_SPLIT[bits], strict=True) for i in range(k)]
    p, offset = where[w]
    return load(builder, builder.gep(p, [c64(offset)]), ty, align=2)


def step_codes(builder, planes: list, bits: int) -> Callable:
    """``code(j)``: the unsigned codes j of the step whose words sit at ``planes`` (the ``words`` planes of
    packing.py, uint16), an int16 vector whose lanes 2r and 2r + 1 are row 8·(j % 2) + r of the step's
    columns 2·(j // 2) and 2·(j // 2) + 1, as vpmaddwd wants them. Code j is bits b·j .. b·j + b - 1 of
    each lane's words: one 16-bit shift and/or mask, or, where it straddles two words, two shifts, a mask
    and an OR; no byte shuffles. Each word is loaded where first needed."""
    loaded: dict[int, ir.Value] = {}

    def word(w: int):
        if w not in loaded:
            loaded[w] = _word_at(builder, planes, bits, w)
        return loaded[w]

    def k(value: int):
        return ir.Constant(V16I16, [value] * 16)

    mask = (1 << bits) - 1

    def code(j: int):
        w, offset = divmod(bits * j, 16)
        value = builder.lshr(word(w), k(offset)) if offset else word(w)
        if offset + bits > 16:
            return builder.or_(value, builder.and_(builder.shl(word(w + 1), k(16 - offset)), k(mask)))
        return builder.and_(value, k(mask)) if offset + bits < 16 else value

    return code


def accumulate(builder, acc_p, k: int, h: int, total, wscale, xs_p) -> None:
    """acc[16k + 8h ...] += total · weight scale: a group's sums of rows 8h..8h+7 for token k. With integer
    activations (``xs_p`` not None) total is int32, and the token's activation scale for the group
    folds into the weight scale here, once per group and token."""
    xs = None if xs_p is None else builder.load(builder.gep(xs_p, [c64(k)]))
    add_scaled(builder, builder.gep(acc_p, [c64(TILE * k + 8 * h)]), total, wscale, xs)


def add_scaled(builder, p, total, wscale, xs=None) -> None:
    """The fp32 accumulators at ``p`` += total · weight scale, fused; with integer activations (``xs``, the
    token's activation scale for the group) total is int32, converted, and xs folds into the weight scale
    first. Every loop that scales a group's sums (vector or AMX, 8 or 16 lanes) does it here, so that they
    round alike, bit for bit."""
    scale = wscale
    if xs is not None:
        total = builder.sitofp(total, wscale.type)
        scale = builder.fmul(wscale, splat(builder, xs, wscale.type.count))
    store(builder, fma(builder, total, scale, load(builder, p, wscale.type, align=4)), p, align=4)


def unpack_steps(builder, planes: list, first, end, out_p, b: int, wide: bool = True) -> None:
    """Store the codes of steps first .. end - 1 of the ``words`` planes at ``planes`` in the buffer ``out_p``
    (prefetching the planes ahead), for a loop that reads them again:

    - ``wide``: for ``many_dot``, each ``step_codes`` vector as it is (unsigned int16), code j of step
      first + s at int16 offset 16·(s·step + j);
    - otherwise, for ``fp32_products``: signed int8 [2, HALF], rows 0-7 of column c at [0, 8c], rows
      8-15 at [1, 8c]: a code vector (rows 8h .. 8h + 7 of a column pair, its two columns interleaved)
      gives its low bytes, de-interleaved, as the pair's 16 bytes at [h, 8·(first column)].

    A group's last step may run past its columns: the plane pads them with code 0."""
    v16i8 = ir.VectorType(I8, 16)
    columns = ir.Constant(ir.VectorType(I32, 16), [*range(0, 16, 2), *range(1, 16, 2)])
    offset = ir.Constant(V16I16, [1 << (b - 1)] * 16)

    def step(s, _) -> list:
        code = step_codes(builder, step_planes(builder, planes, s, b), b)
        column0 = builder.mul(builder.sub(s, first), c64(STEP[b]))
        for j in range(STEP[b]):
            if wide:
                dst = builder.gep(out_p, [builder.mul(builder.add(column0, c64(j)), c64(16))])
                store(builder, code(j), dst, 32)
                continue
            signed = builder.trunc(builder.sub(code(j), offset), v16i8)
            column = builder.add(column0, c64(2 * (j // 2)))
            dst = builder.gep(out_p, [builder.add(builder.mul(column, c64(8)), c64((j % 2) * HALF))])
            store(builder, builder.shuffle_vector(signed, signed, columns), dst, align=1)
        return []

    loop(builder, first, end, 1, [], step)


# 8-bit codes are whole bytes of the words: word w holds columns 2w and 2w + 1, its byte 2(2r + c) + h row
# 8h + r of column 2w + c. Byte 4R + k of a tile row (row R, column 4q + k) is then one byte of words 2q
# and 2q + 1 side by side (64 bytes), wherever it sits: one byte permutation (vpermb).
_BYTE_QUADS = ir.Constant(
    ir.VectorType(I32, 64),
    [32 * (k // 2) + 2 * (2 * (row % 8) + k % 2) + row // 8 for row in range(16) for k in range(4)],
)


# 6- and 7-bit codes straddle the words. Each lane's words side by side are one number (code j its bits
# b·j ..), so four words of a lane make a qword and vpmultishiftqb cuts eight codes out of it at once:
# per step, the qwords of words (first, first + 1, first + 2, first + 3) give codes 8s .. 8s + 7 (the
# 6-bit step's third word is repeated: the bits past it are masked off).
_QWORDS = {6: ((0, 1, 2, 2),), 7: ((0, 1, 2, 3), (3, 4, 5, 6))}


def _shifted_quads(builder, planes: list, out_p, row0, b: int) -> None:
    """``unpack_quads``'s step for 6- and 7-bit codes: per set of eight codes, each lane's four words
    gathered into a qword (a word permutation per 8 lanes), the codes cut out of it as bytes
    (vpmultishiftqb), then permuted into their tile rows (two rows a set) and masked to b bits."""
    v64i8 = ir.VectorType(I8, 64)
    words = [_word_at(builder, planes, b, w) for w in range(sum(WORD_SPLIT[b]))]
    mask = ir.Constant(v64i8, [(1 << b) - 1] * 64)
    for s, (w0, w1, w2, w3) in enumerate(_QWORDS[b]):
        low, high = (
            builder.shuffle_vector(words[u], words[v], ir.Constant(V32I, list(range(32))))
            for u, v in ((w0, w1), (w2, w3))
        )
        halves = []
        for lanes in (range(8), range(8, 16)):
            gathered = builder.shuffle_vector(
                low, high, ir.Constant(V32I, [i + 16 * m for i in lanes for m in range(4)])
            )
            shifts = ir.Constant(v64i8, [b * (8 * s + j) - 16 * w0 for _ in range(8) for j in range(8)])
            halves.append(
                call(builder, "llvm.x86.avx512.pmultishift.qb.512", v64i8, [shifts, builder.bitcast(gathered, v64i8)])
            )
        for q in (2 * s, 2 * s + 1):
            rows = builder.shuffle_vector(*halves, _code_rows(q, 8 * s))
            dst = builder.gep(out_p, [builder.mul(builder.add(row0, c64(q)), c64(64))])
            store(builder, builder.and_(rows, mask), dst, align=32)


def _code_rows(q: int, j0: int) -> ir.Constant:
    """Tile row q's bytes (row R, column 4q + k at 4R + k) out of a set's codes j0 .. j0 + 7 cut as bytes,
    lane L's code j at 8L + j - j0: code j is row 8(j % 2) + r of column 2(j // 2) + c, for lane L = 2r + c."""
    return ir.Constant(
        ir.VectorType(I32, 64),
        [8 * (2 * (row % 8) + k % 2) + 2 * (2 * q + k // 2) + row // 8 - j0 for row in range(16) for k in range(4)],
    )


def _byte_quads(builder, planes: list, out_p, row0) -> None:
    """``unpack_quads``'s step for 8-bit codes, whose bytes need no shifts: the step's words (``planes``,
    moved to it) permuted straight into its two tile rows from row ``row0`` of ``out_p``."""
    v32i8 = ir.VectorType(I8, 32)
    words = [_word_at(builder, planes, 8, w, v32i8) for w in range(sum(WORD_SPLIT[8]))]
    for q in range(STEP[8] // 4):
        dst = builder.gep(out_p, [builder.mul(builder.add(row0, c64(q)), c64(64))])
        store(builder, builder.shuffle_vector(words[2 * q], words[2 * q + 1], _BYTE_QUADS), dst, align=32)


def unpack_quads(builder, planes: list, first, end, out_p, b: int) -> None:
    """Store the codes of steps first .. end - 1 (at most a group) of the ``words`` planes at ``planes`` in
    ``out_p`` as AMX's second operand wants them (uint8, ``amx_row``): 64-byte row q holds, for rows
    r = 0 .. 15, the codes of columns 4q .. 4q + 3 at bytes 4r .. 4r + 3, so a group's 128 columns are two
    tiles of 16 such rows. By permutes, not through ``step_codes``'s vectors (a shift and a mask each, then
    narrowing and two byte shuffles a tile row), which had taken a tiled pass the most time of any part
    (benchmarks/README, "AMX tiles for passes of many tokens"): 8-bit codes by ``_byte_quads``, 6- and
    7-bit ones by ``_shifted_quads``."""

    def step(s, _) -> list:
        moved = step_planes(builder, planes, s, b)
        row0 = builder.mul(builder.sub(s, first), c64(STEP[b] // 4))
        if b == 8:
            _byte_quads(builder, moved, out_p, row0)
        else:
            _shifted_quads(builder, moved, out_p, row0, b)
        return []

    loop(builder, first, end, 1, [], step)
