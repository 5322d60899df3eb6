"""Storage layout of the residual: 16-row tiles, and bit planes for the 6/7-bit codes.

The CPU actor streams the whole residual from RAM once per verify pass, so the layout is chosen for
that loop and for sharding, not for the converter's convenience:

- Codes ``q`` are ints in ``[-qm, qm]``, ``qm = 2^(b-1) - 1``, ``b`` in {6, 7, 8}; there is one fp16
  scale per (row, 128-column group). ``G = ceil(d_in / 128)``; the last group may be shorter
  (``d_in = 576`` gives ``G = 5``, the last of 64 columns).
- Rows are padded to a multiple of 16 (padded rows: code 0, scale 0) and stored in 16-row tiles,
  tile ``t`` = rows ``16t .. 16t+15``. Every tensor has the tile index as its leading axis, so any
  slice of whole tiles is one contiguous byte range of every tensor: a shard of rows is a byte range
  of the file, and an actor can map or copy it without reshuffling.
- Inside a tile, the 16 rows of one input column sit next to each other (``[T][d_in][16]``): the
  kernel reads one column as one 16-lane vector and multiplies it by a broadcast activation.

Planes (``T`` tiles, ``d_in`` columns):

- 8-bit: ``"q"``: int8 ``[T][d_in][16]``.
- 6 and 7 bit: the unsigned code ``u = q + 2^(b-1)`` (in ``[1, 2^b - 1]``) is split into bit planes
  that unpack with shifts and masks only, because AVX2 has no byte permutes across lanes (no VBMI):

  - ``"nib"``   uint8 ``[T][d_in][8]``: byte j = ``(u[j] & 15) | ((u[j+8] & 15) << 4)``
  - ``"crumb"`` uint8 ``[T][d_in][4]``: byte j = ``OR_k ((u[j+4k] >> 4) & 3) << 2k``, k = 0..3
  - ``"bit"``   uint8 ``[T][d_in][2]`` (7-bit only): byte j = ``OR_k ((u[j+2k] >> 6) & 1) << k``,
    k = 0..7

  where ``u[r]`` is the code of row ``r`` of the tile. 6-bit takes 12 bytes and 7-bit 14 bytes per
  16 weights.
- ``"scale"``: float16 ``[T][G][16]``.
"""

from __future__ import annotations

import numpy as np

TILE = 16
GROUP = 128
PLANES: dict[int, tuple[str, ...]] = {6: ("nib", "crumb"), 7: ("nib", "crumb", "bit"), 8: ("q",)}
# bytes of each plane per tile column (16 weights)
_PLANE_WIDTH = {"q": 16, "nib": 8, "crumb": 4, "bit": 2}


def _check_bits(bits: int) -> None:
    if bits not in PLANES:
        raise ValueError(f"residual bits must be one of {sorted(PLANES)}, got {bits!r}")


def num_groups(d_in: int) -> int:
    """Number of 128-column scale groups; the last one may be shorter."""
    return -(-d_in // GROUP)


def num_tiles(rows: int) -> int:
    return -(-rows // TILE)


def bytes_per_weight(bits: int) -> float:
    """Code bytes per weight, without scales (those add 2 bytes per 128 weights)."""
    _check_bits(bits)
    return sum(_PLANE_WIDTH[p] for p in PLANES[bits]) / TILE


def residual_nbytes(rows: int, d_in: int, bits: int) -> int:
    """Exact bytes of all planes and scales, padding included: what one pass reads from RAM."""
    _check_bits(bits)
    per_tile = sum(_PLANE_WIDTH[p] for p in PLANES[bits]) * d_in + 2 * TILE * num_groups(d_in)
    return num_tiles(rows) * per_tile


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

    planes = {"scale": _to_tiles(scales)}
    if bits == 8:
        planes["q"] = _to_tiles(q)
        return planes
    u = (_to_tiles(q).astype(np.int16) + 2 ** (bits - 1)).astype(np.uint8)  # pad first: code 0
    planes["nib"] = (u[..., :8] & 15) | ((u[..., 8:] & 15) << 4)
    planes["crumb"] = _or_fields(u, 4, shift=4, width=2)
    if bits == 7:
        planes["bit"] = _or_fields(u, 2, shift=6, width=1)
    return planes


def _or_fields(u: np.ndarray, nbytes: int, shift: int, width: int) -> np.ndarray:
    """Byte j = OR_k ((u[j + nbytes*k] >> shift) & mask) << (width*k)."""
    mask = (1 << width) - 1
    out = np.zeros((*u.shape[:-1], nbytes), dtype=np.uint8)
    for k in range(TILE // nbytes):
        out |= ((u[..., k * nbytes : (k + 1) * nbytes] >> shift) & mask) << (width * k)
    return out


def _field(plane: np.ndarray, shift: int, width: int) -> np.ndarray:
    """Inverse of ``_or_fields``: the 16 per-row fields, already shifted to ``shift``."""
    nbytes = plane.shape[-1]
    mask = (1 << width) - 1
    parts = [((plane >> (width * k)) & mask) << shift for k in range(TILE // nbytes)]
    return np.concatenate(parts, axis=-1).astype(np.uint8)


def check_planes(planes: dict[str, np.ndarray], bits: int, rows: int) -> tuple[int, int]:
    """Validate plane names, dtypes and shapes against ``rows`` real rows; return (tiles, d_in)."""
    _check_bits(bits)
    missing = [p for p in (*PLANES[bits], "scale") if p not in planes]
    if missing:
        raise ValueError(f"{bits}-bit residual needs planes {PLANES[bits]} + 'scale', missing {missing}")
    first = planes[PLANES[bits][0]]
    if first.ndim != 3:
        raise ValueError(f"planes must be 3-D [tiles, d_in, bytes], got shape {first.shape}")
    t, d_in = first.shape[:2]
    for name in PLANES[bits]:
        want_dtype = np.int8 if name == "q" else np.uint8
        want = (t, d_in, _PLANE_WIDTH[name])
        if planes[name].shape != want or planes[name].dtype != want_dtype:
            raise ValueError(
                f"plane {name!r} must be {np.dtype(want_dtype)} {want}, got {planes[name].dtype} {planes[name].shape}"
            )
    want = (t, num_groups(d_in), TILE)
    if planes["scale"].shape != want or planes["scale"].dtype != np.float16:
        raise ValueError(f"plane 'scale' must be float16 {want}, got {planes['scale'].dtype} {planes['scale'].shape}")
    if not (t - 1) * TILE < rows <= t * TILE:
        raise ValueError(f"{rows} rows do not fit {t} tiles of {TILE}")
    return t, d_in


def unpack_residual(planes: dict[str, np.ndarray], bits: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``pack_residual``: (codes int8 [rows, d_in], scales fp16 [rows, G])."""
    check_planes(planes, bits, rows)
    scales = _from_tiles(planes["scale"], rows)
    if bits == 8:
        return _from_tiles(planes["q"], rows), scales
    nib = planes["nib"]
    u = np.concatenate([nib & 15, nib >> 4], axis=-1) | _field(planes["crumb"], shift=4, width=2)
    if bits == 7:
        u |= _field(planes["bit"], shift=6, width=1)
    q = (u.astype(np.int16) - 2 ** (bits - 1)).astype(np.int8)
    return _from_tiles(q, rows), scales


def dequantize_residual(planes: dict[str, np.ndarray], bits: int, rows: int) -> np.ndarray:
    """The residual as float32 [rows, d_in]: codes times their group's scale (the reference)."""
    q, scales = unpack_residual(planes, bits, rows)
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
