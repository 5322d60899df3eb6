"""Several sequences decoded together: each check verifies every live sequence's tree in one pass.

The residual is streamed from RAM once per pass whatever the number of tokens in it (up to the point
where the CPU actors become compute-bound), so sequences that share a pass share its biggest cost. Each
sequence keeps its own cache, draft shape and sampler; a sequence leaves the batch when it ends, and the
others go on (a server adds new ones between checks the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitspec.config import SamplingParams
from splitspec.gpu_actor.engine import GenerationStats, SplitEngine
from splitspec.gpu_actor.sampling import first_token, make_generator
from splitspec.gpu_actor.speculative import CheckRequest, clip, run_checks
from splitspec.scheduler import cost


@dataclass
class _Live:
    request: CheckRequest
    limit: int
    eos_id: int | None
    tokens: list[int]
    stats: GenerationStats

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.limit or (bool(self.tokens) and self.tokens[-1] == self.eos_id)


def generate_many(
    engine: SplitEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: int | None = None,
    params: Sequence[SamplingParams] | None = None,
) -> list[tuple[list[int], GenerationStats]]:
    """Each prompt's tokens and stats, as ``engine.generate`` would give them one at a time (greedy text
    equal up to near-ties: a pass over more rows sums in another order), with every check shared."""
    params = list(params) if params is not None else [SamplingParams()] * len(prompts)
    choice = engine.draft_shape()
    shape = choice.shape if isinstance(choice, cost.Choice) else choice
    live: list[_Live] = []
    for prompt, p in zip(prompts, params, strict=True):
        if not prompt or len(prompt) + max_new_tokens > engine.config.max_seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens + {max_new_tokens} does not fit max_seq_len")
        cache = engine.new_cache()
        logits, prefill, path = engine.prefill(torch.as_tensor(list(prompt)), cache)
        generator = make_generator(p)
        root = first_token(logits[-1], p, generator)
        stats = GenerationStats(len(prompt), path, prefill, shape.name())
        live.append(_Live(CheckRequest(cache, root, shape, p, generator), max_new_tokens, eos_id, [root], stats))
    everyone = list(live)
    while live := [s for s in live if not s.done]:
        results = run_checks(engine.model, engine.residual, [s.request for s in live], engine.config.spec)
        for seq, (new, check) in zip(live, results, strict=True):
            seq.stats.checks.append(check)
            new = clip(new, seq.limit - len(seq.tokens), eos_id)
            seq.tokens += new
            seq.request.root = new[-1]
    return [(s.tokens, s.stats) for s in everyone]
