"""``graphs.StaticStep``, the steps CUDA graphs record, run eagerly on the CPU: the draft step against the
draft's own forward (``SplitModel.forward(draft=True)``), the verify pass with its residual crossings against
the verifier's forward on a real CPU actor; their capture and replay run on a GPU (benchmarks/gpu_check.py)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from splitspec.gpu_actor.graphs import StaticStep
from splitspec.gpu_actor.model import PassStats, SplitModel
from splitspec.gpu_actor.residual import NoResidual, Residual
from splitspec.quantize.format import ConvertedModel
from test_gpu_actor_model import DRAFT_LOGITS  # the draft's int8 head rounds its input to int16

RTOL = 1e-5  # K/V: fp32 rounding of two orders of the same sums


def check_static_step(split: SplitModel, ids: torch.Tensor, residual: Residual | None = None) -> None:
    """``graphs.StaticStep`` (what CUDA graphs of a step record: attention over the cache's whole buffer under
    a full mask, K/V written at index slots, x' and y_r through host buffers) gives the forward's logits and
    K/V: the draft's, or with ``residual`` the verifier's. A single token, then a tree level of siblings
    sharing a position. The static steps ran further first and the cache was rolled back, as after a check:
    what they saw then must not leak. A linear-attention model's state and pending entries (Qwen 3.5) too."""
    base = split.new_cache(64)
    split.forward(ids[:12], base, NoResidual())
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and its two children
    blocks = [(ids[12:13], None, None), (ids[13:16], torch.tensor([13, 14, 14]), tree)]
    steps: dict[int, StaticStep] = {}
    stats = PassStats()

    def static(tokens, cache, positions=None, mask=None):
        n = tokens.shape[0]
        if n not in steps:
            steps[n] = StaticStep(split, cache, n, residual)
        return steps[n](tokens, cache, positions, mask, stats).clone()

    caches, logits = {}, {}
    for kind in ("forward", "static"):
        cache = split.new_cache(64)
        cache.load_prefix(base, base.length)
        if kind == "static":  # chains of a check, with their masks, rolled back
            for t in (ids[12:13], ids[13:16], ids[16:17]):
                length, n = cache.length, t.shape[0]
                static(t, cache, mask=torch.ones(n, length + n, dtype=torch.bool).tril(length))
            cache.truncate(base.length)
        caches[kind], logits[kind] = cache, []
        for tokens, positions, block in blocks:
            mask = None if block is None else torch.cat((torch.ones(3, cache.length, dtype=torch.bool), block), 1)
            if kind == "forward":
                got = split.forward(tokens, cache, residual or NoResidual(), positions, mask, draft=residual is None)
                logits[kind].append(got)
            else:
                logits[kind].append(static(tokens, cache, positions, mask))
    for want, got in zip(logits["forward"], logits["static"], strict=True):
        assert (got - want).abs().max() <= DRAFT_LOGITS * want.abs().max()
    want, got = caches["forward"], caches["static"]
    assert got.length == want.length == 16 and torch.equal(got.positions[:16], want.positions[:16])
    # K and V of each head shape; of a ring, the entries both hold the same slot in (the static steps' first,
    # rolled-back run left a later slot's K/V in entries the forward's never wrote again)
    same = (got.ring_slots == want.ring_slots) & (got.ring_slots >= 0)
    if want.ring:  # every entry holds the slot the forward's does, but those the rolled-back run left past 16
        kept = got.ring_slots < 16
        assert torch.equal(got.ring_slots[kept], want.ring_slots[kept]) and got.resumable(16) and want.resumable(16)
    # a linear-attention state where the single token left it (folded in), the tree's entries after it
    if want.delta is not None:
        mine, theirs = got.delta, want.delta
        assert mine.base == theirs.base == 13 and mine.chain == theirs.chain == 13
        for x, y in zip(
            (mine.state, mine.window, *(t[:, :3] for t in mine.stored)),
            (theirs.state, theirs.window, *(t[:, :3] for t in theirs.stored)),
            strict=True,
        ):
            assert (x - y).abs().max() <= RTOL * y.abs().max()
    for a, b in zip(got.stacks, want.stacks, strict=True):
        for x, y in zip(a, b, strict=True) if a[0].numel() else ():  # none in linear-attention layers
            x, y = (x[:, same], y[:, same]) if got.ring and x.shape[1] == got.ring else (x[:, :16], y[:, :16])
            assert (x - y).abs().max() <= RTOL * y.abs().max()
    # five passes; the verifier's cross to the residual twice a group (its submit and its wait)
    assert stats.total_s > 0 and stats.round_trips == (0 if residual is None else 5 * 4 * len(split.layers))


def test_a_static_draft_step_equals_the_draft_forward(converted_small, prompts):
    check_static_step(SplitModel(ConvertedModel(converted_small)), torch.tensor(prompts[0]))


def test_a_static_verify_pass_equals_the_verifier_forward(engine, prompts):
    """The verifier's pass with its crossings to a real CPU actor process (the ``engine`` fixture)."""
    check_static_step(engine.model, torch.tensor(prompts[0]), engine.residual)


def test_draft_step_is_the_draft_forward_without_graphs(converted_small, prompts):
    split = SplitModel(ConvertedModel(converted_small))
    ids = torch.tensor(prompts[0])
    caches = [split.new_cache(64) for _ in range(2)]
    for cache in caches:
        split.forward(ids[:12], cache, NoResidual())
    want = split.forward(ids[12:14], caches[0], NoResidual(), draft=True)
    assert torch.equal(split.draft_step(ids[12:14], caches[1]), want)
    assert caches[1].length == caches[0].length == 14


def test_a_step_is_kept_only_once_a_call_of_it_succeeded(converted_small, prompts):
    """``cuda_graphs``' steps (``SplitModel._replay``), here run eagerly: a step whose first call failed (a
    block the cache cannot hold, refused before the pass) is not kept, as on a GPU it would hold no recorded
    pass to replay; the next block that fits makes and keeps its own, with the forward's logits."""
    split = SplitModel(ConvertedModel(converted_small))
    split._graphs = OrderedDict()  # what ``cuda_graphs=True`` sets up, which the CPU refuses
    ids = torch.tensor(prompts[0])
    caches = [split.new_cache(14) for _ in range(2)]
    for cache in caches:
        split.forward(ids[:12], cache, NoResidual())
    with pytest.raises(ValueError, match="do not fit"):
        split.draft_step(ids[12:15], caches[1])
    assert not split._graphs and caches[1].length == 12
    want = split.forward(ids[12:14], caches[0], NoResidual(), draft=True)
    got = split.draft_step(ids[12:14], caches[1])
    assert (got - want).abs().max() <= DRAFT_LOGITS * want.abs().max() and len(split._graphs) == 1


def test_verify_step_is_the_forward_without_graphs(engine, prompts):
    split, ids = engine.model, torch.tensor(prompts[0])
    caches = [split.new_cache(64) for _ in range(2)]
    for cache in caches:
        split.forward(ids[:12], cache, NoResidual())
    want = split.forward(ids[12:14], caches[0], engine.residual)
    stats = PassStats()
    assert torch.equal(split.verify_step(ids[12:14], caches[1], engine.residual, stats=stats), want)
    assert caches[1].length == caches[0].length == 14 and stats.round_trips == 4 * len(split.layers)
