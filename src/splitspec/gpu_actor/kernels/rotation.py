"""Randomized Hadamard rotation of activations at run time (the verifier's x' = H_i·S_i·x, y = S_o·H_o·y').

Same transform as ``quantize.hadamard`` (the offline reference), computed with fewer, larger operations.
The radix-2 butterfly there costs ~3 kernel launches per stage (18 for a 64-block, 36 for 4096), and at
decode sizes (a few tree tokens × d) a GPU spends that time launching, not computing; on the CPU each
stage is a full pass over memory. Here a Sylvester block of size b ≤ 4096 = 64² is split as
H_b = H_r1 ⊗ H_r2 with r2 = min(b, 64), and each factor is one matmul over its half of the column index:
two launches at most, each a dense product that both CPUs and GPUs run near peak. That spends
2·(r1 + r2) ≤ 256 flops per element instead of log2(b) adds, which is cheap next to the launches and
passes it saves (measured 4–10× faster than the butterfly on one CPU core for d = 576…4096).

Precision: fp32 inputs keep fp32 products unless the caller enables TF32 matmuls on the GPU
(``torch.backends.cuda.matmul.allow_tf32``); leave it off for the verifier.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from splitspec.quantize.hadamard import block_size, hadamard_matrix

MAX_FACTOR = 64  # 64 · 64 = 4096, the largest block ``block_size`` returns


@cache
def _factor(r: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return hadamard_matrix(r, dtype).to(device)


def fast_hadamard(x: Tensor) -> Tensor:
    """Block-diagonal normalised Hadamard on the last dim, equal to ``quantize.hadamard.fwht(x)``.

    With column j = j1·r2 + j2 inside a block, H_b[i, j] = (-1)^popcount(i & j) splits into the product of
    the H_r1 entry of the high digits and the H_r2 entry of the low ones, so a block viewed as an r1 × r2
    matrix X transforms as H_r1 · X · H_r2 (both factors symmetric).
    """
    n = x.shape[-1]
    b = block_size(n)
    r2 = min(b, MAX_FACTOR)
    r1 = b // r2
    y = x.reshape(-1, r2) @ _factor(r2, x.dtype, x.device)
    if r1 > 1:
        y = torch.matmul(_factor(r1, x.dtype, x.device), y.reshape(-1, r1, r2))
    return y.reshape(x.shape)


def rotate_input(x: Tensor, s_i: Tensor) -> Tensor:
    """x' = H_i·S_i·x on the last dim. Keep ``s_i`` on x's device: a host copy here would cost a transfer
    per call."""
    return fast_hadamard(x * s_i.to(dtype=x.dtype, device=x.device))


def unrotate_output(y_rot: Tensor, s_o: Tensor) -> Tensor:
    """y = S_o·H_o·y_rot on the last dim: brings W~·x' back to W·x."""
    return fast_hadamard(y_rot) * s_o.to(dtype=y_rot.dtype, device=y_rot.device)
