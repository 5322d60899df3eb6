"""The channel with CURVE keys: only the cluster's client is served, and nothing crosses the wire in clear."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from splitspec.config import ChannelConfig
from splitspec.protocol import AccessRefused, Client, CurveKeys, RequestTimeout
from splitspec.protocol.curve import ENV
from test_protocol_support import MODEL_HASH, SHARDS, expected, shm_leak_check, start_server, stop_server

no_shm_leaks = pytest.fixture(scope="module", autouse=True)(shm_leak_check)

KEYS = CurveKeys.generate()
OTHER = CurveKeys.generate()  # another cluster's


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # Python answers every request, shared memory or frames: the results are then the same bits either way
    process, endpoint = start_server("tcp://127.0.0.1:0", ChannelConfig(curve=KEYS), compiled=False)
    yield endpoint
    stop_server(process)


def _x(n: int = 5, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, SHARDS["o"].d_in), dtype=np.float32)


def _client(endpoint: str, keys: CurveKeys | None, transport: str = "tcp", timeout_s: float = 5.0) -> Client:
    config = ChannelConfig(transport=transport, curve=keys, connect_timeout_s=timeout_s, request_timeout_s=5.0)
    return Client(MODEL_HASH, config, endpoint)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_clusters_client_gets_the_plain_results(server: str, transport: str) -> None:
    x = _x()
    with _client(server, KEYS, transport) as client:
        assert client.transport == transport
        got = client.call(1, "o", x)
    np.testing.assert_array_equal(got, expected(1, "o", x))  # the same float32 product, bit for bit


def test_a_client_without_keys_is_refused(server: str) -> None:
    """Refused at the handshake; or never served, when the server hangs up before the client has read its
    greeting (then ZeroMQ reports no reason)."""
    with pytest.raises((AccessRefused, RequestTimeout)):
        _client(server, None, timeout_s=2.0)


def test_a_client_key_of_another_cluster_is_refused(server: str) -> None:
    impostor = CurveKeys(KEYS.server_public, b"", OTHER.client_public, OTHER.client_secret)  # knows the server
    with pytest.raises(AccessRefused):
        _client(server, impostor)
    with _client(server, KEYS) as client:
        assert client.ping()["refused"] >= 1  # the server's gatekeeper said no, and keeps serving


def test_a_client_with_the_wrong_server_key_is_never_served(server: str) -> None:
    with pytest.raises(RequestTimeout, match="CURVE keys"):
        _client(server, OTHER, timeout_s=1.0)


def test_the_right_client_is_served_while_others_are_refused(server: str) -> None:
    with _client(server, KEYS) as client:
        first = client.call(0, "o", _x(seed=1))
        for keys in (None, CurveKeys(KEYS.server_public, b"", OTHER.client_public, OTHER.client_secret)):
            with pytest.raises((AccessRefused, RequestTimeout)):
                _client(server, keys, timeout_s=2.0)
        np.testing.assert_array_equal(client.call(0, "o", _x(seed=1)), first)  # same session, same answer


class _Tap:
    """A TCP relay between a client and the server that keeps every byte it forwards."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.seen = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        downstream, _ = self._listener.accept()
        upstream = socket.create_connection(self._target)
        for a, b in ((downstream, upstream), (upstream, downstream)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the other pump closed both ends first
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        src.close()
        dst.close()

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("keys", [None, KEYS], ids=["plain", "curve"])
def test_activations_cross_the_wire_in_clear_only_without_curve(keys: CurveKeys | None) -> None:
    process, endpoint = start_server("tcp://127.0.0.1:0", ChannelConfig(curve=keys))
    try:
        tap = _Tap(endpoint)
        x = _x(16, seed=7)
        with _client(tap.endpoint, keys) as client:
            y = client.call(0, "o", x)
        assert (x.tobytes() in tap.seen and y.tobytes() in tap.seen) == (keys is None)
        assert (MODEL_HASH.encode() in tap.seen) == (keys is None)  # the handshake too is sealed
        tap.close()
    finally:
        stop_server(process)


def test_keys_travel_through_the_environment_and_garbage_is_an_error() -> None:
    assert CurveKeys.from_env({ENV: KEYS.to_env()}) == KEYS
    assert CurveKeys.from_env({}) is None
    assert "secret" not in repr(KEYS) and KEYS.client_secret.decode() not in repr(ChannelConfig(curve=KEYS))
    with pytest.raises(ValueError, match=ENV):
        CurveKeys.from_env({ENV: "{not json"})
