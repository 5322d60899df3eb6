"""The engine as a Ray actor: a ``SplitEngine`` connected to CPU actors that the scheduler placed.

The engine never starts nor stops a CPU actor here: it holds their Ray handles only to ask for their
endpoints, once at start and again after losing one (``SplitEngine.connect``'s ``resolve``). A handle's
call waits while Ray restarts a dead actor, so the retried check runs against the new process.

Requests go through a ``Batcher`` whose thread does all the model's work: the actor is threaded
(``max_concurrency``), so several callers ``open`` requests, long-poll their tokens with ``next_many`` and
``cancel`` them at once, and their sequences share each verify pass. A request crosses Ray as plain data
(token ids, a summary dict), never per layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from splitspec.config import EngineConfig
from splitspec.gpu_actor.batcher import UNKNOWN, Batcher, EngineBusy, failure_status
from splitspec.gpu_actor.engine import SplitEngine

MAX_CALLERS = 64  # concurrent method calls: long-polls of open requests and the server's probes


class EngineService:
    """``SplitEngine.connect`` to the CPU actors behind ``cpu_actors`` (Ray handles with an ``endpoint``
    method), pinned to ``engine_cpus``, serving requests through a ``Batcher``."""

    def __init__(self, cpu_actors: Sequence[Any], resolve_timeout_s: float, folder: str | Path, *args: Any) -> None:
        """``args``: the rest of ``SplitEngine.connect``'s after ``folder``, bar the endpoints (bits, config,
        engine_cpus, spin_us): the endpoints come from the actors, now and after a loss."""
        self._actors = list(cpu_actors)
        self._timeout_s = resolve_timeout_s
        bits, *rest = args
        config = rest[0] if rest and rest[0] is not None else EngineConfig()
        self._probe_s = config.channel.connect_timeout_s
        self._engine = SplitEngine.connect(folder, bits, self._endpoints(), *rest, resolve=self._recovered)
        self._cpus = rest[1] if len(rest) > 1 else None
        self._batcher = Batcher(self._engine)
        self._batcher.start()

    def _endpoints(self, probe_s: float | None = None) -> list[str]:
        """Each CPU actor's endpoint now; a call to an actor Ray is restarting waits for the new process."""
        calls = [actor.endpoint.remote(probe_s) for actor in self._actors]
        return ray.get(calls, timeout=self._timeout_s)

    def _recovered(self) -> list[str]:
        """After a lost or unanswered request: the endpoints once every actor answers a handshake (a hung
        one is killed and restarted by then, ``CpuActorService.endpoint``)."""
        return self._endpoints(self._probe_s)

    def open(self, asks: Sequence[tuple[Sequence[int], int, Any]], eos_ids: Sequence[int] = ()) -> dict:
        """Queue one client request's sequences ((prompt ids, max_new_tokens, ``SamplingParams``) each), all
        or none: ``{"ids": […]}``, or ``{"status": 429 or 400, "error": …}`` (with ``retry_after_s`` when
        the engine is full) as a server answers it."""
        try:
            return {"ids": [t.id for t in self._batcher.submit_group(asks, eos_ids)]}
        except EngineBusy as e:
            return {"status": 429, "error": str(e), "retry_after_s": e.retry_after_s}
        except ValueError as e:
            return {"status": 400, "error": str(e)}

    def next_many(self, request_ids: Sequence[str], wait_s: float = 1.0) -> dict[str, dict[str, Any]]:
        """Per request, its tokens decided since the last call, ``done``, and once done its summary, or its
        error with the HTTP status it maps to; once any of them has news, or after ``wait_s``. A server
        polls all its streams in one call (one call a check, not one a stream). Where the request asked,
        ``logprobs`` for those tokens and, with its first tokens, ``prompt_logprobs`` (``TokenLogprob.to_wire``)."""
        out = {}
        for request_id, got in self._batcher.next_many(request_ids, wait_s).items():
            if got is None:
                out[request_id] = {"tokens": [], "done": True, "status": 404, "error": UNKNOWN.format(request_id)}
                continue
            ticket, new, done = got
            entry: dict[str, Any] = {"tokens": new, "done": done}
            if ticket.params.logprobs is not None:  # those of the tokens handed out now
                entry["logprobs"] = [lp.to_wire() for lp in ticket.logprobs[ticket.sent - len(new) : ticket.sent]]
            if ticket.prompt_logprobs is not None and ticket.sent == len(new) and new:  # with the first news
                entry["prompt_logprobs"] = [lp.to_wire() for lp in ticket.prompt_logprobs]
            if done:
                entry["summary"] = self._batcher.summary(ticket)
                if ticket.error is not None:
                    error = f"{type(ticket.error).__name__}: {ticket.error}"
                    entry |= {"status": failure_status(ticket.error), "error": error}
            out[request_id] = entry
        return out

    def cancel(self, request_id: str) -> dict[str, Any] | None:
        """Drop the request; its summary so far (None if it had already finished and been read)."""
        ticket = self._batcher.cancel(request_id)
        return self._batcher.summary(ticket) if ticket is not None else None

    def load(self) -> dict[str, int]:
        """What the batcher holds now (sequences live and waiting, K/V bytes, recoveries)."""
        return self._batcher.load()

    def generate(self, prompt_ids: Sequence[int], *args: Any) -> tuple[list[int], dict[str, Any]]:
        """A whole generation through the batcher: (tokens, summary) (``args``: max_new_tokens, eos_id,
        params); raises what ended it, as the engine would."""
        ticket, done = self._batcher.submit(prompt_ids, *args), False
        while not done:
            ticket, _, done = self._batcher.next(ticket.id)
        if ticket.error is not None:
            raise ticket.error
        return ticket.tokens, self._batcher.summary(ticket)

    def info(self) -> dict[str, Any]:
        """Where the engine runs: pid, Ray node id, CPUs, device, and each CPU actor's transport (shm or tcp)."""
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "cpus": list(self._cpus) if self._cpus is not None else None,
            "device": self._engine.config.device,
            "draft_shape": self._engine.draft_name(self._batcher.choice),
            "transports": self._engine.residual.transports,
        }

    def close(self) -> None:
        self._batcher.close()
        self._engine.close()


EngineActor = ray.remote(max_concurrency=MAX_CALLERS)(EngineService)
"""The Ray actor class; the scheduler sets its resources and placement with ``.options``."""
