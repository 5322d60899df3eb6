"""Continuous batching: requests join and leave between checks, and each check verifies every live
sequence's tree in one pass.

The residual is streamed from RAM once per pass whatever the number of tokens in it (until the CPU actors
become compute-bound), so sequences that share a pass share its biggest cost. Each sequence keeps its own
cache, sampler and first token. A joining request's prompt is prefilled a forward per round
(``BatchConfig.prefill_per_round``), between the checks of those already decoding, so that a long prompt
delays their next token by one forward, not by its whole prefill (chunked prefill, as vLLM schedules it).
One thread (``run``) does all the model's work, and other threads only ``submit``, read (``next``) and
``cancel`` under a lock, so a server's request handlers never touch a tensor. Admission is bounded
(``BatchConfig``): a request that would overflow the queue or the K/V budget is refused at once with
``EngineBusy`` rather than slowing every other request down.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numba
import torch

from splitspec.config import BatchConfig, SamplingParams
from splitspec.gpu_actor.engine import GenerationStats, PrefillJob, SplitEngine
from splitspec.gpu_actor.lookup import Lookup
from splitspec.gpu_actor.prefix_cache import PrefixCache, common_prefix, reusable
from splitspec.gpu_actor.residual import NoResidual
from splitspec.gpu_actor.sampling import TokenLogprob, first_token, make_generator, token_logprobs
from splitspec.gpu_actor.speculative import Checked, CheckRequest, Stops, clip, run_checks, stop_set
from splitspec.protocol import PeerLost, RequestTimeout
from splitspec.scheduler import cost

_log = logging.getLogger(__name__)


class _Gone(Exception):
    """A joining request cancelled or abandoned before its prompt was done."""


UNKNOWN = "no request {} (finished and read, cancelled, or expired)"  # what ``next`` says of an unknown id


class EngineBusy(Exception):
    """No room for one more request now; ``retry_after_s``: when one is likely to fit."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def generation_summary(stats: GenerationStats) -> dict[str, Any]:
    """One generation's figures as plain data: the per-check means of ``GenerationStats.summary`` with the
    prompt, prefill and draft shape beside them (what the CLI prints and a server's usage block carries)."""
    return {
        **stats.summary(),
        "prompt_tokens": stats.prompt_tokens,
        "prefill_path": stats.prefill_path,
        "prefill_ms": stats.prefill.verify_ms,
        "shape": stats.shape,
        "predicted_tok_s": stats.predicted_tok_s,
    }


@dataclass
class Ticket:
    """One request from ``submit`` to its last token; ``tokens`` grows as checks decide them."""

    id: str
    prompt: list[int]
    limit: int
    stops: frozenset[int]  # the token ids that end it
    params: SamplingParams
    capacity: int  # cache slots: prompt, new tokens, and one check's draft beyond them
    kv_bytes: int
    opened: float = field(default_factory=time.perf_counter)
    polled: float = field(default_factory=time.perf_counter)  # last time its client asked
    stats: GenerationStats = field(default_factory=GenerationStats.empty)
    tokens: list[int] = field(default_factory=list)
    request: CheckRequest | None = None
    lookup: Lookup | None = None  # its n-gram drafter, where its checks may copy drafts (``engine.lookup``)
    job: PrefillJob | None = None  # its prompt's prefill while it joins
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, where ``params.logprobs`` asks
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's after its first, for ``prompt_logprobs``
    reused: int = 0  # prompt tokens whose K/V came from the prefix cache
    sent: int = 0  # tokens already handed out by ``next``
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    recoveries: int = 0  # the engine's recovery count when this ticket was admitted
    error: BaseException | None = None
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.limit or (bool(self.tokens) and self.tokens[-1] in self.stops)


class Batcher:
    """Decode the requests given to ``submit`` together, over ``engine`` (which only this object drives)."""

    def __init__(self, engine: SplitEngine, config: BatchConfig | None = None) -> None:
        self.engine = engine
        self.config = config or engine.config.batch
        self.choice = engine.draft_shape()  # measured now, before the first request waits for it
        if engine.config.spec.mode == "ngram":
            engine.check_costs()  # the same for the n-gram draft's verify costs
        if engine.config.prefill == "auto" and engine.device_residual is not None:
            engine.prefill_costs()  # the prefill paths' costs too, for the same reason
        self.shape = self.choice.shape if isinstance(self.choice, cost.Choice) else self.choice
        self.predicted_tok_s = self.choice.tok_s if isinstance(self.choice, cost.Choice) else None
        self.prefixes = PrefixCache(self.config.prefix_cache_bytes)
        self._cv = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._joining: list[Ticket] = []  # admitted, their prompts being prefilled
        self._live: list[Ticket] = []
        self._tickets: dict[str, Ticket] = {}
        self._durations: deque[float] = deque(maxlen=16)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- what other threads call ---------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_id: Stops = None,
        params: SamplingParams | None = None,
    ) -> Ticket:
        """Queue a request; raises ``ValueError`` for one that can never run and ``EngineBusy`` when full."""
        return self.submit_group([(prompt_ids, max_new_tokens, params)], eos_id)[0]

    def submit_group(
        self, asks: Sequence[tuple[Sequence[int], int, SamplingParams | None]], eos_id: Stops = None
    ) -> list[Ticket]:
        """Queue several requests (prompt ids, max_new_tokens, params) all at once or none of them: one
        client request's choices (OpenAI's ``n``, a completion's batch of prompts), which then share every
        check. ``ValueError`` for a group that can never run here, ``EngineBusy`` when it does not fit now."""
        budget, tickets, stops = self.config.kv_budget_bytes, [], stop_set(eos_id)
        for prompt_ids, max_new_tokens, params in asks:
            prompt = list(prompt_ids)
            self.engine.check_request(len(prompt), max_new_tokens, params)
            capacity = len(prompt) + max_new_tokens + self.engine.config.spec.check_tokens
            need = self.engine.model.cache_bytes(capacity)
            tickets.append(
                Ticket(uuid.uuid4().hex, prompt, max_new_tokens, stops, params or SamplingParams(), capacity, need)
            )
        need, most = sum(t.kv_bytes for t in tickets), self.config.max_batch + self.config.max_queue
        if len(tickets) > most:
            raise ValueError(
                f"{len(tickets)} sequences at once; this engine holds at most {most} (max_batch + max_queue)"
            )
        if need > budget:
            what = "this request's" if len(tickets) == 1 else f"these {len(tickets)} sequences'"
            raise ValueError(f"{what} K/V takes {need} bytes, more than BatchConfig.kv_budget_bytes = {budget}")
        with self._cv:
            if self._stop.is_set():
                raise RuntimeError("the engine is closed")
            room = max(0, self.config.max_batch - len(self._live) - len(self._joining))  # they join next round
            if len(self._waiting) + len(tickets) > self.config.max_queue + room:
                raise EngineBusy(f"{len(self._waiting)} requests are waiting already", self._retry_after())
            if need + self._kv_in_use() > budget:
                raise EngineBusy(f"the K/V budget ({budget} bytes) is taken by running requests", self._retry_after())
            for ticket in tickets:
                self._waiting.append(ticket)
                self._tickets[ticket.id] = ticket
            self._cv.notify_all()
        return tickets

    def next(self, ticket_id: str, wait_s: float = 1.0) -> tuple[Ticket, list[int], bool]:
        """(the ticket, its tokens not yet handed out, whether it has finished), once it has new tokens or
        has finished, or after ``wait_s``. A finished ticket is forgotten once read."""
        got = self.next_many([ticket_id], wait_s)[ticket_id]
        if got is None:
            raise KeyError(UNKNOWN.format(ticket_id))
        return got

    def next_many(
        self, ticket_ids: Sequence[str], wait_s: float = 1.0
    ) -> dict[str, tuple[Ticket, list[int], bool] | None]:
        """``next`` for several requests in one call (a server's streams, one call a check instead of one
        each): once any of them has news, or after ``wait_s``, each one's (ticket, new tokens, finished),
        None for one unknown (finished and read, cancelled, or expired)."""
        with self._cv:
            tickets = {i: self._tickets.get(i) for i in ticket_ids}
            now = time.perf_counter()
            for ticket in tickets.values():
                if ticket is not None:
                    ticket.polled = now

            def news() -> bool:
                return any(t is None or len(t.tokens) > t.sent or t.finished is not None for t in tickets.values())

            self._cv.wait_for(news, wait_s)
            out: dict[str, tuple[Ticket, list[int], bool] | None] = {}
            for ticket_id, ticket in tickets.items():
                if ticket is None:
                    out[ticket_id] = None
                    continue
                new, ticket.sent = ticket.tokens[ticket.sent :], len(ticket.tokens)
                done = ticket.finished is not None  # set with the last tokens, under this lock
                if done:
                    self._tickets.pop(ticket_id, None)
                out[ticket_id] = ticket, new, done
            return out

    def cancel(self, ticket_id: str) -> Ticket | None:
        """Drop a request (its client left, or a stop string ended it): it leaves the batch before the next
        check and frees its K/V. Returns the ticket, or None for one already gone."""
        with self._cv:
            ticket = self._tickets.pop(ticket_id, None)
            if ticket is not None and ticket.finished is None:
                ticket.cancelled = True
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                    ticket.finished = time.perf_counter()
                self._cv.notify_all()
            return ticket

    def load(self) -> dict[str, int]:
        """Sequences in the batch, requests waiting, K/V bytes held (live, waiting and kept prefixes)."""
        with self._cv:
            kept = self.prefixes.nbytes
            return {
                "live": len(self._live) + len(self._joining),
                "waiting": len(self._waiting),
                "kv_bytes": self._kv_in_use() + kept,
                "prefix_bytes": kept,
                "prefix_hits": self.prefixes.hits,
                "recoveries": len(self.engine.recoveries),
            }

    def summary(self, ticket: Ticket) -> dict[str, Any]:
        """``generation_summary`` of a finished ticket, with its timings and the tokens reused."""
        out = generation_summary(ticket.stats)
        opened, end = ticket.opened, ticket.finished or time.perf_counter()
        out["generate_s"] = end - opened
        out["queued_s"] = (ticket.admitted or end) - opened
        out["ttft_s"] = (ticket.first_token or end) - opened
        out["reused_prompt_tokens"] = ticket.reused
        out["recoveries_s"] = self.engine.recoveries[ticket.recoveries :]
        return out

    def start(self) -> None:
        """Run ``run`` on a thread of its own until ``close``. numba's thread count is per thread: the loop
        takes the caller's (the engine's pinned count), not numba's default of every CPU, which on a
        pinned engine would put two kernel threads on one core, each spinning while the other waits."""
        threads = numba.get_num_threads()

        def loop() -> None:
            numba.set_num_threads(threads)
            self.run()

        self._thread = threading.Thread(target=loop, name="splitspec-batcher", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the loop; requests still open end with an error."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._end_all(RuntimeError("the engine was closed before this request finished"))

    def _end_all(self, error: Exception) -> None:
        """End every waiting, joining and live request with ``error``."""
        with self._cv:
            for ticket in [*self._waiting, *self._joining, *self._live]:
                self._finish(ticket, error)
            self._waiting.clear()
            self._joining, self._live = [], []

    # --- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                self._cv.wait_for(lambda: self._waiting or self._joining or self._live or self._stop.is_set(), 1.0)
            try:
                self.step()
            except Exception as e:  # outside any one request's guard: it ends every open request, none waits
                _log.exception("a round of the batch failed; its open requests end with the error")
                self._end_all(e)

    def step(self) -> bool:
        """One round: expire abandoned requests, let waiting ones join, run ``prefill_per_round`` tokens of
        the joining ones' prompts (a long prompt does not hold up everyone else's next token for all of its
        prefill), then one check for everyone live. Returns whether any request is still open."""
        with self._cv:
            self._expire()
            while self._waiting and len(self._live) + len(self._joining) < self.config.max_batch:
                ticket = self._waiting.popleft()
                ticket.admitted, ticket.recoveries = time.perf_counter(), len(self.engine.recoveries)
                self._joining.append(ticket)
            joining = list(self._joining)
        self._prefill(joining)
        self._check()
        with self._cv:
            return bool(self._waiting or self._joining or self._live)

    def _prefill(self, joining: list[Ticket]) -> None:
        """Forwards of the joining requests' prompts, oldest first, until ``prefill_per_round`` tokens have
        run; a request whose prompt is done gets its first token and goes live."""
        engine, budget = self.engine, self.config.prefill_per_round or self.engine.config.prefill_chunk
        for ticket in joining:
            if ticket.job is None and not ticket.cancelled and self._sibling(ticket, joining):
                continue  # it starts from that one's K/V once it is live
            try:
                if ticket.cancelled:
                    raise _Gone()
                job = ticket.job or self._start(ticket)
                while budget > 0:
                    tokens = min(job.chunk, job.prompt.shape[0] - job.start)
                    logits = engine._retrying(lambda j=job: engine.prefill_step(j), [job.cache], None)
                    budget -= tokens
                    if logits is not None:
                        self._ready(ticket, logits)
                        break
            except Exception as e:  # this request's own failure (or its client's leaving) ends it alone
                with self._cv:
                    if ticket in self._joining:
                        self._joining.remove(ticket)
                    self._finish(ticket, None if isinstance(e, _Gone) else e)
            if budget <= 0:
                return

    @staticmethod
    def _sibling(ticket: Ticket, joining: list[Ticket]) -> bool:
        """Whether an earlier joining request, its prefill under way, shares most of this one's prompt (a
        request's n choices, a batch with a long common preamble): this one then waits for it, rather than
        prefill the same tokens again. It would have waited for the round's prefill budget anyway."""
        return (
            any(
                other.job is not None and 2 * common_prefix(other.prompt, ticket.prompt) > len(ticket.prompt)
                for other in joining[: joining.index(ticket)]
            )
            and ticket.params.prompt_logprobs is None
        )

    def _start(self, ticket: Ticket) -> PrefillJob:
        """The request's cache (with the K/V of the longest prefix of its prompt that a kept sequence or a
        live one holds) and its prefill job."""
        scored = ticket.params.prompt_logprobs is not None  # every prompt position's logits: no reuse
        with self._cv:
            self.prefixes.shrink(self.config.kv_budget_bytes - self._kv_in_use())
            kept, n = self.prefixes.lookup(ticket.prompt) if not scored else (None, 0)
            for live in self._live if not scored else ():
                m = reusable(live.prompt, ticket.prompt)
                if m > n and live.request is not None and live.request.cache.resumable(m):
                    kept, n = live.request.cache, m
        cache = self.engine.model.new_cache(ticket.capacity)
        if n and kept.ring != cache.ring:  # rings of another size (a context too short for one): prefill it all
            n = 0
        if n:
            cache.load_prefix(kept, n)
        ticket.reused, ticket.prompt_logprobs = n, [] if scored else None
        rest = torch.as_tensor(ticket.prompt[n:], dtype=torch.long)
        ticket.job = self.engine.prefill_job(rest, cache, self._scorer(ticket) if scored else None)
        return ticket.job

    def _ready(self, ticket: Ticket, logits: torch.Tensor) -> None:
        """A prompt prefilled: the request's first token, its check state; it goes live."""
        engine, params, job = self.engine, ticket.params, ticket.job
        draft_cache = None
        if engine.config.spec.kv == "draft2bit" and self.shape.nodes:
            draft_cache = engine.model.new_cache(ticket.capacity)
            engine.model.append(torch.as_tensor(ticket.prompt), draft_cache, NoResidual())
        generator, shaping = make_generator(params), engine.shaping(params, ticket.prompt, ticket.stops)
        root = first_token(logits[-1], params, generator, shaping)
        if shaping is not None:
            shaping.add([root])
        if params.logprobs is not None:
            ticket.logprobs = token_logprobs(logits[-1:], [root], params.logprobs)
        name = engine.draft_name(self.choice)
        ticket.stats = GenerationStats(len(ticket.prompt), job.path, job.step_stats(), name, self.predicted_tok_s)
        ticket.request = CheckRequest(job.cache, root, self.shape, params, generator, draft_cache, shaping=shaping)
        ticket.lookup, ticket.job = engine.lookup(), None
        with self._cv:
            ticket.first_token = time.perf_counter()
            self._joining.remove(ticket)
            self._emit(ticket, [root])
            if ticket.finished is None:
                self._live.append(ticket)

    @staticmethod
    def _scorer(ticket: Ticket) -> Callable[[torch.Tensor, int], None]:
        """What a prefill gives each forward's logits to: the logprob of the prompt token after each
        position (the last position's is the first new token's, kept apart)."""

        def score(logits: torch.Tensor, start: int) -> None:
            targets = ticket.prompt[start + 1 : start + 1 + logits.shape[0]]
            ticket.prompt_logprobs += token_logprobs(logits[: len(targets)], targets, ticket.params.prompt_logprobs)

        return score

    def _check(self) -> None:
        with self._cv:
            for ticket in self._live:
                if ticket.cancelled:
                    self._finish(ticket)
            live = self._live = [t for t in self._live if t.finished is None]
        if not live:
            return
        requests = [t.request for t in live]
        # under "auto" the best draft changes as the shared verify pass grows; the 2-bit-KV draft's own
        # cache follows one fixed shape
        choice = self.engine.draft_shape(len(live)) if self.engine.config.spec.kv == "exact" else self.choice
        shape = choice.shape if isinstance(choice, cost.Choice) else choice
        copies = self.engine.copies(choice)
        reads_text = copies or self.engine.config.spec.ngram_branch  # only then does a check read its history
        for ticket, request in zip(live, requests, strict=True):
            request.shape, ticket.stats.shape = shape, self.engine.draft_name(choice)
            request.lookup = ticket.lookup if copies else None
            request.history = ticket.prompt + ticket.tokens if reads_text else ()
        states = [(r.generator, r.generator.get_state()) for r in requests if r.generator is not None]

        def check() -> list[Checked]:
            for generator, state in states:  # a retried check samples exactly as the lost one would have
                generator.set_state(state)
            return run_checks(self.engine.model, self.engine.residual, requests, self.engine.config.spec)

        caches = [r.cache for r in requests] + [r.draft_cache for r in requests if r.draft_cache is not None]
        try:
            results = self.engine._retrying(check, caches, None)
        except Exception as e:  # the verifier itself failed (an actor lost for good): every live request ends
            with self._cv:
                for ticket in live:
                    self._finish(ticket, e)
            return
        with self._cv:
            for ticket, (new, stats, logprobs) in zip(live, results, strict=True):
                ticket.stats.checks.append(stats)
                new = clip(new, ticket.limit - len(ticket.tokens), ticket.stops)
                ticket.request.root = new[-1]
                if ticket.request.shaping is not None:
                    ticket.request.shaping.add(new)
                if logprobs is not None:
                    ticket.logprobs += logprobs[: len(new)]
                self._emit(ticket, new)

    # --- under the lock ------------------------------------------------------------------------------

    def _emit(self, ticket: Ticket, new: list[int]) -> None:
        ticket.tokens += new
        if ticket.done:
            self._finish(ticket)
        self._cv.notify_all()

    def _finish(self, ticket: Ticket, error: BaseException | None = None) -> None:
        """End a ticket; a completed one leaves its K/V to the prefix cache (prompt and all tokens but the
        last, whose K/V no pass has written)."""
        if ticket.finished is not None:
            return
        ticket.finished, ticket.error = time.perf_counter(), error
        request, ticket.request = ticket.request, None
        covered = ticket.prompt + ticket.tokens[:-1]
        # kept unless a recurrent state (Qwen 3.5) has folded in slots past the text (a check cut by the end)
        kept = request is not None and self.prefixes.budget and len(covered) >= request.cache.floor
        if error is None and not ticket.cancelled and kept:
            request.cache.truncate(len(covered))
            self.prefixes.put(covered, request.cache)
        if error is None:
            self._durations.append(ticket.finished - ticket.opened)
        self._cv.notify_all()

    def _kv_in_use(self) -> int:
        return sum(t.kv_bytes for t in (*self._waiting, *self._joining, *self._live) if t.finished is None)

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free: a recent request's mean duration (1 s at least)."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean))

    def _expire(self) -> None:
        now = time.perf_counter()
        for ticket in list(self._tickets.values()):
            if now - ticket.polled > self.config.lease_s:
                self._tickets.pop(ticket.id)
                if ticket.finished is None:
                    ticket.cancelled = True
                    if ticket in self._waiting:
                        self._waiting.remove(ticket)
                        ticket.finished = now


def failure_status(error: BaseException) -> int:
    """The HTTP status a server answers for a request that ended with ``error``: 503 when the verifier lost a
    CPU actor for good (restarts exhausted), 500 otherwise."""
    return 503 if isinstance(error, (PeerLost, RequestTimeout)) else 500


def generate_many(
    engine: SplitEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: Stops = None,
    params: Sequence[SamplingParams] | None = None,
) -> list[tuple[list[int], GenerationStats]]:
    """Each prompt's tokens and stats, as ``engine.generate`` would give them one at a time (greedy text
    equal up to near-ties: a pass over more rows sums in another order), every check shared by all."""
    params = list(params) if params is not None else [SamplingParams()] * len(prompts)
    n = max(len(prompts), 1)
    unbounded = {"kv_budget_bytes": 2**62, "prefix_cache_bytes": 0, "lease_s": math.inf}
    config = replace(engine.config.batch, max_batch=n, max_queue=n, **unbounded)
    batcher = Batcher(engine, config)
    tickets = [batcher.submit(p, max_new_tokens, eos_id, sp) for p, sp in zip(prompts, params, strict=True)]
    while batcher.step():
        pass
    for ticket in tickets:
        if ticket.error is not None:
            raise ticket.error
    return [(t.tokens, t.stats) for t in tickets]
