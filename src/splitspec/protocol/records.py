"""The shared-memory fast path's headers: the schema's own messages, written into a slot's header area.

A slot hand-off is on the verifier's critical path at every layer, so the header codec there matters.
The schema's msgspec encoder and validating decoder are cheaper than the fixed ``struct`` records this
module used to pack (``benchmarks/README.md``, protocol schema), so a slot carries exactly the bytes a
ZeroMQ header frame would: one schema, one validator, one set of error codes for both transports. The
header area is variable-length already (the arena keeps each header's length), and a message that fits
``HEADER_BYTES`` is the only layout constraint.
"""

from __future__ import annotations

from splitspec.protocol.messages import Compute, Error, ErrorCode, ProtocolError, Result, decode, encode


def pack_compute(buffer: memoryview | bytearray, offset: int, request: Compute) -> int:
    """Write ``request`` (which names its slot) at ``offset``; returns its length."""
    data = encode(request)
    buffer[offset : offset + len(data)] = data
    return len(data)


def unpack_compute(buffer: memoryview | bytes, offset: int, length: int) -> Compute:
    """Read and validate the request header in a slot, as ``decode`` does a ZeroMQ header frame; slicing
    ``buffer`` (the arena's memoryview) hands msgspec the header in place, without a copy."""
    message = decode(buffer[offset : offset + length], length)
    if not isinstance(message, Compute):
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"a request slot holds compute, not {message.OP}", message.id)
    return message


def pack_reply(buffer: memoryview | bytearray, offset: int, reply: Result | Error, capacity: int) -> int:
    """Write a result or an error (its text cut to fit ``capacity`` bytes); returns the length written."""
    data = encode(reply)
    if len(data) > capacity and isinstance(reply, Error):
        text = reply.text.encode()
        text = text[: max(0, len(text) - (len(data) - capacity))].decode(errors="ignore")  # whole characters
        data = encode(Error(reply.id, reply.code, text))
    if len(data) > capacity:
        raise ValueError(f"a {reply.OP} header of {len(data)} bytes does not fit a {capacity}-byte header area")
    buffer[offset : offset + len(data)] = data
    return len(data)


def unpack_reply(buffer: memoryview | bytes, offset: int, length: int, slot: int) -> Result | Error:
    """Read and validate the reply header in ``slot``; a broken one raises ``ProtocolError`` like a bad frame."""
    message = decode(buffer[offset : offset + length], length)
    if isinstance(message, Error) or (isinstance(message, Result) and message.slot == slot):
        return message
    raise ProtocolError(
        ErrorCode.MALFORMED, f"slot {slot} holds {message.OP} {message}, not its result or an error", message.id
    )
