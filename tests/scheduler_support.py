"""Helpers for the tests that start Ray processes (no tests here)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

ALL_CPUS = os.sched_getaffinity(0)  # at import, before any fixture pins this process


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
