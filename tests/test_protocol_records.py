"""The shared-memory fast path's binary records: round trips, and every broken record refused with its code."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitspec.protocol.messages import PROTOCOL_VERSION, Compute, Error, ErrorCode, ProtocolError, Result
from splitspec.protocol.records import (
    COMPUTE,
    OP_COMPUTE,
    OP_ERROR,
    OP_RESULT,
    REPLY,
    pack_compute,
    pack_reply,
    unpack_compute,
    unpack_reply,
)

OFFSET = 8  # records are packed at an offset inside a larger buffer, as in a slot


def test_compute_round_trips() -> None:
    buffer = bytearray(64)
    for request in (
        Compute(5, 29, "gate_up", 16, "float32", [16, 576], 3),
        Compute(2**63 - 1, 0, "o", 1, "float32", [1, 1], 0),
    ):
        length = pack_compute(buffer, OFFSET, request)
        assert length == COMPUTE.size
        assert unpack_compute(buffer, OFFSET, length) == request


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
    assert unpack_reply(buffer, OFFSET, length, 3) == reply


def test_error_text_is_cut_to_the_header_area() -> None:
    buffer = bytearray(128)
    length = pack_reply(buffer, 0, Error(1, ErrorCode.COMPUTE_FAILED, "x" * 300), 100)
    assert length == 100
    assert unpack_reply(buffer, 0, length, 0).text == "x" * (100 - REPLY.size)


def compute_record(**changes: int) -> bytes:
    fields = {"version": PROTOCOL_VERSION, "op": OP_COMPUTE, "dtype": 0, "group": 1, "slot": 2, "id": 9}
    fields |= {"layer": 3, "n": 4, "d_in": 576} | changes
    return COMPUTE.pack(*fields.values())


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (compute_record()[:-1], ErrorCode.MALFORMED, "is 28 bytes"),
        (compute_record(version=2), ErrorCode.WRONG_VERSION, "protocol version 2"),
        (compute_record(op=OP_RESULT), ErrorCode.UNKNOWN_OP, "op 2"),
        (compute_record(dtype=1), ErrorCode.MALFORMED, "dtype 1"),
        (compute_record(group=4), ErrorCode.MALFORMED, "group 4"),
        (compute_record(id=2**63), ErrorCode.MALFORMED, "id"),
        (compute_record(n=0), ErrorCode.INVALID, "n must be"),
        (compute_record(n=5000), ErrorCode.INVALID, "n must be"),
        (compute_record(d_in=0), ErrorCode.INVALID, "shape"),
        (compute_record(layer=1 << 20), ErrorCode.INVALID, "layer"),
        (compute_record(slot=256), ErrorCode.INVALID, "slot"),
    ],
)
def test_broken_compute_records_are_refused_with_their_code(data: bytes, code: ErrorCode, words: str) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack_compute(data, 0, len(data))
    assert info.value.code == code
    assert words in info.value.text
    # the request id survives for the error reply whenever the record was whole and the id in range
    assert info.value.request_id == (None if len(data) != COMPUTE.size or words == "id" else 9)


@pytest.mark.parametrize(
    ("record", "code"),
    [
        (REPLY.pack(PROTOCOL_VERSION, OP_RESULT, 0, 1, 2, 3) + b"!", ErrorCode.MALFORMED),  # trailing bytes
        (REPLY.pack(PROTOCOL_VERSION, OP_ERROR, 0, 1, 99, 0), ErrorCode.MALFORMED),  # unknown error code
        (REPLY.pack(PROTOCOL_VERSION, OP_ERROR, 0, 1, 5, 10) + b"short", ErrorCode.MALFORMED),  # text length
        (REPLY.pack(PROTOCOL_VERSION, OP_COMPUTE, 0, 1, 2, 3), ErrorCode.MALFORMED),
        (REPLY.pack(0, OP_RESULT, 0, 1, 2, 3), ErrorCode.WRONG_VERSION),
        (REPLY.pack(PROTOCOL_VERSION, OP_RESULT, 0, 1, 0, 3), ErrorCode.INVALID),  # empty shape
        (b"\x01\x00", ErrorCode.MALFORMED),
    ],
)
def test_broken_replies_are_refused(record: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack_reply(record, 0, len(record), 0)
    assert info.value.code == code


def _edge_ints(bits: int) -> st.SearchStrategy[int]:
    """Any value a record's field can hold, weighted towards the limits the checks draw."""
    limits = [0, 1, 2, 255, 256, 4095, 4096, 4097, 1 << 16, (1 << 16) + 1, 1 << 24, (1 << 24) + 1]
    top = (1 << bits) - 1
    return st.sampled_from([v for v in limits if v <= top] + [top]) | st.integers(0, top)


@given(layer=_edge_ints(32), n=_edge_ints(32), d_in=_edge_ints(32), slot=_edge_ints(16))
def test_a_compute_record_is_refused_exactly_when_the_message_check_refuses_it(
    layer: int, n: int, d_in: int, slot: int
) -> None:
    """The record's cheap guard stands in for ``Compute.check`` on the hot path: they must agree."""
    data = compute_record(layer=layer, n=n, d_in=d_in, slot=slot)
    try:
        Compute(9, layer, "o", n, "float32", [n, d_in], slot).check()
        valid = True
    except ValueError:
        valid = False
    if valid:
        assert unpack_compute(data, 0, len(data)).shape == [n, d_in]
    else:
        with pytest.raises(ProtocolError) as info:
            unpack_compute(data, 0, len(data))
        assert info.value.code == ErrorCode.INVALID


@given(n=_edge_ints(32), rows=_edge_ints(32))
def test_a_result_record_is_refused_exactly_when_the_message_check_refuses_it(n: int, rows: int) -> None:
    record = REPLY.pack(PROTOCOL_VERSION, OP_RESULT, 0, 1, n, rows)
    try:
        Result(1, "float32", [n, rows], 0).check()
        valid = True
    except ValueError:
        valid = False
    if valid:
        assert unpack_reply(record, 0, len(record), 0).shape == [n, rows]
    else:
        with pytest.raises(ProtocolError):
            unpack_reply(record, 0, len(record), 0)
