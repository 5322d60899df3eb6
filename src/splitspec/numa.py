"""NUMA topology, CPU pinning and page placement for a CPU actor.

A verify pass streams the whole residual from RAM, so a shard must sit in the memory of the node
whose cores read it: remote reads cross the socket link at a fraction of local bandwidth. Linux
places a page on the node of the CPU that first writes it, so an actor pins itself to its node's
CPUs, then first-touches its shard's buffers before filling them, and can check where the pages
landed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SYSFS_NODES = "/sys/devices/system/node"
NUMA_MAPS = "/proc/self/numa_maps"
MAPS = "/proc/self/maps"


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    mem_bytes: int | None  # MemTotal of the node; None where the kernel does not say


def cpulist(cpus: Iterable[int]) -> str:
    """Sorted CPU ids in the kernel's cpulist form ("0-3,8"), the inverse of ``parse_cpulist``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpulist(text: str) -> list[int]:
    """Parse the kernel's cpulist format ("0-3,8-11", "5", "") into sorted CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad cpulist entry {part!r} in {text!r}") from None
        if last < first or first < 0:
            raise ValueError(f"bad cpulist range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def _node_mem_bytes(node_dir: Path) -> int | None:
    meminfo = node_dir / "meminfo"
    if not meminfo.exists():
        return None
    match = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo.read_text())
    return int(match.group(1)) * 1024 if match else None


def topology(root: str | os.PathLike = SYSFS_NODES) -> list[NumaNode]:
    """The machine's NUMA nodes with their CPUs and memory, from sysfs (``root`` for tests).

    A kernel without NUMA support has no node directory: that is one node holding every CPU this
    process may run on.
    """
    root = Path(root)
    dirs = sorted((d for d in root.glob("node*") if re.fullmatch(r"node\d+", d.name)), key=lambda d: int(d.name[4:]))
    if not dirs:
        return [NumaNode(0, tuple(sorted(os.sched_getaffinity(0))), None)]
    return [
        NumaNode(int(d.name[4:]), tuple(parse_cpulist((d / "cpulist").read_text())), _node_mem_bytes(d)) for d in dirs
    ]


def pin_to_cpus(cpus: list[int] | tuple[int, ...]) -> None:
    """Restrict this process (and the threads it starts afterwards) to ``cpus``.

    Call it before the kernel's thread pool starts: threads inherit the affinity at creation.
    """
    wanted = set(cpus)
    if not wanted:
        raise ValueError("pin_to_cpus needs at least one CPU")
    online = set(range(os.cpu_count() or 1))
    missing = wanted - online
    if missing:
        raise ValueError(f"CPUs {sorted(missing)} do not exist here (CPUs 0-{max(online)})")
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as e:
        raise ValueError(f"cannot pin to CPUs {sorted(wanted)}: {e} (outside this container's cpuset?)") from e


def _address_range(obj: np.ndarray | tuple[int, int]) -> tuple[int, int]:
    if isinstance(obj, np.ndarray):
        start = obj.__array_interface__["data"][0]
        return start, start + obj.nbytes
    start, stop = obj
    return int(start), int(stop)


def _vma_ends(maps: Path) -> dict[int, int]:
    ends = {}
    for line in maps.read_text().splitlines():
        lo, hi = line.split(maxsplit=1)[0].split("-")
        ends[int(lo, 16)] = int(hi, 16)
    return ends


def page_nodes(
    obj: np.ndarray | tuple[int, int], numa_maps: str | os.PathLike = NUMA_MAPS, maps: str | os.PathLike = MAPS
) -> dict[int, int]:
    """Bytes resident on each NUMA node for the mappings that hold ``obj``.

    ``obj`` is an array or an address range ``(start, stop)``. numa_maps counts pages per mapping,
    so the answer covers whole mappings that overlap the range; a large numpy array is a mapping of
    its own, so for the shard buffers this is the array. Pages never touched are not counted.
    """
    numa_maps, maps = Path(numa_maps), Path(maps)
    if not numa_maps.exists():
        raise RuntimeError(
            f"{numa_maps} does not exist: this kernel was built without NUMA support "
            "(CONFIG_NUMA), so page placement cannot be checked here"
        )
    start, stop = _address_range(obj)
    ends = _vma_ends(maps)
    resident: dict[int, int] = {}
    for line in numa_maps.read_text().splitlines():
        fields = line.split()
        lo = int(fields[0], 16)
        if lo >= stop or ends.get(lo, lo) <= start:
            continue
        page_kb = 4
        counts = {}
        for f in fields[2:]:
            key, _, value = f.partition("=")
            if key == "kernelpagesize_kB":
                page_kb = int(value)
            elif re.fullmatch(r"N\d+", key):
                counts[int(key[1:])] = int(value)
        for node, pages in counts.items():
            resident[node] = resident.get(node, 0) + pages * page_kb * 1024
    return resident


def first_touch(array: np.ndarray) -> None:
    """Write one byte per page of a fresh ``array`` from this (pinned) process.

    The kernel then backs every page with memory of the node this process runs on. It overwrites
    data, so call it on a new ``np.empty`` buffer before filling it.
    """
    if not array.flags.c_contiguous:
        raise ValueError("first_touch needs a C-contiguous array (one address range)")
    flat = array.reshape(-1).view(np.uint8)
    if flat.size:
        flat[:: os.sysconf("SC_PAGE_SIZE")] = 0
        flat[-1] = 0  # the last page, when the buffer does not start on a page boundary
