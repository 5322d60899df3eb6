"""A dense matrix as 16-bit integers with one fp32 scale per row, and its product on the CPU.

The lm_head is the largest matrix a verify pass reads, once per pass for 1-16 rows of hidden states, so
its cost is its bytes. int16 codes under a per-row scale halve fp32's bytes and keep the weights to
about 15 significant bits where bf16 keeps 8; activations, products and sums stay fp32. The kernel reads
each run of ``ROWS`` matrix rows once, widened to fp32 in a small buffer, for every hidden state.
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


@njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _rows(codes, scale, h, out, first, last):
    """out[:, first:last] for rows first…last-1, ``ROWS`` at a time, the remainder one by one."""
    n, cols = h.shape
    buf = np.empty((ROWS, cols), np.float32)
    r = first
    while r + ROWS <= last:
        for k in range(ROWS):
            for j in range(cols):
                buf[k, j] = codes[r + k, j]
        for t in range(n):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for j in range(cols):
                x = h[t, j]
                a0 += buf[0, j] * x
                a1 += buf[1, j] * x
                a2 += buf[2, j] * x
                a3 += buf[3, j] * x
            out[t, r] = a0 * scale[r]
            out[t, r + 1] = a1 * scale[r + 1]
            out[t, r + 2] = a2 * scale[r + 2]
            out[t, r + 3] = a3 * scale[r + 3]
        r += ROWS
    for q in range(r, last):
        for j in range(cols):
            buf[0, j] = codes[q, j]
        for t in range(n):
            acc = np.float32(0.0)
            for j in range(cols):
                acc += buf[0, j] * h[t, j]
            out[t, q] = acc * scale[q]


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
