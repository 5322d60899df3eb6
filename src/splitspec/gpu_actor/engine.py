"""The decoding loop: speculative checks with the split verifier, from prompt to the last token.

Each check (``speculative.run_check``) drafts a shape with the 2-bit base alone and verifies it with the
residual from real CPU actor processes; the shape is fixed by ``SpecConfig`` or chosen by the cost model
(``scheduler.cost.choose``) from the verify and draft costs this engine measures on its own machine
(``check_costs``) and the folder's rank statistics. "off" is the verifier alone, one token per pass.

Prefill has its own path. A long prompt makes the CPU residual compute-bound (n tokens × the work of a
step), while bringing each group's residual to the device (``DeviceResidual``) costs a fixed transfer per
group and a GEMM whose per-token cost is small there. Which wins depends on the machine, so the engine
times both paths on one layer and the lm_head at a few token counts (``prefill.measure_prefill_costs``),
and ``choose_prefill`` takes the cheaper for the prompt's length (the split path runs one forward per
``prefill_chunk`` tokens, the device path one in all); ``EngineConfig.prefill`` can force either.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import numba
import torch

from splitspec.config import EngineConfig, SamplingParams
from splitspec.gpu_actor.check_costs import measure_check_costs
from splitspec.gpu_actor.grammar import Grammars
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.lookup import Lookup
from splitspec.gpu_actor.model import PassStats, SplitModel
from splitspec.gpu_actor.prefill import PrefillCosts, choose_prefill, measure_prefill_costs
from splitspec.gpu_actor.residual import DeviceResidual, NoResidual, RemoteResidual, Residual
from splitspec.gpu_actor.sampling import Shaping, first_token, make_generator
from splitspec.gpu_actor.speculative import CheckStats, StepStats, Stops, clip, run_check, stop_set
from splitspec.gpu_actor.tree import graphed_sizes
from splitspec.protocol import PeerLost, RequestTimeout
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler import cost

T = TypeVar("T")
_RETRIES = 3  # reconnects per check: a supervisor restarts a lost actor once; more losses in a row are a fault


@dataclass
class GenerationStats:
    prompt_tokens: int
    prefill_path: str  # "split" (through the CPU actors, in chunks) or "device" (one forward, DeviceResidual)
    prefill: StepStats
    shape: str = "off"  # the draft shape the checks used: "off", "chainN" or "treeN"
    predicted_tok_s: float | None = None  # the cost model's prediction for that shape, where it chose it
    checks: list[CheckStats] = field(default_factory=list)

    @classmethod
    def empty(cls) -> GenerationStats:
        """Stats to fill in as a generation goes (``stream`` sets the prompt's fields after its prefill)."""
        return cls(0, "", StepStats(0, 0, 0, 0, 0, 0, 0))

    def summary(self) -> dict[str, float]:
        """Mean of each per-check field (prefill excluded), the check count, and tokens per check."""
        if not self.checks:
            return {"checks": 0}
        n = len(self.checks)
        means = {k: sum(getattr(c, k) for c in self.checks) / n for k in asdict(self.checks[0])}
        return {**means, "checks": n, "tokens_per_check": means["accepted"] + 1}


@dataclass
class PrefillJob:
    """A prompt's prefill in progress (``SplitEngine.prefill_job``): its tokens, cache, path, forward size,
    the prompt position the next forward starts at, and the stats the forwards add up."""

    prompt: torch.Tensor
    cache: KVCache
    path: str
    chunk: int
    every: Callable[[torch.Tensor, int], None] | None = None
    start: int = 0
    stats: PassStats = field(default_factory=PassStats)

    def step_stats(self) -> StepStats:
        return StepStats.of(self.prompt.shape[0], self.stats)


def pin_engine(cpus: Sequence[int]) -> Callable[[], None]:
    """Move every thread of this process (numba's and torch's pools included: affinity is per thread, and
    pools that already exist would not follow the main thread) onto ``cpus``; returns the undo."""
    before = os.sched_getaffinity(0)
    threads = (numba.get_num_threads(), torch.get_num_threads())

    def set_all(mask: set[int]) -> None:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), mask)
            except (ProcessLookupError, PermissionError):
                continue  # a thread that ended meanwhile

    set_all(set(cpus))
    numba.set_num_threads(min(len(cpus), numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(len(cpus))

    def undo() -> None:
        set_all(before)
        numba.set_num_threads(threads[0])
        torch.set_num_threads(threads[1])

    return undo


class SplitEngine:
    """Greedy decoding over a ``SplitModel`` and a residual source; ``close`` runs the cleanups it was given."""

    def __init__(
        self,
        model: SplitModel,
        residual: Residual,
        config: EngineConfig | None = None,
        cleanups: Sequence[Callable[[], object]] = (),
        device_residual: DeviceResidual | None = None,
        tree_stats: list[list[float]] | None = None,
        ngram: cost.NgramStats | None = None,
    ) -> None:
        self.model = model
        self.residual = residual
        self.config = config or EngineConfig()
        self.config.check_context(model.spec.max_positions)
        if model.kv_dtype != getattr(torch, self.config.kv_dtype):
            raise ValueError(f"EngineConfig.kv_dtype is {self.config.kv_dtype}; the model's caches: {model.kv_dtype}")
        if model.spec.sliding_window is not None and model.ring_slack != self.config.ring_slack:
            raise ValueError(
                f"EngineConfig.kv_window gives rings of {self.config.ring_slack} slots past the window; the model's "
                f"caches keep {model.ring_slack} (0: every slot)"
            )
        if self.config.prefill == "device" and device_residual is None:
            raise ValueError('EngineConfig.prefill = "device" needs a DeviceResidual')
        self.device_residual = device_residual
        self._cleanups = list(cleanups)
        self._prefill_costs: PrefillCosts | None = None
        self._check_costs: cost.Costs | None = None
        self._choices: dict[int, cost.Choice] = {}  # the cost model's choice by sequences per check
        self.tree_stats = tree_stats
        self.ngram = ngram  # the n-gram draft's replayed acceptance, for "auto" to weigh it (``fit-tree``)
        self.actors: list[Any] = []  # what the starter launched for this engine (``scheduler.local``), to inspect
        self.reconnect: Callable[[], Residual] | None = None  # a fresh residual source, from ``connect``'s resolve
        self.recoveries: list[float] = []  # seconds from each lost actor to its retried check's start

    @classmethod
    def connect(
        cls,
        folder: str | Path,
        bits: int,
        endpoints: Sequence[str],
        config: EngineConfig | None = None,
        engine_cpus: Sequence[int] | None = None,
        spin_us: float | None = None,
        stops: Sequence[Callable[[], object]] = (),
        resolve: Callable[[], Sequence[str]] | None = None,
    ) -> SplitEngine:
        """An engine on CPU actors already serving at ``endpoints``: their starter (the scheduler)
        owns their lifecycle and runs ``stops`` at ``close``, so the engine needs only the protocol. It pins
        itself to ``engine_cpus``. Given ``resolve`` (the actors' endpoints as they are now), it reconnects
        after losing an actor and retries the check (``_retrying``): a supervisor's restart saves the text."""
        config = config or EngineConfig()
        channel = config.channel if spin_us is None else replace(config.channel, spin_us=spin_us)
        converted = ConvertedModel(folder)
        cleanups: list[Callable[[], object]] = []
        try:
            if engine_cpus is not None:  # first: the residual kernels take their thread count when built
                cleanups.append(pin_engine(engine_cpus))
            device_residual = None
            if config.prefill != "split" or config.resident_bytes:
                args = (converted, bits, config.device, config.resident_bytes, config.activations)
                device_residual = DeviceResidual(*args)
                cleanups.append(device_residual.close)
            residual = RemoteResidual(converted, endpoints, channel, device_residual)
            cleanups.insert(0, residual.close)
            cleanups += stops
            fitted = converted.tree_stats()
            p = fitted.get("p_draft2bit" if config.spec.kv == "draft2bit" else "p") if fitted else None
            ngram = cost.NgramStats.fitted(fitted)
            model = SplitModel(
                converted,
                config.device,
                config.spec.draft_head,
                config.head,
                config.activations,
                config.cuda_graphs,
                config.kv_dtype,
                config.ring_slack,
                config.prefill_parts,
            )
            engine = cls(model, residual, config, cleanups, device_residual, p, ngram)
        except BaseException:
            _run_all([c for c in cleanups if c not in stops])
            raise
        if resolve is not None:
            engine.reconnect = lambda: RemoteResidual(converted, resolve(), channel, device_residual)
        return engine

    def __enter__(self) -> SplitEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        cleanups, self._cleanups = self._cleanups, []
        _run_all(cleanups)

    def new_cache(self) -> KVCache:
        """Room for max_seq_len tokens plus one check's draft beyond them."""
        return self.model.new_cache(self.config.max_seq_len + self.config.spec.check_tokens)

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> tuple[torch.Tensor, StepStats]:
        stats = PassStats()
        logits = self.model.forward(tokens, cache, self.residual, last_only=last_only, stats=stats)
        return logits, StepStats.of(tokens.shape[0], stats)

    def prefill_costs(self) -> PrefillCosts:
        """Both prefill paths' costs, measured at the first call and cached (a fraction of a second per
        layer class; a GPU's and the CPU actors' speeds do not change between prompts)."""
        if self.device_residual is None:
            raise ValueError("prefill costs compare the split and device paths; this engine has no DeviceResidual")
        if self._prefill_costs is None:
            self._prefill_costs = measure_prefill_costs(
                self.model, self.residual, self.device_residual, self.config.prefill_chunk
            )
        return self._prefill_costs

    def prefill_path(self, tokens: int) -> str:
        """The path for a prompt of ``tokens``, "split" or "device": the config's, or under "auto" the cheaper."""
        if self.config.prefill != "auto":
            return self.config.prefill
        if self.device_residual is None:
            return "split"
        return choose_prefill(tokens, self.prefill_costs(), self.config.prefill_chunk)

    def prefill(
        self, prompt: torch.Tensor, cache: KVCache, every: Callable[[torch.Tensor, int], None] | None = None
    ) -> tuple[torch.Tensor, StepStats, str]:
        """(last position's logits [1, vocab], stats, path) after writing the prompt's K/V into ``cache``:
        through the CPU actors in forwards of ``prefill_chunk`` tokens (one channel request per group
        each), or in one forward with the residual on the device. ``every(logits, start)`` is given each
        forward's logits for all its positions (from ``start`` in the prompt), which then all pay the head."""
        job = self.prefill_job(prompt, cache, every)
        return self.finish_prefill(job), job.step_stats(), job.path

    def finish_prefill(self, job: PrefillJob) -> torch.Tensor:
        """``job``'s forwards from where it stands to the last one's logits."""
        while (logits := self.prefill_step(job)) is None:
            pass
        return logits

    def prefill_job(
        self, prompt: torch.Tensor, cache: KVCache, every: Callable[[torch.Tensor, int], None] | None = None
    ) -> PrefillJob:
        """A prompt's prefill to run one forward at a time (``prefill_step``), on the path ``prefill_path``
        takes for it: a server runs other sequences' checks between the forwards of a long prompt."""
        path = self.prefill_path(prompt.shape[0])
        chunk = prompt.shape[0] if path == "device" else self.config.prefill_chunk
        return PrefillJob(prompt, cache, path, chunk, every)

    def prefill_step(self, job: PrefillJob) -> torch.Tensor | None:
        """``job``'s next forward: None, or after the last one the last position's logits [1, vocab]. The
        job moves on only once the forward is done (``_retrying`` may run it again on new actors)."""
        residual = self.device_residual if job.path == "device" else self.residual
        logits = self.model.prefill_step(job.prompt, job.cache, residual, job.chunk, job.start, job.stats, job.every)
        job.start += job.chunk
        return logits

    def rank_stats(self) -> list[list[float]]:
        """The folder's fitted p_d(r) (recipe, section 6); trees and the cost model need them."""
        if self.tree_stats is None:
            raise ValueError(
                "this converted folder has no tree statistics (tree_stats.json): run `splitspec fit-tree FOLDER`, "
                "or draft a chain (SpecConfig.mode='chain') or nothing ('off')"
            )
        return self.tree_stats

    def check_costs(self) -> cost.Costs:
        """What a verify pass and a draft step cost here, measured at the first call and kept."""
        if self._check_costs is None:
            spec = self.config.spec
            self._check_costs = measure_check_costs(
                self.model, self.residual, spec.draft_max + 1, self.config.prefill_chunk
            )
        return self._check_costs

    def draft_shape(self, batch: int = 1) -> cost.Choice | cost.TreeShape:
        """The shape each check drafts: fixed by ``SpecConfig.mode``, or under "auto" the cost model's
        choice (a ``Choice``, with its prediction) from this engine's measured costs, for ``batch``
        sequences sharing each check; that choice may be to copy drafts from the text (``Choice.ngram``)."""
        spec = self.config.spec
        if spec.mode in ("off", "ngram"):  # the n-gram draft is no model's (``lookup``)
            return cost.chain(0)
        if spec.mode == "chain":
            return cost.chain(spec.draft_max)
        if spec.mode == "tree":
            return cost.best_first(self.rank_stats(), spec.draft_max)
        if batch not in self._choices:
            args = (self.rank_stats(), self.check_costs(), spec.draft_min, spec.draft_max, batch, spec.min_gain)
            self._choices[batch] = cost.choose(*args, ngram=self.ngram)
        return self._choices[batch]

    def copies(self, choice: cost.Choice | cost.TreeShape) -> bool:
        """Whether checks drafting ``choice`` (``draft_shape``'s) copy their drafts from the text."""
        return self.config.spec.mode == "ngram" or (isinstance(choice, cost.Choice) and choice.ngram)

    def draft_name(self, choice: cost.Choice | cost.TreeShape) -> str:
        """What checks drafting ``choice`` draft, for stats and logs: the shape's name, or "ngram"."""
        if self.copies(choice):
            return "ngram"
        return choice.name if isinstance(choice, cost.Choice) else choice.name()

    def lookup(self) -> Lookup | None:
        """A drafter for one sequence where its checks may copy drafts from its text (``mode="ngram"``, or
        "auto" with the n-gram statistics to weigh it), which learns from its checks how much of what it
        finds pays; one per sequence, so that a seed gives the same text whatever ran before. Else None."""
        spec = self.config.spec
        if spec.mode != "ngram" and (spec.mode != "auto" or self.ngram is None):
            return None
        sizes = graphed_sizes(spec.draft_max) if self.config.cuda_graphs else None
        return Lookup(spec.ngram_max, spec.ngram_min, spec.draft_max, self.check_costs().verify, sizes)

    @cached_property
    def grammars(self) -> Grammars:
        """The model's tokenizer compiled for structured output, on the first request that asks for it."""
        return Grammars(self.model.folder, self.model.spec.vocab, self.model.spec.eos_ids)

    def shaping(self, params: SamplingParams, prompt: Sequence[int], ends: frozenset[int]) -> Shaping | None:
        """A request's logit shaping (``sampling.Shaping``), with its language's matcher and the tokens that
        end its text (``ends``); None for none."""
        matcher = self.grammars.matcher(*params.constraint) if params.constraint is not None else None
        return Shaping.of(params, prompt, matcher, ends)

    def check_request(self, prompt_tokens: int, max_new_tokens: int, params: SamplingParams | None = None) -> None:
        """Refuse a request that can never run here: an empty prompt, no new tokens, more than the context,
        a logit bias on a token outside the vocabulary, or a schema, grammar or regex that does not compile."""
        vocab = self.model.spec.vocab
        if params is not None and params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names token {max(params.logit_bias)}; this model's vocabulary has {vocab}")
        if params is not None and params.constraint is not None:
            self.grammars.compiled(*params.constraint)  # one that does not compile: ValueError
        if prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1")
        self.config.check_length(prompt_tokens, max_new_tokens)

    def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_id: Stops = None,
        params: SamplingParams | None = None,
        stats: GenerationStats | None = None,
    ) -> Iterator[list[int]]:
        """Yield the new tokens as each check decides them (the first after the prefill), until one of the
        ``eos_id`` tokens (one id or several) or ``max_new_tokens``; ``stats``, when given, is filled in as
        it goes (``generate`` makes one)."""
        params = params or SamplingParams()
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("logprobs come through a Batcher (generate_many, the server); stream yields tokens")
        prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        self.check_request(prompt.numel(), max_new_tokens, params)
        choice = self.draft_shape()
        shape = choice.shape if isinstance(choice, cost.Choice) else choice
        lookup = self.lookup() if self.copies(choice) else None
        generator = make_generator(params)
        cache = self.new_cache()
        draft_cache = None
        if self.config.spec.kv == "draft2bit" and shape.nodes:
            draft_cache = self.new_cache()
            self.model.append(prompt, draft_cache, NoResidual())
        job = self.prefill_job(prompt, cache)
        # a lost forward commits nothing: the retry goes on from the last one done (a recurrent state cannot
        # roll back past the prompt's chunks folded into it)
        logits = self._retrying(lambda: self.finish_prefill(job), [], None)
        prefill_stats, path = job.step_stats(), job.path
        if stats is not None:
            stats.prompt_tokens, stats.prefill_path, stats.prefill = prompt.numel(), path, prefill_stats
            stats.shape = self.draft_name(choice)
            stats.predicted_tok_s = choice.tok_s if isinstance(choice, cost.Choice) else None
        stops = stop_set(eos_id)
        shaping = self.shaping(params, prompt.tolist(), stops)
        new = [first_token(logits[-1], params, generator, shaping)]
        history = [*prompt.tolist()]
        while True:
            history += new
            root = new[-1]
            if shaping is not None:
                shaping.add(new)
            yield new
            if root in stops or len(history) - prompt.numel() >= max_new_tokens:
                return
            spec = self.config.spec
            check_args = (cache, root, shape, spec, params, generator, draft_cache, lookup, history, shaping)
            new, check, _ = self._retrying(
                lambda a=check_args: run_check(self.model, self.residual, *a), check_args, generator
            )
            if stats is not None:
                stats.checks.append(check)
            new = clip(new, max_new_tokens - (len(history) - prompt.numel()), stops)

    def _retrying(self, action: Callable[[], T], caches: Sequence[Any], generator: torch.Generator | None) -> T:
        """``action()`` (a check or the prefill); if a CPU actor is lost or stops answering during it and
        the engine can ``reconnect``, roll the caches and the sampler back to where it started, reconnect
        and run it again, at most ``_RETRIES`` times. A check's outcome depends only on the state before it,
        so the retry emits exactly what the lost one would have."""
        rollback = {c: c.length for c in caches if isinstance(c, KVCache)}
        state, lost = generator.get_state() if generator is not None else None, None
        for attempt in range(_RETRIES + 1):
            try:
                if lost is not None:  # a fresh connection to the actors as they are now; it may fail too
                    self.residual.close()
                    self.residual = self.reconnect()
                    self._cleanups.insert(0, self.residual.close)  # the old close, still listed, is a no-op
                    self.recoveries.append(time.perf_counter() - lost)
                    lost = None
                return action()
            except (PeerLost, RequestTimeout):
                if self.reconnect is None or attempt == _RETRIES:
                    raise
            lost = lost or time.perf_counter()
            for cache, length in rollback.items():
                cache.truncate(length)
            if state is not None:
                generator.set_state(state)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_id: Stops = None,
        params: SamplingParams | None = None,
    ) -> tuple[list[int], GenerationStats]:
        """The verifier's text (greedy, or sampled by ``params``), drafted and checked as ``draft_shape`` says."""
        stats = GenerationStats.empty()
        tokens = [t for new in self.stream(prompt_ids, max_new_tokens, eos_id, params, stats) for t in new]
        return tokens, stats


def _run_all(cleanups: Sequence[Callable[[], object]]) -> None:
    """Run every cleanup even if one fails, then raise the first failure."""
    errors = []
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception as e:  # collected, the first re-raised below
            errors.append(e)
    if errors:
        raise errors[0]
