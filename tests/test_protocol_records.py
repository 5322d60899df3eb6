"""The shared-memory fast path's headers: round trips, and every broken header refused with its code."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitspec.protocol.messages import (
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
from splitspec.protocol.records import pack_compute, pack_reply, unpack_compute, unpack_reply

OFFSET = 8  # headers are packed at an offset inside a larger buffer, as in a slot


def test_compute_round_trips() -> None:
    buffer = bytearray(256)
    for request in (
        Compute(5, 29, "gate_up", 16, "float32", [16, 576], 3),
        Compute(2**63 - 1, 0, "o", 1, "float32", [1, 1], 0),
    ):
        length = pack_compute(buffer, OFFSET, request)
        assert unpack_compute(memoryview(buffer), OFFSET, length) == request


@pytest.mark.parametrize(
    "reply",
    [
        Result(7, "float32", [16, 960], 3),
        Error(8, ErrorCode.INVALID, "layer 99 >= num_layers 30"),
        Error(None, ErrorCode.MALFORMED, "naïve ünïcode"),
    ],
    ids=["result", "error", "error-no-id"],
)
def test_replies_round_trip(reply: Result | Error) -> None:
    buffer = bytearray(512)
    length = pack_reply(buffer, OFFSET, reply, 500)
    assert unpack_reply(memoryview(buffer), OFFSET, length, 3) == reply


def test_error_text_is_cut_to_the_header_area() -> None:
    buffer = bytearray(128)
    length = pack_reply(buffer, 0, Error(1, ErrorCode.COMPUTE_FAILED, "é" * 300), 100)
    assert 90 <= length <= 100
    text = unpack_reply(buffer, 0, length, 0).text
    assert text and text == "é" * len(text)


def record(**changes: object) -> bytes:
    fields = {"v": PROTOCOL_VERSION, "op": "compute", "id": 9, "layer": 3, "group": "o", "n": 4}
    fields |= {"dtype": "float32", "shape": [4, 576], "slot": 2}
    return msgpack.packb(fields | changes)


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (record()[:-1], ErrorCode.MALFORMED, "not a msgpack header"),
        (record(v=PROTOCOL_VERSION + 1), ErrorCode.WRONG_VERSION, f"protocol version {PROTOCOL_VERSION + 1}"),
        (record(op="teleport"), ErrorCode.UNKNOWN_OP, "unknown op"),
        (record(dtype="int4"), ErrorCode.INVALID, "dtype"),
        (record(group="embed"), ErrorCode.INVALID, "group"),
        (record(id=2**63), ErrorCode.INVALID, "id"),
        (record(layer="3"), ErrorCode.MALFORMED, "wrong type"),
        (record(n=0, shape=[0, 576]), ErrorCode.INVALID, "n must be"),
        (record(n=5000, shape=[5000, 576]), ErrorCode.INVALID, "n must be"),
        (record(shape=[4, 0]), ErrorCode.INVALID, "shape"),
        (record(layer=1 << 20), ErrorCode.INVALID, "layer"),
        (record(slot=256), ErrorCode.INVALID, "slot"),
    ],
)
def test_broken_compute_headers_are_refused_with_their_code(data: bytes, code: ErrorCode, words: str) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack_compute(data, 0, len(data))
    assert info.value.code == code
    assert words in info.value.text
    # the request id survives for the error reply whenever the header was whole and the id in range
    assert info.value.request_id == (None if data == record()[:-1] or words == "id" else 9)


def test_a_result_in_a_request_slot_is_refused() -> None:
    data = msgpack.packb(
        {"v": PROTOCOL_VERSION, "op": "result", "id": 9, "dtype": "float32", "shape": [1, 2], "slot": 0}
    )
    with pytest.raises(ProtocolError, match="holds compute") as info:
        unpack_compute(data, 0, len(data))
    assert info.value.code == ErrorCode.UNKNOWN_OP


def reply(**changes: object) -> bytes:
    fields = {"v": PROTOCOL_VERSION, "op": "result", "id": 1, "dtype": "float32", "shape": [2, 3], "slot": 0}
    return msgpack.packb(fields | changes)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (reply() + b"!", ErrorCode.MALFORMED),  # trailing bytes
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "error", "id": 1, "code": 99, "text": ""}), ErrorCode.INVALID),
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "op": "error", "id": 1, "code": 5, "text": "x" * 401}),
            ErrorCode.INVALID,
        ),
        (record(), ErrorCode.MALFORMED),  # a request where the reply belongs
        (reply(slot=1), ErrorCode.MALFORMED),  # the result of another slot
        (reply(v=0), ErrorCode.WRONG_VERSION),
        (reply(shape=[0, 3]), ErrorCode.INVALID),
        (b"\x01\x00", ErrorCode.MALFORMED),
    ],
)
def test_broken_replies_are_refused(data: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack_reply(data, 0, len(data), 0)
    assert info.value.code == code


def _edge_ints(bits: int) -> st.SearchStrategy[int]:
    """Any value a field could be sent with, weighted towards the limits the schema draws."""
    limits = [0, 1, 2, 255, 256, 4095, 4096, 4097, 1 << 16, (1 << 16) + 1, 1 << 24, (1 << 24) + 1]
    top = (1 << bits) - 1
    return st.sampled_from([v for v in limits if v <= top] + [top]) | st.integers(0, top)


@given(layer=_edge_ints(32), n=_edge_ints(32), d_in=_edge_ints(32), slot=_edge_ints(16))
def test_a_compute_header_is_refused_exactly_outside_the_documented_limits(
    layer: int, n: int, d_in: int, slot: int
) -> None:
    """The limits live in the schema's type annotations; this pins them to the constants callers read."""
    data = record(layer=layer, n=n, shape=[n, d_in], slot=slot)
    valid = layer <= MAX_LAYERS and 1 <= n <= MAX_TOKENS and 0 < d_in <= MAX_DIM and slot < MAX_SLOTS
    if valid:
        assert unpack_compute(data, 0, len(data)).shape == [n, d_in]
    else:
        with pytest.raises(ProtocolError) as info:
            unpack_compute(data, 0, len(data))
        assert info.value.code == ErrorCode.INVALID


@given(n=_edge_ints(32), rows=_edge_ints(32))
def test_a_result_header_is_refused_exactly_outside_the_documented_limits(n: int, rows: int) -> None:
    data = reply(shape=[n, rows])
    if 0 < n <= MAX_DIM and 0 < rows <= MAX_DIM:
        assert unpack_reply(data, 0, len(data), 0).shape == [n, rows]
    else:
        with pytest.raises(ProtocolError) as info:
            unpack_reply(data, 0, len(data), 0)
        assert info.value.code == ErrorCode.INVALID
