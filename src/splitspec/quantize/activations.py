"""Rounding the residual's input activations to int16 or int8, so that the CPU kernel can multiply in integers.

The residual is small (about the size of the 2-bit base's error), so its input x' can be rounded far
more coarsely than its output matters: with one fp32 scale per (token, 128-column group), matching the
weights' groups, int16 rounding moves R·x' by ~1e-5 of its size, against ~4e-3 for rounding the
weights to bf16. The CPU kernel then sums code × activation products exactly in int32 within a group
and scales once per group. ``benchmarks/quality.py`` measures what it does to the logits.

int8 (127 levels a side, the same groups) rounds ~260× more coarsely: ~6e-3 of R·x' for Gaussian-like
groups, several times what bf16 weights would, which is why it is not the default; the kernel takes the
same integer paths for it as for int16 (a byte path, vpmaddubsw, would need one built for the layout).
``quality.py`` measures whether the logits can tell.

This is the definition; the kernel's own (numba) rounding must equal it bit for bit.
"""

from __future__ import annotations

import torch

from splitspec.quantize.packing import GROUP

INT16_MAX = 32767
INT8_MAX = 127
# largest code per integer activation mode (config.ACTIVATION_MODES); codes are in [-levels, levels]
LEVELS = {"int16": INT16_MAX, "int8": INT8_MAX}


def activation_scales(x: torch.Tensor, levels: int = INT16_MAX) -> torch.Tensor:
    """fp32 scales [n, groups]: max |x| of each (token, 128-column group) / levels; 1 where it is all 0."""
    n, d = x.shape
    groups = -(-d // GROUP)
    padded = torch.nn.functional.pad(x.float().abs(), (0, groups * GROUP - d))
    amax = padded.view(n, groups, GROUP).amax(dim=2)
    return torch.where(amax > 0, amax / levels, torch.ones_like(amax))


def round_activations(x: torch.Tensor, levels: int = INT16_MAX) -> torch.Tensor:
    """x rounded to integer codes in [-levels, levels] times its (token, group) scale: what the kernel
    multiplies, as fp32."""
    scales = activation_scales(x, levels).repeat_interleave(GROUP, dim=1)[:, : x.shape[1]]
    return torch.round(x.float() / scales) * scales
