"""Storage layout of the residual: 16-row tiles, and word-sliced 16-bit words for the 6/7-bit codes.

The CPU actor streams the whole residual from RAM once per verify pass, so the layout is chosen for
that loop and for sharding, not for the converter's convenience:

- Codes ``q`` are ints in ``[-qm, qm]``, ``qm = 2^(b-1) - 1``, ``b`` in {6, 7, 8}; there is one fp16
  scale per (row, 128-column group). ``G = ceil(d_in / 128)``; the last group may be shorter
  (``d_in = 576`` gives ``G = 5``, the last of 64 columns).
- Rows are padded to a multiple of 16 (padded rows: code 0, scale 0) and stored in 16-row tiles,
  tile ``t`` = rows ``16t .. 16t+15``. Every tensor has the tile index as its leading axis, so any
  slice of whole tiles is one contiguous byte range of every tensor: a shard of rows is a byte range
  of the file, and an actor can map or copy it without reshuffling.

Planes (``T`` tiles, ``d_in`` columns):

- 8-bit: ``"q"``: int8 ``[T][d_in][16]``: the 16 rows of one input column side by side, so the
  kernel reads one column as one 16-lane vector.
- 6 and 7 bit: ``words[T][S][W][16]``, uint16, of the unsigned codes ``u = q + 2^(b-1)`` (in
  ``[1, 2^b - 1]``), cut into steps of ``step = STEP[b]`` columns (8 for 6-bit, 16 for 7-bit),
  ``S = ceil(d_in / step)``, ``W = WORDS[b]`` words (3 for 6-bit, 7 for 7-bit). Columns past
  ``d_in`` are padding with ``u = 2^(b-1)`` (``q = 0``), as are the padded rows.

  Step ``s`` of tile ``t`` holds ``NJ = step`` codes per lane ``i`` in ``[0, 16)``, indexed
  ``j = 4·quad + rq``: code ``j`` of lane ``i`` is the code of tile row ``4·rq + (i % 8) // 2`` and
  column ``s·step + 4·quad + 2·(i // 8) + i % 2``. So one code ``j`` of all 16 lanes covers 4 rows by
  4 columns, lanes ``2k`` and ``2k + 1`` being two adjacent columns of one row. Each lane's codes make
  one ``16·W``-bit integer ``V_i = Σ_j u(j, i) << (b·j)``, stored low word first:
  ``words[t, s, w, i] = (V_i >> 16w) & 0xFFFF``. No bit is spare (6·8 = 3·16, 7·16 = 7·16): a 6-bit
  tile column takes 12 bytes and a 7-bit one 14, plus the padding of the last step.

  ``words`` is stored as three planes, ``"words0"``, ``"words1"``, ``"words2"``: consecutive runs of
  its ``W`` words (``WORD_SPLIT[b]``: 1, 1, 1 for 6-bit and 4, 2, 1 for 7-bit), each
  ``[T][S][k][16]``. One plane would do, but the kernel's loop reads three streams faster than one:
  at one token, 6-bit passes from RAM took 0.95× and 7-bit ones 0.88× the time of the same bytes read as
  one stream took (same memory, same process); 7 streams (one per word) were no faster than one.

  Why: the CPU kernel multiplies int16 codes with vpmaddwd, whose int16 lanes must hold two columns
  of the same row side by side. In this layout each of a step's ``NJ`` int16 code vectors comes out of
  the ``W`` words with one 16-bit shift and/or one mask (two shifts, a mask and an OR where a code
  straddles two words), with no byte shuffles: ~2 ops per 16 codes, against ~4 for the bit planes
  (``"nib"``, ``"crumb"``, ``"bit"``) that format versions before 3 stored; the kernel's loop over
  them took 0.65× the time per 6-bit column at 1-2 tokens (one core, in L1).
- ``"scale"``: float16 ``[T][G][16]``.
"""

from __future__ import annotations

import math

import numpy as np

TILE = 16
GROUP = 128
_WORD_PLANES = ("words0", "words1", "words2")
PLANES: dict[int, tuple[str, ...]] = {6: _WORD_PLANES, 7: _WORD_PLANES, 8: ("q",)}
STEP: dict[int, int] = {6: 8, 7: 16}  # columns per step of the "words" planes, also the codes per lane
WORDS: dict[int, int] = {6: 3, 7: 7}  # uint16 words per lane and step
WORD_SPLIT: dict[int, tuple[int, ...]] = {6: (1, 1, 1), 7: (4, 2, 1)}  # of them, in each "words" plane
# A tile's unsigned codes [16 rows, S·step columns] split as (row quad, row in quad, step, column quad,
# column pair, column in pair); _LANE_ORDER puts them in "words" order [step, j = (column quad, row quad),
# lane = (column pair, row in quad, column in pair)] and _ROW_ORDER back.
_LANE_ORDER = (0, 3, 4, 1, 5, 2, 6)
_ROW_ORDER = (0, 3, 5, 1, 2, 4, 6)


def _check_bits(bits: int) -> None:
    if bits not in PLANES:
        raise ValueError(f"residual bits must be one of {sorted(PLANES)}, got {bits!r}")


def num_groups(d_in: int) -> int:
    """Number of 128-column scale groups; the last one may be shorter."""
    return -(-d_in // GROUP)


def num_tiles(rows: int) -> int:
    return -(-rows // TILE)


def num_steps(d_in: int, bits: int) -> int:
    """Steps of the 6/7-bit ``"words"`` planes: ``ceil(d_in / STEP[bits])``, the last one padded."""
    if bits not in STEP:
        raise ValueError(f"only 6- and 7-bit codes are stored in steps, got {bits!r} bits")
    return -(-d_in // STEP[bits])


def plane_shapes(tiles: int, d_in: int, bits: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every plane of a ``bits``-bit residual of ``tiles`` tiles and ``d_in`` columns."""
    _check_bits(bits)
    if bits == 8:
        codes = {"q": ((tiles, d_in, TILE), np.dtype(np.int8))}
    else:
        steps = num_steps(d_in, bits)
        codes = {
            name: ((tiles, steps, k, TILE), np.dtype(np.uint16))
            for name, k in zip(PLANES[bits], WORD_SPLIT[bits], strict=True)
        }
    return {**codes, "scale": ((tiles, num_groups(d_in), TILE), np.dtype(np.float16))}


def bytes_per_weight(bits: int) -> float:
    """Code bytes per weight, without scales (2 bytes per 128 weights) or the padding of the last step."""
    _check_bits(bits)
    return 1.0 if bits == 8 else 2 * WORDS[bits] / STEP[bits]


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
    """Codes int8 [rows, d_in] -> unsigned codes uint8 [T, S, NJ, 16] in "words" order, padded with q = 0."""
    rows, d_in = q.shape
    tiles, steps, step = num_tiles(rows), num_steps(d_in, bits), STEP[bits]
    u = np.full((tiles * TILE, steps * step), 2 ** (bits - 1), np.uint8)
    u[:rows, :d_in] = q + np.int8(2 ** (bits - 1))  # in [1, 2^b - 1]: no int8 overflow for b <= 7
    u = u.reshape(tiles, 4, 4, steps, step // 4, 2, 2).transpose(_LANE_ORDER)
    return u.reshape(tiles, steps, step, TILE)


def _from_lanes(u: np.ndarray, rows: int, d_in: int, bits: int) -> np.ndarray:
    """Inverse of ``_to_lanes``: codes int8 [rows, d_in], padding dropped."""
    tiles, steps, step, _ = u.shape
    u = u.reshape(tiles, steps, step // 4, 4, 2, 4, 2).transpose(_ROW_ORDER).reshape(tiles * TILE, steps * step)
    return u[:rows, :d_in].view(np.int8) - np.int8(2 ** (bits - 1))  # a new C-contiguous array


def _code_position(bits: int, j: int) -> tuple[int, int]:
    """(word, bit) where code ``j`` of a lane starts; it spills into the next word if bit + bits > 16."""
    return divmod(bits * j, 16)


def _pack_words(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [T, S, NJ, 16] -> all the words [T, S, W, 16] (before the split into planes)."""
    words = np.zeros((*u.shape[:2], WORDS[bits], TILE), np.uint16)
    for j in range(STEP[bits]):
        w, bit = _code_position(bits, j)
        code = u[:, :, j].astype(np.uint16)
        words[:, :, w] |= code << np.uint16(bit)  # bits past 16 drop out here ...
        if bit + bits > 16:
            words[:, :, w + 1] |= code >> np.uint16(16 - bit)  # ... and land in the next word
    return words


def _unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``_pack_words``: unsigned codes uint8 [T, S, NJ, 16]."""
    mask = np.uint16((1 << bits) - 1)
    u = np.empty((*words.shape[:2], STEP[bits], TILE), np.uint8)
    for j in range(STEP[bits]):
        w, bit = _code_position(bits, j)
        code = words[:, :, w] >> np.uint16(bit)
        if bit + bits > 16:
            code |= words[:, :, w + 1] << np.uint16(16 - bit)
        u[:, :, j] = code & mask
    return u


def pack_residual(q: np.ndarray, scales: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    """Pack codes ``q`` (int8 [rows, d_in]) and ``scales`` (fp16 [rows, G]) into the tile planes."""
    _check_bits(bits)
    q = np.asarray(q)
    scales = np.asarray(scales)
    if q.ndim != 2 or q.shape[0] == 0 or q.shape[1] == 0:
        raise ValueError(f"codes must be a non-empty 2-D [rows, d_in] array, got shape {q.shape}")
    if q.dtype != np.int8:
        raise ValueError(f"codes must be int8, got {q.dtype}")
    if scales.dtype != np.float16:
        raise ValueError(f"scales must be float16, got {scales.dtype}")
    rows, d_in = q.shape
    if scales.shape != (rows, num_groups(d_in)):
        raise ValueError(
            f"scales must have shape (rows, ceil(d_in/{GROUP})) = {(rows, num_groups(d_in))}, got {scales.shape}"
        )
    qm = 2 ** (bits - 1) - 1
    if int(q.min()) < -qm or int(q.max()) > qm:
        raise ValueError(f"{bits}-bit codes must lie in [-{qm}, {qm}], got [{q.min()}, {q.max()}]")

    if bits == 8:
        return {"q": _to_tiles(q), "scale": _to_tiles(scales)}
    words = _pack_words(_to_lanes(q, bits), bits)
    cuts = np.cumsum(WORD_SPLIT[bits])[:-1]
    parts = np.split(words, cuts, axis=2)
    planes = {name: np.ascontiguousarray(part) for name, part in zip(PLANES[bits], parts, strict=True)}
    return {**planes, "scale": _to_tiles(scales)}


def check_planes(planes: dict[str, np.ndarray], bits: int, rows: int, *, d_in: int | None = None) -> tuple[int, int]:
    """Validate plane names, dtypes and shapes against ``rows`` real rows; return (tiles, d_in).

    ``d_in`` is required for 6/7 bits: the ``"words"`` planes hold whole steps, so their shape does not
    say how many of the last step's columns are real. For 8 bits it defaults to the ``"q"`` plane's.
    """
    _check_bits(bits)
    missing = [p for p in (*PLANES[bits], "scale") if p not in planes]
    if missing:
        raise ValueError(f"{bits}-bit residual needs planes {PLANES[bits]} + 'scale', missing {missing}")
    name = PLANES[bits][0]
    codes = planes[name]
    axes, ndim = ("[tiles, d_in, 16]", 3) if bits == 8 else ("[tiles, steps, words, 16]", 4)
    if codes.ndim != ndim:
        raise ValueError(f"plane {name!r} must be {axes}, got shape {codes.shape}")
    if d_in is None:
        if bits != 8:
            raise ValueError(
                f"a {bits}-bit residual needs d_in: its 'words' planes are padded to {STEP[bits]}-column steps, "
                "so the column count cannot be read from it (pass the group's d_in)"
            )
        d_in = codes.shape[1]
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
    """Inverse of ``pack_residual``: (codes int8 [rows, d_in], scales fp16 [rows, G]).

    ``d_in`` as for ``check_planes``: required for 6/7 bits.
    """
    _, d_in = check_planes(planes, bits, rows, d_in=d_in)
    scales = _from_tiles(planes["scale"], rows)
    if bits == 8:
        return _from_tiles(planes["q"], rows), scales
    words = np.concatenate([planes[name] for name in PLANES[bits]], axis=2)
    return _from_lanes(_unpack_words(words, bits), rows, d_in, bits), scales


def dequantize_residual(planes: dict[str, np.ndarray], bits: int, rows: int, *, d_in: int | None = None) -> np.ndarray:
    """The residual as float32 [rows, d_in]: codes times their group's scale (the reference).

    ``d_in`` as for ``check_planes``: required for 6/7 bits.
    """
    q, scales = unpack_residual(planes, bits, rows, d_in=d_in)
    per_col = np.repeat(scales.astype(np.float32), GROUP, axis=1)[:, : q.shape[1]]
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
