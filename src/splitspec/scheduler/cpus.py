"""Which CPUs the engine and each CPU actor run on, and how long the channel's ends spin.

One plan serves both ways of starting the actors (``scheduler.local`` as plain processes,
``scheduler.cluster`` as Ray actors), so that a measured pass means the same layout either way.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

from splitspec.config import ChannelConfig, EngineConfig
from splitspec.numa import cpulist
from splitspec.scheduler.topology import Host, local_host


def plan_cpus(
    n_actors: int, actor_cpus: Sequence[Sequence[int]] | None, config: EngineConfig, host: Host | None = None
) -> tuple[tuple[int, ...] | None, list[tuple[int, ...] | None]]:
    """(engine CPUs, each actor's CPUs); None = leave that process unpinned. ``host``: the CPUs this process
    may use and their NUMA nodes (``topology.local_host``, by default this one's).

    With at least two allowed CPUs the engine takes its own (the first, by default) and the actors split
    the rest, so the base product never waits for a core the residual holds. When the actors come in a
    whole number per NUMA node, each node's actors split that node's CPUs, so that an actor streams its
    rows from its own node's memory at the bandwidth ``splitspec plan`` measured there (``probe``); else
    each takes the next run of CPUs.
    """
    if actor_cpus is not None and len(actor_cpus) != n_actors:
        raise ValueError(f"cpus names {len(actor_cpus)} CPU sets for {n_actors} CPU actors")
    host = local_host(gpus=0) if host is None else host
    allowed = list(host.cpu_ids)
    check_engine_cpus(config.engine_cpus, allowed)
    if not config.pin or (len(allowed) < 2 and actor_cpus is None):
        return None, [tuple(c) for c in actor_cpus] if actor_cpus is not None else [None] * n_actors
    engine = config.engine_cpus or (allowed[0],)
    if actor_cpus is not None:
        return engine, [tuple(c) for c in actor_cpus]
    nodes = [node.cpus for node in host.numa] if host.numa and n_actors % len(host.numa) == 0 else [allowed]
    per_node = n_actors // len(nodes)
    return engine, [share for cpus in nodes for share in _split(cpus, engine, per_node)]


def _split(cpus: Sequence[int], engine: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """``cpus`` less the engine's in ``n`` runs; all of them where the engine's leave none, and where there
    are more actors than CPUs, the actors share them."""
    rest = [c for c in cpus if c not in engine] or list(cpus)
    shares = [tuple(rest[i * len(rest) // n : (i + 1) * len(rest) // n]) for i in range(n)]
    return [share or tuple(rest) for share in shares]


def check_engine_cpus(cpus: Sequence[int] | None, allowed: Collection[int] | None = None) -> None:
    """Refuse engine CPUs that this process may not use (the engine runs on this host; ``allowed``: its CPUs
    as ``plan_cpus`` was given them, by default its affinity)."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    if cpus is not None and not set(cpus) <= allowed:
        raise ValueError(
            f"the engine's CPUs {cpulist(cpus)} are not all among the CPUs this process may use ({cpulist(allowed)})"
        )


def spin_budget(
    engine_cpus: Sequence[int] | None, actor_cpus: Sequence[Sequence[int] | None], channel: ChannelConfig
) -> float:
    """How long both ends of the channel spin before sleeping: ``own_core_spin_us`` when every process has
    CPUs no other one uses (a spinner then takes nothing from its peer), the short ``spin_us`` otherwise."""
    sets = [engine_cpus, *actor_cpus]
    if any(s is None for s in sets):
        return channel.spin_us
    flat = [cpu for s in sets for cpu in s]
    return channel.own_core_spin_us if len(flat) == len(set(flat)) else channel.spin_us
