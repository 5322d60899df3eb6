"""The only thing that crosses between the GPU actor and the CPU actors: msgpack headers (binary records
on the shared-memory fast path), with payloads in shared-memory slots (same host) or zero-copy ZeroMQ
frames (other host), and the same slots driven from compiled code (``lane``). Imports nothing of the
other components (only ``kernels.ir``'s pointer helpers, which no actor owns), so that either actor can
be built and tested alone.
"""

from splitspec.protocol.channel import Client, Ticket
from splitspec.protocol.curve import CurveKeys
from splitspec.protocol.errors import AccessRefused, PeerLost, RemoteError, RequestTimeout
from splitspec.protocol.messages import (
    HEAD,
    HEAD_TOKENS,
    PROTOCOL_VERSION,
    ErrorCode,
    GroupShard,
    ProtocolError,
    ShardInfo,
)
from splitspec.protocol.server import ComputeFn, Server, serve

__all__ = [
    "HEAD",
    "HEAD_TOKENS",
    "PROTOCOL_VERSION",
    "AccessRefused",
    "Client",
    "ComputeFn",
    "CurveKeys",
    "ErrorCode",
    "GroupShard",
    "PeerLost",
    "ProtocolError",
    "RemoteError",
    "RequestTimeout",
    "Server",
    "ShardInfo",
    "Ticket",
    "serve",
]
