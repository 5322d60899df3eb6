"""Stopping in bounded time: a command that placed actors tears them down once, and never hangs doing it.

The first Ctrl-C or SIGTERM raises ``KeyboardInterrupt`` (a service manager's stop is a Ctrl-C) and
starts the teardown: Serve, the actors, the cluster. That teardown talks to Ray, and where Ray's own
processes got the signal too (systemd's control group, ``timeout``, a terminal's process group) its
calls wait for a GCS that is gone, for a minute before Ray aborts the process. So once the teardown has
begun, further signals no longer interrupt it halfway: they reach a watcher thread through the wakeup
pipe that Python's C-level handler writes to from whichever thread the kernel chose (so also while the
main thread sits in Ray's C++). A second signal, or a teardown still running after ``limit_s``, ends the
process at once: every process below this one (an embedded cluster's GCS, raylet, agents and workers,
the CPU actors under them) is killed first, so nothing outlives it; a joined cluster's raylet ends this
job's actors when its driver goes, but not Serve's controller and proxy, which outlive drivers by design:
after stopping at once on a cluster a user started (``ray start``), ``serve shutdown`` ends them.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from types import FrameType, TracebackType

SIGNALS = {signal.SIGINT, signal.SIGTERM}
_POLL_S = 0.1  # how often the watcher looks whether the teardown finished


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc, children before grandchildren (zombies too: a killed
    process's leader is one while its other threads end, and its children hang below it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue  # it ended meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(0), [])
        found += below
        queue += below
    return found


class Stopping:
    """Within the block, the first Ctrl-C or SIGTERM raises ``KeyboardInterrupt`` and arms the bound;
    ``arm`` arms it where a teardown begins without one. Leaving the block disarms it and restores the
    signals: the caller (a test, a notebook) goes on as before."""

    def __init__(self, command: str, limit_s: float) -> None:
        self._command, self._limit_s = command, limit_s
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._handlers: dict[int, object] = {}
        self._pipe = (-1, -1, -1)  # the wakeup pipe's ends, and the wakeup fd before it

    def __enter__(self) -> Stopping:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._handlers = {s: signal.signal(s, self._first) for s in SIGNALS}
        return self

    def _first(self, signum: int, frame: FrameType | None) -> None:
        print(f"splitspec {self._command}: stopping (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        self.arm()
        raise KeyboardInterrupt

    def arm(self) -> None:
        if self._watcher is not None or not self._handlers:
            return
        read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pipe = (read, write, signal.set_wakeup_fd(write))
        for s in SIGNALS:  # later signals only wake the watcher: a handler must stay for the pipe to be written
            signal.signal(s, lambda signum, frame: None)
        self._watcher = threading.Thread(target=self._watch, args=(read,), name="splitspec-stopping", daemon=True)
        self._watcher.start()

    def _watch(self, read: int) -> None:
        deadline = time.monotonic() + self._limit_s
        while not self._done.is_set():
            if select.select([read], [], [], _POLL_S)[0]:
                self._at_once("interrupted while stopping")
            if time.monotonic() > deadline:
                self._at_once(f"still stopping after {self._limit_s:g} s")

    def _at_once(self, why: str) -> None:
        os.write(2, f"splitspec {self._command}: {why}; stopping at once\n".encode())
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        os._exit(130)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._watcher is not None:
            self._done.set()
            self._watcher.join()
            read, write, before = self._pipe
            signal.set_wakeup_fd(before)
            os.close(read)
            os.close(write)
        for s, handler in self._handlers.items():
            signal.signal(s, handler)
