"""Ray: join a running cluster or start an embedded one, reserve a placement, start and supervise the actors.

A user who ran ``ray start --head`` gets that cluster; anyone else gets a local one started in this
process, so ``splitspec generate`` and ``make demo`` need no set-up. The engine and the CPU actors are Ray
actors in one placement group: one bundle for the engine (with the GPU where there is one) and one per CPU
actor, sized from the same CPU plan the direct path pins by (``scheduler.cpus.plan_cpus``). Ray carries
only the set-up (the actors' endpoints) and each request's tokens; activations go over the protocol.

The channel is sealed with CURVE keys made per deployment: the CPU actors get them as Ray actor arguments
and the engine in its ``ChannelConfig``, and each actor binds only to the address of the node Ray put it
on, so a process outside the placement can neither connect to it nor read what crosses.

A CPU actor may run on another host (``SchedulerConfig.actor_hosts``: a Ray node resource that marks that
host); it then serves its rows over TCP, and the engine and the CPU actors of this host stay together.

Supervision is Ray's: a CPU actor runs with ``max_restarts``, so a killed one comes back in its bundle,
reloads its shard and binds a new endpoint; its ``endpoint`` calls retry until it answers
(``max_task_retries``), and the engine asks for the endpoints again after losing an actor.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants
from ray._private.authentication import authentication_token_setup
from ray._private.utils import read_ray_address
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from splitspec.config import EngineConfig, SchedulerConfig
from splitspec.cpu_actor.ray_actor import CpuActor
from splitspec.gpu_actor.ray_actor import EngineActor
from splitspec.numa import cpulist
from splitspec.protocol import HEAD, CurveKeys
from splitspec.scheduler import probe
from splitspec.scheduler.cpus import plan_cpus, spin_budget

# Ray 2.60 binds to the machine's external address unless told otherwise, and refuses a multi-node
# set-up on some platforms without the first variable; the second keeps actors' repeated lines apart.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0"}
NAMESPACE = "splitspec"
log = logging.getLogger(__name__)


class SchedulerError(RuntimeError):
    """The cluster cannot hold the placement, or an actor did not start; the message says which."""


@dataclass
class Cluster:
    """The Ray connection this process holds: ``started`` when it runs the cluster itself (embedded),
    ``owned`` when it made the connection (and so ends it at ``shutdown``)."""

    address: str
    started: bool
    owned: bool

    def shutdown(self) -> None:
        """Disconnect; an embedded cluster stops with its processes (and its object store in /dev/shm)."""
        if self.owned and ray.is_initialized():
            ray.shutdown()


def connect_or_start(config: SchedulerConfig | None = None) -> Cluster:
    """Join the cluster ``config`` names or finds, else start an embedded one on ``config.node_ip``."""
    config = config or SchedulerConfig()
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    # Ray reads the first variable once, at import; an earlier import in this process missed it, and
    # ray.init would then resolve 127.0.0.1 to the external address (the child processes read the env)
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0"
    if ray.is_initialized():  # this process is already connected (a test's cluster, a caller's): use it
        return Cluster(ray.get_runtime_context().gcs_address, started=False, owned=False)
    common: dict[str, Any] = {
        "namespace": NAMESPACE,
        "logging_level": logging.ERROR,
        "log_to_driver": not config.quiet,
        "_node_ip_address": config.node_ip,
    }
    address = config.address or _started_cluster()
    if address is not None and address != "local":
        try:
            _check_listening(address)
            _follow_token_auth()
            ray.init(address=address, **common)
            return Cluster(ray.get_runtime_context().gcs_address, started=False, owned=True)
        except ConnectionError:
            if config.address is not None:
                raise
    ray.init(
        address="local",  # never ``None``: Ray would read RAY_ADDRESS and the recorded cluster again
        include_dashboard=False,
        num_cpus=config.num_cpus or len(os.sched_getaffinity(0)),
        object_store_memory=config.object_store_bytes,
        **common,
    )
    return Cluster(ray.get_runtime_context().gcs_address, started=True, owned=True)


def _started_cluster() -> str | None:
    """The cluster a user started: ``RAY_ADDRESS``, else the one ``ray start`` recorded in Ray's temp dir
    (``ray_current_cluster``, removed by ``ray stop``). Never ``"auto"``: Ray then also scans the processes
    of this machine and joins any cluster it finds, another process's embedded one included, which records
    nothing."""
    return os.environ.get("RAY_ADDRESS") or read_ray_address()


def _follow_token_auth() -> None:
    """``ray start`` turns Ray's token authentication on when a token exists (~/.ray/auth_token); ``ray.init``
    given an address does not, and the cluster would refuse it: follow the cluster's rule (quietly: Ray
    warns about it on stderr, where the CLI's own lines go)."""
    log = logging.getLogger(authentication_token_setup.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        authentication_token_setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        log.setLevel(level)


def _check_listening(address: str | None, timeout_s: float = 5.0) -> None:
    """Refuse a ``host:port`` where nothing listens, which ``ray.init`` would retry for ever."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout_s).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"nothing answers at {address} ({e})") from e


def bundle_cpus(
    engine_cpus: Sequence[int] | None, actor_cpus: Sequence[Sequence[int] | None], allowed: Sequence[int]
) -> list[float]:
    """Logical CPUs each process's bundle asks for: its share of every CPU it is pinned to (a CPU two
    processes share counts half for each; an unpinned process shares all of ``allowed``), so the bundles
    add up to the CPUs really used and fit a cluster that advertises this host's CPUs."""
    sets = [set(s) if s is not None else set(allowed) for s in (engine_cpus, *actor_cpus)]
    users = Counter(cpu for s in sets for cpu in s)
    return [math.floor(sum(1 / users[cpu] for cpu in s) * 1e4) / 1e4 for s in sets]  # Ray's precision


_MARK = 0.001  # of a node's resource: picks that node and leaves the rest of it to others


@dataclass
class Placement:
    """A placement group: bundle 0 for the engine, bundle ``1 + i`` for CPU actor ``i``; ``hosts[b]`` is
    the address of the node bundle ``b`` landed on, the only one its actor listens on."""

    group: PlacementGroup
    bundles: list[dict[str, float]]
    hosts: list[str]

    @classmethod
    def reserve(
        cls,
        engine_cpus: Sequence[int] | None,
        actor_cpus: Sequence[Sequence[int] | None],
        gpu: bool,
        timeout_s: float,
        actor_hosts: Sequence[str | None] = (),
    ) -> Placement:
        """Reserve the bundles, or raise ``SchedulerError`` if the cluster cannot hold them in time. The engine
        and the actors without a host in ``actor_hosts`` go on this process's node (its ``node:<ip>``
        resource): the planned CPU ids are this process's and the shared-memory channel is this host's, and
        Ray would otherwise pack them on whichever node has room. An actor given a host resource gets one
        unpinned logical CPU on a node that has it."""
        hosts = list(actor_hosts) or [None] * len(actor_cpus)
        local = [cpus for cpus, host in zip(actor_cpus, hosts, strict=True) if host is None]
        local_cpus = iter(bundle_cpus(engine_cpus, local, sorted(os.sched_getaffinity(0))))
        here = f"node:{ray.util.get_node_ip_address()}"
        bundles = [{"CPU": next(local_cpus), here: _MARK}]
        bundles += [{"CPU": 1.0, host: _MARK} if host else {"CPU": next(local_cpus), here: _MARK} for host in hosts]
        if gpu:
            bundles[0]["GPU"] = 1
        strategy = "PACK" if any(hosts) else "STRICT_PACK"
        group = placement_group(bundles, strategy=strategy)
        if not group.wait(timeout_s):
            remove_placement_group(group)
            raise SchedulerError(
                f"Ray could not place the bundles {bundles} ({strategy}) within {timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()} free"
            )
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        placed = placement_group_table(group)["bundles_to_node_id"]
        return cls(group, bundles, [addresses[placed[b]] for b in range(len(bundles))])

    def options(self, bundle: int) -> dict[str, Any]:
        """The ``.options`` of the actor that runs in ``bundle``: its resources and its place."""
        return {
            "num_cpus": self.bundles[bundle]["CPU"],
            "num_gpus": self.bundles[bundle].get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
        }

    def remove(self) -> None:
        remove_placement_group(self.group)


class Deployment:
    """One engine and its CPU actors, placed and supervised on the connected Ray cluster."""

    def __init__(self, placement: Placement, cpu_actors: list[Any], engine: Any, timeout_s: float) -> None:
        self.placement: Placement | None = placement
        self.cpu_actors = cpu_actors
        self.engine = engine
        self._timeout_s = timeout_s
        self.row_weights: tuple[float, ...] | None = None  # each CPU actor's share of the rows, as started
        self.engine_args: tuple[EngineConfig, tuple[int, ...] | None, float] | None = None  # see ``place``

    @classmethod
    def start(
        cls, folder: str | Path, bits: int, config: EngineConfig | None = None, scheduler: SchedulerConfig | None = None
    ) -> Deployment:
        """Place and start the CPU actors (``place``), then the engine on their endpoints; returns once the
        engine is connected. Needs a connected cluster (``connect_or_start``)."""
        deployment = cls.place(folder, bits, config, scheduler)
        with _closed_on_failure(deployment):
            engine = EngineActor.options(**deployment.placement.options(0)).remote(
                deployment.cpu_actors, deployment._timeout_s, str(folder), bits, *deployment.engine_args
            )
            deployment.engine = engine
            ray.get(engine.info.remote(), timeout=deployment._timeout_s)
        return deployment

    @classmethod
    def place(
        cls, folder: str | Path, bits: int, config: EngineConfig | None = None, scheduler: SchedulerConfig | None = None
    ) -> Deployment:
        """Plan the CPUs as the direct path does for the CPU actors of this host, reserve the placement (the
        engine's bundle too), make the channel's keys and start the CPU actors; returns once each serves.
        ``engine_args`` is then what an engine needs to connect to them (config with the keys, CPUs, spin):
        ``start`` runs it as a Ray actor, a benchmark may run it in its own process."""
        config, scheduler = config or EngineConfig(), scheduler or SchedulerConfig()
        n_cpu_actors = scheduler.cpu_actors
        hosts = scheduler.actor_hosts or (None,) * n_cpu_actors
        local = [i for i, host in enumerate(hosts) if host is None]
        engine_cpus, local_cpus = plan_cpus(len(local), None, config)
        planned = dict(zip(local, local_cpus, strict=True))
        actor_cpus = [planned.get(i) for i in range(n_cpu_actors)]  # another host's actor: unpinned
        spin_us = spin_budget(engine_cpus, local_cpus, config.channel)
        keys = CurveKeys.generate()
        config = replace(config, channel=replace(config.channel, curve=keys))
        gpu = config.device.startswith("cuda")
        if gpu:  # Ray shows the actor only its bundle's GPU, as device 0
            config = replace(config, device="cuda")
        timeout_s = scheduler.start_timeout_s
        placement = Placement.reserve(engine_cpus, actor_cpus, gpu, timeout_s, hosts)
        actors: list[Any] = []
        deployment = cls(placement, actors, None, timeout_s)
        deployment.engine_args = (config, engine_cpus, spin_us)
        with _closed_on_failure(deployment):
            weights = scheduler.row_weights or _measured_weights(placement, actor_cpus, timeout_s)
            deployment.row_weights = weights
            for i, cpus in enumerate(actor_cpus):
                options = placement.options(1 + i) | {"max_restarts": scheduler.max_restarts, "max_task_retries": -1}
                args = (str(folder), bits, i, n_cpu_actors, cpus, spin_us, config.activations)
                where = (placement.hosts[1 + i], keys, weights, config.resident_bytes)  # the engine's rows: skipped
                where += (config.actor_head_share(n_cpu_actors), config.actor_base_share())
                actors.append(CpuActor.options(**options).remote(*args, *where))
            # each actor serves, or its error comes back (no retry: a failed start is final, and a retry
            # would print Ray's notice of it on stdout)
            ray.get([a.endpoint.options(max_task_retries=0).remote() for a in actors], timeout=timeout_s)
        return deployment

    def endpoints(self) -> list[str]:
        """Each CPU actor's endpoint now."""
        return ray.get([a.endpoint.remote() for a in self.cpu_actors], timeout=self._timeout_s)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt_ids: Sequence[int], *args: Any) -> tuple[list[int], dict[str, Any]]:
        """(tokens, summary) from the engine actor (``EngineService.generate``; ``args`` as there)."""
        return ray.get(self.engine.generate.remote(list(prompt_ids), *args))

    def info(self) -> dict[str, Any]:
        """Where everything runs now: the engine's ``info`` and each CPU actor's (pids change on restart)."""
        engine = ray.get(self.engine.info.remote(), timeout=self._timeout_s)
        actors = ray.get([a.info.remote() for a in self.cpu_actors], timeout=self._timeout_s)
        return {"engine": engine, "cpu_actors": actors, "bundles": self.placement.bundles}

    def where(self) -> list[str]:
        """One line per actor: what it is, its process, node, CPUs and channel."""
        info = self.info()
        hosts = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        e = info["engine"]

        def cpus(process: dict[str, Any]) -> str:
            return cpulist(process["cpus"] or ()) or "any"

        lines = [f"engine: pid {e['pid']} on {hosts.get(e['node'])}, CPUs {cpus(e)}, device {e['device']}"]
        for a, transport in zip(info["cpu_actors"], e["transports"], strict=True):
            held = "residual and lm_head rows" if HEAD in a["shards"] else "residual"
            lines.append(
                f"CPU actor {a['shard']}: pid {a['pid']} on {hosts.get(a['node'])}, CPUs {cpus(a)}, "
                f"{a['threads']} threads, {a['nbytes'] / 2**20:.1f} MiB of {held}, {transport} at {a['endpoint']}"
            )
        return lines

    def close(self, timeout_s: float = 10.0) -> None:
        """End every actor and free the placement; waits until Ray reports the actors dead, so that none
        outlives the call. No polite close first: the engine may be busy with a generation the caller
        gave up on (Ctrl-C), and a killed process leaves nothing behind (the clients unlink the
        shared-memory segments as they map them; Ray ends a worker's process group with it). A second
        call does nothing (nor starts a cluster, as a Ray call after ``ray.shutdown`` would)."""
        if self.placement is None:
            return
        handles = [h for h in (self.engine, *self.cpu_actors) if h is not None]
        for handle in handles:
            ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + timeout_s
        for handle in handles:
            _wait_dead(handle, deadline)
        self.placement.remove()
        self.placement, self.engine, self.cpu_actors = None, None, []


@contextlib.contextmanager
def _closed_on_failure(deployment: Deployment) -> Iterator[None]:
    """Close what was started when starting fails; an actor whose ``__init__`` failed (Ray does not restart
    it) becomes one ``SchedulerError`` with the actor's own message."""
    try:
        yield
    except ray.exceptions.RayActorError as e:
        deployment.close()
        raise SchedulerError(_actor_failure(e)) from e
    except BaseException:
        deployment.close()
        raise


@ray.remote(max_retries=0)
def _read_bandwidth(cpus: Sequence[int] | None) -> float:
    """The read bandwidth of an actor's CPUs, measured where it will run (cached on that host)."""
    return probe.row_weights([cpus])[0]


def _measured_weights(
    placement: Placement, actor_cpus: Sequence[Sequence[int] | None], timeout_s: float
) -> tuple[float, ...] | None:
    """The plan's row shares for several CPU actors (``probe.row_weights``), each measured in its own bundle,
    one after another so that no two reads share the memory bus; None (even) for a single actor."""
    if len(actor_cpus) < 2:
        return None
    return tuple(
        ray.get(_read_bandwidth.options(**placement.options(1 + i)).remote(cpus), timeout=timeout_s)
        for i, cpus in enumerate(actor_cpus)
    )


def _actor_failure(e: Exception) -> str:
    """The actor's own error from Ray's report, which wraps it in the creation task's traceback and a
    ``ray::`` line: from the first exception's message on (``CpuActorError`` quotes the service's stderr)."""
    lines = [line for line in str(e).splitlines() if "ray::" not in line]
    for i, line in enumerate(lines):
        if match := re.match(r"[\w.]+(Error|Exception): (.*)", line):
            return "\n".join([match.group(2), *lines[i + 1 :]])
    return str(e)


def _wait_dead(handle: Any, deadline: float) -> None:
    """Block until Ray reports the killed actor dead (its calls fail), or the deadline passes. An actor not
    reported dead by then is said so in the log: ``close`` frees the placement anyway (a caller tearing down
    must not be held up), and a process that may live on is something a user has to be able to see."""
    while time.monotonic() < deadline:
        try:
            ready = handle.__ray_ready__.options(max_task_retries=0)  # no retry: it would wait for a restart
            ray.get(ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    log.warning(
        "%s was killed but Ray has not reported it dead in time: its placement is freed; it may still run", handle
    )
