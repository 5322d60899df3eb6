"""A lane: compiled code posts into a leased slot and reads the reply itself, against a real server
process; what it cannot take (an error reply, a late one, a dead peer) goes back to ``Client``'s Python."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from splitspec.config import ChannelConfig
from splitspec.protocol import Client, ErrorCode, PeerLost, RemoteError
from splitspec.protocol import lane as lanes
from splitspec.protocol.lane import LaneTemplates, _patch
from splitspec.protocol.messages import FIRST_ID, Compute, Result, encode
from test_protocol_support import (
    FAILING_LAYER,
    LATE_LAYER,
    LATE_S,
    MODEL_HASH,
    SHARDS,
    expected,
    shm_leak_check,
    start_server,
    stop_server,
)

no_shm_leaks = pytest.fixture(scope="module", autouse=True)(shm_leak_check)
GROUPS = ("qkv", "o", "gate_up", "down")
COLUMNS = [3, 0, 5, 1]  # where each group's rows start in the output the lane's replies are added into


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    process, endpoint = start_server("tcp://127.0.0.1:0")
    yield endpoint
    stop_server(process)


@pytest.fixture
def client(server: str) -> Iterator[Client]:
    with Client(MODEL_HASH, ChannelConfig(transport="shm", spin_us=1000, request_timeout_s=5.0), server) as c:
        yield c


def x_for(group: str, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, SHARDS[group].d_in), dtype=np.float32)


def reply_of(client: Client, lane: lanes.SlotLane) -> np.ndarray:
    """The reply in the lane's slot, where ``lane.reply`` points compiled code."""
    at, rows, column = lanes.reply(lane.address)
    n = int(lane.fields[lanes.TOKENS])
    assert at == client._transport.arena.y(lane.slot, n, rows).ctypes.data
    assert column == COLUMNS[int(lane.fields[lanes.GROUP])]
    return client._transport.arena.y(lane.slot, n, rows).copy()


def test_requests_posted_from_compiled_code_equal_the_kernel(client: Client) -> None:
    lane = client.lease(5, GROUPS, COLUMNS)
    try:
        for layer in (0, 1):
            for g, group in enumerate(GROUPS):
                for n in (1, 7, 64):
                    x = x_for(group, n, seed=layer * 100 + g * 10 + n)
                    assert lanes.post(lane.address, layer, g, x.ctypes.data, n) == 0
                    assert lanes.answered(lane.address)
                    np.testing.assert_allclose(reply_of(client, lane), expected(layer, group, x), rtol=1e-5, atol=1e-5)
        last = int(lane.fields[lanes.ID])
    finally:
        client.end_lease(lane)
    ticket = client.request(0, "qkv", 1)  # the client's own requests go on after the lane's ids
    assert ticket.request.id > last >= FIRST_ID
    client.release(ticket)
    x = x_for("o", 3, seed=1)
    np.testing.assert_allclose(client.call(1, "o", x), expected(1, "o", x), rtol=1e-5, atol=1e-5)


def test_an_error_reply_is_raised_from_python_and_the_slot_comes_back(client: Client) -> None:
    lane = client.lease(5, GROUPS, COLUMNS)
    x = x_for("qkv", 2, seed=0)
    assert lanes.post(lane.address, FAILING_LAYER, 0, x.ctypes.data, 2) == 0
    assert not lanes.answered(lane.address)  # an Error, not the expected Result
    with pytest.raises(RemoteError, match="fails at this layer") as info:
        client.wait_lane(lane)
    assert info.value.code == ErrorCode.COMPUTE_FAILED
    client.end_lease(lane)
    lanes_now = [client.lease(5, GROUPS, COLUMNS) for _ in range(ChannelConfig().slots)]  # every slot is free
    assert None not in lanes_now
    for each in lanes_now:
        client.end_lease(each)


def test_a_late_reply_is_waited_for_in_python_then_read_in_place(client: Client) -> None:
    lane = client.lease(5, GROUPS, COLUMNS)
    try:
        x = x_for("down", 4, seed=3)
        assert lanes.post(lane.address, LATE_LAYER, 3, x.ctypes.data, 4) == 0
        start = time.monotonic()
        assert not lanes.answered(lane.address)  # spins for 1 ms, not for the whole LATE_S
        assert time.monotonic() - start < LATE_S / 2
        client.wait_lane(lane)
        np.testing.assert_allclose(reply_of(client, lane), expected(LATE_LAYER, "down", x), rtol=1e-5, atol=1e-5)
    finally:
        client.end_lease(lane)


def test_a_lease_ended_mid_request_waits_for_its_reply(client: Client) -> None:
    lane = client.lease(5, GROUPS, COLUMNS)
    x = x_for("o", 1, seed=4)
    assert lanes.post(lane.address, LATE_LAYER, 1, x.ctypes.data, 1) == 0
    assert lane.pending()
    client.end_lease(lane)  # the server still owns the slot: ending the lease waits for its answer
    assert not lane.pending()
    np.testing.assert_allclose(client.call(0, "o", x), expected(0, "o", x), rtol=1e-5, atol=1e-5)


def test_a_dead_server_is_a_lost_peer() -> None:
    process, endpoint = start_server("tcp://127.0.0.1:0")
    try:
        with Client(MODEL_HASH, ChannelConfig(transport="shm", spin_us=1000, request_timeout_s=20.0), endpoint) as c:
            lane = c.lease(5, GROUPS, COLUMNS)
            os.kill(process.pid, 9)
            process.join(10)
            x = x_for("qkv", 1, seed=5)
            lanes.post(lane.address, 0, 0, x.ctypes.data, 1)  # the doorbell may still take the byte
            assert not lanes.answered(lane.address)
            start = time.monotonic()
            with pytest.raises(PeerLost):
                c.wait_lane(lane)
            assert time.monotonic() - start < 5, "a dead peer must be noticed long before the timeout"
            c.end_lease(lane)  # a lost connection's slot: nothing to give back, no error
    finally:
        stop_server(process)


@pytest.mark.parametrize("layer", [0, 127, 128, 300])
def test_a_patched_template_is_the_encoded_message(layer: int) -> None:
    """Every id, token count and slot a lane writes into a template gives the bytes msgspec would encode,
    whatever width the layer's own number takes."""
    shapes = [(SHARDS[g].d_in, SHARDS[g].rows, 0) for g in GROUPS]
    templates = LaneTemplates(layer + 1, GROUPS, shapes, "float32")
    rng = np.random.default_rng(layer)
    for g, group in enumerate(GROUPS):
        for ident, n, slot in [
            (FIRST_ID, 1, 0),
            (2**63 - 1, 127, 127),
            *zip(
                rng.integers(FIRST_ID, 2**62, 5).tolist(),
                rng.integers(1, 128, 5).tolist(),
                rng.integers(0, 128, 5).tolist(),
                strict=True,
            ),
        ]:
            for row, message in (
                (
                    templates.requests[layer, g],
                    Compute(ident, layer, group, n, "float32", [n, SHARDS[group].d_in], slot),
                ),
                (templates.replies[g], Result(ident, "float32", [n, SHARDS[group].rows], slot)),
            ):
                offset, length, *positions = row.tolist()
                header = templates.bytes[offset : offset + length].tobytes()
                assert _patch(header, positions, ident, n, slot) == encode(message)


def test_a_lease_that_posted_nothing_ends_at_once(client: Client) -> None:
    """A pass that leased slots but ran another way (an actor on another host) gives them back without
    waiting, though the slots carry flags of earlier requests."""
    for seed in range(ChannelConfig().slots + 1):  # every slot answers a request first
        x = x_for("qkv", 1, seed)
        client.call(0, "qkv", x)
    lane = client.lease(5, GROUPS, COLUMNS)
    assert not lane.pending()
    start = time.monotonic()
    client.wait_lane(lane)
    client.end_lease(lane)
    assert time.monotonic() - start < 0.5
