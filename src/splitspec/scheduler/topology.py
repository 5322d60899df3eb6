"""What the scheduler places actors on: this host's CPUs, NUMA nodes and GPUs, and the hosts of a Ray cluster.

The local view comes from the kernel (the CPUs this process may use, /sys's NUMA nodes through
``splitspec.numa``) and torch (GPUs); the cluster view from the resources each Ray node advertises, which
is all the scheduler can know of a host it does not run on. Parsing is kept apart from reading, so that
both can be checked against fixed inputs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from splitspec.numa import SYSFS_NODES, NumaNode, cpulist, topology


@dataclass(frozen=True)
class Host:
    """One machine: its address, the CPUs (ids where local, else a count), NUMA nodes, GPUs and memory."""

    address: str
    cpus: int
    gpus: int
    memory_bytes: int | None
    numa: tuple[NumaNode, ...] = ()
    cpu_ids: tuple[int, ...] = ()

    def describe(self) -> str:
        nodes = ", ".join(f"node {n.id}: CPUs {cpulist(n.cpus)}" for n in self.numa)
        memory = f", {self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else ""
        return f"{self.address}: {self.cpus} CPUs, {self.gpus} GPUs{memory}" + (f" ({nodes})" if nodes else "")


def local_gpus() -> int:
    """CUDA devices torch sees (0 without a CUDA build or a device)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_host(address: str = "127.0.0.1", sysfs: str | os.PathLike = SYSFS_NODES, gpus: int | None = None) -> Host:
    """This machine as this process sees it: only the CPUs it may run on (a container's cpuset, a
    ``taskset``), each NUMA node cut down to those, and the nodes' memory where the kernel reports it."""
    allowed = set(os.sched_getaffinity(0))
    nodes = [
        NumaNode(n.id, tuple(c for c in n.cpus if c in allowed), n.mem_bytes)
        for n in topology(sysfs)
        if allowed.intersection(n.cpus)
    ]
    memories = [n.mem_bytes for n in nodes]
    memory = sum(memories) if memories and None not in memories else None
    gpus = local_gpus() if gpus is None else gpus
    return Host(address, len(allowed), gpus, memory, tuple(nodes), tuple(sorted(allowed)))


def hosts_from_ray(nodes: Iterable[Mapping[str, Any]]) -> list[Host]:
    """The alive nodes of ``ray.nodes()`` as hosts, from the resources each advertises (CPU and GPU
    counts are the logical ones Ray schedules by)."""
    hosts = []
    for node in nodes:
        if not node.get("Alive", False):
            continue
        resources = node.get("Resources", {})
        memory = resources.get("memory")
        hosts.append(
            Host(
                node["NodeManagerAddress"],
                int(resources.get("CPU", 0)),
                int(resources.get("GPU", 0)),
                int(memory) if memory is not None else None,
            )
        )
    return sorted(hosts, key=lambda h: h.address)
