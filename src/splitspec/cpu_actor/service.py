"""The CPU actor's process, and the launcher that starts one and waits until it serves.

The order inside the process matters: it pins itself first, because numba's worker threads and the
shard's first-touched pages take the CPUs (and so the NUMA node) the process has at that moment; it
compiles the kernel before it binds, so that the first verify pass does not pay for compilation.

    python -m splitspec.cpu_actor.service --model FOLDER --bits 8 --shard 0 --shards 2 \
        [--cpus 0-7 | --numa-node 0] [--threads N] [--endpoint tcp://127.0.0.1:0]

When it serves it prints one line ``READY {json}`` on stdout (endpoint, shard, load and compile seconds),
and ``STATS {json}`` (its counters) when it exits after a ``Shutdown`` message, SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numba
import numpy as np

from splitspec import numa
from splitspec.config import ACTIVATION_MODES, ChannelConfig, CpuActorConfig
from splitspec.kernels import residual
from splitspec.kernels.shard import ResidualShard
from splitspec.protocol import Client, ComputeFn, CurveKeys, Server, ShardInfo
from splitspec.protocol.curve import ENV as CURVE_ENV
from splitspec.protocol.messages import shards_from_wire, shards_to_wire

READY = "READY "
STATS = "STATS "
_LOCAL_ANY_PORT = "tcp://127.0.0.1:0"
_STDERR_TAIL = 4000  # characters of the child's stderr quoted in an error
_PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>


class _Terminated(Exception):
    """Raised by the SIGTERM handler to leave ``serve_forever`` through the same cleanup as Shutdown."""


@dataclass
class _Counters:
    """What the actor did in Python (``counting``) and, added at the end, in the server's compiled answers
    (``add``): the protocol's ping reports requests and compute seconds, not bytes."""

    calls: int = 0
    bytes_streamed: int = 0
    kernel_s: float = 0.0

    def counting(self, shard: ResidualShard) -> ComputeFn:
        def compute(layer: int, group: str, x: np.ndarray, out: np.ndarray) -> None:
            start = time.perf_counter()
            shard.compute(layer, group, x, out)
            self.kernel_s += time.perf_counter() - start
            self.calls += 1
            self.bytes_streamed += shard.request_bytes(layer, group)

        return compute

    def add(self, calls: int, kernel_s: float, bytes_streamed: int) -> None:
        self.calls += calls
        self.kernel_s += kernel_s
        self.bytes_streamed += bytes_streamed

    def report(self, shard_nbytes: int) -> dict[str, float]:
        return {
            **asdict(self),
            "passes": self.bytes_streamed / shard_nbytes,  # whole-shard passes: a verify pass reads it once
            "gb_per_s": self.bytes_streamed / self.kernel_s / 1e9 if self.kernel_s else 0.0,
        }


def _actor_cpus(config: CpuActorConfig) -> list[int]:
    if config.cpus is not None:
        return list(config.cpus)
    if config.numa_node is not None:
        nodes = {node.id: node for node in numa.topology()}
        if config.numa_node not in nodes:
            raise ValueError(f"NUMA node {config.numa_node} does not exist here; nodes: {sorted(nodes)}")
        return list(nodes[config.numa_node].cpus)
    return sorted(os.sched_getaffinity(0))


def _set_threads(threads: int) -> None:
    limit = numba.config.NUMBA_NUM_THREADS
    if not 1 <= threads <= limit:
        raise ValueError(f"--threads must be in [1, {limit}]; raise the NUMBA_NUM_THREADS environment variable")
    numba.set_num_threads(threads)


def _page_nodes(buffer: np.ndarray) -> dict[int, int] | None:
    """Bytes of the shard on each NUMA node, or None where the kernel cannot tell."""
    try:
        return numa.page_nodes(buffer)
    except RuntimeError:
        return None


def _die_with_parent(parent: int) -> None:
    """Have the kernel send SIGTERM when the process that started this one dies, however it dies (SIGKILL
    included): an orphaned actor would keep its cores spinning and its shard's memory. The signal takes the
    same exit as ``Shutdown``, which removes the session's shared-memory slots. A parent that died before
    the request leaves this process adopted already, which ``getppid`` shows."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        raise _Terminated


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m splitspec.cpu_actor.service", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, type=Path, help="converted folder (`splitspec convert`)")
    p.add_argument("--bits", required=True, type=int, choices=(6, 7, 8), help="residual width to serve")
    p.add_argument("--shard", type=int, default=0, help="this actor's index among --shards")
    p.add_argument("--shards", type=int, default=1, help="how many CPU actors split the rows")
    p.add_argument("--weights", type=_weights, help="each shard's share of the rows, e.g. 3,1 (default: even)")
    p.add_argument(
        "--resident-bytes",
        type=int,
        default=0,
        help="bytes of the residual the engine holds (EngineConfig.resident_bytes): its rows are skipped",
    )
    p.add_argument(
        "--head-share",
        type=float,
        default=0.0,
        help="the CPU actors' part of the lm_head's vocabulary rows (EngineConfig.head_share); 0: none",
    )
    p.add_argument(
        "--base-share",
        type=float,
        default=0.0,
        help="the CPU actors' part of every group's base in a prompt's requests (EngineConfig.base_share)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cpus", type=numa.parse_cpulist, help="CPU list, e.g. 0-7,16-23 (default: all allowed)")
    where.add_argument("--numa-node", type=int, help="run on this node's CPUs")
    p.add_argument("--threads", type=int, help="kernel threads (default: one per CPU)")
    p.add_argument("--no-pin", action="store_true", help="do not restrict the process to its CPUs")
    p.add_argument("--endpoint", default=ChannelConfig().endpoint, help="where to bind; tcp://HOST:0 picks a port")
    p.add_argument("--verify", action="store_true", help="check every file's sha256 before serving")
    p.add_argument("--parent-pid", type=int, help="exit when this process (the starter) dies")
    p.add_argument(
        "--activations",
        choices=ACTIVATION_MODES,
        default=CpuActorConfig.activations,
        help="how the kernel multiplies x' (CpuActorConfig.activations)",
    )
    p.add_argument(
        "--spin-us",
        type=float,
        default=ChannelConfig().spin_us,
        help="how long to watch the slots for the next request before sleeping (ChannelConfig.spin_us)",
    )
    return p.parse_args(argv)


def _weights(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.parent_pid is not None:
        try:
            _die_with_parent(args.parent_pid)
        except _Terminated:
            return 0
    try:
        config = CpuActorConfig(
            threads=args.threads,
            pin=not args.no_pin,
            cpus=args.cpus and tuple(args.cpus),
            numa_node=args.numa_node,
            activations=args.activations,
        )
        cpus = _actor_cpus(config)
        if config.pin:
            numa.pin_to_cpus(cpus)
        _set_threads(config.threads or min(len(cpus), numba.config.NUMBA_NUM_THREADS))
        start = time.perf_counter()
        shard = ResidualShard.load(
            args.model,
            args.bits,
            args.shard,
            args.shards,
            verify=args.verify,
            activations=config.activations,
            weights=args.weights,
            resident_bytes=args.resident_bytes,
            head_share=args.head_share,
            base_share=args.base_share,
        )
        load_s = time.perf_counter() - start
        compile_s = residual.warmup()
        counters = _Counters()
        channel = ChannelConfig(spin_us=args.spin_us, curve=CurveKeys.from_env())  # keys: see start_cpu_actor
        server = Server(shard.shard_info(), counters.counting(shard), channel, args.endpoint, shard.slot_kernels())
    except (ValueError, OSError) as exc:  # a bad folder, shard or CPU list: the user's to fix, not a bug
        print(f"splitspec cpu_actor: {exc}", file=sys.stderr)
        return 1
    info = shard.shard_info()
    ready = {
        "endpoint": server.endpoint,
        "pid": os.getpid(),
        "model_hash": info.model_hash,
        "num_layers": info.num_layers,
        "shards": shards_to_wire(info.shards),
        "base_share": info.base_share,
        "nbytes": shard.nbytes,
        "load_s": load_s,
        "compile_s": compile_s,
        "cpus": cpus if config.pin else None,
        "threads": numba.get_num_threads(),
        "activations": shard.activations,
        "page_nodes": _page_nodes(shard.buffer()),
    }

    def terminate(signum: int, frame: object) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        print(READY + json.dumps(ready), flush=True)
        server.serve_forever()
    except (_Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        server.close()
    counters.add(*server.compiled_counters())
    print(STATS + json.dumps(counters.report(shard.nbytes)), flush=True)
    return 0


# --------------------------------------------------------------------------- launcher


class CpuActorError(RuntimeError):
    """A CPU actor process failed to start; the message quotes what it wrote to stderr."""


class CpuActorProcess:
    """A running CPU actor started by ``start_cpu_actor``; ``stop`` (or leaving ``with``) ends it."""

    def __init__(
        self, proc: subprocess.Popen, ready: dict[str, Any], stderr: IO[bytes], curve: CurveKeys | None = None
    ) -> None:
        self._proc = proc
        self.curve = curve  # the keys its server admits: a polite shutdown needs them too
        self._stderr = stderr
        self.ready = ready  # the READY line: load_s, compile_s, nbytes, cpus, threads, page_nodes
        self.pid: int = proc.pid
        self.endpoint: str = ready["endpoint"]
        shards = shards_from_wire(ready["shards"])
        self.shard_info = ShardInfo(ready["model_hash"], ready["num_layers"], shards, base_share=ready["base_share"])
        self.stats: dict[str, float] | None = None  # the STATS line, once stopped gracefully

    def __enter__(self) -> CpuActorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def wait(self, timeout_s: float | None = None) -> int:
        """The exit code once the actor has exited; raises ``subprocess.TimeoutExpired`` if it has not."""
        return self._proc.wait(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> dict[str, float] | None:
        """Ask for a Shutdown over the protocol, then SIGTERM, then SIGKILL; return the actor's counters."""
        if self.alive():
            self._request_shutdown(timeout_s / 2)
            for escalate in (lambda: None, self._proc.terminate, self._proc.kill):
                escalate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout_s)
                    break
        if self._proc.stdout is not None and not self._proc.stdout.closed:
            for line in self._proc.stdout.read().decode(errors="replace").splitlines():
                if line.startswith(STATS):
                    self.stats = json.loads(line[len(STATS) :])
            self._proc.stdout.close()
        self._stderr.close()
        return self.stats

    def _request_shutdown(self, timeout_s: float) -> None:
        config = ChannelConfig(
            endpoint=self.endpoint,
            transport="tcp",  # a control message needs no shared-memory slots
            slots=1,
            max_tokens=1,
            connect_timeout_s=timeout_s,
            request_timeout_s=timeout_s,
            curve=self.curve,
        )
        try:
            client = Client(self.shard_info.model_hash, config)
            try:
                client.shutdown_server()
            finally:
                client.close()
        except Exception:  # any failure of the polite path leaves the signals in stop() to end it
            pass


def _stderr_tail(stderr: IO[bytes]) -> str:
    stderr.seek(0)
    return stderr.read().decode(errors="replace")[-_STDERR_TAIL:].strip()


def _wait_ready(proc: subprocess.Popen, stderr: IO[bytes], timeout_s: float, what: str) -> dict[str, Any]:
    """Read the child's stdout until its READY line; raise with its stderr if it dies or is too slow."""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                continue
            line = proc.stdout.readline().decode(errors="replace")
            if line.startswith(READY):
                return json.loads(line[len(READY) :])
            if not line:  # EOF: the child is gone
                code = proc.wait()
                raise CpuActorError(f"{what} exited with code {code} before serving:\n{_stderr_tail(stderr)}")
    raise CpuActorError(
        f"{what} did not report READY within {timeout_s:.0f} s (a large shard or a cold numba cache? "
        f"raise timeout_s); its stderr so far:\n{_stderr_tail(stderr)}"
    )


def start_cpu_actor(
    folder: str | Path,
    bits: int,
    index: int = 0,
    n_shards: int = 1,
    cpus: Sequence[int] | None = None,
    endpoint: str | None = None,
    threads: int | None = None,
    timeout_s: float = 120.0,
    spin_us: float | None = None,
    activations: str | None = None,
    curve: CurveKeys | None = None,
    weights: Sequence[float] | None = None,
    resident_bytes: int = 0,
    head_share: float = 0.0,
    base_share: float = 0.0,
) -> CpuActorProcess:
    """Start a CPU actor serving shard ``index`` of ``n_shards`` (rows split by ``weights``, or evenly) of the
    rows an engine holding ``resident_bytes`` of the residual leaves, and of the actors' ``head_share`` of
    the lm_head's rows and ``base_share`` of the base's, and return once it answers requests.

    ``endpoint=None`` binds a free local port (read it from ``.endpoint``), so several actors never collide.
    ``curve``: the server admits only clients with these CURVE keys; they go through the environment,
    which only this user can read, not the command line, which every user can.
    The actor ends when this process does, even when it is killed (``--parent-pid``); the kernel ties it
    to the calling thread, so call this from a thread that lives as long as the actor should (the main
    thread; Ray runs a default actor's methods there too).
    """
    argv = [sys.executable, "-m", "splitspec.cpu_actor.service", "--model", str(folder), "--bits", str(bits)]
    argv += ["--shard", str(index), "--shards", str(n_shards), "--endpoint", endpoint or _LOCAL_ANY_PORT]
    argv += ["--parent-pid", str(os.getpid())]
    if cpus is not None:
        argv += ["--cpus", ",".join(map(str, cpus))]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if spin_us is not None:
        argv += ["--spin-us", str(spin_us)]
    if activations is not None:
        argv += ["--activations", activations]
    if weights is not None:
        argv += ["--weights", ",".join(map(str, weights))]
    if resident_bytes:
        argv += ["--resident-bytes", str(resident_bytes)]
    if head_share:
        argv += ["--head-share", repr(head_share)]
    if base_share:
        argv += ["--base-share", repr(base_share)]
    # stderr goes to a file, not a pipe: nobody reads it while the actor serves, and a full pipe would block it
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- CpuActorProcess owns and closes it
    env = {name: value for name, value in os.environ.items() if name != CURVE_ENV}
    if curve is not None:
        env[CURVE_ENV] = curve.to_env()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env)
    try:
        ready = _wait_ready(proc, stderr, timeout_s, f"CPU actor {index}/{n_shards} of {folder}")
    except BaseException:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        stderr.close()
        raise
    return CpuActorProcess(proc, ready, stderr, curve)


if __name__ == "__main__":
    sys.exit(main())
