"""The local path: the engine in this process and its CPU actors as plain processes on this host.

The scheduler owns the actors' lifecycle (``scheduler.cluster`` does the same on Ray), so that the engine
only talks to residual sources through ``protocol`` and ``gpu_actor`` imports nothing of ``cpu_actor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

from splitspec.config import EngineConfig
from splitspec.cpu_actor.service import CpuActorProcess, start_cpu_actor
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.protocol.curve import CurveKeys
from splitspec.scheduler import probe
from splitspec.scheduler.cpus import plan_cpus, spin_budget


def start_local(
    folder: str | Path,
    bits: int,
    n_cpu_actors: int = 1,
    cpus: Sequence[Sequence[int]] | None = None,
    config: EngineConfig | None = None,
    row_weights: Sequence[float] | None = None,
) -> SplitEngine:
    """Start ``n_cpu_actors`` CPU actor processes serving the ``bits``-bit residual, connect, and pin
    this process (see ``plan_cpus``; ``cpus`` gives each actor's CPUs; ``row_weights`` each actor's share of
    the rows, by default the plan's: the read bandwidth of its CPUs, ``probe.row_weights``). ``close``
    undoes all of it."""
    config = config or EngineConfig()
    keys = config.channel.curve or CurveKeys.generate()  # sealed as on Ray: other local users cannot connect
    config = replace(config, channel=replace(config.channel, curve=keys))
    engine_cpus, actor_cpus = plan_cpus(n_cpu_actors, cpus, config)
    spin_us = spin_budget(engine_cpus, actor_cpus, config.channel)
    if row_weights is None and n_cpu_actors > 1:
        row_weights = probe.row_weights(actor_cpus)
    actors: list[CpuActorProcess] = []
    try:
        options = {"spin_us": spin_us, "activations": config.activations, "curve": keys, "weights": row_weights}
        options["resident_bytes"] = config.resident_bytes  # the engine's rows: the actors skip them
        options["head_share"] = config.actor_head_share(n_cpu_actors)
        options["base_share"] = config.actor_base_share()
        launch = partial(start_cpu_actor, folder, bits, **options)
        for i, actor_set in enumerate(actor_cpus):
            actors.append(launch(i, n_cpu_actors, actor_set))
        endpoints = [a.endpoint for a in actors]
        engine = SplitEngine.connect(folder, bits, endpoints, config, engine_cpus, spin_us, [a.stop for a in actors])
    except BaseException:
        for actor in actors:
            actor.stop()
        raise
    engine.actors = actors
    return engine
