"""The verifier's next-token distribution under ``SamplingParams``: temperature, top-k, top-p.

Computed in float64 on the CPU from fp32 logits, one row at a time: acceptance visits a handful of
nodes per check, and float64 keeps the masses that the rejection walk subtracts from drifting.
"""

from __future__ import annotations

import torch

from splitspec.config import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 [vocab] probabilities (summing to 1) from one row of logits; needs ``temperature > 0``."""
    if params.greedy:
        raise ValueError("probabilities need temperature > 0; greedy decoding takes the argmax")
    x = logits.detach().to("cpu", torch.float64) / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sorted_p, order = p.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p  # the mass before a token is under top_p
        p = torch.zeros_like(p).scatter_(0, order[keep], sorted_p[keep])
        p /= p.sum()
    return p


def first_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The token after a prompt, from its last position's logits [vocab]."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded from ``params.seed`` (a fresh random seed when None); None when greedy."""
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen
