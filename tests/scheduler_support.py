"""Helpers for the tests that start Ray processes (no tests here)."""

from __future__ import annotations

import contextlib
import os
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
