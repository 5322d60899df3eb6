"""The GPU actor's side: one API over both transports, with several requests in flight.

Per layer the GPU actor posts up to four requests (qkv, o, gate_up, down) to every CPU actor, and may run
ahead a layer; each request holds a slot from ``request`` until ``release``::

    ticket = client.request(layer, "qkv", n)   # ticket.x: where to write x' (in shared memory if same host)
    ticket.x[...] = x_rotated                   # e.g. torch.from_numpy(ticket.x).copy_(x_gpu)
    client.submit(ticket)
    y_r = client.gather(ticket)                 # a view of the reply, valid until release
    client.release(ticket)

A lost peer or a timeout fails the requests in flight (``PeerLost`` / ``RequestTimeout``); the next
``request`` reconnects and redoes the handshake, so a restarted CPU actor is picked up without a new client.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from splitspec.config import ChannelConfig
from splitspec.protocol.errors import PeerLost, RemoteError, RequestTimeout
from splitspec.protocol.lane import ERRNO as LANE_ERRNO
from splitspec.protocol.lane import MAX_SMALL, NEXT_ID, SERIAL, LaneTemplates, SlotLane
from splitspec.protocol.lane import ROWS as LANE_ROWS
from splitspec.protocol.link import Link
from splitspec.protocol.messages import (
    FIRST_ID,
    Bye,
    Compute,
    Error,
    ErrorCode,
    GroupShard,
    Hello,
    Message,
    Ping,
    Pong,
    ProtocolError,
    ShardInfo,
    Shutdown,
    Welcome,
    request_tokens,
    shards_from_wire,
    shards_to_wire,
)
from splitspec.protocol.shm import SlotLayout, host_id
from splitspec.protocol.transports import FrameTransport, SlotTransport, Transport

T = TypeVar("T")


@dataclass(slots=True)
class Ticket:
    """One request from ``request`` to ``release``; write x' into ``x`` before ``submit``.

    Between ``submit`` and the reply the slot belongs to the server (``state == "submitted"``): the
    client must not touch ``x`` nor give the slot back then.
    """

    request: Compute
    slot: int
    x: np.ndarray
    rows: int
    generation: int
    serial: int = 0
    state: str = "ready"  # -> "submitted" -> "answered"


class Client:
    """Connect to one CPU actor and handshake; ``shards`` (from the plan) is checked by the server."""

    def __init__(
        self,
        model_hash: str,
        config: ChannelConfig | None = None,
        endpoint: str | None = None,
        shards: dict[str, GroupShard] | None = None,
    ) -> None:
        self._config = config or ChannelConfig()
        self.endpoint = endpoint or self._config.endpoint
        self._hello_fields = (model_hash, shards)
        self._next_id = FIRST_ID - 1
        self._generation = 0
        self.info: ShardInfo | None = None  # what the server serves, from its handshake
        self._free: list[int] = []
        self._templates: LaneTemplates | None = None  # this connection's lane headers, made at the first lease
        self._link: Link | None = None
        self._transport: Transport | None = None
        self._connect()

    @property
    def transport(self) -> str:
        return "shm" if isinstance(self._transport, SlotTransport) else "tcp"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, layer: int, group: str, n: int) -> Ticket:
        """Reserve a slot for ``n`` tokens of ``group``; reconnects first if the peer was lost."""
        if self._link is None:
            self._connect()
        shard = self.info.shards.get(group)
        if shard is None:
            raise ValueError(f"this CPU actor serves groups {sorted(self.info.shards)}, not {group!r}")
        limit = request_tokens(group, self._config.max_tokens)
        if not 1 <= n <= limit:
            raise ValueError(f"n must be in [1, {limit}] for a {group} request (ChannelConfig.max_tokens), got {n}")
        if not self._free:
            raise RuntimeError(
                f"all {self._config.slots} slots are in flight: gather and release a ticket first, "
                "or raise ChannelConfig.slots"
            )
        slot = self._free.pop()
        in_slot = slot if isinstance(self._transport, SlotTransport) else None
        request = Compute(self._new_id(), layer, group, n, self.info.dtype, [n, shard.d_in], in_slot)
        return Ticket(request, slot, self._transport.x(slot, n, shard.d_in), shard.rows, self._generation)

    def submit(self, ticket: Ticket) -> None:
        self._check_current(ticket)
        if ticket.state != "ready":
            raise ValueError(f"request {ticket.request.id} was already submitted")
        ticket.state = "submitted"
        ticket.serial = self._guard(lambda: self._transport.post(ticket.slot, ticket.request))

    def gather(self, ticket: Ticket, timeout_s: float | None = None) -> np.ndarray:
        """Wait for the reply; the returned [n, rows] array is a view valid until ``release(ticket)``."""
        self._check_current(ticket)
        if ticket.state == "ready":
            raise ValueError(f"request {ticket.request.id} was never submitted")
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._config.request_timeout_s)
        try:
            return self._guard(
                lambda: self._transport.wait(ticket.slot, ticket.request, ticket.serial, ticket.rows, deadline)
            )
        except (RemoteError, ProtocolError):
            ticket.state = "answered"  # an error reply also hands the slot back
            raise
        finally:
            if ticket.state == "submitted" and self._link is not None:
                ticket.state = "answered"

    def release(self, ticket: Ticket) -> None:
        """Give the slot back; a ticket of a lost connection has nothing to give back."""
        if ticket.generation != self._generation or self._link is None:
            return
        if ticket.state == "submitted":
            raise ValueError(f"request {ticket.request.id} is still with the server: gather it before release")
        self._free.append(ticket.slot)
        ticket.generation = -1

    def lease(self, num_layers: int, groups: Sequence[str], columns: Sequence[int]) -> SlotLane | None:
        """One slot for compiled code to drive through a pass of ``num_layers`` layers of ``groups`` (whose
        outputs this actor's rows fill from ``columns``), until ``end_lease``: None over frames (another
        host), or where a free slot's index does not fit a lane."""
        if self._link is None:
            self._connect()
        if not isinstance(self._transport, SlotTransport) or not self._free or self._free[-1] > MAX_SMALL:
            return None
        shards = [self.info.shards[g] for g in groups]
        shapes = [(s.d_in, s.rows, c) for s, c in zip(shards, columns, strict=True)]
        if self._templates is None or self._templates.key != (
            num_layers,
            tuple(groups),
            tuple(shapes),
            self.info.dtype,
        ):
            self._templates = LaneTemplates(num_layers, groups, shapes, self.info.dtype)
        lane = SlotLane(
            self._transport.arena, self._free.pop(), self._transport.request_fd, self._templates,
            self._next_id + 1, self._transport.spin_us, self._generation,
        )  # fmt: skip
        return lane

    def end_lease(self, lane: SlotLane) -> None:
        """Take the slot back from compiled code once its last request is answered (nothing to take on a lost
        connection); later requests carry ids after the lane's."""
        if lane.generation != self._generation or self._link is None:
            return
        if lane.pending():
            try:
                self.wait_lane(lane)
            except (RemoteError, ProtocolError):
                pass  # answered all the same: the slot is back with the client
            except (PeerLost, RequestTimeout):
                return  # the connection is dropped, and the slot with it
        self._next_id = max(self._next_id, int(lane.fields[NEXT_ID]) - 1)
        self._free.append(lane.slot)
        lane.generation = -1

    def wait_lane(self, lane: SlotLane) -> None:
        """The slow path of a lane's request in flight: sleep on the doorbell until its reply (or the
        deadline), then read the reply's header as ``gather`` does, raising what it raises; a doorbell that
        failed in ``post`` is a lost peer."""
        if lane.generation != self._generation or self._link is None:
            raise PeerLost("the lane belongs to a connection that was lost or closed")
        code = int(lane.fields[LANE_ERRNO])
        if code:
            self._disconnect()
            raise PeerLost(f"ringing the CPU actor's doorbell failed: {os.strerror(code)}")
        serial = int(lane.fields[SERIAL])
        if not serial:
            return  # nothing was posted through it
        request = lane.in_flight()
        deadline = time.monotonic() + self._config.request_timeout_s
        rows = int(lane.templates.shapes[lane.templates.groups.index(request.group), LANE_ROWS])
        self._guard(lambda: self._transport.wait(lane.slot, request, serial, rows, deadline))

    def call(self, layer: int, group: str, x: np.ndarray) -> np.ndarray:
        """One blocking request with copies in and out: for tests and simple callers, not the hot path."""
        ticket = self.request(layer, group, x.shape[0])
        try:
            np.copyto(ticket.x, x, casting="same_kind")
            self.submit(ticket)
            return self.gather(ticket).copy()
        finally:
            self.release(ticket)

    def ping(self) -> dict[str, float]:
        """The server's counters; raises if it does not answer within ``request_timeout_s``."""
        reply = self._control(Ping(self._new_id()), Pong, self._config.request_timeout_s)
        return reply.stats

    def shutdown_server(self) -> None:
        self._control(Shutdown(self._new_id()), Bye, self._config.request_timeout_s)
        self._disconnect()

    def close(self) -> None:
        self._disconnect()

    def _connect(self) -> None:
        model_hash, shards = self._hello_fields
        config = self._config
        self._link = Link(self.endpoint, config)
        try:
            hello = Hello(
                self._new_id(),
                model_hash,
                "float32",
                config.max_tokens,
                config.slots,
                None if config.transport == "tcp" else host_id(),
                None if shards is None else shards_to_wire(shards),
            )
            welcome = self._control(hello, Welcome, config.connect_timeout_s)
            self.info = ShardInfo(
                welcome.model_hash, welcome.num_layers, shards_from_wire(welcome.shards), welcome.dtype,
                welcome.base_share,
            )  # fmt: skip
            layout = SlotLayout.for_shards(config.slots, config.max_tokens, self.info.shards)
            if welcome.shm_dir is not None:
                self._transport = SlotTransport(welcome.shm_dir, layout, config.spin_us)
            elif config.transport == "shm":
                raise RuntimeError(
                    f"transport='shm' but the CPU actor at {self.endpoint} is on another host: "
                    "use transport 'auto' or 'tcp'"
                )
            else:
                self._transport = FrameTransport(self._link, layout)
        except BaseException:
            self._disconnect()
            raise
        self._generation += 1
        self._free = list(range(config.slots))[::-1]
        self._templates = None

    def _disconnect(self) -> None:
        """Forget the connection; tickets in flight become stale and the next ``request`` reconnects."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._link is not None:
            self._link.close()
            self._link = None
        self._generation += 1

    def _control(self, message: Message, expected: type, timeout_s: float) -> Message:
        if self._link is None:
            self._connect()
        self._link.send(message)
        reply, _ = self._guard(lambda: self._link.receive(message.id, time.monotonic() + timeout_s))
        if not isinstance(reply, expected):
            if isinstance(reply, Error):
                raise RemoteError(ErrorCode(reply.code), reply.text)
            raise ProtocolError(ErrorCode.INVALID, f"{message.OP} was answered by {reply.OP}")
        return reply

    def _guard(self, action: Callable[[], T]) -> T:
        """Run a wait; on peer loss or timeout, drop the connection so that the next use reconnects."""
        try:
            return action()
        except (PeerLost, RequestTimeout):
            self._disconnect()
            raise

    def _check_current(self, ticket: Ticket) -> None:
        if ticket.generation != self._generation or self._link is None:
            raise PeerLost(f"request {ticket.request.id} belongs to a connection that was lost or closed")

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id
