"""The schema on its own: every message round-trips, every broken header is refused with its code."""

from __future__ import annotations

import msgpack
import pytest

from splitspec.config import ChannelConfig
from splitspec.protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    Compute,
    Error,
    ErrorCode,
    Hello,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Result,
    Shutdown,
    Welcome,
    decode,
    encode,
)

SHARDS = {"qkv": [576, 0, 960], "down": [1536, 0, 576]}
EXAMPLES: list[Message] = [
    Hello(1, "sha256:abc", "float32", 64, 8, "host/boot", SHARDS),
    Hello(2, "sha256:abc", "float32", 1, 1, None, None),
    Welcome(3, "sha256:abc", 30, "float32", SHARDS, "/dev/shm/splitspec-x1"),
    Welcome(4, "sha256:abc", 30, "float32", SHARDS, None),
    Compute(5, 29, "gate_up", 16, "float32", [16, 576], 3),
    Compute(6, 0, "o", 1, "float32", [1, 576], None),
    Result(7, "float32", [16, 960], 3),
    Error(8, ErrorCode.INVALID, "layer 99 >= num_layers 30"),
    Error(None, ErrorCode.MALFORMED, "not a msgpack header"),
    Ping(9),
    Pong(10, {"requests": 3, "compute_s": 0.25}),
    Shutdown(11),
    Bye(12),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.OP)
def test_every_message_round_trips(message: Message) -> None:
    assert decode(encode(message), 4096) == message


def raw(**fields: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields})


COMPUTE = {"op": "compute", "id": 5, "layer": 1, "group": "qkv", "n": 2, "dtype": "float32", "shape": [2, 8]}


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (b"\xc1garbage", ErrorCode.MALFORMED, "not a msgpack header"),
        (msgpack.packb([1, 2]), ErrorCode.MALFORMED, "must be a map"),
        (msgpack.packb({"v": 99, "op": "ping", "id": 1}), ErrorCode.WRONG_VERSION, "version 99"),
        (msgpack.packb({"op": "ping", "id": 1}), ErrorCode.WRONG_VERSION, "version None"),
        (raw(op="teleport", id=1), ErrorCode.UNKNOWN_OP, "unknown op"),
        (raw(op="ping"), ErrorCode.MALFORMED, "exactly the fields"),
        (raw(op="ping", id=1, extra=0), ErrorCode.MALFORMED, "exactly the fields"),
        (raw(op="ping", id="one"), ErrorCode.MALFORMED, "wrong type"),
        (raw(op="ping", id=True), ErrorCode.MALFORMED, "wrong type"),
        (raw(op="ping", id=-1), ErrorCode.INVALID, "id must be"),
        (raw(**COMPUTE, slot=None, pad="x" * 5000), ErrorCode.OVERSIZED, "exceeds 4096"),
        (raw(**{**COMPUTE, "group": "embed"}, slot=None), ErrorCode.INVALID, "unknown group"),
        (raw(**{**COMPUTE, "n": 0, "shape": [0, 8]}, slot=None), ErrorCode.INVALID, "n must be"),
        (raw(**{**COMPUTE, "shape": [3, 8]}, slot=None), ErrorCode.INVALID, "shape must be"),
        (raw(**{**COMPUTE, "dtype": "int4"}, slot=None), ErrorCode.INVALID, "not supported"),
        (raw(**COMPUTE, slot=999), ErrorCode.INVALID, "slot must be"),
        (raw(**{**COMPUTE, "layer": -1}, slot=None), ErrorCode.INVALID, "layer must be"),
        (raw(op="error", id=1, code=77, text="?"), ErrorCode.INVALID, "77"),
        (
            raw(
                op="welcome",
                id=1,
                model_hash="h",
                num_layers=2,
                dtype="float32",
                shards=SHARDS,
                shm_dir="/etc",
            ),
            ErrorCode.INVALID,
            "shm_dir must be",
        ),
        (
            raw(
                op="hello",
                id=1,
                model_hash="h",
                dtype="float32",
                max_tokens=64,
                slots=8,
                host_id=None,
                shards={"qkv": [576, 10, 5]},
            ),
            ErrorCode.INVALID,
            "row_start < row_stop",
        ),
    ],
)
def test_broken_headers_are_refused_with_their_code(data: bytes, code: ErrorCode, words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as info:
        decode(data, 4096)
    assert info.value.code == code


def test_the_request_id_survives_for_the_error_reply() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(raw(op="teleport", id=42), 4096)
    assert info.value.request_id == 42


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("endpoint", "http://x"),
        ("transport", "carrier-pigeon"),
        ("slots", 0),
        ("spin_us", -1.0),
        ("request_timeout_s", 0.0),
        ("max_header_bytes", 10),
    ],
)
def test_channel_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"ChannelConfig.{field}"):
        ChannelConfig(**{field: value})


def test_the_channel_s_errors_survive_pickling():
    """Ray carries an engine actor's failed init to the driver pickled: a refusal must arrive whole, not as
    Ray's "Failed to deserialize exception"."""
    import pickle

    from splitspec.protocol import RemoteError

    remote = pickle.loads(pickle.dumps(RemoteError(ErrorCode.INVALID, "no room in /dev/shm")))
    assert (type(remote), remote.code, remote.text) == (RemoteError, ErrorCode.INVALID, "no room in /dev/shm")
    assert str(remote) == "CPU actor replied INVALID: no room in /dev/shm"
    refused = pickle.loads(pickle.dumps(ProtocolError(ErrorCode.MALFORMED, "not msgpack", 7)))
    assert (refused.code, refused.text, refused.request_id, str(refused)) == (
        ErrorCode.MALFORMED,
        "not msgpack",
        7,
        "MALFORMED: not msgpack",
    )
