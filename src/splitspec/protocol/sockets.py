"""ZeroMQ sockets configured alike on both sides: no lingering on close, heartbeats to drop silent peers,
and CURVE when the config carries keys (a ROUTER is the server's socket, anything else a client's)."""

from __future__ import annotations

import zmq

from splitspec.config import ChannelConfig
from splitspec.protocol.curve import secure_client, secure_server


def make_socket(context: zmq.Context, kind: int, config: ChannelConfig) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # a dead peer must not keep our close() waiting
    # A peer host that vanishes without a FIN/RST (power loss, cable) is only noticed by heartbeats.
    sock.setsockopt(zmq.HEARTBEAT_IVL, config.heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * config.heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * config.heartbeat_ms)
    if config.curve is not None:
        (secure_server if kind == zmq.ROUTER else secure_client)(sock, config.curve)
    return sock
