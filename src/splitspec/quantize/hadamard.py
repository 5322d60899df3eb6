"""Randomized Hadamard transform (POC recipe, section 1).

The two-sided rotation W~ = H_o·S_o·W·S_i·H_i spreads outliers so the rotated weights look Gaussian, which
is what lets a 4-level Lloyd–Max grid fit them. H is block-diagonal with power-of-two Sylvester blocks, so
every dimension of a real model (576, 1536, 5376, ...) gets a transform, and it is applied with the
O(n log n) butterfly: the verifier rotates each activation at run time, so a dense matmul is not an option.

Conventions: W is d_out × d_in, y = W·x, activations are row vectors on the last dim. H is symmetric and
orthonormal, so it is its own inverse and x·H == H·x for a row vector.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

MAX_BLOCK = 4096


def block_size(n: int) -> int:
    """Largest power of two dividing n, capped at 4096 (576 → 64, 15360 → 1024, 5376 → 256).

    The cap keeps the per-block work bounded; beyond it, mixing wider gains little (recipe, section 1).
    """
    if n < 1:
        raise ValueError(f"block_size needs a positive dimension, got {n}")
    return min(n & -n, MAX_BLOCK)


def _check_block(b: int) -> None:
    if b < 1 or b & (b - 1):
        raise ValueError(f"Hadamard block size must be a positive power of two, got {b}")


def hadamard_matrix(b: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dense normalised Sylvester Hadamard matrix of size b; the reference that tests hold fwht to."""
    _check_block(b)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(b)).to(dtype)


def fwht(x: Tensor, b: int | None = None) -> Tensor:
    """Block-diagonal normalised Hadamard along the last dim, by the butterfly (log2(b) add/sub passes).

    Step h pairs element k with k + h inside each 2h-wide span, which reproduces the Sylvester recursion
    H_2h = [[H_h, H_h], [H_h, -H_h]] exactly, so fwht(x) == x @ blockdiag(hadamard_matrix(b)).
    """
    n = x.shape[-1]
    b = block_size(n) if b is None else b
    _check_block(b)
    if n % b:
        raise ValueError(f"last dim {n} is not a multiple of the Hadamard block {b}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n // b, b)
    h = 1
    while h < b:
        y = y.reshape(-1, b // (2 * h), 2, h)
        lo, hi = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((lo + hi, lo - hi), dim=2)
        h *= 2
    # The scaling multiply also makes b == 1 return a fresh tensor rather than a view of x.
    return (y * (1.0 / math.sqrt(b))).reshape(*lead, n)


def random_signs(seed: int, n: int) -> Tensor:
    """±1 vector of length n, float32, regenerable from the seed alone so files need not store it."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(torch.float32)


def linear_seed(base_seed: int, name: str) -> int:
    """Per-Linear seed; crc32 (not hash()) so it is stable across processes and Python versions."""
    return base_seed + zlib.crc32(name.encode()) % 100000


def _signs(s: Tensor, like: Tensor) -> Tensor:
    return s.to(dtype=like.dtype, device=like.device)


def rotate_input(x: Tensor, s_i: Tensor) -> Tensor:
    """x' = H_i·S_i·x on the last dim; done once per Linear group, shared by its Linears."""
    return fwht(x * _signs(s_i, x))


def unrotate_output(y_rot: Tensor, s_o: Tensor) -> Tensor:
    """y = S_o·H_o·y_rot on the last dim: brings W~·x' back to W·x."""
    return fwht(y_rot) * _signs(s_o, y_rot)


def _rotate_rows(m: Tensor) -> Tensor:
    """H·M for a matrix M: the column-wise transform, via the row transform of M^T."""
    return fwht(m.T).T


def rot_fwd(W: Tensor, s_o: Tensor, s_i: Tensor) -> Tensor:
    """W~ = H_o·S_o·W·S_i·H_i, so that W~·rotate_input(x) == H_o·S_o·W·x."""
    right = fwht(W * _signs(s_i, W))
    return _rotate_rows(right * _signs(s_o, W)[:, None])


def rot_inv(Wr: Tensor, s_o: Tensor, s_i: Tensor) -> Tensor:
    """W = S_o·H_o·W~·H_i·S_i, the exact inverse of rot_fwd (H and S are self-inverse)."""
    left = _rotate_rows(Wr) * _signs(s_o, Wr)[:, None]
    return fwht(left) * _signs(s_i, Wr)


def rotate_hessian(H: Tensor, s_i: Tensor) -> Tensor:
    """H~ = H_i·S_i·H·S_i·H_i: the second moment of the rotated inputs x', which GPTQ must see."""
    return rot_fwd(H, s_i, s_i)
