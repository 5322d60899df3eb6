"""Randomized Hadamard transform (POC recipe, section 1), in two kinds.

The two-sided rotation W~ = H_o·S_o·W·S_i·H_iᵀ spreads outliers so the rotated weights look Gaussian,
which is what lets a 4-level Lloyd–Max grid fit them. Every dimension of a real model (576, 1536, 5376,
...) gets a transform, applied in O(n log n)-ish time: the verifier rotates each activation at run time,
so a dense n × n matmul is not an option.

- ``"sylvester"`` (the recipe): block-diagonal with power-of-two Sylvester blocks (``block_size``),
  applied with the butterfly. Symmetric. On widths with a large odd factor the blocks are small
  (576 = 9·64 gets 64-blocks), so each output mixes few inputs.
- ``"kronecker"`` (the default: it measured better, see ``ConvertConfig``): full width, H_n = H_p ⊗ H_r
  for n = 2^k·m (m odd, k ≥ 2), p = 4m and r = n/p a power of two; H_p comes from Paley's construction
  (``paley_order``), H_r is Sylvester. Applied as a small dense p × p product plus the butterfly. H_p is
  not symmetric in general, hence the transposes below. A width with no such construction (m = 1,
  k < 2, or no suitable prime) falls back to the Sylvester block-diagonal transform, so every width
  still gets a rotation.

Conventions: W is d_out × d_in, y = W·x, activations are row vectors on the last dim; ``hadamard(x)``
computes H·x for each row vector and ``hadamard(x, transpose=True)`` Hᵀ·x = H⁻¹·x (H is orthonormal).
"""

from __future__ import annotations

import math
import zlib
from functools import cache

import torch
from torch import Tensor

from splitspec.config import ROTATIONS

MAX_BLOCK = 4096
SYLVESTER, KRONECKER = ROTATIONS


def check_rotation(kind: str) -> str:
    """The kind, if this splitspec knows it; a clear error otherwise (configs and manifests call this)."""
    if kind not in ROTATIONS:
        raise ValueError(f"unknown rotation {kind!r}; known: {', '.join(ROTATIONS)}")
    return kind


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


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _paley_prime(p: int) -> tuple[int, int] | None:
    """(construction, q) that builds a Hadamard matrix of order p = 4m (m odd), or None.

    Paley I needs a prime q = p − 1 (then q ≡ 3 mod 4), Paley II a prime q = p/2 − 1 (then q ≡ 1 mod 4).
    Prime fields only: prime powers would need GF(q^k) arithmetic for orders no target model has.
    """
    if p % 4 or p < 12:
        return None
    if _is_prime(p - 1):
        return 1, p - 1
    if _is_prime(p // 2 - 1):
        return 2, p // 2 - 1
    return None


def paley_order(n: int) -> int | None:
    """p = 4m for n = 2^k·m (m odd, k ≥ 2) when Paley gives H_p, else None (the Sylvester fallback).

    576 → 36 (Paley II, q = 17), 1536 → 12 (Paley I, q = 11), 14336 → 28, 5376 → 84, 4096 → None.
    """
    if n < 1:
        raise ValueError(f"paley_order needs a positive dimension, got {n}")
    two = n & -n
    if two < 4:
        return None
    p = 4 * (n // two)
    return p if _paley_prime(p) else None


def _jacobsthal(q: int) -> Tensor:
    """Q[i, j] = χ(j − i) with the quadratic character χ(a) = a^((q−1)/2) mod q, mapped to {0, ±1}."""
    chi = torch.tensor([0] + [1 if pow(a, (q - 1) // 2, q) == 1 else -1 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _conference(q: int, sign: int) -> Tensor:
    """[[0, 1ᵀ], [sign·1, Q]]: antisymmetric (sign −1) for q ≡ 3 mod 4, symmetric (+1) for q ≡ 1 mod 4."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = sign
    c[1:, 1:] = _jacobsthal(q)
    return c


@cache
def _paley_pm1(p: int) -> Tensor:
    """The ±1 Paley matrix of order p; cached, as a conversion asks for the same order once per Linear.

    Paley I: I + C with C antisymmetric. Paley II: C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]].
    """
    found = _paley_prime(p)
    if found is None:
        raise ValueError(f"no Paley construction gives a Hadamard matrix of order {p}")
    construction, q = found
    if construction == 1:
        return torch.eye(p, dtype=torch.float64) + _conference(q, -1)
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(_conference(q, 1), a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


def paley_conference(p: int) -> Tensor | None:
    """C [p/2, p/2] where H_p is Paley II's C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]] (unnormalised,
    float64), else None: a rotation applies C to pairs of rows, half the multiply-adds of H_p."""
    found = _paley_prime(p)
    return None if found is None or found[0] != 2 else _conference(found[1], 1)


def paley_matrix(p: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dense normalised Paley Hadamard matrix of order p (orthonormal, not symmetric in general)."""
    return (_paley_pm1(p) / math.sqrt(p)).to(dtype)


def rotation_matrix(n: int, kind: str, dtype: torch.dtype = torch.float64) -> Tensor:
    """The dense n × n H of a kind, for tests and analysis only (run-time code never builds it)."""
    p = paley_order(n) if check_rotation(kind) == KRONECKER else None
    if p is None:
        b = block_size(n)
        return torch.block_diag(*[hadamard_matrix(b, dtype)] * (n // b))
    return torch.kron(paley_matrix(p, torch.float64), hadamard_matrix(n // p, torch.float64)).to(dtype)


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
    # In place on one fresh copy: a pass holds half a copy more, not three (a converter's group can be GBs).
    y = x.reshape(-1, n // b, b).clone(memory_format=torch.contiguous_format)
    h = 1
    while h < b:
        pairs = y.view(-1, b // (2 * h), 2, h)
        lo, hi = pairs[:, :, 0, :], pairs[:, :, 1, :]
        total = lo + hi
        torch.sub(lo, hi, out=hi)
        lo.copy_(total)
        h *= 2
    return y.mul_(1.0 / math.sqrt(b)).reshape(*lead, n)


def hadamard(x: Tensor, kind: str = KRONECKER, transpose: bool = False) -> Tensor:
    """H·x (or Hᵀ·x) for each row vector x on the last dim.

    Kronecker: with x viewed as X [p, r] (x[j1·r + j2] = X[j1, j2]), (H_p ⊗ H_r)·x = H_p·X·H_r, so the
    Paley factor is one small matmul over the high index and the butterfly does the low one.
    """
    n = x.shape[-1]
    p = paley_order(n) if check_rotation(kind) == KRONECKER else None
    if p is None:
        return fwht(x)
    hp = paley_matrix(p, x.dtype).to(x.device)
    y = torch.matmul(hp.T if transpose else hp, x.reshape(-1, p, n // p))
    return fwht(y, n // p).reshape(x.shape)


def random_signs(seed: int, n: int) -> Tensor:
    """±1 vector of length n, float32, regenerable from the seed alone so files need not store it."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(torch.float32)


def linear_seed(base_seed: int, name: str) -> int:
    """Per-Linear seed; crc32 (not hash()) so it is stable across processes and Python versions."""
    return base_seed + zlib.crc32(name.encode()) % 100000


def _signs(s: Tensor, like: Tensor) -> Tensor:
    return s.to(dtype=like.dtype, device=like.device)


def rotate_input(x: Tensor, s_i: Tensor, kind: str = KRONECKER) -> Tensor:
    """x' = H_i·S_i·x on the last dim; done once per Linear group, shared by its Linears."""
    return hadamard(x * _signs(s_i, x), kind)


def unrotate_output(y_rot: Tensor, s_o: Tensor, kind: str = KRONECKER) -> Tensor:
    """y = S_o·H_oᵀ·y_rot on the last dim: brings W~·x' back to W·x."""
    return hadamard(y_rot, kind, transpose=True) * _signs(s_o, y_rot)


def _columns(m: Tensor, kind: str, transpose: bool = False) -> Tensor:
    """H·M (or Hᵀ·M) for a matrix M: the column-wise transform, via the row transform of Mᵀ."""
    return hadamard(m.T, kind, transpose).T


def rot_fwd(W: Tensor, s_o: Tensor, s_i: Tensor, kind: str = KRONECKER) -> Tensor:
    """W~ = H_o·S_o·W·S_i·H_iᵀ, so that W~·rotate_input(x) == H_o·S_o·W·x.

    Row r of W·S_i·H_iᵀ is H_i·(S_i·w_r), the same transform ``rotate_input`` gives an activation.
    """
    right = hadamard(W * _signs(s_i, W), kind)
    return _columns(right * _signs(s_o, W)[:, None], kind)


def rot_inv(Wr: Tensor, s_o: Tensor, s_i: Tensor, kind: str = KRONECKER) -> Tensor:
    """W = S_o·H_oᵀ·W~·H_i·S_i, the exact inverse of rot_fwd (H orthonormal, S self-inverse)."""
    left = _columns(Wr, kind, transpose=True) * _signs(s_o, Wr)[:, None]
    return hadamard(left, kind, transpose=True) * _signs(s_i, Wr)


def rotate_hessian(H: Tensor, s_i: Tensor, kind: str = KRONECKER) -> Tensor:
    """H~ = H_i·S_i·H·S_i·H_iᵀ: the second moment of the rotated inputs x', which GPTQ must see."""
    return rot_fwd(H, s_i, s_i, kind)
