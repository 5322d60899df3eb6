"""A second host simulated on this machine, for the scaling experiments and the tests: a network namespace
(its own addresses and ports, reached through a veth pair) and a UTS namespace (its own host name, so the
channel cannot take it for this host and picks TCP). A Ray head runs here on the veth address (loopback
is not reachable from inside the namespace) and a Ray worker node inside the namespace, marked with the
``RESOURCE`` node resource that ``SchedulerConfig.actor_hosts`` names. Needs root, iproute2's ``ip`` and
util-linux's ``unshare``; ``close`` removes the namespace and every process it started, by their ids.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from splitspec.scheduler.cluster import RAY_ENV

IP = shutil.which("ip") or "/usr/sbin/ip"
RESOURCE = "host2"
RAY_CLI = str(Path(sys.executable).parent / "ray")
RAY_COMMON = ["--object-store-memory=100000000", "--block", "--disable-usage-stats"]


def unavailable() -> str | None:
    """Why no namespace can be made here, or None."""
    if os.geteuid() != 0 or not os.access(IP, os.X_OK) or shutil.which("unshare") is None:
        return "a network namespace needs root, iproute2's `ip` and util-linux's `unshare`"
    return None


def wait_listening(host: str, port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until a ``ray start --head`` (``proc``) accepts connections on ``host:port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("ray start --head exited")
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"ray start --head did not listen on {host}:{port} within {timeout_s:.0f} s")


def _ip(*args: str, netns: str | None = None) -> None:
    prefix = [IP, "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, IP, *args], check=True, capture_output=True, text=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 no interface of this machine uses: one address for each end of the veth pair."""
    taken = subprocess.run([IP, "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    while True:
        net = ipaddress.IPv4Network(f"10.{secrets.randbelow(50) + 200}.{secrets.randbelow(256)}.0/30")
        if f" 10.{net.network_address.packed[1]}.{net.network_address.packed[2]}." not in taken:
            return net


@dataclass
class SecondHost:
    """The namespace, its veth pair and the two Ray nodes; ``close`` removes all of it and may run twice."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    cpus: set[int] = field(default_factory=lambda: os.sched_getaffinity(0))  # the Ray nodes' processes run on
    procs: list[subprocess.Popen] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.netns, self.veth = f"splitspec-{self.tag}", f"ssv{self.tag}"
        net = _free_subnet()
        self.host_ip, self.ns_ip = (str(a) for a in net.hosts())
        self.prefix = net.prefixlen

    def create(self) -> None:
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", f"{self.veth}n")
        _ip("link", "set", f"{self.veth}n", "netns", self.netns)
        _ip("addr", "add", f"{self.host_ip}/{self.prefix}", "dev", self.veth)
        _ip("link", "set", self.veth, "up")
        _ip("addr", "add", f"{self.ns_ip}/{self.prefix}", "dev", f"{self.veth}n", netns=self.netns)
        _ip("link", "set", f"{self.veth}n", "up", netns=self.netns)
        _ip("link", "set", "lo", "up", netns=self.netns)

    def start_head(self, timeout_s: float = 120.0) -> str:
        """The Ray head here, on the veth address; returns its address."""
        with socket.socket() as s:
            s.bind((self.host_ip, 0))
            port = s.getsockname()[1]
        head = ["start", "--head", f"--node-ip-address={self.host_ip}", f"--port={port}", "--num-cpus=2"]
        self._ray([*head, "--include-dashboard=false"])
        wait_listening(self.host_ip, port, self.procs[0], timeout_s)
        return f"{self.host_ip}:{port}"

    def start_worker(self, address: str) -> None:
        """A Ray worker node in the namespace, with its own host name too (the same boot id and name would
        read as this host to the channel). Started after this process joined the head: joining turned
        Ray's token authentication on in this environment if the head has it, and the worker needs the same."""
        worker = ["start", f"--address={address}", f"--node-ip-address={self.ns_ip}", "--num-cpus=1"]
        inside = [IP, "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
        self._ray([*worker, f"--resources={json.dumps({RESOURCE: 1})}"], [*inside, f"splitspec-{self.tag}"])

    def _ray(self, args: list[str], prefix: list[str] | None = None) -> None:
        temp = tempfile.mkdtemp(prefix=f"ss{self.tag}-", dir="/tmp")  # short: Ray's socket paths live here
        self.temps.append(temp)
        log = open(os.path.join(temp, "ray-start.log"), "wb")  # noqa: SIM115 -- closed with the temp dir
        env = {**os.environ, **RAY_ENV, "RAY_USAGE_STATS_ENABLED": "0"}
        if prefix is not None:  # a worker node: Ray refuses to join one that runs with this variable at 0
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        env.pop("RAY_ADDRESS", None)
        command = [*(prefix or []), RAY_CLI, *args, f"--temp-dir={temp}", *RAY_COMMON]
        pinned = os.sched_getaffinity(0)  # a child inherits the starting thread's CPUs
        os.sched_setaffinity(0, self.cpus)
        try:
            self.procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True))
        finally:
            os.sched_setaffinity(0, pinned)

    def log_tails(self) -> str:
        tails = []
        for temp in self.temps:
            with contextlib.suppress(OSError):
                tails.append(Path(temp, "ray-start.log").read_text(errors="replace")[-1500:])
        return "\n---\n".join(tails)

    def ours(self) -> set[int]:
        """Every live process this module started: in the namespace, or naming one of its temp dirs."""
        pids = set()
        listed = subprocess.run([IP, "netns", "pids", self.netns], capture_output=True, text=True)
        pids |= {int(p) for p in listed.stdout.split()}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    cmdline = (entry / "cmdline").read_bytes()
                    if any(t.encode() in cmdline for t in self.temps):
                        pids.add(int(entry.name))
        return pids - {os.getpid()}

    def close(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        for proc in self.procs:  # `ray start --block` ends its node's processes when signalled...
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5  # ...politely, in half a minute: nothing here is worth the wait
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for _ in range(40):  # whatever is left, by its own id, never by name
            if not (left := self.ours()):
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.25)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run([IP, "netns", "del", self.netns], capture_output=True)  # takes the veth pair with it
        subprocess.run([IP, "link", "del", self.veth], capture_output=True)
        for temp in self.temps:
            shutil.rmtree(temp, ignore_errors=True)

    def wait_nodes(self, n: int, timeout_s: float = 120.0) -> None:
        """Until the connected cluster has ``n`` live nodes."""
        deadline = time.monotonic() + timeout_s
        while sum(node["Alive"] for node in ray.nodes()) < n:
            if not all(p.poll() is None for p in self.procs):
                raise RuntimeError(f"a Ray node exited:\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the namespace's Ray node did not join:\n{self.log_tails()}")
            time.sleep(0.5)
