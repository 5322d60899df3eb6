"""Which CPUs the engine and each CPU actor run on, and how long the channel's ends spin.

One plan serves both ways of starting the actors (``scheduler.local`` as plain processes,
``scheduler.cluster`` as Ray actors), so that a measured pass means the same layout either way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from splitspec.config import ChannelConfig, EngineConfig
from splitspec.numa import cpulist


def plan_cpus(
    n_actors: int, actor_cpus: Sequence[Sequence[int]] | None, config: EngineConfig
) -> tuple[tuple[int, ...] | None, list[tuple[int, ...] | None]]:
    """(engine CPUs, each actor's CPUs); None = leave that process unpinned.

    With at least two allowed CPUs the engine takes its own (the first, by default) and the actors split
    the rest, so the base product never waits for a core the residual holds.
    """
    if actor_cpus is not None and len(actor_cpus) != n_actors:
        raise ValueError(f"cpus names {len(actor_cpus)} CPU sets for {n_actors} CPU actors")
    allowed = sorted(os.sched_getaffinity(0))
    check_engine_cpus(config.engine_cpus)
    if not config.pin or (len(allowed) < 2 and actor_cpus is None):
        return None, [tuple(c) for c in actor_cpus] if actor_cpus is not None else [None] * n_actors
    engine = config.engine_cpus or (allowed[0],)
    if actor_cpus is not None:
        return engine, [tuple(c) for c in actor_cpus]
    rest = [c for c in allowed if c not in engine] or allowed
    shares = [tuple(rest[i * len(rest) // n_actors : (i + 1) * len(rest) // n_actors]) for i in range(n_actors)]
    return engine, [share or tuple(rest) for share in shares]  # more actors than CPUs: they share


def check_engine_cpus(cpus: Sequence[int] | None) -> None:
    """Refuse engine CPUs that this process may not use (the engine runs on this host)."""
    allowed = os.sched_getaffinity(0)
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
