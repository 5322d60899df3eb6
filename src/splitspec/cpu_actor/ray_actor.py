"""The CPU actor as a Ray actor: a thin owner of the CPU actor process (``service.start_cpu_actor``).

The service runs exactly as on the direct path, in a process of its own: it pins itself before its
numba threads start and its shard's pages are first-touched, and it serves the protocol (shared-memory
slots on this host). The Ray actor around it only starts it, hands its endpoint to whoever asks, and ties
the two lifetimes together so that Ray's supervision covers the process that does the work:

- the service dies (a SIGKILL, a crash): the Ray actor exits at once, Ray counts an actor death and
  restarts it (``max_restarts``), and the new actor starts a new service, which reloads the shard and
  binds a new endpoint;
- the service hangs: a probe after a lost request (``endpoint(probe_s)``) finds it silent and kills it,
  which ends as above;
- the Ray actor dies or is killed: Ray ends its worker's process group, the service with it.

Only the endpoint and a description cross through Ray; activations never touch Ray's object store.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from splitspec.config import ChannelConfig, CpuActorConfig
from splitspec.cpu_actor.service import start_cpu_actor
from splitspec.protocol import Client, CurveKeys, PeerLost, RequestTimeout

_DIED = 70  # the Ray actor's exit status when its service died under it (EX_SOFTWARE)


class CpuActorService:
    """Serve shard ``index`` of ``n_shards`` (rows split by ``weights``, or evenly) of ``folder``'s ``bits``-bit
    residual, past the rows an engine holding ``resident_bytes`` of it keeps (and its rows of the actors'
    ``head_share`` of the lm_head and ``base_share`` of the base), on ``cpus``, bound to
    ``host`` only, to the clients holding ``curve`` (the cluster's keys) only; ``__init__`` returns once the
    service answers requests (so a restarted actor's first call already sees the new endpoint), and raises
    ``CpuActorError`` when the service cannot start."""

    def __init__(
        self,
        folder: str | Path,
        bits: int,
        index: int,
        n_shards: int,
        cpus: Sequence[int] | None = None,
        spin_us: float = ChannelConfig.spin_us,
        activations: str = CpuActorConfig.activations,
        host: str = "127.0.0.1",
        curve: CurveKeys | None = None,
        weights: Sequence[float] | None = None,
        resident_bytes: int = 0,
        head_share: float = 0.0,
        base_share: float = 0.0,
    ) -> None:
        self._index = index
        self._stopping = False
        endpoint = f"tcp://{host}:0"
        options = {"spin_us": spin_us, "activations": activations, "curve": curve, "weights": weights}
        options |= {"resident_bytes": resident_bytes, "head_share": head_share, "base_share": base_share}
        self._process = start_cpu_actor(folder, bits, index, n_shards, cpus, endpoint, **options)
        threading.Thread(target=self._watch, name="splitspec-cpu-actor-watch", daemon=True).start()

    def _watch(self) -> None:
        """Exit this Ray actor when its service exits without being asked to: Ray then restarts both."""
        self._process.wait()
        self._exit_if_dead()

    def _exit_if_dead(self) -> None:
        if not self._stopping and not self._process.alive():
            print(f"splitspec: CPU actor {self._index}'s service died; exiting for a restart", file=sys.stderr)
            os._exit(_DIED)

    def endpoint(self, probe_s: float | None = None) -> str:
        """The service's endpoint, never a dead one: asked after the service died but before the watcher
        noticed, the actor exits here and Ray runs the call again on the restarted actor. With ``probe_s``
        (after a client lost its requests) the service must also answer a handshake within that time; a
        hung one is killed, with the same outcome."""
        self._exit_if_dead()
        if probe_s is not None and not self._answers(probe_s):
            print(f"splitspec: CPU actor {self._index}'s service does not answer; killing it", file=sys.stderr)
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._exit_if_dead()
        return self._process.endpoint

    def _answers(self, timeout_s: float) -> bool:
        probe = ChannelConfig(
            transport="tcp", slots=1, max_tokens=1, connect_timeout_s=timeout_s, curve=self._process.curve
        )
        try:
            with Client(self._process.shard_info.model_hash, probe, self._process.endpoint):
                return True
        except (PeerLost, RequestTimeout):
            return False

    def info(self) -> dict[str, Any]:
        """Where it serves and runs (endpoint, the service's pid, Ray node id, CPUs) and what starting it cost."""
        return {
            **self._process.ready,
            "shard": self._index,
            "pid": self._process.pid,
            "actor_pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
        }

    def stop(self) -> dict[str, float] | None:
        """End the service politely (its counters come back); the Ray actor stays until it is killed."""
        self._stopping = True
        return self._process.stop()


CpuActor = ray.remote(CpuActorService)
"""The Ray actor class; the scheduler sets its resources, placement and restarts with ``.options``."""
