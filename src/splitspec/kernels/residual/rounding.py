"""x rounded to integer codes in the layout the integer loops read, bit for bit as
``quantize.activations.round_activations``."""

from __future__ import annotations

import numpy as np
from numba import njit

from splitspec.kernels import amx
from splitspec.quantize.packing import GROUP


@njit(cache=True, fastmath=True)
def _amax(values):
    """max |values|; fast-math lets LLVM vectorize the reduction (max is exact in any order; only NaN
    inputs could come out differently, and they have no meaningful code either way)."""
    amax = np.float32(0.0)
    for c in range(values.size):
        amax = max(amax, abs(values[c]))
    return amax


@njit(cache=True, error_model="numpy")
def round_activations_into(x, xq, xs, xb, offset, levels):
    """``quantize.activations.round_activations(x, levels)`` in the kernel's layout, bit for bit: token k's
    codes of columns 2p and 2p + 1 in the int32 word xq[p·n + k] (it starts zeroed, which pads the last
    columns), its scale at xs[(c // 128)·n + k] (fp32), and ``offset`` × its codes' sum over the group at
    the same place in xb (int32; the share of unsigned codes' offset).

    A group's codes are made in a buffer of their own, in loops that vectorize (the max, the rounding,
    the sum; ``error_model="numpy"`` drops the division's zero check, which kept the rounding scalar: the
    scale is never 0), then stored a word at a time."""
    n, d = x.shape
    codes = np.zeros(GROUP, np.int16)  # zero past a short last group: its padding
    pairs, words = codes.view(np.uint32), xq.view(np.uint32)
    for k in range(n):
        for c0 in range(0, d, GROUP):
            cols = min(GROUP, d - c0)
            seg = x[k, c0 : c0 + cols]
            amax = _amax(seg)
            scale = amax / np.float32(levels) if amax > 0 else np.float32(1.0)
            for c in range(cols):
                codes[c] = np.int16(np.rint(seg[c] / scale))
            total = 0
            for c in range(cols):
                total += codes[c]
            codes[cols:] = 0
            for p in range((cols + 1) // 2):
                words[(c0 // 2 + p) * n + k] = pairs[p]
            xs[(c0 // GROUP) * n + k] = scale
            xb[(c0 // GROUP) * n + k] = offset * total


@njit(cache=True)
def round_digits_into(x, digits, plane, xs, xb, offset, levels, stride):
    """``round_activations_into``'s codes q as AMX's activation tiles want them, token k's column c at
    k·stride + c of two byte planes ``plane`` bytes apart in ``digits``: q >> 8 (int8) in the first, q & 255
    in the second (``amx.split_bytes``); a short last group's columns past x are zero. The scales and
    offset sums as there."""
    n, d = x.shape
    flat = x.reshape(-1)
    short = np.zeros(GROUP, np.float32)  # a short last group, padded
    for k in range(n):
        for c0 in range(0, d, GROUP):
            values, start = flat, k * d + c0
            if d - c0 < GROUP:
                for c in range(d - c0):
                    short[c] = flat[start + c]
                values, start = short, 0
            amax = amx.group_amax(values, start)
            scale = amax / np.float32(levels) if amax > 0 else np.float32(1.0)
            total = amx.split_bytes(values, start, scale, digits, k * stride + c0, plane)
            xs[(c0 // GROUP) * n + k] = scale
            xb[(c0 // GROUP) * n + k] = offset * total
