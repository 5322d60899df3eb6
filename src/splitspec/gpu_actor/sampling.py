"""The verifier's next-token distribution under ``SamplingParams``: logit bias and penalties, temperature,
top-k, top-p, min-p; and the log-probabilities a request asks for.

Computed in float64 on the CPU from fp32 logits, one row at a time: acceptance visits a handful of
nodes per check, and float64 keeps the masses that the rejection walk subtracts from drifting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitspec.config import SamplingParams
from splitspec.gpu_actor.grammar import Matcher


class Shaping:
    """One sequence's logit bias, penalties and grammar (``SamplingParams.shaped``): what its prompt and new
    tokens so far do to its next token's logits. A check's node sees the sequence plus the drafted tokens
    on its own path (``apply``'s ``path``), so each node is shaped as the text would be had it got there,
    and the walks stay exact. ``add`` the tokens a sequence emits, as it emits them. ``ends``: the tokens
    that end the text, which ``min_tokens`` holds back."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        matcher: Matcher | None = None,
        ends: frozenset[int] = frozenset(),
    ) -> None:
        self.params, self.matcher = params, matcher
        self._ends = torch.tensor(sorted(ends), dtype=torch.long)
        self.counts: Counter[int] = Counter()  # the new tokens
        self.prompt = frozenset(prompt) if params.repetition_penalty != 1 else frozenset()
        self._bias = torch.tensor(list(params.logit_bias), dtype=torch.long)
        self._bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float64)

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        prompt: Sequence[int],
        matcher: Matcher | None = None,
        ends: frozenset[int] = frozenset(),
    ) -> Shaping | None:
        """A ``Shaping`` where ``params`` shape the logits, else None (the walks' plain argmax); ``matcher``:
        the request's schema, grammar or regex compiled (``gpu_actor.grammar``)."""
        return cls(params, prompt, matcher, ends) if params.shaped else None

    def add(self, tokens: Sequence[int]) -> None:
        self.counts.update(tokens)
        if self.matcher is not None:
            self.matcher.accept(tokens)

    def apply(self, logits: torch.Tensor, path: Sequence[int] = ()) -> torch.Tensor:
        """float64 [vocab]: one row of logits after the bias, then the repetition penalty over the prompt
        and new tokens, then frequency and presence penalties over the new tokens (``path`` appended),
        then the grammar's mask, or the ends' while the text is under ``min_tokens``."""
        p = self.params
        x = logits.detach().to("cpu", torch.float64, copy=True)
        if self._bias.numel():
            x[self._bias] += self._bias_values
        counts = self.counts + Counter(path) if path else self.counts
        if p.repetition_penalty != 1 and (self.prompt or counts):
            seen = torch.tensor(sorted(self.prompt | counts.keys()), dtype=torch.long)
            v = x[seen]
            x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and counts:
            ids = torch.tensor(list(counts), dtype=torch.long)
            n = torch.tensor(list(counts.values()), dtype=torch.float64)
            x[ids] -= p.frequency_penalty * n + p.presence_penalty
        allowed = self.matcher.allowed(path) if self.matcher is not None else None
        if allowed is not None:
            x = x.masked_fill(~allowed, float("-inf"))
        if self._ends.numel() and counts.total() < p.min_tokens:
            x[self._ends] = float("-inf")
        return x


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 [vocab] probabilities (summing to 1) from one row of logits (shaped already, where
    ``params`` shape them); needs ``temperature > 0``."""
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
    if params.min_p > 0:
        p = p.masked_fill(p < params.min_p * p.max(), 0.0)
        p /= p.sum()
    return p


def first_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, shaping: Shaping | None = None
) -> int:
    """The token after a prompt, from its last position's logits [vocab]."""
    if shaping is not None:
        logits = shaping.apply(logits)
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
