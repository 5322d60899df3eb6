"""One speculative check: the 2-bit base drafts a tree, the verifier checks it in one pass, a path is kept.

The draft is the verifier without its residual (``NoResidual``): the same model, weights and cache
(recipe, section 5). It appends its K/V for the root and each drafted level behind the verified prefix,
so its attention reads the verifier's exact K/V for every verified position and its own 2-bit K/V only
for the positions it drafts; the verify pass then truncates the cache to the prefix and writes exact
K/V over the same slots, and ``KVCache.keep`` compacts the accepted path. With ``kv="draft2bit"`` the
draft keeps a cache of its own for everything instead (for comparison only): after each check the
accepted tokens are run through the draft into it.

A shape (``scheduler.cost.TreeShape``) says which ranks to draft; the tokens are the draft's top
candidates at each node, one draft forward per level, read after the request's logit shaping (bias,
penalties, schema) along each node's path, as the verifier's will be. ``p_min`` drops a node whose draft
probability is under it, with what hangs below it, before the verify pass.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from splitspec.config import SamplingParams, SpecConfig
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.lookup import Lookup, find
from splitspec.gpu_actor.model import PassStats, Segment, SplitModel
from splitspec.gpu_actor.residual import NoResidual, Residual
from splitspec.gpu_actor.sampling import Shaping, TokenLogprob, token_logprobs
from splitspec.gpu_actor.tree import DraftTree, accept_greedy, accept_sampled, ancestors, graphed_sizes
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
    model: SplitModel, cache: KVCache, root: int, shape: TreeShape, p_min: float = 0.0, shaping: Shaping | None = None
) -> tuple[DraftTree, int]:
    """(the drafted tree, draft forwards run); the draft's K/V stay appended to ``cache``."""
    n = len(shape.parents)
    tokens = [root] + [-1] * (n - 1)
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
        logits = model.draft_step(torch.tensor([tokens[i] for i in run]), cache, positions, mask)
        if shaping is not None:  # each node's path: its ancestors below the root, and itself
            paths = [[tokens[j] for j in range(1, u + 1) if anc[u, j]] for u in run]
            logits = torch.stack([shaping.apply(row, path) for row, path in zip(logits, paths, strict=True)])
        steps += 1
        written += run
        k = 1 + max(shape.ranks[c] for u in run for c in kids[u])
        top = logits.topk(k, dim=-1)
        top_p = torch.softmax(logits, dim=-1).gather(1, top.indices) if p_min > 0 else None
        for row, u in enumerate(run):
            for c in kids[u]:
                tokens[c] = int(top.indices[row, shape.ranks[c]])
                alive[c] = top_p is None or float(top_p[row, shape.ranks[c]]) >= p_min
    keep = [i for i in range(n) if alive[i]]
    index = {old: new for new, old in enumerate(keep)}
    tree = DraftTree(
        tokens=[tokens[i] for i in keep],
        parents=[-1] + [index[shape.parents[i]] for i in keep[1:]],
        depths=[shape.depths[i] for i in keep],
    )
    return tree, steps


Stops = int | Collection[int] | None  # the token ids that end a sequence: one, several, or none


def stop_set(eos_id: Stops) -> frozenset[int]:
    if eos_id is None:
        return frozenset()
    return frozenset([eos_id]) if isinstance(eos_id, int) else frozenset(eos_id)


def clip(new: list[int], room: int, eos_id: Stops) -> list[int]:
    """A check's tokens cut to the ``room`` left and after the first of the ``eos_id`` tokens: what a
    sequence emits."""
    new, stops = new[:room], stop_set(eos_id)
    end = next((i for i, t in enumerate(new) if t in stops), None)
    return new if end is None else new[: end + 1]


@dataclass
class CheckRequest:
    """One sequence's part of a check: its cache (the verified prefix), its root token, the shape to draft,
    how to choose tokens, the draft's own cache under ``kv="draft2bit"`` (else None), and where its drafts
    are copied from its text, its drafter (``lookup``) and ``history`` (its prompt and every token emitted,
    the root last): the check then verifies the proposed chain instead of drafting ``shape``, and tells
    the drafter how it fared. ``shaping`` holds the request's logit bias, penalties and schema (None: none); its
    caller adds the tokens each check emits."""

    cache: KVCache
    root: int
    shape: TreeShape
    params: SamplingParams
    generator: torch.Generator | None = None
    draft_cache: KVCache | None = None
    lookup: Lookup | None = None
    history: Sequence[int] = ()
    shaping: Shaping | None = None


Checked = tuple[list[int], CheckStats, list[TokenLogprob] | None]


def run_checks(
    model: SplitModel, residual: Residual, requests: Sequence[CheckRequest], spec: SpecConfig
) -> list[Checked]:
    """Draft each sequence's tree, verify all of them in one pass, and accept per sequence; returns each
    one's emitted tokens (accepted + bonus), stats, and where its ``params`` ask for them the emitted
    tokens' logprobs (each read at its parent node). Each cache ends holding its prefix plus its root and
    accepted path."""
    t0 = time.perf_counter()
    trees, steps, draft_s, starts = [], [], [], []
    for r in requests:
        t = time.perf_counter()
        start = r.cache.length
        if r.lookup is None and r.shape.nodes:
            cache = r.draft_cache if r.draft_cache is not None else r.cache
            tree, n = draft_tree(model, cache, r.root, r.shape, spec.p_min, r.shaping)
            if r.draft_cache is None:
                r.cache.truncate(start)
            if spec.ngram_branch and r.history:  # the text's own continuation, beside the model's
                sizes = graphed_sizes(spec.draft_max) if model.graphed else None
                tree = tree.graft(find(r.history, spec.ngram_max, spec.ngram_min, spec.draft_max), sizes)
        else:  # no draft forward: the root alone, or with a chain copied from the text (timed as the draft)
            chain = r.lookup.propose(r.history, len(requests) - 1) if r.lookup is not None else []
            tree, n = DraftTree([r.root, *chain], list(range(-1, len(chain))), list(range(len(chain) + 1))), 0
        trees.append(tree)
        steps.append(n)
        starts.append(start)
        draft_s.append(time.perf_counter() - t)
    verify = PassStats()
    segments = [
        Segment(torch.tensor(tree.tokens), r.cache, tree.positions(start), tree.check_mask(start))
        for r, tree, start in zip(requests, trees, starts, strict=True)
    ]
    if len(segments) == 1:  # a pass of one sequence, which ``cuda_graphs`` replays
        seg = segments[0]
        all_logits = [model.verify_step(seg.tokens, seg.cache, residual, seg.positions, seg.mask, verify)]
    else:
        all_logits = model.forward_many(segments, residual, verify)
    verify_end = time.perf_counter()
    out = []
    for r, tree, start, logits, n, d in zip(requests, trees, starts, all_logits, steps, draft_s, strict=True):
        t = time.perf_counter()
        if r.params.greedy:
            path, bonus = accept_greedy(tree, logits, r.shaping)
        else:
            path, bonus = accept_sampled(tree, logits, r.params, r.generator, r.shaping)
        r.cache.keep(start, [0, *path])
        if r.lookup is not None:
            r.lookup.record(tree.nodes, len(path))
        if r.draft_cache is not None and r.shape.nodes:
            r.draft_cache.truncate(start + 1)  # the root's draft K/V, from the first draft step, stay
            if path:
                model.append(torch.tensor([tree.tokens[i] for i in path]), r.draft_cache, _NO_RESIDUAL)
        emitted = [tree.tokens[i] for i in path] + [bonus]
        k = r.params.logprobs
        logprobs = token_logprobs(logits[[0, *path]], emitted, k) if k is not None else None
        own_ms = (d + time.perf_counter() - t) * 1e3
        total_ms = own_ms + (verify_end - t0 - sum(draft_s)) * 1e3
        stats = CheckStats(len(tree.tokens), *verify.ms(), tree.nodes, len(path), d * 1e3, n, total_ms)
        out.append((emitted, stats, logprobs))
    return out


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
    lookup: Lookup | None = None,
    history: Sequence[int] = (),
    shaping: Shaping | None = None,
) -> Checked:
    """``run_checks`` for one sequence."""
    request = CheckRequest(cache, root, shape, params, generator, draft_cache, lookup, history, shaping)
    return run_checks(model, residual, [request], spec)[0]
