"""The verifier's next-token distribution under ``SamplingParams``: temperature, top-k, top-p; and the
log-probabilities a request asks for.

Computed in float64 on the CPU from fp32 logits, one row at a time: acceptance visits a handful of
nodes per check, and float64 keeps the masses that the rejection walk subtracts from drifting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability where it stood under the verifier's raw logits, and the ``top`` likeliest
    tokens there with theirs (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list[Any]:
        """Plain data for a Ray call: [token, logprob, [[token, logprob], ...]]."""
        return [self.token, self.logprob, [list(t) for t in self.top]]


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Each row of ``logits`` [m, vocab]'s log-probability of its token in ``tokens`` (m of them), with the
    row's ``k`` likeliest: log-softmax in float64, whatever the row was sampled under."""
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=-1)
    mine = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(int(t), m) for t, m in zip(tokens, mine, strict=True)]
    top = lp.topk(k, dim=-1)
    pairs = [tuple(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    return [TokenLogprob(int(t), m, p) for t, m, p in zip(tokens, mine, pairs, strict=True)]
