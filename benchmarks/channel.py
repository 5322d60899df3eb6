"""Round-trip cost of the GPU↔CPU channel, beside a memcpy and a raw socket measured in the same run.

    .venv/bin/python benchmarks/channel.py  # ~2 minutes; writes results/channel.json and channel.png

The server's kernel does nothing (``noop``), so a round trip is the protocol's own cost. Client and server
are set up as the engine sets up itself and a CPU actor: pinned to disjoint CPUs, both spinning
``ChannelConfig.own_core_spin_us`` before they sleep; ``spin`` compares spinning and blocking, pinned
and not. ``rtt_us_*`` is
the zero-copy path the GPU actor uses (it writes x' into ``ticket.x`` and reads y_r from the view, copies
it would make anyway: device to host and back); ``rtt_copy_us_p50`` adds a copy in and a copy out
(``Client.call``). Replies are as wide as the payload (rows = d). Raw-socket rows send the same bytes both
ways over one TCP connection; ``zmq_ipc_tiny_rtt_us_p50`` is a plain ZeroMQ DEALER/ROUTER ping over ipc://.
The ``curve`` rows are what sealing the channel costs (the scheduler always does): frames over TCP
loopback to a plain server and to a CURVE one, as a CPU actor on another host is reached, and shared
memory behind a CURVE control socket (sealed only at the handshake, so it should cost nothing per request).
``lane_tiny_rtt_us_p50`` is the round trip a CPU engine's pass makes: a lane posts from compiled code and
waits on the slot's flag (``protocol.lane``), to a server that answers in Python (``python``) and to one
that answers from compiled code as a CPU actor does (``compiled``, ``protocol.answer``, its C kernel doing
nothing).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import zmq
from numba import cfunc, njit, types

from splitspec.config import ChannelConfig
from splitspec.protocol import Client, CurveKeys, GroupShard, Server, ShardInfo
from splitspec.protocol import lane as lanes

RESULTS = Path(__file__).parent / "results"
TOKENS = (1, 16, 64)
WIDTHS = {576: "qkv", 4096: "o", 14336: "down"}
TINY = "gate_up"
BUSY_LAYER = 1  # the kernel computes ~1-2 ms there: does a spinning client slow it down?
INFO = ShardInfo("bench", 2, {**{g: GroupShard(d, 0, d) for d, g in WIDTHS.items()}, TINY: GroupShard(8, 0, 8)})
SECONDS_PER_CASE = 0.6
TINY_SECONDS = 5.0
SPINS_US = (0.0, ChannelConfig().spin_us, ChannelConfig().own_core_spin_us)  # both sides


def _kernel(layer: int, group: str, x: np.ndarray, out: np.ndarray) -> None:
    if layer == BUSY_LAYER:  # single-threaded, so that it measures the spinner's effect, not a BLAS pool's
        np.sin(_BUSY, out=_BUSY_OUT)


_BUSY, _BUSY_OUT = np.linspace(0, 1, 400_000, dtype=np.float32), np.empty(400_000, np.float32)


def _serve(
    endpoint: str,
    spin_us: float,
    cpus: set[int] | None,
    curve: CurveKeys | None,
    ready: Connection,
    compiled: bool = False,
) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    kernels = None
    if compiled:  # every (layer, group) answered from compiled code, by a C kernel that does nothing

        @cfunc(types.int64(types.int64, types.int64, types.int64, types.int64))
        def noop(argument, x, n, y):
            return 0

        kernels = np.zeros((INFO.num_layers, len(INFO.shards), 3), np.int64)
        kernels[:, :, 0] = noop.address
    config = ChannelConfig(slots=2, spin_us=spin_us, curve=curve)
    with Server(INFO, _kernel, config, endpoint, kernels) as server:
        ready.send(server.endpoint)
        server.serve_forever()


def _echo(ready: Connection) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(64 * 14336 * 4)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        size = int.from_bytes(head, "little")
        view = memoryview(buf)[:size]
        got = 0
        while got < size:
            got += conn.recv_into(view[got:])
        conn.sendall(view)


def _zmq_pong(endpoint: str, ready: Connection) -> None:
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.send(endpoint)
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart(frames)
        if frames[-1] == b"stop":
            return


def _spawn(target: Callable[..., None], *args: object, **kwargs: object) -> tuple[multiprocessing.Process, object]:
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, send), kwargs=kwargs, daemon=True)
    process.start()
    return process, receive.recv()


def _percentiles(one: Callable[[], None], seconds: float = SECONDS_PER_CASE) -> tuple[float, float]:
    """p50 and p99 in µs of ``one()``, repeated for about ``seconds`` after a warm-up."""
    for _ in range(20):
        one()
    times = []
    stop = time.perf_counter() + seconds
    while (time.perf_counter() < stop or len(times) < 30) and len(times) < 100_000:
        start = time.perf_counter()
        one()
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 50) * 1e6), float(np.percentile(times, 99) * 1e6)


def _round_trip(client: Client, layer: int, group: str, n: int) -> Callable[[], None]:
    def one() -> None:
        ticket = client.request(layer, group, n)
        client.submit(ticket)
        client.gather(ticket)
        client.release(ticket)

    return one


@njit
def _lane_trip(lane_at: int, x_at: int, g: int) -> bool:
    """One tiny request through a lane as a verify pass posts it; False if not answered within the spin."""
    lanes.post(lane_at, 0, g, x_at, 1)
    return lanes.answered(lane_at)


def _lane_rows(
    tmp: str, servers: list, client_cpus: set[int] | None, server_cpus: set[int] | None, spin: float
) -> dict:
    """The tiny round trip from compiled code to a server that answers in Python and to a compiled one."""
    rows = {}
    allowed = os.sched_getaffinity(0)
    groups = list(INFO.shards)
    for compiled in (False, True):
        name = "compiled" if compiled else "python"
        server, endpoint = _spawn(_serve, f"ipc://{tmp}/lane-{name}", spin, server_cpus, None, compiled=compiled)
        servers.append(server)
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        with Client("bench", ChannelConfig(transport="shm", slots=2, spin_us=spin), endpoint) as client:
            lane = client.lease(INFO.num_layers, groups, [0] * len(groups))
            x = np.ones(8, np.float32)
            at = (lane.address, x.ctypes.data, groups.index(TINY))  # outside the timing: ~1 µs each to read

            def one(lane=lane, client=client, at=at) -> None:
                if not _lane_trip(*at):
                    client.wait_lane(lane)

            rows[name] = _percentiles(one, TINY_SECONDS)[0]
            client.end_lease(lane)
        os.sched_setaffinity(0, allowed)
        server.kill()
        print(json.dumps({"lane_tiny_rtt_us_p50": {name: rows[name]}}), flush=True)
    return rows


def _memcpy(nbytes: int) -> float:
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    return _percentiles(lambda: np.copyto(dst, src))[0]


def _raw_socket(port: int) -> Callable[[int], float]:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(64 * 14336 * 4)

    def rtt(nbytes: int) -> float:
        payload = memoryview(buf)[:nbytes]

        def one() -> None:
            conn.sendall(nbytes.to_bytes(8, "little"))
            conn.sendall(payload)
            got = 0
            while got < nbytes:
                got += conn.recv_into(payload[got:])

        return _percentiles(one)[0]

    return rtt


def _zmq_tiny(endpoint: str) -> float:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)

    def one() -> None:
        sock.send(b"ping")
        sock.recv()

    result = _percentiles(one)[0]
    sock.send(b"stop")
    sock.recv()
    sock.close()
    return result


def _layout() -> tuple[set[int] | None, set[int] | None, float]:
    """The engine's set-up: client and server on disjoint CPUs, both spinning ``own_core_spin_us`` (as
    ``scheduler.local.start_local`` does with two or more CPUs); otherwise unpinned with the short spin."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None, None, ChannelConfig().spin_us
    return {allowed[0]}, set(allowed[1:]), ChannelConfig().own_core_spin_us


def _spin_rows(tmp: str, servers: list, client_cpus: set[int] | None, server_cpus: set[int] | None) -> list[dict]:
    """Spin against block, pinned to disjoint CPUs and not: the tiny round trip, and one whose kernel
    computes ~1-2 ms with the machine's cores (does a spinning waiter slow it down?)."""
    rows = []
    allowed = os.sched_getaffinity(0)
    for pinned in (True, False) if client_cpus else (False,):
        for spin in SPINS_US:
            cpus = server_cpus if pinned else None
            spin_server, spin_endpoint = _spawn(_serve, f"ipc://{tmp}/spin{spin}{pinned}", spin, cpus, None)
            servers.append(spin_server)
            os.sched_setaffinity(0, client_cpus if pinned else allowed)
            with Client("bench", ChannelConfig(transport="shm", slots=2, spin_us=spin), spin_endpoint) as c:
                rows.append(
                    {
                        "pinned": pinned,
                        "spin_us": spin,
                        "tiny_rtt_us_p50": _percentiles(_round_trip(c, 0, TINY, 1))[0],
                        "busy_kernel_rtt_us_p50": _percentiles(_round_trip(c, BUSY_LAYER, TINY, 1))[0],
                    }
                )
            os.sched_setaffinity(0, allowed)
            spin_server.kill()
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    servers, rows = [], []
    client_cpus, server_cpus, spin = _layout()
    allowed = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            server, endpoint = _spawn(_serve, f"ipc://{tmp}/channel", spin, server_cpus, None)
            echo, port = _spawn(_echo)
            pong, zmq_endpoint = _spawn(_zmq_pong, f"ipc://{tmp}/zmq")
            servers += [server, echo, pong]
            raw = _raw_socket(port)
            if client_cpus:
                os.sched_setaffinity(0, client_cpus)
            config = ChannelConfig(slots=2, spin_us=spin)
            clients = {t: Client("bench", replace(config, transport=t), endpoint) for t in ("shm", "tcp")}
            # the headline: long enough to span the slow and fast phases of a shared VM (medians of 0.6 s
            # windows of this same loop ranged 27-59 µs)
            tiny_p50, tiny_p99 = _percentiles(_round_trip(clients["shm"], 0, TINY, 1), TINY_SECONDS)
            for d, group in WIDTHS.items():
                for n in TOKENS:
                    nbytes = n * d * 4
                    memcpy = _memcpy(nbytes)
                    raw_us = raw(nbytes)
                    for transport, client in clients.items():
                        p50, p99 = _percentiles(_round_trip(client, 0, group, n))
                        x = np.ones((n, d), np.float32)
                        copy_p50, _ = _percentiles(lambda c=client, g=group, x=x: c.call(0, g, x))
                        row = {
                            "transport": transport,
                            "n": n,
                            "d": d,
                            "bytes": nbytes,
                            "rtt_us_p50": p50,
                            "rtt_us_p99": p99,
                            "rtt_copy_us_p50": copy_p50,
                            "memcpy_us": memcpy,
                            "raw_socket_us_p50": raw_us,
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            for client in clients.values():
                client.close()
            curve_rows = _curve_rows(servers, server_cpus, spin)
            os.sched_setaffinity(0, allowed)
            zmq_tiny = _zmq_tiny(zmq_endpoint)
            spin_rows = _spin_rows(tmp, servers, client_cpus, server_cpus)
            lane_rows = _lane_rows(tmp, servers, client_cpus, server_cpus, spin)
        finally:
            for process in servers:
                process.kill()
                process.join()
    setup = {
        "client_cpus": sorted(client_cpus or allowed),
        "server_cpus": sorted(server_cpus or allowed),
        "spin_us": spin,
    }
    _report(tiny_p50, tiny_p99, zmq_tiny, lane_rows, rows, spin_rows, curve_rows, setup)


def _curve_rows(servers: list, server_cpus: set[int] | None, spin: float) -> list[dict]:
    """The same round trips without and with CURVE: over TCP loopback (``plain``, ``curve``) and over shared
    memory whose control socket is sealed (``shm_curve``)."""
    keys = CurveKeys.generate()
    configs = {
        name: ChannelConfig(slots=2, spin_us=spin, transport="tcp", curve=k)
        for name, k in (("plain", None), ("curve", keys))
    }
    clients = {}
    for name, config in configs.items():
        server, endpoint = _spawn(_serve, "tcp://127.0.0.1:0", spin, server_cpus, config.curve)
        servers.append(server)
        clients[name] = Client("bench", config, endpoint)
    clients["shm_curve"] = Client("bench", replace(configs["curve"], transport="shm"), endpoint)
    rows = []
    for d, group in WIDTHS.items():
        for n in TOKENS:
            row: dict[str, float] = {"n": n, "d": d, "bytes": n * d * 4}
            for name, client in clients.items():
                row[f"{name}_rtt_us_p50"] = _percentiles(_round_trip(client, 0, group, n))[0]
            row["curve_over_plain"] = row["curve_rtt_us_p50"] / row["plain_rtt_us_p50"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    for client in clients.values():
        client.close()
    return rows


def _goals(tiny: float, rows: list[dict]) -> dict[str, object]:
    shm16 = next(r for r in rows if r["transport"] == "shm" and r["n"] == 16 and r["d"] == 4096)
    large = [r for r in rows if r["transport"] == "tcp" and r["bytes"] >= 1 << 20]
    return {
        "shm_16x4096_rtt_over_memcpy": shm16["rtt_us_p50"] / shm16["memcpy_us"],
        "shm_16x4096_rtt_over_memcpy_goal": 3.0,
        "tiny_rtt_us_p50_goal": 30.0,
        "tcp_large_rtt_over_raw_socket": {
            f"{r['n']}x{r['d']}": r["rtt_us_p50"] / r["raw_socket_us_p50"] for r in large
        },
        "tcp_large_rtt_over_raw_socket_goal": 2.0,
        "tiny_met": tiny <= 30.0,
    }


def _report(
    tiny: float,
    tiny_p99: float,
    zmq_tiny: float,
    lane_rows: dict,
    rows: list[dict],
    spin_rows: list[dict],
    curve_rows: list[dict],
    setup: dict,
) -> None:
    RESULTS.mkdir(exist_ok=True)
    result = {
        "tiny_rtt_us_p50": tiny,
        "tiny_rtt_us_p99": tiny_p99,
        "zmq_ipc_tiny_rtt_us_p50": zmq_tiny,
        "lane_tiny_rtt_us_p50": lane_rows,
        "setup": setup,
        "goals": _goals(tiny, rows),
        "rows": rows,
        "spin": spin_rows,
        "curve": curve_rows,
        "load_avg_1_5_15m": os.getloadavg(),  # at the end; other work on the machine inflates every figure
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "zmq": zmq.zmq_version()},
    }
    (RESULTS / "channel.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(rows, curve_rows)
    print(json.dumps(result["goals"], indent=2))


def _plot(rows: list[dict], curve_rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for transport, marker in (("shm", "o"), ("tcp", "s")):
        sel = sorted((r for r in rows if r["transport"] == transport), key=lambda r: r["bytes"])
        ax.plot(
            [r["bytes"] for r in sel],
            [r["rtt_us_p50"] for r in sel],
            marker=marker,
            label=f"{transport} round trip",
        )
    sel = sorted((r for r in rows if r["transport"] == "shm"), key=lambda r: r["bytes"])
    ax.plot(
        [r["bytes"] for r in sel],
        [r["raw_socket_us_p50"] for r in sel],
        "k--",
        label="raw TCP socket round trip",
    )
    ax.plot([r["bytes"] for r in sel], [r["memcpy_us"] for r in sel], "k:", label="memcpy of the payload")
    sel = sorted(curve_rows, key=lambda r: r["bytes"])
    for name, marker in (("plain", "^"), ("curve", "v")):
        label = f"tcp loopback round trip, {'CURVE' if name == 'curve' else 'plain'}"
        ax.plot([r["bytes"] for r in sel], [r[f"{name}_rtt_us_p50"] for r in sel], marker=marker, label=label)
    ax.set(xscale="log", yscale="log", xlabel="payload bytes (n × d × 4)", ylabel="µs (median)")
    ax.set_title("GPU↔CPU actor channel, same machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "channel.png", dpi=120)


if __name__ == "__main__":
    main()
