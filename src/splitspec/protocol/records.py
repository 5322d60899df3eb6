"""The shared-memory fast path's headers: the schema's compute, result and error as fixed binary records.

A slot hand-off is on the verifier's critical path, four times per layer per CPU actor. In Python a
msgpack header costs ~10 µs to build, pack, unpack and type-check on each side, most of a 30 µs round
trip; one ``struct`` record costs ~0.3 µs. A record carries exactly the fields of ``messages.Compute``,
``Result`` and ``Error`` (same protocol version, same range checks, decoded into those same classes), so
the rest of the code sees one schema; everything off this path (handshake, ping, TCP) stays msgpack.

Little-endian layouts (the arena's header area, one per direction and slot)::

    compute: version u16 | op u8 | dtype u8 | group u8 | pad u8 | slot u16 | id u64 | layer u32 | n u32 | d_in u32
    reply:   version u16 | op u8 | dtype u8 | pad u32 | id u64 | a u32 | b u32 [| text]

A result's (a, b) is its shape [n, rows]; an error's is (code, byte length of the UTF-8 text that follows).
An unreadable request id travels as 2^64 - 1.
"""

from __future__ import annotations

import struct
from typing import Any

from splitspec.protocol.messages import (
    DTYPES,
    GROUPS,
    MAX_DIM,
    MAX_LAYERS,
    MAX_SLOTS,
    MAX_TOKENS,
    PROTOCOL_VERSION,
    Compute,
    Error,
    ErrorCode,
    ProtocolError,
    Result,
)

COMPUTE = struct.Struct("<HBBBxHQIII")
REPLY = struct.Struct("<HBBxxxxQII")
OP_COMPUTE, OP_RESULT, OP_ERROR = 1, 2, 3
_NO_ID = 2**64 - 1


def pack_compute(buffer: Any, offset: int, request: Compute) -> int:
    """Write ``request`` (which names its slot) at ``offset``; returns the record's length."""
    COMPUTE.pack_into(
        buffer,
        offset,
        PROTOCOL_VERSION,
        OP_COMPUTE,
        DTYPES.index(request.dtype),
        GROUPS.index(request.group),
        request.slot,
        request.id,
        request.layer,
        request.n,
        request.shape[1],
    )
    return COMPUTE.size


def unpack_compute(buffer: Any, offset: int, length: int) -> Compute:
    """Read and validate a compute record as strictly as ``messages.decode`` does a msgpack header."""
    if length != COMPUTE.size:
        raise ProtocolError(ErrorCode.MALFORMED, f"a compute record is {COMPUTE.size} bytes, got {length}")
    version, op, dtype, group, slot, request_id, layer, n, d_in = COMPUTE.unpack_from(buffer, offset)
    rid = request_id if request_id < 2**63 else None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.WRONG_VERSION,
            f"protocol version {version}, this side speaks {PROTOCOL_VERSION}: run the same splitspec version "
            "on both actors",
            rid,
        )
    if op != OP_COMPUTE:
        raise ProtocolError(
            ErrorCode.UNKNOWN_OP, f"slot record op {op}; a request slot holds compute ({OP_COMPUTE})", rid
        )
    if rid is None or dtype >= len(DTYPES) or group >= len(GROUPS):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"compute record with id {request_id}, dtype {dtype}, group {group}", rid
        )
    message = Compute(rid, layer, GROUPS[group], n, DTYPES[dtype], [n, d_in], slot)
    if not (layer <= MAX_LAYERS and 1 <= n <= MAX_TOKENS and 0 < d_in <= MAX_DIM and slot < MAX_SLOTS):
        _refuse(message)  # the only fields a record can get out of range; ``check`` names which
    return message


def pack_reply(buffer: Any, offset: int, reply: Result | Error, capacity: int) -> int:
    """Write a result or an error (text cut to fit ``capacity`` bytes); returns the record's length."""
    rid = _NO_ID if reply.id is None else reply.id
    if isinstance(reply, Result):
        REPLY.pack_into(buffer, offset, PROTOCOL_VERSION, OP_RESULT, DTYPES.index(reply.dtype), rid, *reply.shape)
        return REPLY.size
    text = reply.text.encode()[: capacity - REPLY.size]
    REPLY.pack_into(buffer, offset, PROTOCOL_VERSION, OP_ERROR, 0, rid, reply.code, len(text))
    buffer[offset + REPLY.size : offset + REPLY.size + len(text)] = text
    return REPLY.size + len(text)


def unpack_reply(buffer: Any, offset: int, length: int, slot: int) -> Result | Error:
    """Read and validate the reply record in ``slot``; a malformed one raises ``ProtocolError`` like a bad header."""
    if length < REPLY.size:
        raise ProtocolError(ErrorCode.MALFORMED, f"a reply record is at least {REPLY.size} bytes, got {length}")
    version, op, dtype, request_id, a, b = REPLY.unpack_from(buffer, offset)
    rid = None if request_id == _NO_ID else request_id
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.WRONG_VERSION, f"reply of protocol version {version}", rid)
    if op == OP_RESULT and length == REPLY.size and dtype < len(DTYPES):
        message = Result(rid, DTYPES[dtype], [a, b], slot)
        if not (0 < a <= MAX_DIM and 0 < b <= MAX_DIM):
            _refuse(message)
        return message
    if op == OP_ERROR and length == REPLY.size + b and a in ErrorCode._value2member_map_:
        text = bytes(buffer[offset + REPLY.size : offset + length]).decode(errors="replace")
        message = Error(rid, a, text)
        _refuse(message)
        return message
    raise ProtocolError(ErrorCode.MALFORMED, f"reply record op {op}, {length} bytes: not a result or an error", rid)


def _refuse(message: Compute | Result | Error) -> None:
    """Run the message's full ``check``. Records call it only where their cheap guard (a few int compares,
    ~0.1 µs against ~1 µs for ``check``, on the per-layer path) saw a field out of range, and for errors."""
    try:
        message.check()
    except ValueError as exc:
        raise ProtocolError(ErrorCode.INVALID, str(exc), message.id) from None
