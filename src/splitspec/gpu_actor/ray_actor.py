"""The engine as a Ray actor: a ``SplitEngine`` connected to CPU actors that the scheduler placed.

The engine never starts nor stops a CPU actor here: it holds their Ray handles only to ask for their
endpoints, once at start and again after losing one (``SplitEngine.connect``'s ``resolve``). A handle's
call waits while Ray restarts a dead actor, so the retried check runs against the new process.
Generation happens inside this actor, so a request crosses Ray once and returns plain data (tokens and
a summary dict), whatever the number of layers and checks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from splitspec.config import EngineConfig
from splitspec.gpu_actor.engine import GenerationStats, SplitEngine


def generation_summary(stats: GenerationStats) -> dict[str, Any]:
    """One generation's figures as plain data: the per-check means of ``GenerationStats.summary`` with the
    prompt, prefill and draft shape beside them (what the CLI prints on either path)."""
    return {
        **stats.summary(),
        "prompt_tokens": stats.prompt_tokens,
        "prefill_path": stats.prefill_path,
        "prefill_ms": stats.prefill.verify_ms,
        "shape": stats.shape,
        "predicted_tok_s": stats.predicted_tok_s,
    }


class EngineService:
    """``SplitEngine.connect`` to the CPU actors behind ``cpu_actors`` (Ray handles with an ``endpoint``
    method), pinned to ``engine_cpus``; ``generate`` is the engine's, with a plain-data summary."""

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

    def _endpoints(self, probe_s: float | None = None) -> list[str]:
        """Each CPU actor's endpoint now; a call to an actor Ray is restarting waits for the new process."""
        calls = [actor.endpoint.remote(probe_s) for actor in self._actors]
        return ray.get(calls, timeout=self._timeout_s)

    def _recovered(self) -> list[str]:
        """After a lost or unanswered request: the endpoints once every actor answers a handshake (a hung
        one is killed and restarted by then, ``CpuActorService.endpoint``)."""
        return self._endpoints(self._probe_s)

    def generate(self, prompt_ids: Sequence[int], *args: Any) -> tuple[list[int], dict[str, Any]]:
        """``SplitEngine.generate``'s tokens with ``generation_summary``, the seconds it took and each
        recovery's seconds (``args``: max_new_tokens, eos_id, params)."""
        before = len(self._engine.recoveries)
        start = time.perf_counter()
        tokens, stats = self._engine.generate(prompt_ids, *args)
        summary = generation_summary(stats)
        summary["generate_s"] = time.perf_counter() - start
        summary["recoveries_s"] = self._engine.recoveries[before:]
        return tokens, summary

    def info(self) -> dict[str, Any]:
        """Where the engine runs: pid, Ray node id, CPUs, device, and each CPU actor's transport (shm or tcp)."""
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "cpus": list(self._cpus) if self._cpus is not None else None,
            "device": self._engine.config.device,
            "transports": self._engine.residual.transports,
        }

    def close(self) -> None:
        self._engine.close()


EngineActor = ray.remote(EngineService)
"""The Ray actor class; the scheduler sets its resources and placement with ``.options``."""
