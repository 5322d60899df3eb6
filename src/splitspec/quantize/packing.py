"""Storage layout of the residual: 16-row tiles, the codes packed into 16-bit words in a "pair map".

The CPU actor streams the whole residual from RAM once per verify pass, so the layout is chosen for
that loop and for sharding, not for the converter's convenience. It is the same for 6, 7 and 8 bits:

- Codes ``q`` are ints in ``[-qm, qm]``, ``qm = 2^(b-1) - 1``, ``b`` in {6, 7, 8}; there is one scale
  per (row, 128-column group). ``G = ceil(d_in / 128)``; the last group may be shorter
  (``d_in = 576`` gives ``G = 5``, the last of 64 columns).
- Rows are padded to a multiple of 16 (padded rows: code 0, scale byte 0) and stored in 16-row tiles,
  tile ``t`` = rows ``16t .. 16t+15``. Every tensor has the tile index as its leading axis, so any
  slice of whole tiles is one contiguous byte range of every tensor: a shard of rows is a byte range
  of the file, and an actor can map or copy it without reshuffling.
- The codes are stored unsigned, ``u = q + 2^(b-1)`` in ``[1, 2^b - 1]``, in steps of ``step = STEP[b]``
  columns (8 for 6 and 8 bits, 16 for 7), ``S = ceil(d_in / step)``; columns past ``d_in`` are padding
  with ``u = 2^(b-1)`` (``q = 0``), as are the padded rows.

  Step ``s`` of tile ``t`` holds ``step`` codes per lane ``i`` in ``[0, 16)``: code ``j`` of lane ``i`` is
  the code of tile row ``8·(j % 2) + i // 2``, column ``s·step + 2·(j // 2) + i % 2``. So code ``j`` of
  all 16 lanes is rows ``8h .. 8h+7`` (``h = j % 2``) of the step's column pair ``p = j // 2``, lanes
  ``2r`` and ``2r + 1`` being columns ``2p`` and ``2p + 1`` of row ``8h + r``. Each lane's codes make one
  ``16·W``-bit integer ``V_i = Σ_j u(j, i) << (b·j)``, ``W = WORDS[b]`` (3 for 6 bits, 7 for 7, 4 for 8),
  stored low word first: ``words[t, s, w, i] = (V_i >> 16w) & 0xFFFF``. No bit is spare (6·8 = 3·16,
  7·16 = 7·16, 8·8 = 4·16): a tile column takes 12, 14 or 16 bytes, plus the padding of the last step.

  ``words`` is stored as three uint16 planes, ``"words0"``, ``"words1"``, ``"words2"``, each
  ``[T][S][k][16]``: consecutive runs of its ``W`` words (``WORD_SPLIT[b]``: 1, 1, 1 for 6 bits, 4, 2, 1
  for 7, 2, 1, 1 for 8). One plane would do, but the kernel's loop reads three streams faster than one,
  and one stream per word was no faster than one (measurements: ``benchmarks/README.md``, "Residual
  layout").
- ``"scale"``: uint8 ``[T][G][16]``, each scale as a small float relative to its tile's ``"scale_top"``
  (float32 ``[T]``, a power of two): byte ``e·64 + m`` stands for ``top · 2^(e-3) · (1 + m/64)``, so a tile
  spans four octaves ``[top/8, 1.984·top]`` with six mantissa bits. The kernel turns 8 bytes into 8 fp32
  scales with a shift and an add (the byte's bits land in an fp32's exponent and mantissa) and multiplies
  the tile's sums by the power of two once, exactly. Against an fp16 scale per group this is half the
  scale bytes (1/16 bit a weight), which the mixed widths of ``quantize.convert`` spend on wider groups;
  choosing the nearer of the two grid values around each group's max/qm by rounding error
  (``quantize.gptq.UniformQuantizer``) costs no precision (``benchmarks/README.md``, "Precision"). Scales
  within a tile span under three octaves in practice; the quantizer clamps a rare smaller one to its
  tile's floor.

Why this map: the CPU kernel multiplies int16 codes with vpmaddwd, whose int16 lanes must hold two
columns of one row side by side. Here each code vector ``j`` comes out of the words with one 16-bit
shift and/or mask (for 8 bits an AND with 0xFF or a shift by 8; two shifts, a mask and an OR where a
6/7-bit code straddles two words) and is rows ``8h .. 8h+7`` of one column pair, so one vpmaddwd
against a broadcast of that pair's two activations gives 8 rows' int32 sums. Against format 3's map
(each code vector 4 rows × 4 columns) that is 2 accumulators per token instead of 4, and x in a plain
pair layout instead of replicated 4×; for 8 bits it also replaces format 3's int8 ``"q"`` plane (two
byte unpacks and two sign extensions per 32 codes). How the map compares with format 3's, loop by loop
and for the whole kernel, is measured in ``benchmarks/README.md`` ("Residual layout"). (Formats before 3
stored 6/7-bit codes in bit planes, 3 in words with that 4 × 4 map and 8-bit codes as plain int8;
format 4 is this one layout for all widths.)
"""

from __future__ import annotations

import math

import numpy as np

TILE = 16
GROUP = 128
_WORD_PLANES = ("words0", "words1", "words2")
SCALE_PLANES = ("scale", "scale_top")
SCALE_MANTISSA = 6  # bits of a scale byte's mantissa; the other 2 pick one of 4 octaves below the top
SCALE_SPAN = 2 ** (8 - SCALE_MANTISSA)  # octaves a tile's scales may span
SCALE_MAX = 2.0 - 2.0**-SCALE_MANTISSA  # the largest scale over its tile's top
SCALE_BITS = 8 / GROUP  # what the scale bytes add to a weight's bits
PLANES: dict[int, tuple[str, ...]] = {6: _WORD_PLANES, 7: _WORD_PLANES, 8: _WORD_PLANES}
STEP: dict[int, int] = {6: 8, 7: 16, 8: 8}  # columns per step, also the codes per lane
WORDS: dict[int, int] = {6: 3, 7: 7, 8: 4}  # uint16 words per lane and step
WORD_SPLIT: dict[int, tuple[int, ...]] = {6: (1, 1, 1), 7: (4, 2, 1), 8: (2, 1, 1)}  # of them, in each plane
# A tile's unsigned codes [16 rows, S·step columns] split as (row half h, row r in half, step, column
# pair p, column c in pair); _PAIR_ORDER puts them in "words" order [step, j = (p, h), lane = (r, c)].
# It swaps the axis blocks (h, r) and (s, p), so it is its own inverse: it also takes them back.
_PAIR_ORDER = (0, 3, 4, 1, 2, 5)


def _check_bits(bits: int) -> None:
    if bits not in PLANES:
        raise ValueError(f"residual bits must be one of {sorted(PLANES)}, got {bits!r}")


def num_groups(d_in: int) -> int:
    """Number of 128-column scale groups; the last one may be shorter."""
    return -(-d_in // GROUP)


def num_tiles(rows: int) -> int:
    return -(-rows // TILE)


def num_steps(d_in: int, bits: int) -> int:
    """Steps of the ``"words"`` planes: ``ceil(d_in / STEP[bits])``, the last one padded."""
    _check_bits(bits)
    return -(-d_in // STEP[bits])


def plane_shapes(tiles: int, d_in: int, bits: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every plane of a ``bits``-bit residual of ``tiles`` tiles and ``d_in`` columns."""
    steps = num_steps(d_in, bits)
    codes = {
        name: ((tiles, steps, k, TILE), np.dtype(np.uint16))
        for name, k in zip(PLANES[bits], WORD_SPLIT[bits], strict=True)
    }
    scale = {"scale": ((tiles, num_groups(d_in), TILE), np.dtype(np.uint8))}
    return {**codes, **scale, "scale_top": ((tiles,), np.dtype(np.float32))}


def bytes_per_weight(bits: int) -> float:
    """Code bytes per weight, without scales (1 byte per 128 weights) or the padding of the last step."""
    _check_bits(bits)
    return 2 * WORDS[bits] / STEP[bits]


def residual_nbytes(rows: int, d_in: int, bits: int) -> int:
    """Exact bytes of all planes and scales, padding included: what one pass reads from RAM."""
    shapes = plane_shapes(num_tiles(rows), d_in, bits)
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())


def _to_tiles(a: np.ndarray) -> np.ndarray:
    """[rows, k] -> [T, k, 16], zero-padding the rows to whole tiles."""
    rows, k = a.shape
    padded = np.zeros((num_tiles(rows) * TILE, k), dtype=a.dtype)
    padded[:rows] = a
    return np.ascontiguousarray(padded.reshape(-1, TILE, k).transpose(0, 2, 1))


def _from_tiles(a: np.ndarray, rows: int) -> np.ndarray:
    """[T, k, 16] -> [rows, k], dropping padded rows."""
    t, k, _ = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(t * TILE, k)[:rows])


def _to_lanes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes int8 [rows, d_in] -> unsigned codes uint8 [T, S, step, 16] in "words" order, padded with q = 0."""
    rows, d_in = q.shape
    tiles, steps, step = num_tiles(rows), num_steps(d_in, bits), STEP[bits]
    u = np.full((tiles * TILE, steps * step), 2 ** (bits - 1), np.uint8)
    # q + 2^(b-1) in uint8 arithmetic: exact, as the sum lies in [1, 2^b - 1] (q + 128 would overflow int8)
    u[:rows, :d_in] = q.view(np.uint8) + np.uint8(2 ** (bits - 1))
    u = u.reshape(tiles, 2, 8, steps, step // 2, 2).transpose(_PAIR_ORDER)
    return u.reshape(tiles, steps, step, TILE)


def _from_lanes(u: np.ndarray, rows: int, d_in: int, bits: int) -> np.ndarray:
    """Inverse of ``_to_lanes``: codes int8 [rows, d_in], padding dropped."""
    tiles, steps, step, _ = u.shape
    u = u.reshape(tiles, steps, step // 2, 2, 8, 2).transpose(_PAIR_ORDER).reshape(tiles * TILE, steps * step)
    return (u[:rows, :d_in] - np.uint8(2 ** (bits - 1))).view(np.int8)  # a new C-contiguous array


def _code_position(bits: int, j: int) -> tuple[int, int]:
    """(word, bit) where code ``j`` of a lane starts; it spills into the next word if bit + bits > 16."""
    return divmod(bits * j, 16)


def _pack_words(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [T, S, step, 16] -> all the words [T, S, W, 16] (before the split into planes)."""
    words = np.zeros((*u.shape[:2], WORDS[bits], TILE), np.uint16)
    for j in range(STEP[bits]):
        w, bit = _code_position(bits, j)
        code = u[:, :, j].astype(np.uint16)
        words[:, :, w] |= code << np.uint16(bit)  # bits past 16 drop out here ...
        if bit + bits > 16:
            words[:, :, w + 1] |= code >> np.uint16(16 - bit)  # ... and land in the next word
    return words


def _unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``_pack_words``: unsigned codes uint8 [T, S, step, 16]."""
    mask = np.uint16((1 << bits) - 1)
    u = np.empty((*words.shape[:2], STEP[bits], TILE), np.uint8)
    for j in range(STEP[bits]):
        w, bit = _code_position(bits, j)
        code = words[:, :, w] >> np.uint16(bit)
        if bit + bits > 16:
            code |= words[:, :, w + 1] << np.uint16(16 - bit)
        u[:, :, j] = code & mask
    return u


def tile_tops(scales: np.ndarray) -> np.ndarray:
    """Each tile's ``"scale_top"``: the least power of two whose grid reaches the tile's largest scale
    (``scales`` float32 [rows, G]; a tile of zeros gets 1)."""
    t = num_tiles(scales.shape[0])
    peak = np.zeros(t * TILE, np.float64)
    peak[: scales.shape[0]] = scales.max(axis=1, initial=0.0)
    peak = peak.reshape(t, TILE).max(axis=1)
    exp = np.ceil(np.log2(np.where(peak > 0, peak, 1.0) / SCALE_MAX))
    return np.ldexp(np.float32(1.0), exp.astype(np.int32)).astype(np.float32)


def encode_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 scales [rows, G] on the grid (``quantize.gptq.round_scales``) -> (bytes [T, G, 16], tops [T]);
    padded rows get byte 0. Raises if a scale is off the grid or out of its tile's four octaves."""
    rows = scales.shape[0]
    tops = tile_tops(scales)
    rel = scales.astype(np.float64) / np.repeat(tops, TILE)[:rows, None]
    mant, exp = np.frexp(rel)  # rel = mant · 2^exp: e = exp + 2, m = (2·mant - 1)·64
    e = exp + SCALE_SPAN - 2
    m = (2 * mant - 1) * 2**SCALE_MANTISSA
    bad = (e < 0) | (e >= SCALE_SPAN) | (m != np.round(m)) | ~(rel > 0)
    if bad.any():
        r, g = np.argwhere(bad)[0]
        raise ValueError(
            f"scale {scales[r, g]!r} of row {r}, group {g} is off the residual's scale grid or more than "
            f"{SCALE_SPAN} octaves under its tile's largest (round it with quantize.gptq.round_scales)"
        )
    codes = (e * 2**SCALE_MANTISSA + m).astype(np.uint8)
    return _to_tiles(codes), tops


def decode_scales(codes: np.ndarray, tops: np.ndarray) -> np.ndarray:
    """Inverse of ``encode_scales`` in tile layout: bytes [T, G, 16] -> float32 scales [T, G, 16], exactly as
    the kernel computes them (the byte's bits placed in an fp32, times the tile's power of two)."""
    bits = (codes.astype(np.uint32) << np.uint32(23 - SCALE_MANTISSA)) + np.uint32((127 - SCALE_SPAN + 1) << 23)
    return bits.view(np.float32) * tops[:, None, None]


def pack_residual(q: np.ndarray, scales: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    """Pack codes ``q`` (int8 [rows, d_in]) and ``scales`` (float32 [rows, G], on the grid of
    ``quantize.gptq.round_scales``) into the tile planes."""
    _check_bits(bits)
    q = np.asarray(q)
    scales = np.asarray(scales)
    if q.ndim != 2 or q.shape[0] == 0 or q.shape[1] == 0:
        raise ValueError(f"codes must be a non-empty 2-D [rows, d_in] array, got shape {q.shape}")
    if q.dtype != np.int8:
        raise ValueError(f"codes must be int8, got {q.dtype}")
    if scales.dtype != np.float32:
        raise ValueError(f"scales must be float32 on the scale grid (quantize.gptq.round_scales), got {scales.dtype}")
    rows, d_in = q.shape
    if scales.shape != (rows, num_groups(d_in)):
        raise ValueError(
            f"scales must have shape (rows, ceil(d_in/{GROUP})) = {(rows, num_groups(d_in))}, got {scales.shape}"
        )
    qm = 2 ** (bits - 1) - 1
    if int(q.min()) < -qm or int(q.max()) > qm:
        raise ValueError(f"{bits}-bit codes must lie in [-{qm}, {qm}], got [{q.min()}, {q.max()}]")
    words = _pack_words(_to_lanes(q, bits), bits)
    cuts = np.cumsum(WORD_SPLIT[bits])[:-1]
    parts = np.split(words, cuts, axis=2)
    planes = {name: np.ascontiguousarray(part) for name, part in zip(PLANES[bits], parts, strict=True)}
    codes, tops = encode_scales(scales)
    return {**planes, "scale": codes, "scale_top": tops}


def check_planes(planes: dict[str, np.ndarray], bits: int, rows: int, *, d_in: int | None = None) -> tuple[int, int]:
    """Validate plane names, dtypes and shapes against ``rows`` real rows; return (tiles, d_in).

    ``d_in`` is required (a keyword only so that forgetting it is a clear error): the ``"words"`` planes
    hold whole steps, so their shape does not say how many of the last step's columns are real.
    """
    _check_bits(bits)
    missing = [p for p in (*PLANES[bits], *SCALE_PLANES) if p not in planes]
    if missing:
        raise ValueError(f"{bits}-bit residual needs planes {PLANES[bits] + SCALE_PLANES}, missing {missing}")
    name = PLANES[bits][0]
    codes = planes[name]
    if codes.ndim != 4:
        raise ValueError(f"plane {name!r} must be [tiles, steps, words, 16], got shape {codes.shape}")
    if d_in is None:
        raise ValueError(
            f"a {bits}-bit residual needs d_in: its 'words' planes are padded to {STEP[bits]}-column steps, "
            "so the column count cannot be read from it (pass the group's d_in)"
        )
    if d_in < 1:
        raise ValueError(f"d_in must be positive, got {d_in}")
    tiles = codes.shape[0]
    for plane, (shape, dtype) in plane_shapes(tiles, d_in, bits).items():
        if planes[plane].shape != shape or planes[plane].dtype != dtype:
            raise ValueError(
                f"plane {plane!r} of a {bits}-bit residual of {tiles} tiles and d_in = {d_in} must be "
                f"{dtype} {shape}, got {planes[plane].dtype} {planes[plane].shape}"
            )
    if not (tiles - 1) * TILE < rows <= tiles * TILE:
        raise ValueError(f"{rows} rows do not fit {tiles} tiles of {TILE}")
    return tiles, d_in


def unpack_residual(
    planes: dict[str, np.ndarray], bits: int, rows: int, *, d_in: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``pack_residual``: (codes int8 [rows, d_in], scales float32 [rows, G]).

    ``d_in`` as for ``check_planes``: required.
    """
    _, d_in = check_planes(planes, bits, rows, d_in=d_in)
    scales = _from_tiles(decode_scales(planes["scale"], planes["scale_top"]), rows)
    words = np.concatenate([planes[name] for name in PLANES[bits]], axis=2)
    return _from_lanes(_unpack_words(words, bits), rows, d_in, bits), scales


def dequantize_residual(planes: dict[str, np.ndarray], bits: int, rows: int, *, d_in: int | None = None) -> np.ndarray:
    """The residual as float32 [rows, d_in]: codes times their group's scale (the reference).

    ``d_in`` as for ``check_planes``: required.
    """
    q, scales = unpack_residual(planes, bits, rows, d_in=d_in)
    per_col = np.repeat(scales, GROUP, axis=1)[:, : q.shape[1]]
    return q.astype(np.float32) * per_col


def tile_range(rows_start: int, rows_stop: int) -> tuple[int, int]:
    """Tiles ``[t0, t1)`` that hold rows ``[rows_start, rows_stop)``.

    Shards should own whole tiles; a range that does not start on a tile boundary still maps to
    the tiles covering it, and the caller drops the extra rows.
    """
    if not 0 <= rows_start <= rows_stop:
        raise ValueError(f"need 0 <= rows_start <= rows_stop, got {rows_start}, {rows_stop}")
    return rows_start // TILE, num_tiles(rows_stop)


def slice_tiles(planes: dict[str, np.ndarray], t0: int, t1: int) -> dict[str, np.ndarray]:
    """Tiles ``[t0, t1)`` of every plane, as contiguous views (no copy)."""
    t = next(iter(planes.values())).shape[0]
    if not 0 <= t0 < t1 <= t:
        raise ValueError(f"need 0 <= t0 < t1 <= {t} tiles, got [{t0}, {t1})")
    return {name: plane[t0:t1] for name, plane in planes.items()}
