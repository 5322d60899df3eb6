"""Fit the 4 Lloyd–Max levels of the 2-bit base (POC recipe, section 2).

The base quantizes each (row, 128-group) as level × RMS of the group, so the levels are fitted to rotated
weights divided by their group RMS. For rotated weights that distribution is close to a unit Gaussian and
the fit lands near the Gaussian 4-level quantizer (±0.4528, ±1.5104); fitting rather than hard-coding it
keeps whatever non-Gaussian shape a model has.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_rms_normalize(W: Tensor, group: int = 128) -> Tensor:
    """Each (row, group-column block) divided by its RMS, flattened; the last block of a row may be short.

    All-zero blocks (dead columns zeroed by GPTQ, pruned rows) carry no shape information and would divide
    by zero, so they are left out.
    """
    if W.ndim != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {tuple(W.shape)}")
    if group < 1:
        raise ValueError(f"group must be positive, got {group}")
    parts = []
    for start in range(0, W.shape[1], group):
        blk = W[:, start : start + group].to(torch.float32)
        rms = blk.square().mean(dim=1).sqrt()
        keep = rms > 0
        parts.append((blk[keep] / rms[keep, None]).reshape(-1))
    return torch.cat(parts)


def _lloyd_step(xs: Tensor, csum: Tensor, levels: Tensor) -> Tensor:
    """One Lloyd step on sorted samples: each level moves to the mean of the samples nearest to it.

    With sorted samples the cells are contiguous ranges found by binary search, so a step costs
    O(L log n) instead of a pass over all samples.
    """
    edges = torch.searchsorted(xs, (levels[1:] + levels[:-1]) / 2)
    bounds = torch.cat([edges.new_zeros(1), edges, edges.new_full((1,), xs.numel())])
    counts = (bounds[1:] - bounds[:-1]).to(torch.float64)
    sums = csum[bounds[1:]] - csum[bounds[:-1]]
    # An empty cell keeps its level instead of becoming NaN.
    return torch.where(counts > 0, sums / counts.clamp(min=1), levels)


def fit_levels(
    samples: Tensor, n_levels: int = 4, iters: int = 60, max_samples: int = 2_000_000, seed: int = 0
) -> Tensor:
    """Symmetric Lloyd–Max levels for the samples, sorted, float32.

    Deterministic: at most max_samples are drawn (uniformly, with replacement, from a generator seeded
    with seed) so a multi-billion-weight model costs the same as a small one. Lloyd starts from the
    quantiles (2k+1)/(2·n_levels) and runs `iters` steps; from there it converges fast on bell-shaped
    data (on exact Gaussian quantiles: 1.8e-3 off after 10 steps, 1e-5 after 20, ~1e-6 after 30), so the
    recipe's 60 need no convergence test. The result is symmetrised, (l - flip(l)) / 2: the random signs
    of the rotation make a weight's sign arbitrary, so any asymmetry is sampling noise.
    """
    if n_levels < 2:
        raise ValueError(f"need at least 2 levels, got {n_levels}")
    x = samples.reshape(-1)
    if x.numel() > max_samples:
        # Subsample before any copy: the flattened weights of a large model do not fit twice in RAM.
        g = torch.Generator().manual_seed(seed)
        x = x[torch.randint(0, x.numel(), (max_samples,), generator=g)]
    x = x[torch.isfinite(x)].to(torch.float64)
    if x.numel() < n_levels:
        raise ValueError(f"need at least {n_levels} finite samples, got {x.numel()}")
    xs = x.sort().values
    csum = torch.cat([xs.new_zeros(1), xs.cumsum(0)])
    probs = (2 * torch.arange(n_levels, dtype=torch.float64) + 1) / (2 * n_levels)
    levels = xs[(probs * (xs.numel() - 1)).round().long()]
    for _ in range(iters):
        levels = _lloyd_step(xs, csum, levels)
    levels = (levels - levels.flip(0)) / 2
    return levels.sort().values.to(torch.float32)
