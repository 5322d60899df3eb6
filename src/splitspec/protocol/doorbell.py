"""A wake-up call between two processes: a named pipe (FIFO) that a sleeper can poll.

A pipe, unlike a futex, is a file descriptor: the server sleeps on its ZeroMQ socket and every client's
doorbell in one ``zmq.poll``, and a reader learns of a dead writer for free (POLLHUP once every writer is
gone, which the kernel does when a process dies, even by SIGKILL). Bytes carry no meaning: a waiter
re-checks the shared-memory flag after each wake-up, so a stale byte costs a spurious wake-up, never a
lost one. Writers never block: a full pipe already holds a pending wake-up.
"""

from __future__ import annotations

import math
import os
import select

from splitspec.protocol.errors import PeerLost

_WAKE = b"\x01"
_DRAIN = 65536


class Doorbell:
    """One end of a FIFO. ``reader=True`` opens it for ``wait``; otherwise for ``ring``."""

    def __init__(self, path: str, reader: bool, keep_open_for_peer: bool = False) -> None:
        # A reader opened before any writer sees POLLHUP only after a writer came and went, which is
        # what lets a server open its end first. A writer needs a reader to exist, unless it opens
        # read-write (``keep_open_for_peer``) as the side that creates the pipe before the peer attaches.
        flags = os.O_RDONLY if reader else os.O_RDWR if keep_open_for_peer else os.O_WRONLY
        self.fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    @staticmethod
    def create(path: str) -> None:
        os.mkfifo(path, 0o600)

    def ring(self) -> None:
        try:
            os.write(self.fd, _WAKE)
        except BlockingIOError:
            pass  # the pipe is full of unread wake-ups: the reader will wake anyway
        except BrokenPipeError:
            raise PeerLost("the peer closed its doorbell: it exited or was killed") from None

    def drain(self) -> bool:
        """Swallow pending wake-ups; True when the other end is gone (EOF and nothing left to read)."""
        while True:
            try:
                data = os.read(self.fd, _DRAIN)
            except BlockingIOError:
                return False
            if not data:
                return True
            if len(data) < _DRAIN:
                return False

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung, hung up or ``timeout_s``; True when the writer is gone."""
        events = self._poll.poll(max(0, math.ceil(timeout_s * 1000)))
        if not events:
            return False
        hung_up = bool(events[0][1] & (select.POLLHUP | select.POLLERR))
        return self.drain() or hung_up

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
