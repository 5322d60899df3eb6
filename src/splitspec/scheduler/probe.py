"""This host as a ``Machine``: its NUMA nodes' read bandwidth and flop rate, measured once and cached.

The engine takes the first allowed CPU and each NUMA node's other CPUs get one CPU actor, as
``scheduler.cpus.plan_cpus`` places one actor per node. Bandwidth is what the cores that will stream the
residual reach together: a read of a buffer larger than the caches, one thread per CPU, each pinned to its CPU.
The figures go to a small JSON file under the cache, keyed by the CPU sets, because a read of a few
hundred megabytes is not something to repeat at every ``splitspec plan``. Per-round-trip and per-layer
engine costs are not measured here; they default to what ``benchmarks/verify_pass.py`` found on this
kind of machine (``benchmarks/README.md``) and are printed as assumptions.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from splitspec.config import ModelConfig
from splitspec.scheduler.machine import Engine, Host, Machine, Node
from splitspec.scheduler.topology import local_host

CACHE = ModelConfig().cache_dir.parent / "machine.json"
ROUND_TRIP_S = 60e-6  # a shared-memory request and its answer between pinned processes (verify_pass.py)
LAYER_OVERHEAD_S = 1.5e-3  # the CPU engine's norms, rotations, attention and Python per layer (verify_pass.py)
_READ_BYTES = 256 * 2**20
_REPS = 3


def _pinned(cpu: int, work) -> threading.Thread:
    def run() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only: affinity is per thread on Linux
        work()

    return threading.Thread(target=run)


def read_bandwidth(cpus: Sequence[int], nbytes: int = _READ_BYTES, reps: int = _REPS) -> float:
    """Bytes/s of a parallel read: one thread per CPU summing its own slice (numpy releases the GIL)."""
    buf = np.ones(nbytes // 8, dtype=np.float64)
    chunks = np.array_split(buf, len(cpus))
    best = 0.0
    for _ in range(reps):
        threads = [_pinned(cpu, chunk.sum) for cpu, chunk in zip(cpus, chunks, strict=True)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = max(best, buf.nbytes / (time.perf_counter() - t0))
    return best


def flop_rate(cpus: Sequence[int], size: int = 384, reps: int = 5) -> float:
    """Flop/s of fp32 matrix products, one thread per CPU: the compute roof the kernel works under."""
    import torch

    a = torch.randn(size, size)
    best = 0.0
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(reps):
            workers = [_pinned(cpu, lambda: [a @ a for _ in range(4)]) for cpu in cpus]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = max(best, len(cpus) * 4 * 2 * size**3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads_before)
    return best


def cpu_figures(cpus: Sequence[int], cache: Path = CACHE) -> dict[str, float]:
    """The read bandwidth and flop rate of these CPUs together, measured at the first call and cached."""
    key = ",".join(map(str, sorted(cpus)))
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key not in known:
        known[key] = {"bandwidth": read_bandwidth(sorted(cpus)), "flops": flop_rate(sorted(cpus))}
        cache.parent.mkdir(parents=True, exist_ok=True)
        part = cache.with_suffix(f".{os.getpid()}.part")  # whole or not at all: others read it meanwhile
        part.write_text(json.dumps(known, indent=1))
        part.replace(cache)
    return known[key]


def row_weights(actor_cpus: Sequence[Sequence[int] | None], cache: Path = CACHE) -> tuple[float, ...]:
    """Each CPU actor's share of the residual rows when none is given: the read bandwidth of the CPUs it
    runs on (None: every CPU this process may use), the rule ``plan.make_plan`` splits NUMA nodes by, so
    that the actors finish a group together. Actors on the same CPUs measure alike and share evenly."""
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    return tuple(cpu_figures(tuple(cpus) if cpus else allowed, cache)["bandwidth"] for cpus in actor_cpus)


def local_machine(cache: Path = CACHE) -> Machine:
    """This host: the engine on its first allowed CPU, a CPU actor per NUMA node on the others."""
    host = local_host(gpus=0)
    engine_cpu = (host.cpu_ids[0],)
    nodes = []
    for node in host.numa or ():
        cpus = tuple(c for c in node.cpus if c not in engine_cpu) or node.cpus
        m = cpu_figures(cpus, cache)
        nodes.append(Node(len(cpus), m["bandwidth"], m["flops"]))
    if not nodes:  # no NUMA information: one node of every allowed CPU but the engine's
        cpus = tuple(c for c in host.cpu_ids if c not in engine_cpu) or host.cpu_ids
        m = cpu_figures(cpus, cache)
        nodes.append(Node(len(cpus), m["bandwidth"], m["flops"]))
    e = cpu_figures(engine_cpu, cache)
    engine = Engine(e["bandwidth"], e["flops"], ROUND_TRIP_S, LAYER_OVERHEAD_S)
    return Machine(f"this host ({host.cpus} CPUs)", engine, (Host("this host", tuple(nodes)),))
