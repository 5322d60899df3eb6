"""Fitting the draft's rank statistics: the batched count against drafting from each position alone."""

from __future__ import annotations

import pytest
import torch

from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import LocalResidual, NoResidual
from splitspec.gpu_actor.tree_fit import continuation, probabilities, rank_counts
from splitspec.quantize.format import ConvertedModel

DEPTH = 4


@pytest.fixture(scope="module")
def verifier(converted_small):
    # the fp32 draft head: the int8 one quantizes a call's rows with one scale, so its logits depend on
    # what else is in the pass, and this test is about the batching
    return SplitModel(ConvertedModel(converted_small), draft_head="fp32"), LocalResidual.load(converted_small, 8)


def _one_start_at_a_time(model, residual, prompt, verified, kv):
    """The definition: for each start t, a cache holding the first t tokens (the verifier's K/V, or the
    draft's own for "draft2bit"), then the draft runs seq[t : t + depth] and ranks the next tokens."""
    seq = torch.tensor([*prompt, *verified])
    counts = torch.zeros(DEPTH, 17, dtype=torch.long)
    for t in range(len(prompt), seq.numel() - 1):
        span = min(DEPTH, seq.numel() - 1 - t)
        cache = model.new_cache(seq.numel())
        model.forward(seq[:t], cache, residual if kv == "exact" else NoResidual())
        logits = model.forward(seq[t : t + span], cache, NoResidual(), draft=True)
        truth = seq[t + 1 : t + 1 + span]
        rank = (logits > logits.gather(1, truth[:, None])).sum(1).clamp(max=16)
        for d, r in enumerate(rank.tolist()):
            counts[d, r] += 1
    return counts


@pytest.mark.parametrize("kv", ["exact", "draft2bit"])
def test_batched_rank_counts_equal_one_start_at_a_time(verifier, prompts, kv):
    model, residual = verifier
    prompt = prompts[0][:24]
    verified = continuation(model, residual, prompt, 13)
    assert len(verified) == 13
    got = rank_counts(model, residual, prompt, verified, depth=DEPTH, kv=kv)
    want = _one_start_at_a_time(model, residual, prompt, verified, kv)
    # a pass over other rows sums in another order: a rank may move where two logits nearly tie
    assert got.sum() == want.sum() == sum(min(DEPTH, 12 - i) for i in range(12))
    assert (got - want).abs().sum() <= 2, f"{got}\n{want}"
    p = probabilities(got)
    assert len(p) == DEPTH and all(0.0 <= sum(row) <= 1.0 + 1e-9 for row in p)
