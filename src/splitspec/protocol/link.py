"""The client's ZeroMQ connection: requests out, replies matched to their request id, peer loss noticed.

ZeroMQ reconnects silently and hides disconnections; a monitor socket reports them, so that a request in
flight fails with ``PeerLost`` as soon as the server dies or the connection drops instead of waiting out
its timeout. A link stays lost after that: the pipe ZeroMQ re-makes under it carries no session (the
``Client`` reconnects with a new link and a new handshake). A refused security handshake (CURVE keys)
fails at once with ``AccessRefused`` instead of as a timeout.
"""

from __future__ import annotations

import time

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from splitspec.config import ChannelConfig
from splitspec.protocol.errors import AccessRefused, PeerLost, RemoteError, RequestTimeout
from splitspec.protocol.messages import Error, ErrorCode, Message, ProtocolError, decode, encode
from splitspec.protocol.sockets import make_socket

Reply = tuple[Message, zmq.Frame | None]
_WATCHED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL  # definitive, unlike NO_DETAIL


class Link:
    """A DEALER socket to one server. Not thread-safe: one GPU-actor loop drives it."""

    def __init__(self, endpoint: str, config: ChannelConfig) -> None:
        self.endpoint = endpoint
        self._config = config
        self._context = zmq.Context()
        self._socket = make_socket(self._context, zmq.DEALER, config)
        self._monitor = self._socket.get_monitor_socket(_WATCHED | _REFUSED)
        self._socket.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._replies: dict[int, Reply] = {}
        self._connected = False
        self._handshake_failed = False
        self._lost = False

    def send(self, message: Message, payload: np.ndarray | None = None) -> None:
        header = encode(message)
        if payload is None:
            self._socket.send(header)
        else:  # zero-copy: the slot buffer is not reused before its reply arrives, so ZeroMQ may read it late
            self._socket.send_multipart([header, payload], copy=False)

    def receive(self, request_id: int, deadline: float) -> Reply:
        """The reply to ``request_id``; replies to other requests are kept for their own caller."""
        while request_id not in self._replies:
            if self._lost:
                raise PeerLost(f"the connection to the CPU actor at {self.endpoint} dropped (or the actor exited)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(
                    f"no reply from {self.endpoint} for request {request_id}: "
                    + ("the CPU actor is stuck or overloaded" if self._connected else self._why_unconnected())
                )
            ready = dict(self._poller.poll(max(1, int(remaining * 1000))))
            if self._socket in ready:
                self._read_replies()
            if self._monitor in ready and self._read_monitor():
                self._lost = True
                self._read_replies()  # a reply sent just before the peer closed still counts
        return self._replies.pop(request_id)

    def _read_monitor(self) -> bool:
        """True when the peer disconnected after a handshake; raises when it refused the handshake."""
        event = recv_monitor_message(self._monitor)["event"]
        if event & _REFUSED:
            raise AccessRefused(
                f"the CPU actor at {self.endpoint} refused this client's security handshake: its CURVE keys "
                "are not the cluster's, or one side runs without CURVE (ChannelConfig.curve)"
            )
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
        self._handshake_failed |= event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        return event != zmq.EVENT_HANDSHAKE_SUCCEEDED and self._connected

    def _why_unconnected(self) -> str:
        if self._handshake_failed:  # what a CURVE server does with a client that has the wrong server key
            return "it dropped every handshake: are this client's CURVE keys the cluster's?"
        return "is the CPU actor running?"

    def _read_replies(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._connected = True
            message = decode(frames[0].buffer, self._config.max_header_bytes)
            if message.id is None:
                if isinstance(message, Error):  # the server could not read which request it answers
                    raise RemoteError(ErrorCode(message.code), message.text)
                raise ProtocolError(ErrorCode.MALFORMED, f"{message.OP} reply without a request id")
            self._replies[message.id] = (message, frames[1] if len(frames) > 1 else None)

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()
        self._context.term()
