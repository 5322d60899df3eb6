"""Where a request's payloads live and how the client waits for its reply: two interchangeable ways.

``SlotTransport`` (same host): x' and y_r live in shared-memory slots; the header goes in the slot too and
the hand-off is a flag plus a doorbell, so ZeroMQ is off the per-layer path. ``FrameTransport`` (other
host): x' is sent from a private buffer as a zero-copy ZeroMQ frame and y_r is read in place from the
received frame.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

import numpy as np

from splitspec.protocol.errors import PeerLost, RemoteError, RequestTimeout
from splitspec.protocol.link import Link
from splitspec.protocol.messages import (
    Compute,
    Error,
    ErrorCode,
    Message,
    ProtocolError,
    Result,
)
from splitspec.protocol.records import pack_compute, unpack_reply
from splitspec.protocol.shm import ORDERED_STORES, REQUEST, RESULT, ShmEndpoint, SlotArena, SlotLayout


def check_result(message: Message, request: Compute, rows: int) -> None:
    """Turn an error reply into RemoteError and check that a result answers ``request``."""
    if isinstance(message, Error):
        if message.code == ErrorCode.NO_SESSION:  # ZeroMQ re-made a dropped connection the server never met
            raise PeerLost(f"the CPU actor lost this client's session ({message.text}): the connection dropped")
        raise RemoteError(ErrorCode(message.code), message.text)
    if not isinstance(message, Result) or message.id != request.id or message.shape != [request.n, rows]:
        raise ProtocolError(
            ErrorCode.INVALID,
            f"expected the result of request {request.id} shaped [{request.n}, {rows}], got {message}",
        )


class Transport(Protocol):
    def x(self, slot: int, n: int, d_in: int) -> np.ndarray: ...

    def post(self, slot: int, request: Compute) -> int: ...

    def wait(self, slot: int, request: Compute, ticket: int, rows: int, deadline: float) -> np.ndarray: ...

    def close(self) -> None: ...


class SlotTransport:
    def __init__(self, directory: str, layout: SlotLayout, spin_us: float) -> None:
        self._shm = ShmEndpoint.attach(directory, layout)
        self._arena = self._shm.arena
        self._spin_s = spin_us * 1e-6 if ORDERED_STORES else 0.0

    @property
    def arena(self) -> SlotArena:
        return self._arena

    @property
    def request_fd(self) -> int:
        """The request doorbell's file descriptor: what a lane's compiled ``post`` writes to."""
        return self._shm.request_bell.fd

    @property
    def spin_us(self) -> float:
        return self._spin_s * 1e6

    def x(self, slot: int, n: int, d_in: int) -> np.ndarray:
        return self._arena.x(slot, n, d_in)

    def post(self, slot: int, request: Compute) -> int:
        arena = self._arena
        offset = arena.header_offset(slot, REQUEST)
        arena.set_header_length(slot, REQUEST, pack_compute(arena.buffer, offset, request))
        serial = int(arena.posted[0]) + 1
        arena.ring[(serial - 1) % arena.layout.slots] = slot
        arena.posted[0] = serial  # the publishing store: the slot is the server's from here
        self._shm.request_bell.ring()
        return serial

    def wait(self, slot: int, request: Compute, ticket: int, rows: int, deadline: float) -> np.ndarray:
        done = self._arena.done
        if done[slot] != ticket and self._spin_s:
            spin_until = time.perf_counter() + self._spin_s
            while done[slot] != ticket and time.perf_counter() < spin_until:
                os.sched_yield()  # a thread sharing this core (the peer, unpinned) runs at once
        while done[slot] != ticket:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(
                    f"request {request.id} got no answer in time: the CPU actor is stuck or overloaded"
                )
            if self._shm.done_bell.wait(remaining) and done[slot] != ticket:
                raise PeerLost("the CPU actor hung up its doorbell mid-request: it exited or was killed")
        arena = self._arena
        reply = unpack_reply(arena.buffer, arena.header_offset(slot, RESULT), arena.header_length(slot, RESULT), slot)
        check_result(reply, request, rows)
        return arena.y(slot, request.n, rows)

    def close(self) -> None:
        self._shm.close()


class FrameTransport:
    def __init__(self, link: Link, layout: SlotLayout) -> None:
        self._link = link
        self._buffers = np.empty((layout.slots, layout.max_tokens * layout.max_d_in), np.float32)

    def x(self, slot: int, n: int, d_in: int) -> np.ndarray:
        return self._buffers[slot, : n * d_in].reshape(n, d_in)

    def post(self, slot: int, request: Compute) -> int:
        self._link.send(request, self.x(slot, request.n, request.shape[1]))
        return request.id

    def wait(self, slot: int, request: Compute, ticket: int, rows: int, deadline: float) -> np.ndarray:
        message, frame = self._link.receive(request.id, deadline)
        check_result(message, request, rows)
        if frame is None or len(frame) != request.n * rows * 4:
            raise ProtocolError(
                ErrorCode.INVALID, f"result of request {request.id} lacks its [{request.n}, {rows}] payload"
            )
        return np.frombuffer(frame.buffer, np.float32).reshape(request.n, rows)

    def close(self) -> None:
        self._buffers = np.empty((0, 0), np.float32)
