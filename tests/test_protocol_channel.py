"""The channel end to end: a real server process, real sockets, real shared memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from splitspec.config import ChannelConfig
from splitspec.protocol import HEAD, HEAD_TOKENS, Client, ErrorCode, GroupShard, PeerLost, RemoteError, RequestTimeout
from splitspec.protocol.messages import PROTOCOL_VERSION, Error
from test_protocol_support import (
    FAILING_LAYER,
    MODEL_HASH,
    SHARDS,
    SLOW_LAYER,
    expected,
    hello_without_attaching,
    ipc_endpoint,
    post_raw,
    shm_leak_check,
    start_server,
    stop_server,
)

no_shm_leaks = pytest.fixture(scope="module", autouse=True)(shm_leak_check)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    process, endpoint = start_server("tcp://127.0.0.1:0")
    yield endpoint
    stop_server(process)


@pytest.fixture(params=["shm", "tcp"])
def client(request: pytest.FixtureRequest, server: str) -> Iterator[Client]:
    with Client(MODEL_HASH, ChannelConfig(transport=request.param, request_timeout_s=5.0), server) as c:
        assert c.transport == request.param
        yield c


def random_x(group: str, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, SHARDS[group].d_in), dtype=np.float32)


@pytest.mark.parametrize("group", sorted(SHARDS))
def test_compute_matches_the_kernel(client: Client, group: str) -> None:
    for n in (1, 7, HEAD_TOKENS if group == HEAD else 64):
        x = random_x(group, n, seed=n)
        np.testing.assert_allclose(client.call(1, group, x), expected(1, group, x), rtol=1e-5, atol=1e-5)


def test_pipelined_requests_gathered_out_of_order(client: Client) -> None:
    tickets = []
    for layer in (0, 1):
        for group in ("qkv", "o", "gate_up", "down"):
            ticket = client.request(layer, group, 5)
            ticket.x[...] = random_x(group, 5, seed=len(tickets))
            client.submit(ticket)
            tickets.append((ticket, layer, group, ticket.x.copy()))
    with pytest.raises(RuntimeError, match="slots are in flight"):
        client.request(0, "qkv", 1)
    for ticket, layer, group, x in reversed(tickets):
        np.testing.assert_allclose(client.gather(ticket), expected(layer, group, x), rtol=1e-5, atol=1e-5)
        client.release(ticket)


def test_release_before_gather_is_refused(client: Client) -> None:
    ticket = client.request(0, "o", 2)
    ticket.x[...] = 1.0
    client.submit(ticket)
    with pytest.raises(ValueError, match="gather it before release"):
        client.release(ticket)
    client.gather(ticket)
    client.release(ticket)


def test_kernel_failure_is_an_error_reply_and_serving_goes_on(client: Client) -> None:
    with pytest.raises(RemoteError, match="ArithmeticError") as info:
        client.call(FAILING_LAYER, "qkv", random_x("qkv", 3))
    assert info.value.code == ErrorCode.COMPUTE_FAILED
    x = random_x("qkv", 3)
    np.testing.assert_allclose(client.call(0, "qkv", x), expected(0, "qkv", x), rtol=1e-5, atol=1e-5)


def test_lm_head_requests_carry_at_most_head_tokens(client: Client) -> None:
    """An lm_head request's reply (a share of the vocabulary's logits) is far wider than a group's, so the
    slots hold ``HEAD_TOKENS`` rows of it: more is refused by the client, and by the server from a client
    that skips the check."""
    with pytest.raises(ValueError, match=rf"n must be in \[1, {HEAD_TOKENS}\] for a lm_head request"):
        client.request(0, HEAD, HEAD_TOKENS + 1)
    if client.transport == "shm":
        fields = {"v": PROTOCOL_VERSION, "op": "compute", "id": 1, "layer": 0, "group": HEAD, "n": HEAD_TOKENS + 1}
        record = msgpack.packb(fields | {"dtype": "float32", "shape": [HEAD_TOKENS + 1, 32], "slot": 0})
        reply = post_raw(client, 0, record)
        assert isinstance(reply, Error) and reply.code == ErrorCode.INVALID
        assert f"exceeds the {HEAD_TOKENS} rows a lm_head request may carry" in reply.text
    x = random_x(HEAD, 2)
    np.testing.assert_allclose(client.call(0, HEAD, x), expected(0, HEAD, x), rtol=1e-5, atol=1e-5)


def test_layer_out_of_range_is_refused(client: Client) -> None:
    with pytest.raises(RemoteError, match="num_layers") as info:
        client.call(99, "qkv", random_x("qkv", 1))
    assert info.value.code == ErrorCode.INVALID


def test_ping_reports_stats(client: Client) -> None:
    before = client.ping()["requests"]
    client.call(0, "down", random_x("down", 2))
    stats = client.ping()
    assert stats["requests"] == before + 1
    assert stats["sessions"] >= 1 and stats["uptime_s"] > 0


def test_handshake_mismatches_are_error_replies(server: str) -> None:
    config = ChannelConfig(connect_timeout_s=5.0)
    with pytest.raises(RemoteError, match="model hash") as info:
        Client("sha256:another-model", config, server)
    assert info.value.code == ErrorCode.MISMATCH
    wrong = {**SHARDS, "o": GroupShard(d_in=32, row_start=0, row_stop=40)}
    with pytest.raises(RemoteError, match="shards"):
        Client(MODEL_HASH, config, server, shards=wrong)
    with Client(MODEL_HASH, config, server, shards=dict(SHARDS)) as ok:
        assert ok.info.shards == SHARDS


def test_no_server_is_a_timeout_not_a_hang() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        with pytest.raises(RequestTimeout, match="is the CPU actor running"):
            Client(MODEL_HASH, ChannelConfig(connect_timeout_s=0.5), ipc_endpoint(tmp, "nobody"))
        assert time.monotonic() - start < 3


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peer_killed_mid_request_then_restarted(transport: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = ipc_endpoint(tmp, "restart")
        process, _ = start_server(endpoint)
        config = ChannelConfig(transport=transport, request_timeout_s=20.0, connect_timeout_s=20.0)
        try:
            with Client(MODEL_HASH, config, endpoint) as client:
                ticket = client.request(SLOW_LAYER, "qkv", 4)
                ticket.x[...] = 1.0
                client.submit(ticket)
                time.sleep(0.2)  # let the server enter the slow kernel
                os.kill(process.pid, 9)
                start = time.monotonic()
                with pytest.raises(PeerLost):
                    client.gather(ticket)
                assert time.monotonic() - start < 5, "peer loss must be noticed long before the timeout"
                process.join(10)
                process, _ = start_server(endpoint)
                x = random_x("gate_up", 3)
                got = client.call(0, "gate_up", x)
                np.testing.assert_allclose(got, expected(0, "gate_up", x), rtol=1e-5, atol=1e-5)
                assert client.transport == transport
        finally:
            stop_server(process)


def test_shutdown_stops_the_server() -> None:
    """And removes the slots no client attached: an attached client deletes their directory at once."""
    process, endpoint = start_server("tcp://127.0.0.1:0")
    try:
        unattached = hello_without_attaching(endpoint)
        assert os.path.isdir(unattached)
        with Client(MODEL_HASH, ChannelConfig(), endpoint) as client:
            client.shutdown_server()
        process.join(10)
        assert process.exitcode == 0
        assert not os.path.exists(unattached)
    finally:
        stop_server(process)


def test_slots_never_attached_are_dropped_after_the_connect_timeout() -> None:
    """A client that gave up before the welcome came, and each retry of a connect (a new identity each), leave
    slots that no client attaches, nor hangs up on (a doorbell reports that only after a writer came and
    went): the server drops them after its connect timeout, and keeps an attached client however long idle."""
    config = ChannelConfig(transport="shm", connect_timeout_s=0.5, request_timeout_s=5.0)
    process, endpoint = start_server("tcp://127.0.0.1:0", config)
    try:
        with Client(MODEL_HASH, config, endpoint) as client:
            unattached = [hello_without_attaching(endpoint) for _ in range(3)]
            assert all(os.path.isdir(d) for d in unattached)
            assert client.ping()["sessions"] == 4
            deadline = time.monotonic() + 5
            while client.ping()["sessions"] > 1:
                assert time.monotonic() < deadline, "the server kept slots that no client attached"
                time.sleep(0.05)
            assert not any(os.path.exists(d) for d in unattached)
            x = random_x("qkv", 3)
            np.testing.assert_allclose(client.call(0, "qkv", x), expected(0, "qkv", x), rtol=1e-5, atol=1e-5)
            assert client.transport == "shm"
    finally:
        stop_server(process)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None, reason="`ss -K` needs root and iproute2")
def test_a_dropped_tcp_connection_is_a_lost_peer_then_reconnected(server: str) -> None:
    """ZeroMQ re-makes a dropped connection by itself, but the server has no session for the new one: a
    reply that came before the drop still counts, the next request fails as ``PeerLost`` (which callers
    retry), not as an error reply, and the one after it reconnects with a handshake."""
    x = random_x("o", 4)
    with Client(MODEL_HASH, ChannelConfig(transport="tcp", request_timeout_s=5.0), server) as client:
        before = client.call(0, "o", x)
        ticket = client.request(0, "o", 4)
        ticket.x[...] = x
        client.submit(ticket)
        time.sleep(0.2)  # its reply waits in the client's socket
        port = server.rpartition(":")[2]
        dropped = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", port], capture_output=True, text=True)
        assert f":{port}" in dropped.stdout, dropped.stdout + dropped.stderr
        time.sleep(0.3)  # long enough for ZeroMQ to connect again under the client
        np.testing.assert_array_equal(client.gather(ticket), before)
        client.release(ticket)
        with pytest.raises(PeerLost):
            client.call(0, "o", x)
        np.testing.assert_array_equal(client.call(0, "o", x), before)
