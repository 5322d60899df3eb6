"""``graphs.StaticDraft``, the draft step a CUDA graph records, run eagerly on the CPU against the draft's
own forward (``SplitModel.forward(draft=True)``); its capture and replay run on a GPU (benchmarks/gpu_check.py)."""

from __future__ import annotations

import torch

from splitspec.gpu_actor.graphs import StaticDraft
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import NoResidual
from splitspec.quantize.format import ConvertedModel
from test_gpu_actor_model import DRAFT_LOGITS  # the draft's int8 head rounds its input to int16

RTOL = 1e-5  # K/V: fp32 rounding of two orders of the same sums


def check_static_draft(split: SplitModel, ids: torch.Tensor) -> None:
    """``graphs.StaticDraft`` (what a CUDA graph of a draft step records: attention over the cache's whole
    buffer under a full mask, K/V written at index slots) gives the draft's logits and K/V: a single token,
    then a tree level of siblings sharing a position. The static steps ran further first and the cache was
    rolled back, as after a check: what they saw then must not leak."""
    base = split.new_cache(64)
    split.forward(ids[:12], base, NoResidual())
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and its two children
    blocks = [(ids[12:13], None, None), (ids[13:16], torch.tensor([13, 14, 14]), tree)]
    drafts: dict[int, StaticDraft] = {}

    def static(tokens, cache, positions=None, mask=None):
        n = tokens.shape[0]
        if n not in drafts:
            drafts[n] = StaticDraft(split, cache, n)
        return drafts[n](tokens, cache, positions, mask).clone()

    caches, logits = {}, {}
    for kind in ("forward", "static"):
        cache = split.new_cache(64)
        cache.load_prefix(base, base.length)
        if kind == "static":
            for t in (ids[12:13], ids[13:16], ids[16:17]):
                static(t, cache)
            cache.truncate(base.length)
        caches[kind], logits[kind] = cache, []
        for tokens, positions, block in blocks:
            mask = None if block is None else torch.cat((torch.ones(3, cache.length, dtype=torch.bool), block), 1)
            if kind == "forward":
                logits[kind].append(split.forward(tokens, cache, NoResidual(), positions, mask, draft=True))
            else:
                logits[kind].append(static(tokens, cache, positions, mask))
    for want, got in zip(logits["forward"], logits["static"], strict=True):
        assert (got - want).abs().max() <= DRAFT_LOGITS * want.abs().max()
    want, got = caches["forward"], caches["static"]
    assert got.length == want.length == 16 and torch.equal(got.positions[:16], want.positions[:16])
    for a, b in ((got.k, want.k), (got.v, want.v)):
        assert (a[:, :16] - b[:, :16]).abs().max() <= RTOL * b[:, :16].abs().max()


def test_a_static_draft_step_equals_the_draft_forward(converted_small, prompts):
    check_static_draft(SplitModel(ConvertedModel(converted_small)), torch.tensor(prompts[0]))


def test_draft_step_is_the_draft_forward_without_graphs(converted_small, prompts):
    split = SplitModel(ConvertedModel(converted_small))
    ids = torch.tensor(prompts[0])
    caches = [split.new_cache(64) for _ in range(2)]
    for cache in caches:
        split.forward(ids[:12], cache, NoResidual())
    want = split.forward(ids[12:14], caches[0], NoResidual(), draft=True)
    assert torch.equal(split.draft_step(ids[12:14], caches[1]), want)
    assert caches[1].length == caches[0].length == 14
