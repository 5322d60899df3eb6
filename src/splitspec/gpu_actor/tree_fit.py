"""Fit the draft's rank statistics p_d(r) of a converted folder (recipe, section 6).

On the tree-statistics split (chats that neither calibration nor evaluation uses) the verifier writes a
greedy continuation of each prompt; then, from every position of it, the draft runs ``depth`` of the
verifier's tokens in one forward (its attention reading the verifier's exact K/V before that position
and its own 2-bit K/V after it, as a drafted path does) and records, at each depth d, the rank of the
verifier's next token among the draft's logits (the number of larger logits; 0 is the argmax).
p_d(r) is the share of rank r at depth d, for r < ``ranks``. The same is measured with the draft reading
only its own K/V (``p_draft2bit``), which shapes the trees of the 2-bit-KV draft kept for comparison.
Over the same continuations the draft copied from the text (``lookup.replay``) records how many tokens it
finds at each check and how many of them the text went on with (``ngram``), which is what the cost model
needs to weigh it against the 2-bit drafts.

The verifier here is the engine's model with the residual computed in this process (``LocalResidual``:
the CPU actors' shards and kernel, no processes), the widest residual the folder holds by default.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from splitspec.config import DataConfig, SpecConfig
from splitspec.gpu_actor.lookup import replay
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import LocalResidual, NoResidual, Residual
from splitspec.quantize.format import TREE_STATS_VERSION, ConvertedModel, write_tree_stats

DEPTH = 8
RANKS = 16
NGRAM_LIMIT = 32  # the longest n-gram draft the statistics describe (``SpecConfig.draft_max`` up to this)
_CHUNK = 64
_STARTS_PER_PASS = 8  # drafts from this many positions share one forward


def continuation(model: SplitModel, residual: Residual, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """The verifier's greedy continuation of ``prompt`` (one verify pass a token)."""
    cache = model.new_cache(len(prompt) + new_tokens)
    logits = model.prefill(torch.tensor(list(prompt)), cache, residual, _CHUNK)
    out = [int(logits[-1].argmax())]
    while len(out) < new_tokens:
        out.append(int(model.forward(torch.tensor(out[-1:]), cache, residual)[-1].argmax()))
    return out


def rank_counts(
    model: SplitModel,
    residual: Residual,
    prompt: Sequence[int],
    verified: Sequence[int],
    depth: int = DEPTH,
    ranks: int = RANKS,
    kv: str = "exact",
) -> torch.Tensor:
    """int64 [depth, ranks + 1]: how often the verifier's token had rank r at depth d (last column: r >=
    ranks), over every start in ``verified`` (the verifier's greedy tokens after ``prompt``)."""
    seq = torch.tensor([*prompt, *verified])
    length = seq.numel()
    counts = torch.zeros(depth, ranks + 1, dtype=torch.long)
    draft = NoResidual()
    context = residual if kv == "exact" else draft
    if model.spec.delta_net is not None:
        return _walked_counts(model, context, seq, len(prompt), depth, counts)
    starts = list(range(len(prompt), length - 1))
    cache = model.new_cache(length + _STARTS_PER_PASS * depth)
    model.prefill(seq, cache, context, _CHUNK)
    # A draft from position t runs seq[t : t + depth] (the root is the last verified token, seq[t]), seeing
    # the cached prefix before t and its own rows. Several starts share a forward: their rows go after the
    # whole sequence's K/V, each masked to its own prefix and chain, and are dropped after.
    for i in range(0, len(starts), _STARTS_PER_PASS):
        group = starts[i : i + _STARTS_PER_PASS]
        spans = [min(depth, length - 1 - t) for t in group]
        rows = sum(spans)
        tokens = torch.cat([seq[t : t + n] for t, n in zip(group, spans, strict=True)])
        positions = torch.cat([torch.arange(t, t + n) for t, n in zip(group, spans, strict=True)])
        mask = torch.zeros(rows, length + rows, dtype=torch.bool)
        row = 0
        for t, n in zip(group, spans, strict=True):
            mask[row : row + n, :t] = True
            mask[row : row + n, length + row : length + row + n] = torch.ones(n, n, dtype=torch.bool).tril()
            row += n
        logits = model.forward(tokens, cache, draft, positions, mask, draft=True)
        cache.truncate(length)
        truth = torch.cat([seq[t + 1 : t + 1 + n] for t, n in zip(group, spans, strict=True)])
        _tally(counts, logits, truth, torch.cat([torch.arange(n) for n in spans]))
    return counts


def _tally(counts: torch.Tensor, logits: torch.Tensor, truth: torch.Tensor, depths: torch.Tensor) -> None:
    """Count each row's rank of its true token (the number of larger logits) at its depth."""
    rank = (logits > logits.gather(1, truth[:, None])).sum(1).clamp(max=counts.shape[1] - 1)
    counts.index_put_((depths, rank), torch.ones_like(rank), accumulate=True)


def _walked_counts(
    model: SplitModel, context: Residual, seq: torch.Tensor, first: int, depth: int, counts: torch.Tensor
) -> torch.Tensor:
    """``rank_counts`` for a model with a recurrent state (Qwen 3.5), which holds only the prefix it has
    passed, never an earlier one: from each start in turn the draft's chain, rolled back, then the verified
    token appended (``context`` computes the prefix), one start at a time."""
    cache = model.new_cache(seq.numel() + depth)
    model.prefill(seq[:first], cache, context, _CHUNK)
    for t in range(first, seq.numel() - 1):
        n = min(depth, seq.numel() - 1 - t)
        mask = torch.ones(n, t + n, dtype=torch.bool).tril(t)
        logits = model.forward(seq[t : t + n], cache, NoResidual(), mask=mask, draft=True)
        cache.truncate(t)
        _tally(counts, logits, seq[t + 1 : t + 1 + n], torch.arange(n))
        model.append(seq[t : t + 1], cache, context)
    return counts


def probabilities(counts: torch.Tensor) -> list[list[float]]:
    """p_d(r) = count / all counts at depth d, for the ranks below the last column."""
    totals = counts.sum(1, keepdim=True).clamp(min=1)
    return (counts[:, :-1].double() / totals).tolist()


def fit_tree_stats(
    folder: str | Path,
    bits: int | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    n_prompts: int = 24,
    new_tokens: int = 64,
    max_prompt_tokens: int = 384,
    depth: int = DEPTH,
    write: bool = True,
) -> dict[str, Any]:
    """Fit (and by default write into the folder) the rank statistics; returns what it wrote."""
    t0 = time.perf_counter()
    converted = ConvertedModel(folder)
    bits = bits or max(converted.residual_bits)
    if prompts is None:
        from transformers import AutoTokenizer

        from splitspec.models.data import make_split, tree_prompts

        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompts = [p for p in tree_prompts(make_split(DataConfig()), tokenizer) if len(p) <= max_prompt_tokens]
        prompts = prompts[:n_prompts]
    model = SplitModel(converted)
    residual = LocalResidual.load(folder, bits)
    counts = {kv: torch.zeros(depth, RANKS + 1, dtype=torch.long) for kv in ("exact", "draft2bit")}
    spec = SpecConfig()
    ngram = torch.zeros(NGRAM_LIMIT + 1, NGRAM_LIMIT + 1, dtype=torch.long)
    for prompt in tqdm(prompts, desc="fit tree statistics", unit="prompt", disable=None):
        verified = continuation(model, residual, prompt, new_tokens)
        for kv, c in counts.items():
            c += rank_counts(model, residual, prompt, verified, depth, RANKS, kv)
        ngram += torch.tensor(replay(prompt, verified, spec.ngram_max, spec.ngram_min, NGRAM_LIMIT))
    stats = {
        "version": TREE_STATS_VERSION,
        "conversion_id": converted.conversion_id,
        "bits": bits,
        "p": probabilities(counts["exact"]),
        "p_draft2bit": probabilities(counts["draft2bit"]),
        "counts": counts["exact"].tolist(),
        "counts_draft2bit": counts["draft2bit"].tolist(),
        "ngram": {"n_max": spec.ngram_max, "n_min": spec.ngram_min, "counts": ngram.tolist()},
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if write:
        write_tree_stats(folder, stats)
    return stats
