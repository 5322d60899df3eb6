"""Measure what a check costs on this machine, for the cost model (``scheduler.cost``).

A verify pass is timed at a few token counts up to the largest check, and a draft step (the base alone,
its lm_head and top-k included) at a few widths, each after a short verified prefix and rolled back after,
taking the median of a few passes. The loop's own time per check (masks, acceptance, compaction) is
timed on real one-node checks and charged as a fixed overhead. The timed passes carry their causal mask,
as a check does: a pass without one would be final (``KVCache.commit``), which a recurrent state (Qwen
3.5) could not roll back; each timed check runs on a copy of the prefix for the same reason.
"""

from __future__ import annotations

import statistics

import torch

from splitspec.config import SamplingParams, SpecConfig
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.model import SplitModel, device_clock
from splitspec.gpu_actor.residual import Residual
from splitspec.gpu_actor.speculative import run_check
from splitspec.scheduler.cost import CostCurve, Costs, chain

_PREFIX = 32
_REPS = 3
_DRAFT_TOP = 4  # the top-k a draft step takes (its cost barely depends on k)


def _counts(largest: int) -> list[int]:
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n < largest]
    return [*counts, largest]


def _median_ms(run, cache: KVCache, reps: int) -> float:
    """The median of ``reps`` timed calls, each waiting for the device (a CUDA pass returns before it ends)."""
    clock = device_clock(cache.positions.device)
    times = []
    for _ in range(reps):
        length = cache.length
        t0 = clock()
        run()
        times.append(clock() - t0)
        cache.truncate(length)
    return 1e3 * statistics.median(times)


def measure_check_costs(model: SplitModel, residual: Residual, max_tokens: int, chunk: int, reps: int = _REPS) -> Costs:
    """Costs of checks of up to ``max_tokens`` positions; ``chunk`` is the most tokens one forward may
    carry to the residual (the prefix is written in forwards of at most that)."""
    cache = model.new_cache(_PREFIX + max_tokens + 2)
    prefix = torch.arange(_PREFIX) % 100 + 10
    for i in range(0, _PREFIX, chunk):
        model.append(prefix[i : i + chunk], cache, residual)

    def tokens(n: int) -> torch.Tensor:
        return prefix[:n] if n <= _PREFIX else torch.ones(n, dtype=torch.long)

    def causal(n: int) -> torch.Tensor:
        return torch.ones(n, cache.length + n, dtype=torch.bool).tril(cache.length)

    def verify(n: int) -> None:
        model.verify_step(tokens(n), cache, residual, mask=causal(n))

    def draft_step(n: int) -> None:
        model.draft_step(tokens(n), cache, mask=causal(n)).topk(_DRAFT_TOP)

    counts = _counts(max_tokens)
    verify_ms = {n: _median_ms(lambda n=n: verify(n), cache, reps) for n in counts}
    draft_ms = {n: _median_ms(lambda n=n: draft_step(n), cache, reps) for n in counts if n < max_tokens or n == 1}
    overheads = []
    for _ in range(reps):
        copy = model.new_cache(cache.max_seq)
        copy.load_prefix(cache, cache.length)
        _, check, _ = run_check(model, residual, copy, 11, chain(1), SpecConfig(), SamplingParams(), None)
        overheads.append(max(check.total_ms - check.draft_ms - check.verify_ms, 0.0))
    return Costs(CostCurve.of(verify_ms), CostCurve.of(draft_ms), statistics.median(overheads))
