"""Numba 2-bit GEMM ``y[n, rows] = x · dequant(Q_base)ᵀ``: the GPU actor's kernel when no GPU is present.

Each row is dequantized into fp32 scratch that stays in L1/L2 and then serves every token, so the
packed codes stream from memory once per call however many tree tokens there are; a float copy of the
whole base would be 16× the bytes to stream. Rows are dequantized four at a time and multiplied in
4 × 1 or 1 × 4 register blocks (see ``_rows_times_tokens``), which keeps the loop on FMAs rather than loads.

The code→level map is two nested selects on the code bits between the four group-scaled levels, which
vectorize to blends; a table lookup would be a gather per weight. Numba has no fp16
arithmetic, so scales are read as uint16 bits and widened with integer ops (exact for every finite half).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from splitspec.quantize.format import CODE_WORD, GROUP

_WORDS_PER_GROUP = GROUP // CODE_WORD
_ROWS_PER_TASK = 16  # enough tasks to balance the threads, few enough to amortize the scratch allocation
_BLOCK = 4  # rows and tokens per register block
_TWO_POW_112 = np.float32(2.0**112)
# Bit j tested with a mask rather than a shift: numba widens shifts to int64 lanes (half the vector
# width, plus shuffles), while and/compare/blend stay on 8 int32 lanes (measured 6× faster).
_BIT = (np.uint32(1) << np.arange(CODE_WORD, dtype=np.uint32)).view(np.int32)


@njit(inline="always", cache=True)
def _half_to_float(bits: np.ndarray, out: np.ndarray) -> None:
    """fp16 bits -> fp32: move sign, exponent and mantissa into place, then rescale the exponent by 2^112
    (exact for normals and subnormals; scales are never inf or nan)."""
    as_bits = out.view(np.uint32)
    for g in range(bits.size):
        h = np.uint32(bits[g])
        as_bits[g] = ((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))
    for g in range(bits.size):
        out[g] *= _TWO_POW_112


@njit(inline="always", fastmath=True, cache=True)
def _dequant_row(codes: np.ndarray, scale: np.ndarray, levels: np.ndarray, w: np.ndarray) -> None:
    """w[k] = levels[code k] · scale[k // 128] for one row; codes is its [words, 2] bit planes."""
    for word in range(codes.shape[0]):
        s = scale[word // _WORDS_PER_GROUP]
        l0, l1, l2, l3 = levels[0] * s, levels[1] * s, levels[2] * s, levels[3] * s
        lo, hi = codes[word, 0], codes[word, 1]
        for j in range(CODE_WORD):
            b0 = (lo & _BIT[j]) != 0
            b1 = (hi & _BIT[j]) != 0
            w[word * CODE_WORD + j] = (l3 if b0 else l2) if b1 else (l1 if b0 else l0)


@njit(inline="always", fastmath=True, cache=True)
def _rows_times_tokens(w: np.ndarray, x: np.ndarray, out: np.ndarray, r0: int, nr: int) -> None:
    """out[:, r0 + i] = x · w[i] for i < nr ≤ 4: each weight load feeds four FMAs, over four tokens at a
    time and over the four rows for the tokens left over (n = 1 is the common decode case)."""
    n, d_in = x.shape
    full = n - n % _BLOCK
    for i in range(nr):
        for k in range(0, full, _BLOCK):
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for c in range(d_in):
                wc = w[i, c]
                s0 += wc * x[k, c]
                s1 += wc * x[k + 1, c]
                s2 += wc * x[k + 2, c]
                s3 += wc * x[k + 3, c]
            out[k, r0 + i] = s0
            out[k + 1, r0 + i] = s1
            out[k + 2, r0 + i] = s2
            out[k + 3, r0 + i] = s3
    for k in range(full, n):
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for c in range(d_in):
            xc = x[k, c]
            s0 += w[0, c] * xc
            s1 += w[1, c] * xc
            s2 += w[2, c] * xc
            s3 += w[3, c] * xc
        for i, s in enumerate((s0, s1, s2, s3)):
            if i < nr:
                out[k, r0 + i] = s


@njit(parallel=True, fastmath=True, cache=True)
def _base_matmul(codes: np.ndarray, scale_bits: np.ndarray, levels: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """Parallel over 16-row tasks; each task dequantizes into its own scratch, so threads share nothing."""
    rows = codes.shape[0]
    d_in = x.shape[1]
    for task in prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.zeros((_BLOCK, d_in), np.float32)  # zeros: a short last block computes on its unused rows
        scale = np.empty(scale_bits.shape[1], np.float32)
        for r0 in range(task * _ROWS_PER_TASK, min(rows, (task + 1) * _ROWS_PER_TASK), _BLOCK):
            nr = min(_BLOCK, rows - r0)
            for i in range(nr):
                _half_to_float(scale_bits[r0 + i], scale)
                _dequant_row(codes[r0 + i], scale, levels, w[i])
            _rows_times_tokens(w, x, out, r0, nr)


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ on the CPU; arguments as ``gpu_actor.kernels.base_matmul``, which checks them."""
    y = out if out is not None and out.is_contiguous() else torch.empty(x.shape[0], codes.shape[0])
    _base_matmul(
        codes.contiguous().numpy(),
        scale.contiguous().view(torch.int16).numpy().view(np.uint16),
        levels.to(torch.float32).contiguous().numpy(),
        x.to(torch.float32).contiguous().numpy(),
        y.numpy(),
    )
    if out is None:
        return y
    if y is not out:  # a column slice: one kernel specialization (C layout) is worth a small copy
        out.copy_(y)
    return out
