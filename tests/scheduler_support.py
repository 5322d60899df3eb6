"""Helpers for the scheduler's tests, those that start Ray processes above all (no tests here)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

ALL_CPUS = os.sched_getaffinity(0)  # at import, before any fixture pins this process


def fake_sysfs(root: Path, nodes: dict[int, tuple[str, int]]) -> Path:
    """A /sys/devices/system/node tree: ``nodes`` maps node id to (cpulist, MemTotal in kB)."""
    for node, (cpus, kb) in nodes.items():
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree: 1 kB\n")
    (root / "possible").write_text("0-1\n")  # not a node directory: ignored
    return root


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Children started meanwhile take Ctrl-C: a process that ignores SIGINT (a shell's background job)
    passes the ignoring on through exec, and Python then never raises KeyboardInterrupt in the child. A
    handled signal is reset to the default at exec, so this process handles it for a while."""
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """This thread on every CPU for a while: the direct ``engine`` fixture pins this process to its own CPU,
    but Ray's processes inherit the affinity of the thread that starts them, and the CPU plan reads it."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def alive(pids: Iterable[int]) -> set[int]:
    """The pids still running, or still ending their threads (the leader of a killed process shows as a
    zombie while the others tear down, its sockets still open); a zombie alone, dead but not reaped, is not."""
    running = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1:
                running.add(pid)
    return running


def wait_gone(pids: Iterable[int], timeout_s: float = 30.0) -> set[int]:
    """The pids still ``alive`` after waiting up to ``timeout_s`` for them to end."""
    pids, deadline = set(pids), time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)
