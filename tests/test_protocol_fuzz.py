"""Throw garbage and near-valid headers and slot records at a running server process; it must answer each
and keep serving."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitspec.config import ChannelConfig
from splitspec.protocol import Client
from splitspec.protocol.messages import MESSAGES, PROTOCOL_VERSION, Error, ErrorCode, Result, decode
from test_protocol_support import MODEL_HASH, SHARDS, expected, post_raw, shm_leak_check, start_server, stop_server

no_shm_leaks = pytest.fixture(scope="module", autouse=True)(shm_leak_check)

# Every field name of the schema, so that random headers often have the right keys with wrong values.
FIELD_NAMES = sorted({name for cls in MESSAGES.values() for name in cls.__struct_fields__})
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from(["qkv", "o", "gate_up", "down", "float32", MODEL_HASH]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
ops = st.sampled_from([op for op in MESSAGES if op != "shutdown"] + ["", "compute2"])
headers = st.builds(
    lambda version, op, fields: msgpack.packb({"v": version, "op": op, **fields}),
    st.sampled_from([PROTOCOL_VERSION] * 3 + [0, PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION)]),
    ops,
    st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=9),
)
requests = st.lists(st.one_of(headers, st.binary(max_size=300)), min_size=1, max_size=3)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    process, endpoint = start_server("tcp://127.0.0.1:0")
    yield endpoint
    stop_server(process)


@pytest.fixture(scope="module")
def raw_socket(server: str) -> Iterator[zmq.Socket]:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server)
    yield sock
    sock.close()
    context.term()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=requests)
def test_server_answers_every_random_request(raw_socket: zmq.Socket, frames: list[bytes]) -> None:
    raw_socket.send_multipart(frames)
    assert raw_socket.poll(5000), "the server stopped answering"
    reply = raw_socket.recv_multipart()
    decode(reply[0], 4096)  # every answer is itself a valid message


# Slot headers: random bytes, and compute headers with random (mostly near-valid) field values.
near_valid = st.fixed_dictionaries(
    {
        "v": st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, PROTOCOL_VERSION + 1]),
        "op": st.sampled_from(["compute", "compute", "result", "", "ping"]),
        "id": st.integers(0, 2**64 - 1) | st.none(),
        "layer": st.integers(0, 2**32 - 1) | st.integers(0, 5),
        "group": st.sampled_from(["qkv", "o", "gate_up", "down", "lm_head", "embed"]),
        "n": st.integers(0, 2**32 - 1) | st.integers(0, 70),
        "dtype": st.sampled_from(["float32", "float32", "int4"]),
        "d_in": st.integers(0, 2**32 - 1) | st.sampled_from([s.d_in for s in SHARDS.values()]),
        "slot": st.integers(0, 3) | st.none(),
    }
).map(lambda f: msgpack.packb({k: v for k, v in f.items() if k != "d_in"} | {"shape": [f["n"], f["d_in"]]}))
records = st.one_of(st.binary(max_size=60), near_valid)


@pytest.fixture(scope="module")
def shm_client(server: str) -> Iterator[Client]:
    with Client(MODEL_HASH, ChannelConfig(transport="shm", request_timeout_s=5.0), server) as client:
        yield client


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=records, slot=st.integers(0, 1))
def test_server_answers_every_random_slot_record(shm_client: Client, record: bytes, slot: int) -> None:
    reply = post_raw(shm_client, slot, record)  # itself a valid reply record, or this raises
    if isinstance(reply, Result):  # the record happened to be a valid request: then it was computed
        assert reply.shape[0] == msgpack.unpackb(record)["n"]


NESTED = b"\x91" * 2000 + b"\x01"  # [[[...[1]...]]]: deeper than msgspec decodes, and fits a slot's header area


@pytest.mark.parametrize("header", [NESTED, b"\x81\xa1x" + NESTED], ids=["array", "before_the_op"])
def test_a_header_nested_too_deep_is_refused_as_malformed(
    raw_socket: zmq.Socket, shm_client: Client, header: bytes
) -> None:
    """msgspec gives up on such nesting with a RecursionError, not a DecodeError: from the schema's decoder
    where it skips a value before the op, from the refusal's untyped reading otherwise. Either way the header
    is malformed, on a socket and in a slot, and the server goes on."""
    raw_socket.send(header)
    assert raw_socket.poll(5000), "the server stopped answering"
    reply = decode(raw_socket.recv(), 4096)
    assert isinstance(reply, Error) and reply.code == ErrorCode.MALFORMED, reply
    reply = post_raw(shm_client, 0, header)
    assert isinstance(reply, Error) and reply.code == ErrorCode.MALFORMED, reply
    x = np.random.default_rng(5).standard_normal((4, SHARDS["o"].d_in), dtype=np.float32)
    np.testing.assert_allclose(shm_client.call(0, "o", x), expected(0, "o", x), rtol=1e-5, atol=1e-5)


def test_server_still_computes_after_the_fuzzing(server: str, shm_client: Client) -> None:
    x = np.random.default_rng(3).standard_normal((5, SHARDS["qkv"].d_in), dtype=np.float32)
    np.testing.assert_allclose(shm_client.call(1, "qkv", x), expected(1, "qkv", x), rtol=1e-5, atol=1e-5)
    for transport in ("shm", "tcp"):
        with Client(MODEL_HASH, ChannelConfig(transport=transport, request_timeout_s=5.0), server) as client:
            x = np.random.default_rng(7).standard_normal((9, SHARDS["down"].d_in), dtype=np.float32)
            np.testing.assert_allclose(client.call(0, "down", x), expected(0, "down", x), rtol=1e-5, atol=1e-5)
