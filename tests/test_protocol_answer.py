"""A server answering its slots from compiled code (``protocol.answer``) against a real server process: the
same replies as Python's answers, and whatever it does not recognise left to Python, which answers or
refuses it as a server without kernels does."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from splitspec.config import ChannelConfig
from splitspec.protocol import Client, ErrorCode, GroupShard, PeerLost, RemoteError, Server, ShardInfo
from splitspec.protocol import lane as lanes
from splitspec.protocol.messages import FIRST_ID, HEAD, Compute, Error, Result, encode
from test_protocol_support import (
    FAILING_LAYER,
    MODEL_HASH,
    SHARDS,
    expected,
    post_raw,
    shm_leak_check,
    start_server,
    stop_server,
)

no_shm_leaks = pytest.fixture(scope="module", autouse=True)(shm_leak_check)
GROUPS = ("qkv", "o", "gate_up", "down")
CONFIG = ChannelConfig(transport="shm", spin_us=1000, request_timeout_s=5.0)


@pytest.fixture(scope="module", params=[False, True], ids=["python", "compiled"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    """(endpoint, whether it has compiled kernels)"""
    process, endpoint = start_server("tcp://127.0.0.1:0", compiled=request.param)
    yield endpoint, request.param
    stop_server(process)


@pytest.fixture
def client(server: tuple[str, bool]) -> Iterator[Client]:
    with Client(MODEL_HASH, CONFIG, server[0]) as c:
        yield c


def x_for(group: str, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, SHARDS[group].d_in), dtype=np.float32)


def test_every_group_and_token_count_is_answered_with_the_kernel(client: Client, server: tuple[str, bool]) -> None:
    """Lanes post as a verify pass does (requests in layer and group order, then out of it), and ``Client``
    posts through its own slots; the ping counts every answer, compiled or not."""
    before = client.ping()
    lane = client.lease(5, GROUPS, [0, 0, 0, 0])
    try:
        for layer, g in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (0, 2), (1, 3), (1, 1)]:
            for n in (1, 7, 64):
                x = x_for(GROUPS[g], n, seed=layer * 100 + g * 10 + n)
                assert lanes.post(lane.address, layer, g, x.ctypes.data, n) == 0
                if not lanes.answered(lane.address):  # not within the spin (a busy machine): as a pass does
                    client.wait_lane(lane)
                at, rows, _ = lanes.reply(lane.address)
                got = client._transport.arena.y(lane.slot, n, rows)
                assert got.ctypes.data == at
                np.testing.assert_allclose(got, expected(layer, GROUPS[g], x), rtol=1e-5, atol=1e-5)
    finally:
        client.end_lease(lane)
    for group in (*GROUPS, HEAD):
        x = x_for(group, 3, seed=7)
        np.testing.assert_allclose(client.call(1, group, x), expected(1, group, x), rtol=1e-5, atol=1e-5)
    after = client.ping()
    assert after["requests"] == before["requests"] + 8 * 3 + 5
    compiled = after["compiled_requests"] - before["compiled_requests"]
    assert compiled == (8 * 3 + 4 if server[1] else 0)  # the lm_head's rows are Python's
    assert after["compute_s"] > before["compute_s"]


def test_a_request_another_client_encodes_another_way_is_answered(client: Client) -> None:
    """An id below ``FIRST_ID`` takes fewer bytes than the templates' nine: Python decodes it."""
    x = x_for("o", 2, seed=3)
    client._transport._arena.x(0, 2, SHARDS["o"].d_in)[:] = x
    reply = post_raw(client, 0, encode(Compute(5, 0, "o", 2, "float32", [2, SHARDS["o"].d_in], 0)))
    assert reply == Result(5, "float32", [2, SHARDS["o"].rows], 0)
    got = client._transport._arena.y(0, 2, SHARDS["o"].rows)
    np.testing.assert_allclose(got, expected(0, "o", x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "message, problem",
    [
        (Compute(FIRST_ID, 0, "qkv", 1, "float32", [1, SHARDS["qkv"].d_in], 1), "slot 0 holds a request naming slot 1"),
        (Compute(FIRST_ID, 9, "qkv", 1, "float32", [1, SHARDS["qkv"].d_in], 0), "layer 9 >= num_layers"),
        (Compute(FIRST_ID, 0, "qkv", 1, "float32", [1, 8], 0), "takes d_in=32"),
        (Compute(FIRST_ID, 0, HEAD, 120, "float32", [120, 32], 0), "exceeds the"),
        (Compute(2**63 - 1, 0, "qkv", 1, "float32", [1, SHARDS["qkv"].d_in], 0), None),
    ],
)
def test_near_valid_requests_get_pythons_answer(client: Client, message: Compute, problem: str | None) -> None:
    """Headers one field away from a template: the server answers as Python does, an error or, for the
    largest id the schema takes, a result; and it goes on serving."""
    reply = post_raw(client, 0, encode(message))
    if problem is None:
        assert reply == Result(message.id, "float32", [1, SHARDS["qkv"].rows], 0)
    else:
        assert isinstance(reply, Error) and reply.code == ErrorCode.INVALID and problem in reply.text
    x = x_for("qkv", 1, seed=1)
    np.testing.assert_allclose(client.call(0, "qkv", x), expected(0, "qkv", x), rtol=1e-5, atol=1e-5)


def test_an_id_past_the_schema_is_refused(client: Client) -> None:
    header = bytearray(encode(Compute(FIRST_ID, 0, "qkv", 1, "float32", [1, SHARDS["qkv"].d_in], 0)))
    at = header.index(0xCF) + 1  # the id's 8 bytes follow msgpack's uint64 marker
    header[at] = 0x80  # 2^63 and more
    reply = post_raw(client, 0, bytes(header))
    assert isinstance(reply, Error) and reply.code in (ErrorCode.INVALID, ErrorCode.MALFORMED)


def test_a_count_or_slot_past_one_byte_is_refused_as_the_schema_refuses_it(server: tuple[str, bool]) -> None:
    """A template has one byte for the token count and one for the slot: msgpack's ints under 128. With more
    tokens or slots than that, the byte at their place may be no int at all (0x80 an empty map, 0xc0 nil),
    which compiled code must leave to the schema."""
    config = ChannelConfig(transport="shm", max_tokens=128, slots=200, request_timeout_s=5.0)
    with Client(MODEL_HASH, config, server[0]) as client:
        # byte values that no other field takes (the protocol version is one small int too)
        header = encode(Compute(FIRST_ID, 0, "qkv", 27, "float32", [27, SHARDS["qkv"].d_in], 29))
        assert header.count(27) == 2 and header.count(29) == 1  # n and shape[0]; the slot
        reply = post_raw(client, 0, header.replace(b"\x1b", b"\x80").replace(b"\x1d", b"\x00"))
        assert (
            isinstance(reply, Error)
            and reply.code == ErrorCode.MALFORMED
            and "compute.n has the wrong type" in reply.text
        ), reply
        reply = post_raw(client, 0xC0, header.replace(b"\x1d", b"\xc0"))
        assert isinstance(reply, Error) and "naming slot None" in reply.text, reply
        x = x_for("qkv", 3, seed=5)
        np.testing.assert_allclose(client.call(0, "qkv", x), expected(0, "qkv", x), rtol=1e-5, atol=1e-5)


def test_a_posted_count_ahead_of_the_slots_drops_the_session(server: tuple[str, bool]) -> None:
    """The client writes ``posted``: one further ahead of the served count than there are slots counts
    requests never posted, and the server would answer stale ring entries for ever and nothing else. It
    replies with an error instead, drops that session and serves on."""
    with Client(MODEL_HASH, CONFIG, server[0]) as bad, Client(MODEL_HASH, CONFIG, server[0]) as good:
        x = x_for("qkv", 2, seed=4)
        bad.call(0, "qkv", x)  # leaves a request in the ring that would match a template
        arena = bad._transport._arena
        arena.posted[0] = int(arena.posted[0]) + 2**40
        bad._transport._shm.request_bell.ring()
        deadline = time.monotonic() + 5
        with pytest.raises(RemoteError, match=r"posted runs \d+ ahead of 8 slots; session dropped"):
            while time.monotonic() < deadline:  # pings queued on the socket may be answered first
                bad.ping()
                time.sleep(0.01)
        with pytest.raises(PeerLost):
            bad.call(0, "qkv", x)
        np.testing.assert_allclose(good.call(0, "qkv", x), expected(0, "qkv", x), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(bad.call(0, "qkv", x), expected(0, "qkv", x), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_fails_is_pythons_to_report(client: Client) -> None:
    """Layers from ``FAILING_LAYER`` on have no compiled kernel: their requests go to Python's, which raises."""
    with pytest.raises(RemoteError, match="fails at this layer"):
        client.call(FAILING_LAYER, "o", x_for("o", 1, seed=2))


def test_a_kernel_table_of_the_wrong_shape_is_refused() -> None:
    info = ShardInfo(MODEL_HASH, 2, {"qkv": GroupShard(8, 0, 8)})
    with pytest.raises(ValueError, match=r"kernels must be int64 \[2, 1, 3\]"):
        Server(info, lambda *a: None, CONFIG, "tcp://127.0.0.1:0", np.zeros((2, 2, 3), np.int64))
