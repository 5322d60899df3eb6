"""The GPU actor's kernels: the 2-bit base product and the activation rotation, on whatever device holds
the tensors.

``base_matmul`` runs the Triton kernel for CUDA tensors and the numba kernel otherwise, so the actor runs
unchanged on a machine without a GPU. Triton is imported only when a CUDA tensor first arrives: importing
it decides, from ``TRITON_INTERPRET``, whether kernels compile or interpret, and that choice must stay
with whoever imports it first (the tests run the Triton kernel interpreted in a subprocess).
"""

from __future__ import annotations

import time

import torch

from splitspec.gpu_actor.kernels import cpu_base
from splitspec.gpu_actor.kernels.rotation import fast_hadamard, rotate_input, unrotate_output
from splitspec.quantize.format import CODE_WORD, GROUP

__all__ = ["base_matmul", "fast_hadamard", "rotate_input", "unrotate_output", "warmup"]


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ, float32 ``[n, rows]``, straight from the packed base (format.py).

    codes: int32 ``[rows, d_in/32, 2]`` bit planes; scale: fp16 ``[rows, ceil(d_in/128)]``; levels: the
    four code values; x: ``[n, d_in]`` rotated activations (any float dtype, computed in fp32); out: an
    optional float32 ``[n, rows]`` with unit stride along rows (a column slice of a wider buffer works).
    All on one device.
    """
    _check(codes, scale, levels, x, out)
    if x.device.type == "cuda":
        from splitspec.gpu_actor.kernels import triton_base

        return triton_base.base_matmul(codes, scale, levels, x, out)
    return cpu_base.base_matmul(codes, scale, levels, x, out)


def _check(
    codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None
) -> None:
    """Kernels index raw memory: a shape mismatch would read out of bounds rather than fail. Each product
    pays for these checks, so they compare the shapes as they come (a small layer's call is microseconds)."""
    rows, words, planes = codes.shape
    d_in = words * CODE_WORD
    x_shape = x.shape
    if len(x_shape) != 2 or x_shape[1] != d_in or planes != 2:
        raise ValueError(
            f"codes {tuple(codes.shape)} hold [rows, {d_in}/32, 2]; x must be [n, {d_in}], got {tuple(x_shape)}"
        )
    groups = -(-d_in // GROUP)
    if scale.shape != (rows, groups) or scale.dtype != torch.float16:
        raise ValueError(f"scale must be float16 [{rows}, {groups}], got {scale.dtype} {tuple(scale.shape)}")
    if levels.numel() != 4:
        raise ValueError(f"levels must hold the 4 code values, got {levels.numel()}")
    if out is not None and (out.shape != (x_shape[0], rows) or out.dtype != torch.float32 or out.stride(1) != 1):
        want = [x_shape[0], rows]
        raise ValueError(f"out must be float32 {want} with unit stride along rows, got {out.dtype} {out.stride()}")


def warmup(device: str | torch.device = "cpu") -> float:
    """Compile the base product for ``device`` ahead of the first real call (numba loads from its cache
    when it can); returns the seconds it took."""
    t0 = time.perf_counter()
    codes = torch.zeros(1, 1, 2, dtype=torch.int32, device=device)
    scale = torch.ones(1, 1, dtype=torch.float16, device=device)
    base_matmul(codes, scale, torch.zeros(4, device=device), torch.zeros(1, CODE_WORD, device=device))
    return time.perf_counter() - t0
