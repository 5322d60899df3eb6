"""Randomized Hadamard rotation of activations at run time (the verifier's x' = H_i·S_i·x, y = S_o·H_oᵀ·y').

Same transform as ``quantize.hadamard`` (the offline reference), for both rotation kinds, computed with
fewer, larger operations. The radix-2 butterfly there costs ~3 kernel launches per stage (18 for a
64-block, 36 for 4096), and at decode sizes (a few tree tokens × d) a GPU spends that time launching, not
computing; on the CPU each stage is a full pass over memory. Here the transform is written as a Kronecker
product of small dense factors, each applied as one matmul over its digit of the column index:

- Sylvester block b ≤ 4096 = 64²: H_b = H_r1 ⊗ H_r2 with r2 = min(b, 64);
- Kronecker n = p·r: H_n = H_p ⊗ H_r1 ⊗ H_r2 (Paley factor, then the Sylvester one split the same way).

The Paley factor absorbs the first Sylvester factor when the product stays ≤ ``MAX_MERGED`` wide
(1536 → H_12 ⊗ H_2 = 24 wide, then 64; 14336 → 224, then 64), so most model widths take two launches. That
spends 2·(sum of factor widths) flops per element instead of log2(b) adds, which is cheap next to the
launches and passes it saves (measured 4–10× faster than the butterfly on one CPU core for d = 576…4096).

On the CPU, fp32 rows take ``kron``'s kernel: at a decode step's few rows a small matmul's call, and the
views around it, cost several times its arithmetic, and at a prompt's hundreds the kernel, whose Sylvester
factor takes butterflies, still beats the matmuls. Its plan is its own (``_kron_plan``): the Sylvester part
as wide as its butterflies go, so that the dense factor before it, a multiply-add an element per row of it,
stays narrow.

Precision: fp32 inputs keep fp32 products unless the caller enables TF32 matmuls on the GPU
(``torch.backends.cuda.matmul.allow_tf32``); leave it off for the verifier.
"""

from __future__ import annotations

import math
from functools import cache

import torch
from torch import Tensor

from splitspec.gpu_actor.kernels import kron
from splitspec.quantize.hadamard import (
    KRONECKER,
    block_size,
    check_rotation,
    hadamard_matrix,
    paley_conference,
    paley_matrix,
    paley_order,
)

MAX_FACTOR = 64  # Sylvester factors: 64 · 64 = 4096, the largest block ``block_size`` returns
MAX_MERGED = 256  # the widest Paley ⊗ Sylvester factor worth one launch fewer


def _sylvester_factors(r: int) -> list[tuple[str, int]]:
    """H_r as Sylvester factors of ≤ 64, high digits first (H_2^(a+b) = H_2^a ⊗ H_2^b in natural order)."""
    sizes = []
    while r > MAX_FACTOR:
        sizes.append(MAX_FACTOR)
        r //= MAX_FACTOR
    return [("sylvester", size) for size in ([r] if r > 1 else []) + sizes]


@cache
def _plan(n: int, kind: str) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The dense factors of H on a width-n vector, high digits first; each factor is a tuple of
    (``"paley"`` | ``"sylvester"``, size) parts whose Kronecker product it is. The block count of a
    block-diagonal Sylvester transform stays a batch dimension."""
    p = paley_order(n) if check_rotation(kind) == KRONECKER else None
    if p is None:
        return tuple((part,) for part in _sylvester_factors(block_size(n)))
    syl = _sylvester_factors(n // p)
    if len(syl) > 1 and p * syl[0][1] <= MAX_MERGED:
        return (("paley", p), syl[0]), *((part,) for part in syl[1:])
    return (("paley", p),), *((part,) for part in syl)


@cache
def _kron_plan(n: int, kind: str) -> tuple[tuple[tuple[str, int], ...], int, int, bool] | None:
    """(F1's parts, a, b, pairs) where ``kron`` takes a width-n rotation, else None: b = the Sylvester part up
    to ``kron.WIDTHS``' widest, F1 [a, a] the Paley factor and what is left of the Sylvester part (empty: F1 =
    [1]); ``pairs`` where F1 is a lone Paley II factor that ``kron`` applies by its conference matrix."""
    p = paley_order(n) if check_rotation(kind) == KRONECKER else None
    r = block_size(n) if p is None else n // p
    b = min(r, kron.WIDTHS[-1])
    parts = (() if p is None else (("paley", p),)) + ((("sylvester", r // b),) if r > b else ())
    a = math.prod(size for _, size in parts)
    if (len(parts) > 1 and a > MAX_MERGED) or not kron.takes(a, b):
        return None
    pairs = len(parts) == 1 and p is not None and paley_conference(p) is not None and kron.takes(p // 2, 2 * b)
    return parts, a, b, pairs


def _part(name: str, size: int) -> Tensor:
    return paley_matrix(size, torch.float64) if name == "paley" else hadamard_matrix(size, torch.float64)


@cache
def _factor(parts: tuple[tuple[str, int], ...], transpose: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The factor's dense matrix, built in float64 and cast once; ``transpose`` gives the inverse's."""
    m = _part(*parts[0])
    for part in parts[1:]:
        m = torch.kron(m, _part(*part))
    return (m.T if transpose else m).contiguous().to(dtype=dtype, device=device)


class Rotation:
    """H (or Hᵀ) on width-``width`` rows, times optional signs, with its factors built once for one dtype and
    device: a decode step applies ~10 of these per layer to one or a few rows, where each lookup, cast
    and broadcast a call makes costs as much as its arithmetic. ``signs`` multiply before H (the input
    side, H·S·x) or after Hᵀ (the output side, S·Hᵀ·y)."""

    def __init__(
        self,
        width: int,
        kind: str,
        transpose: bool = False,
        signs: Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        device = torch.device(device)
        plan = _plan(width, kind)
        mats = [_factor(f, transpose, dtype, device) for f in plan]
        sizes = [m.shape[0] for m in mats]
        self.width, self.transpose = width, transpose
        # The factors act on different digits of the index, so their order is free: the last one goes
        # first, a right product with its transpose (a view) on the input's own [-1, f_last] view; each
        # other factor is then (factor, its size, the product of the sizes after it), a left product.
        self._last = mats[-1].T if mats else None
        self._last_size = sizes[-1] if mats else 1
        self._left = [(m, sizes[k], math.prod(sizes[k + 1 :])) for k, m in enumerate(mats[:-1])]
        self.signs = None if signs is None else signs.to(dtype=dtype, device=device)
        # the side each applies on, decided once: a decode step makes hundreds of these calls
        self._in_signs = None if transpose else self.signs
        self._out_signs = self.signs if transpose else None
        # on the CPU: ``kron``, its factors and signs kept here and handed to it by address
        self._kron = None
        kron_plan = _kron_plan(width, kind)
        if device.type == "cpu" and dtype == torch.float32 and kron_plan is not None:
            parts, a, b, pairs = kron_plan
            signs = None if self.signs is None else self.signs.reshape(-1).contiguous()
            # the last factor is Sylvester's (a power of two), which kron applies by butterflies; the 1/√b
            # of its normalisation goes into F1 (a Paley II factor, symmetric, as its conference matrix)
            if pairs:
                f1 = paley_conference(parts[0][1]) / math.sqrt(parts[0][1])
            elif parts:
                f1 = _factor(parts, transpose, torch.float64, device)
            else:
                f1 = torch.ones(1, 1, dtype=torch.float64)
            f1 = (f1 / math.sqrt(b)).to(dtype=dtype, device=device).contiguous()
            self._kron_keep = (f1, signs)
            s_at = 0 if signs is None else signs.data_ptr()
            s_in_at, s_out_at = (s_at, 0) if self._in_signs is not None else (0, s_at)
            s_len = 1 if signs is None else signs.numel()
            self._kron = (f1.data_ptr(), a, b, s_in_at, s_out_at, s_len, int(pairs))

    @property
    def kron_fields(self) -> tuple[int, ...] | None:
        """``kron.kron_rows``'s factor and sign fields for this rotation (``cpu_step`` calls it from compiled
        code), or None where ``kron`` does not take it."""
        return self._kron

    def work(self, rows: int) -> tuple[int, int]:
        """(flops, bytes) of the transform on ``rows`` rows as it runs (its floor): each dense factor takes a
        dot product of its size per element, and on ``kron`` the last one log2(b) butterfly adds instead; the
        rows are read and written once, the dense factors and signs read once."""
        sizes = [m.shape[0] for m, _, _ in self._left] + ([self._last_size] if self._last is not None else [])
        if self._kron is None:
            dense, adds = sizes, 0
        else:
            _, a, b, *_, pairs = self._kron
            dense = [a // 2] if pairs else [a] if a > 1 else []  # a Paley II factor: half its width, 2 adds more
            adds = int(math.log2(b)) + 2 * pairs
        flops = rows * self.width * (2 * sum(dense) + adds)
        signs = 0 if self.signs is None else self.signs.numel()
        return flops, 4 * (2 * rows * self.width + sum(f * f for f in dense) + signs)

    def _product(self, x: Tensor) -> Tensor:
        """H·S·x on the input side, Hᵀ·y on the output side (its signs still to apply), a new tensor."""
        y = x if self._in_signs is None else x * self._in_signs
        # width 1 has no factors but still returns a new tensor, as every other width does
        y = y.clone() if self._last is None else torch.mm(y.reshape(-1, self._last_size), self._last)
        for m, size, rest in self._left:  # the digits before a factor's (rows, blocks, factors) batch it
            batch = y.numel() // (size * rest)
            # an expanded (stride-0) factor goes to bmm as is; matmul's broadcasting costs more at these sizes
            y = (
                torch.bmm(m.expand(batch, size, size), y.view(batch, size, rest))
                if batch > 1
                else torch.mm(m, y.view(size, rest))
            )
        return y.view_as(x)  # not view(x.shape): a Size argument costs more than the view

    def _kron_layout(self, x: Tensor) -> tuple[int, int, int] | None:
        """(rows, their length, their stride) where ``kron`` takes x: fp32, rows on its first dim, each row
        contiguous (the whole of x, or a slice of columns)."""
        if self._kron is None or x.dtype is not torch.float32 or x.dim() < 2:
            return None
        rows = x.shape[0]
        if rows == 0:
            return None
        if x.is_contiguous():
            row_len = x.numel() // rows
            return rows, row_len, row_len
        if x.stride(-1) == 1 and (x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2])):
            return rows, x.numel() // rows, x.stride(0)
        return None

    def _kron_product(self, x: Tensor, layout: tuple[int, int, int]) -> Tensor:
        """``kron``'s transform of x (signs on both sides), a new contiguous tensor of x's shape."""
        rows, row_len, stride = layout
        y = torch.empty_like(x)  # contiguous: x is, or is a slice of columns
        kron.kron_rows(x.data_ptr(), stride, rows, row_len, *self._kron, y.data_ptr(), row_len)
        return y

    def __call__(self, x: Tensor) -> Tensor:
        """The transform of each width-``width`` row on x's last dim, a new tensor of x's shape."""
        layout = self._kron_layout(x)
        if layout is not None:
            return self._kron_product(x, layout)
        y = self._product(x)
        return y if self._out_signs is None else y.mul_(self._out_signs)

    def add_to(self, acc: Tensor, y: Tensor) -> Tensor:
        """``acc += self(y)`` in place, the output signs applied on the way in (one fused multiply-add
        instead of a multiply and an add: a layer's residual stream takes two of these per token); where
        ``kron`` takes y, its product with the signs, then one add."""
        layout = self._kron_layout(y)
        if layout is not None:
            return acc.add_(self._kron_product(y, layout))
        if self._out_signs is None:
            return acc.add_(self._product(y))
        return acc.addcmul_(self._product(y), self._out_signs)


@cache
def _rotation(width: int, kind: str, transpose: bool, dtype: torch.dtype, device: torch.device) -> Rotation:
    return Rotation(width, kind, transpose, None, dtype, device)


def fast_hadamard(x: Tensor, kind: str = KRONECKER, transpose: bool = False) -> Tensor:
    """H·x (or Hᵀ·x) for each row vector on the last dim, equal to ``quantize.hadamard.hadamard``.

    With the column index split into digits (j = j1·f2 + j2 for two factors), H[i, j] = F1[i1, j1]·F2[i2, j2],
    so each factor multiplies along its own digit: F1 as a (batched) left product on the [f1, f2] view, the
    last factor as a right product with its transpose.
    """
    return _rotation(x.shape[-1], kind, transpose, x.dtype, x.device)(x)


def rotate_input(x: Tensor, s_i: Tensor, kind: str = KRONECKER) -> Tensor:
    """x' = H_i·S_i·x on the last dim (a model keeps a ``Rotation`` per group instead: no lookups per call)."""
    return fast_hadamard(x * s_i.to(dtype=x.dtype, device=x.device), kind)


def unrotate_output(y_rot: Tensor, s_o: Tensor, kind: str = KRONECKER) -> Tensor:
    """y = S_o·H_oᵀ·y_rot on the last dim: brings W~·x' back to W·x."""
    return fast_hadamard(y_rot, kind, transpose=True) * s_o.to(dtype=y_rot.dtype, device=y_rot.device)
