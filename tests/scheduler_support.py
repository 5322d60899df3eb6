"""Helpers for the tests that start Ray processes (no tests here)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator

ALL_CPUS = os.sched_getaffinity(0)  # at import, before any fixture pins this process


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


def wait_listening(host: str, port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until a ``ray start --head`` (``proc``) accepts connections on ``host:port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "ray start --head exited"
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"ray start --head did not listen on {host}:{port} within {timeout_s:.0f} s")
