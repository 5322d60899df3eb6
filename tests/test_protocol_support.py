"""Server processes, a raw slot writer and a hello never attached, for the protocol tests (no tests here).

The served "kernel" is a numpy matmul with fixed random weights, scaled by the layer, so every result can
be checked. Layer ``SLOW_LAYER`` sleeps (to kill a server mid-request), ``FAILING_LAYER`` raises,
``LATE_LAYER`` answers after ``LATE_S`` (longer than a waiter spins). As a CPU actor's server does, a server
answers its slots' requests from compiled code where it has a C kernel (``compiled``: the same product for
the layers below ``FAILING_LAYER``, every group but the lm_head's), and in Python otherwise.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numba
import numpy as np
import zmq
from numba import cfunc, types

from splitspec.config import ChannelConfig
from splitspec.kernels.ir import F32_PTR, I64_PTR
from splitspec.protocol import Client, GroupShard, Server, ShardInfo
from splitspec.protocol.messages import FIRST_ID, HEAD, Error, Hello, Result, Welcome, decode, encode
from splitspec.protocol.records import unpack_reply
from splitspec.protocol.shm import REQUEST, RESULT, host_id
from splitspec.protocol.transports import SlotTransport

MODEL_HASH = "sha256:test-model"
SHARDS = {
    "qkv": GroupShard(d_in=32, row_start=0, row_stop=48),
    "o": GroupShard(d_in=32, row_start=8, row_stop=40),
    "gate_up": GroupShard(d_in=32, row_start=0, row_stop=64),
    "down": GroupShard(d_in=64, row_start=16, row_stop=48),
    "lm_head": GroupShard(d_in=32, row_start=16, row_stop=400),  # its HEAD_TOKENS rows size the slots' y
}
INFO = ShardInfo(MODEL_HASH, num_layers=5, shards=SHARDS)
FAILING_LAYER = 2
SLOW_LAYER = 3
LATE_LAYER, LATE_S = 4, 0.2


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {g: rng.standard_normal((s.rows, s.d_in), dtype=np.float32) for g, s in SHARDS.items()}


def expected(layer: int, group: str, x: np.ndarray) -> np.ndarray:
    return (x @ weights()[group].T) * np.float32(layer + 1)


def _compiled_kernels(w: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(kernels, their records: keep them alive) for ``Server``: ``expected``'s product as a C function."""

    @cfunc(types.int64(types.int64, types.int64, types.int64, types.int64), cache=True)
    def product(record_at, x_at, n, out_at):
        r = numba.carray(I64_PTR(record_at), 4)  # weights' address, rows, d_in, the layer's factor
        weight = numba.carray(F32_PTR(r[0]), (r[1], r[2]))
        x, out = numba.carray(F32_PTR(x_at), (n, r[2])), numba.carray(F32_PTR(out_at), (n, r[1]))
        for i in range(n):
            for j in range(r[1]):
                acc = np.float32(0.0)
                for k in range(r[2]):
                    acc += x[i, k] * weight[j, k]
                out[i, j] = acc * np.float32(r[3])
        return 0

    kernels = np.zeros((INFO.num_layers, len(SHARDS), 3), np.int64)
    records = np.zeros((INFO.num_layers, len(SHARDS), 4), np.int64)
    for layer in range(FAILING_LAYER):
        for g, (group, shard) in enumerate(SHARDS.items()):
            if group != HEAD:
                records[layer, g] = (w[group].ctypes.data, shard.rows, shard.d_in, layer + 1)
                kernels[layer, g] = (product.address, records[layer, g].ctypes.data, w[group].nbytes)
    return kernels, records


def _serve(endpoint: str, config: ChannelConfig, compiled: bool, ready: Connection) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that Server.close removes its files
    w = weights()
    kernels, _records = _compiled_kernels(w) if compiled else (None, None)

    def compute(layer: int, group: str, x: np.ndarray, out: np.ndarray) -> None:
        if layer == FAILING_LAYER:
            raise ArithmeticError("the test kernel fails at this layer")
        if layer == SLOW_LAYER:
            time.sleep(60)
        if layer == LATE_LAYER:
            time.sleep(LATE_S)
        np.matmul(x, w[group].T, out=out)
        out *= np.float32(layer + 1)

    with Server(INFO, compute, config, endpoint, kernels) as server:
        ready.send(server.endpoint)
        server.serve_forever()


def start_server(
    endpoint: str, config: ChannelConfig | None = None, compiled: bool = True
) -> tuple[multiprocessing.Process, str]:
    """Spawn a server process; returns it with the endpoint it bound (``tcp://...:0`` resolved)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_serve, args=(endpoint, config or ChannelConfig(), compiled, send), daemon=True)
    process.start()
    if not receive.poll(30):
        stop_server(process)
        raise RuntimeError("the test server did not start within 30 s")
    return process, receive.recv()


def stop_server(process: multiprocessing.Process) -> None:
    if process.is_alive():
        process.terminate()
        process.join(10)
    if process.is_alive():
        process.kill()
        process.join(10)


def shm_leak_check() -> Iterator[None]:
    """Fail the module if it left shared-memory directories behind. A client deletes its slots' directory as
    soon as it attaches them, so only a session no client attached (``hello_without_attaching``) can leave
    one: the server must remove it when it drops the session or stops."""
    before = set(glob.glob("/dev/shm/splitspec-*"))
    yield
    left = set(glob.glob("/dev/shm/splitspec-*")) - before
    assert not left, f"leaked shared memory: {sorted(left)}"


def hello_without_attaching(endpoint: str, model_hash: str = MODEL_HASH) -> str:
    """Ask for shared-memory slots as a client does, then go away without attaching them (as a client that
    gave up before the welcome came, or each retry of a connect, does); returns the slots' directory."""
    config = ChannelConfig()
    hello = Hello(FIRST_ID, model_hash, "float32", config.max_tokens, config.slots, host_id(), None)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(hello))
        assert sock.poll(10_000), "the server did not answer a hello"
        welcome = decode(sock.recv(), config.max_header_bytes)
    finally:
        sock.close()
        context.term()
    assert isinstance(welcome, Welcome) and welcome.shm_dir is not None, welcome
    return welcome.shm_dir


def ipc_endpoint(tmp_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(tmp_dir, name)}"


def post_raw(client: Client, slot: int, record: bytes, timeout_s: float = 5.0) -> Result | Error:
    """Put arbitrary bytes in ``slot``'s request header, post them like a request, and read the reply.

    Reaches into the client's shared-memory transport on purpose: a well-behaved client cannot write a
    broken record, and the fuzz test needs to.
    """
    transport = client._transport
    assert isinstance(transport, SlotTransport), "post_raw needs a shared-memory client"
    arena = transport._arena
    offset = arena.header_offset(slot, REQUEST)
    arena.buffer[offset : offset + len(record)] = record
    arena.set_header_length(slot, REQUEST, len(record))
    serial = int(arena.posted[0]) + 1
    arena.ring[(serial - 1) % arena.layout.slots] = slot
    arena.posted[0] = serial
    transport._shm.request_bell.ring()
    deadline = time.monotonic() + timeout_s
    while arena.done[slot] != serial:
        assert time.monotonic() < deadline, "the server stopped answering its slots"
        time.sleep(1e-4)
    return unpack_reply(arena.buffer, arena.header_offset(slot, RESULT), arena.header_length(slot, RESULT), slot)
