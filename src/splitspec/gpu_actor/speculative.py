"""One speculative check: the 2-bit base drafts a tree, the verifier checks it in one pass, a path is kept.

The draft is the verifier without its residual (``NoResidual``): the same model, weights and cache
(recipe, section 5). It appends its K/V for the root and each drafted level behind the verified prefix,
so its attention reads the verifier's exact K/V for every verified position and its own 2-bit K/V only
for the positions it drafts; the verify pass then truncates the cache to the prefix and writes exact
K/V over the same slots, and ``KVCache.keep`` compacts the accepted path. With ``kv="draft2bit"`` the
draft keeps a cache of its own for everything instead (for comparison only): after each check the
accepted tokens are run through the draft into it.

A shape (``scheduler.cost.TreeShape``) says which ranks to draft; the tokens are the draft's top
candidates at each node, one draft forward per level. ``p_min`` drops a node whose draft probability is
under it, with what hangs below it, before the verify pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splitspec.config import SamplingParams, SpecConfig
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.model import PassStats, SplitModel
from splitspec.gpu_actor.residual import NoResidual, Residual
from splitspec.gpu_actor.tree import DraftTree, accept_greedy, accept_sampled, ancestors
from splitspec.scheduler.cost import TreeShape

_NO_RESIDUAL = NoResidual()


@dataclass
class StepStats:
    """One forward pass, in milliseconds. ``channel_ms`` is this process's side of the channel (writing x'
    into the slots, posting); the channel's latency hides in ``residual_wait_ms`` together with the part
    of the CPU actors' compute that the base product did not cover (``benchmarks/verify_pass.py`` splits
    the two)."""

    tokens: int
    verify_ms: float
    base_ms: float
    residual_wait_ms: float
    channel_ms: float
    attention_ms: float
    head_ms: float

    @classmethod
    def of(cls, tokens: int, s: PassStats) -> StepStats:
        return cls(tokens, *s.ms())


@dataclass
class CheckStats(StepStats):
    """One check: its verify pass (``tokens`` = the root and the drafted nodes) and its draft, in ms.
    ``drafted`` counts the nodes verified (root excluded), ``accepted`` those that matched (the bonus token
    excluded), so a check emits ``accepted + 1`` tokens; ``total_ms`` includes the loop's own time."""

    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    draft_steps: int = 0
    total_ms: float = 0.0


def draft_tree(
    model: SplitModel, cache: KVCache, root: int, shape: TreeShape, p_min: float = 0.0
) -> tuple[DraftTree, int]:
    """(the drafted tree, draft forwards run); the draft's K/V stay appended to ``cache``."""
    n = len(shape.parents)
    tokens, probs = [root] + [-1] * (n - 1), [1.0] * n
    alive = [True] + [False] * (n - 1)
    kids = shape.children()
    anc = ancestors(shape.parents)
    start = cache.length
    written: list[int] = []  # the node in each slot this draft appended
    steps = 0
    for level in shape.draft_levels():
        run = [i for i in level if alive[i]]
        if not run:
            break
        cols = written + run
        mask = torch.cat((torch.ones(len(run), start, dtype=torch.bool), anc[run][:, cols]), dim=1)
        positions = torch.tensor([shape.depths[i] for i in run]) + start
        logits = model.forward(torch.tensor([tokens[i] for i in run]), cache, _NO_RESIDUAL, positions, mask)
        steps += 1
        written += run
        k = 1 + max(shape.ranks[c] for u in run for c in kids[u])
        top = logits.topk(k, dim=-1)
        top_p = torch.softmax(logits, dim=-1).gather(1, top.indices) if p_min > 0 else None
        for row, u in enumerate(run):
            for c in kids[u]:
                tokens[c] = int(top.indices[row, shape.ranks[c]])
                probs[c] = float(top_p[row, shape.ranks[c]]) if top_p is not None else 1.0
                alive[c] = probs[c] >= p_min
    keep = [i for i in range(n) if alive[i]]
    index = {old: new for new, old in enumerate(keep)}
    tree = DraftTree(
        tokens=[tokens[i] for i in keep],
        parents=[-1] + [index[shape.parents[i]] for i in keep[1:]],
        depths=[shape.depths[i] for i in keep],
        draft_probs=[probs[i] for i in keep],
    )
    return tree, steps


def run_check(
    model: SplitModel,
    residual: Residual,
    cache: KVCache,
    root: int,
    shape: TreeShape,
    spec: SpecConfig,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_cache: KVCache | None = None,
) -> tuple[list[int], CheckStats]:
    """Draft, verify and accept once after ``root``; returns the tokens it emits (accepted + bonus).

    ``cache`` holds the verified prefix (without ``root``) and ends holding it plus the root and the
    accepted path. ``draft_cache`` is the draft's own cache under ``kv="draft2bit"``, else None.
    """
    t0 = time.perf_counter()
    start = cache.length
    steps = 0
    if shape.nodes:
        tree, steps = draft_tree(model, draft_cache or cache, root, shape, spec.p_min)
        if draft_cache is None:
            cache.truncate(start)
    else:
        tree = DraftTree([root], [-1], [0], [1.0])
    t1 = time.perf_counter()
    verify = PassStats()
    logits = model.forward(
        torch.tensor(tree.tokens), cache, residual, tree.positions(start), tree.check_mask(start), stats=verify
    )
    if params.greedy:
        path, bonus = accept_greedy(tree, logits)
    else:
        path, bonus = accept_sampled(tree, logits, params, generator)
    cache.keep(start, [0, *path])
    if draft_cache is not None and shape.nodes:
        draft_cache.truncate(start + 1)  # the root's draft K/V, from the first draft step, stay
        if path:
            model.forward(torch.tensor([tree.tokens[i] for i in path]), draft_cache, _NO_RESIDUAL)
    emitted = [tree.tokens[i] for i in path] + [bonus]
    total_ms = (time.perf_counter() - t0) * 1e3
    check = CheckStats(len(tree.tokens), *verify.ms(), tree.nodes, len(path), (t1 - t0) * 1e3, steps, total_ms)
    return emitted, check
