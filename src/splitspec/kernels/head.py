"""A dense matrix as 16-bit integers with one fp32 scale per row, and its product on the CPU.

The lm_head is the largest matrix a verify pass reads, once per pass for 1-16 rows of hidden states, so
its cost is its bytes. int16 codes under a per-row scale halve fp32's bytes and keep the weights to
about 15 significant bits where bf16 keeps 8; activations, products and sums stay fp32. The kernel reads
``ROWS`` matrix rows at a time from as many places in the matrix, widened to fp32 where they are used.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

ROWS = 4  # matrix rows per step: each hidden-state element loaded once feeds four products
CODE_MAX = 32767


def quantize_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int16 codes [rows, cols], fp32 scale [rows]) with weight ≈ codes · scale per row: the row's largest
    magnitude maps to ±32767 (an all-zero row gets scale 1 and zero codes)."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [rows, cols], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight holds NaN or infinite values")
    top = np.abs(w).max(axis=1)
    scale = np.where(top > 0, top / CODE_MAX, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / scale[:, None]), -CODE_MAX, CODE_MAX).astype(np.int16)
    return codes, scale


@njit(inline="always", fastmath=True, boundscheck=False)
def _four(codes, scale, h, out, r0, r1, r2, r3):
    """out[:, r] for four rows at once, their codes widened where they are used: every row of every call
    takes this one loop, so a row's sum does not depend on the range it came in (the CPU actors' part of
    the head must equal the whole head's bit for bit)."""
    n, cols = h.shape
    for t in range(n):
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for j in range(cols):
            x = h[t, j]
            a0 += np.float32(codes[r0, j]) * x
            a1 += np.float32(codes[r1, j]) * x
            a2 += np.float32(codes[r2, j]) * x
            a3 += np.float32(codes[r3, j]) * x
        out[t, r0] = a0 * scale[r0]
        out[t, r1] = a1 * scale[r1]
        out[t, r2] = a2 * scale[r2]
        out[t, r3] = a3 * scale[r3]


@njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _rows(codes, scale, h, out, first, last):
    """out[:, first:last]: four rows at a time, one from each quarter of the range, so that four streams
    of codes are in flight (one stream read at a time left the core well short of its memory rate); the
    0-3 rows past the quarters in one more step of four, the last row standing in for the missing ones
    (computed again, the same value)."""
    quarter = (last - first) // ROWS
    for i in range(quarter):
        r = first + i
        _four(codes, scale, h, out, r, r + quarter, r + 2 * quarter, r + 3 * quarter)
    rest = first + ROWS * quarter
    if rest < last:
        top = last - 1
        _four(codes, scale, h, out, rest, min(rest + 1, top), min(rest + 2, top), top)


@njit(parallel=True, cache=True, nogil=True)
def _parallel(codes, scale, h, out, chunks):
    rows = codes.shape[0]
    step = -(-rows // chunks // ROWS) * ROWS  # chunk edges on whole runs of ROWS
    for c in prange(chunks):
        _rows(codes, scale, h, out, min(c * step, rows), min((c + 1) * step, rows))


def product(codes: np.ndarray, scale: np.ndarray, h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out [n, rows] = h [n, cols] · (codes · scale)ᵀ in fp32, on numba's threads (one chunk of rows each)."""
    rows, cols = codes.shape
    if codes.dtype != np.int16 or scale.dtype != np.float32 or scale.shape != (rows,):
        raise ValueError(f"codes must be int16 [rows, cols] and scale float32 [{rows}]")
    if h.ndim != 2 or h.shape[1] != cols or h.dtype != np.float32:
        raise ValueError(f"h must be float32 [n, {cols}], got {h.dtype} {h.shape}")
    h = np.ascontiguousarray(h)
    if out is None:
        out = np.empty((h.shape[0], rows), np.float32)
    elif out.shape != (h.shape[0], rows) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {(h.shape[0], rows)}")
    chunks = numba.get_num_threads()
    if chunks == 1:
        _rows(codes, scale, h, out, 0, rows)
    else:
        _parallel(codes, scale, h, out, chunks)
    return out
