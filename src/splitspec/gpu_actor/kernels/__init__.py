"""The GPU actor's kernels: the 2-bit base product and the activation rotation, on whatever device holds
the tensors.

``BaseProduct`` (and ``base_matmul``, one call of it) runs the Triton kernel for CUDA tensors and the
numba kernel otherwise, so the actor runs unchanged on a machine without a GPU. Triton is imported only
when a CUDA tensor first arrives: importing it decides, from ``TRITON_INTERPRET``, whether kernels compile
or interpret, and that choice must stay with whoever imports it first (the tests run the Triton kernel
interpreted in a subprocess).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from splitspec.gpu_actor.kernels.rotation import fast_hadamard, rotate_input, unrotate_output
from splitspec.kernels import cpu_base
from splitspec.quantize.format import CODE_WORD, GROUP

__all__ = ["BaseProduct", "base_matmul", "fast_hadamard", "rotate_input", "unrotate_output", "warmup"]


class BaseProduct:
    """x ↦ x · dequant(Q_base)ᵀ for one packed matrix, float32 ``[n, rows]``, on the matrix's device.

    The matrix (codes: int32 ``[rows, d_in/32, 2]`` bit planes, format.py; scale: fp16 ``[rows,
    ceil(d_in/128)]``; levels: the four code values) is checked and bound once, so that a call checks only
    its input: a decode step makes four of these calls a layer, each only microseconds of work. x: ``[n,
    d_in]`` rotated activations (any float dtype, computed in fp32) on the matrix's device; out: an optional
    float32 ``[n, rows]`` with unit stride along rows (a column slice of a wider buffer works). The Triton
    kernel is imported only when a CUDA matrix arrives. ``tiled`` chooses, on the CPU, whether products of
    many tokens may run on AMX tiles (``cpu_base.Product``; None: where they can)."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, tiled: bool | None = None
    ) -> None:
        rows, words, planes = codes.shape
        groups = -(-words * CODE_WORD // GROUP)
        if planes != 2:
            raise ValueError(f"codes must be [rows, d_in/32, 2] bit planes, got {tuple(codes.shape)}")
        if scale.shape != (rows, groups) or scale.dtype != torch.float16:
            raise ValueError(f"scale must be float16 [{rows}, {groups}], got {scale.dtype} {tuple(scale.shape)}")
        if levels.numel() != 4:
            raise ValueError(f"levels must hold the 4 code values, got {levels.numel()}")
        self.rows, self.d_in = rows, words * CODE_WORD
        if codes.device.type == "cuda":
            from splitspec.gpu_actor.kernels import triton_base

            self._product = partial(triton_base.base_matmul, codes, scale, levels)
        else:
            self._product = cpu_base.Product(codes, scale, levels, tiled)

    @property
    def cpu_fields(self) -> tuple[int, ...] | None:
        """The CPU kernel's fields for ``cpu_step`` (``cpu_base.Product.fields``), None on a GPU."""
        return self._product.fields if isinstance(self._product, cpu_base.Product) else None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
        """``split``: on the CPU, each row's first code words to take (None: all), the CPU actors multiplying
        the rest (``EngineConfig.base_share``)."""
        # kernels index raw memory: a shape mismatch would read out of bounds rather than fail
        x_shape = x.shape
        if len(x_shape) != 2 or x_shape[1] != self.d_in:
            raise ValueError(f"x must be [n, {self.d_in}], got {tuple(x_shape)}")
        want = (x_shape[0], self.rows)
        if out is not None and (out.shape != want or out.dtype != torch.float32 or out.stride(1) != 1):
            raise ValueError(f"out must be float32 {want} with unit stride along rows, got {out.dtype} {out.stride()}")
        if split is None:
            return self._product(x, out)
        if not isinstance(self._product, cpu_base.Product) or not 0 <= split <= self.d_in // CODE_WORD:
            raise ValueError(f"a split of the base's {self.d_in // CODE_WORD} code words is the CPU's, got {split}")
        return self._product(x, out, split)


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    tiled: bool | None = None,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ, float32 ``[n, rows]``, straight from the packed base: ``BaseProduct`` for a
    single call (a model binds one per matrix instead)."""
    return BaseProduct(codes, scale, levels, tiled)(x, out)


def warmup(device: str | torch.device = "cpu") -> float:
    """Compile the base product for ``device`` ahead of the first real call (numba loads from its cache
    when it can); returns the seconds it took."""
    t0 = time.perf_counter()
    codes = torch.zeros(1, 1, 2, dtype=torch.int32, device=device)
    scale = torch.ones(1, 1, dtype=torch.float16, device=device)
    base_matmul(codes, scale, torch.zeros(4, device=device), torch.zeros(1, CODE_WORD, device=device))
    return time.perf_counter() - t0
