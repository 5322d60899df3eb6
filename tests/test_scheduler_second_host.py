"""A second host simulated on this machine: a network namespace (its own addresses and ports, reached
through a veth pair) and a UTS namespace (its own host name, so the channel cannot take it for this host
and picks TCP). The Ray head runs here on the veth address, a Ray worker node inside the namespace, and
one of two CPU actors is placed there; the text must equal the single-host run's. Everything the module
starts (namespace, veth pair, Ray processes) is removed at its end, also when a test fails."""

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray

from scheduler_support import unpinned, wait_listening
from splitspec.config import ChannelConfig, EngineConfig, SpecConfig
from splitspec.scheduler.cluster import RAY_ENV, Deployment, SchedulerConfig, connect_or_start

IP = shutil.which("ip") or "/usr/sbin/ip"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(IP, os.X_OK) or shutil.which("unshare") is None,
    reason="a network namespace needs root, iproute2's `ip` and util-linux's `unshare`",
)

RESOURCE = "host2"
NEW_TOKENS = 40
DROP_TOKENS = 96  # long enough that a drop a third of the way in lands mid-generation
CONFIG = EngineConfig(
    spec=SpecConfig(mode="tree", draft_max=8),  # a fixed shape: both runs verify the same trees
    channel=ChannelConfig(request_timeout_s=10.0, connect_timeout_s=10.0),
)
RAY_CLI = str(Path(sys.executable).parent / "ray")
RAY_COMMON = ["--object-store-memory=100000000", "--block", "--disable-usage-stats"]


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
        with unpinned():
            command = [*(prefix or []), RAY_CLI, *args, f"--temp-dir={temp}", *RAY_COMMON]
            self.procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True))

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


def _wait_nodes(n: int, host: SecondHost, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(node["Alive"] for node in ray.nodes()) < n:
        assert all(p.poll() is None for p in host.procs), f"a Ray node exited:\n{host.log_tails()}"
        assert time.monotonic() < deadline, f"the namespace's Ray node did not join:\n{host.log_tails()}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def second_host() -> Iterator[SecondHost]:
    # joining would otherwise keep a connection another module left open, to another cluster
    assert not ray.is_initialized(), "Ray is still connected from an earlier test module"
    host = SecondHost()
    try:
        host.create()
        address = host.start_head()
        with unpinned():
            connect_or_start(SchedulerConfig(address=address, node_ip=host.host_ip))
        host.start_worker(address)
        _wait_nodes(2, host)
        yield host
    finally:
        host.close()


def _deploy(folder: Path, hosts: tuple[str | None, ...], host: SecondHost) -> Deployment:
    scheduler = SchedulerConfig(node_ip=host.host_ip, cpu_actors=2, actor_hosts=hosts, start_timeout_s=180)
    with unpinned():
        return Deployment.start(folder, 8, CONFIG, scheduler)


@pytest.fixture(scope="module")
def single_host(second_host, converted_small, prompts) -> dict[int, list[int]]:
    """The reference: both CPU actors on this host (shared memory), same cluster, same config."""
    with _deploy(converted_small, (), second_host) as deployment:
        assert deployment.info()["engine"]["transports"] == ["shm", "shm"]
        return {n: deployment.generate(prompts[0], n)[0] for n in (NEW_TOKENS, DROP_TOKENS)}


@pytest.fixture(scope="module")
def split(second_host, converted_small, single_host) -> Iterator[Deployment]:
    with _deploy(converted_small, (None, RESOURCE), second_host) as deployment:
        yield deployment


def test_an_actor_on_the_second_host_gives_the_single_host_text(split, single_host, second_host, prompts):
    info = split.info()
    nodes = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    local, remote = info["cpu_actors"]
    assert nodes[info["engine"]["node"]] == nodes[local["node"]] == second_host.host_ip
    assert nodes[remote["node"]] == second_host.ns_ip and remote["endpoint"].startswith(f"tcp://{second_host.ns_ip}:")
    assert info["engine"]["transports"] == ["shm", "tcp"]  # this host's rows in shared memory, the other's by TCP
    assert remote["pid"] in second_host.ours()  # it runs inside the namespace
    tokens, summary = split.generate(prompts[0], NEW_TOKENS)
    assert tokens == single_host[NEW_TOKENS]
    assert summary["recoveries_s"] == []


def test_a_dropped_tcp_connection_mid_generation_is_reconnected(split, single_host, second_host, prompts):
    """The engine's TCP connection to the second host's actor is destroyed (``ss -K``, an RST as a
    reboot of a switch or a NAT timeout would give); the actor lives on. The check in flight is retried
    on a new connection and the text is unchanged."""
    undisturbed = split.generate(prompts[0], DROP_TOKENS)[1]["generate_s"]
    remote = split.info()["cpu_actors"][1]
    port = remote["endpoint"].rpartition(":")[2]
    pending = split.engine.generate.remote(list(prompts[0]), DROP_TOKENS)
    time.sleep(undisturbed / 3)
    dropped = subprocess.run(["ss", "-K", "dst", second_host.ns_ip, "dport", "=", port], capture_output=True, text=True)
    assert f"{second_host.ns_ip}:{port}" in dropped.stdout, dropped.stdout + dropped.stderr
    tokens, summary = ray.get(pending, timeout=300)
    assert tokens == single_host[DROP_TOKENS]
    assert len(summary["recoveries_s"]) == 1, "the drop landed outside the generation: raise DROP_TOKENS"
    assert split.info()["cpu_actors"][1]["pid"] == remote["pid"]  # the same actor: only the connection was lost
    print(
        f"\ndropped TCP peer: engine reconnected {summary['recoveries_s'][0]:.2f} s after the loss; the "
        f"generation took {summary['generate_s']:.2f} s against {undisturbed:.2f} s undisturbed"
    )


def test_closing_leaves_no_namespace_and_no_process(split, second_host):
    """Last: ends the deployment and both Ray nodes, as the fixture's teardown would, and checks."""
    started = second_host.ours() | {p.pid for p in second_host.procs}
    assert len(started) > 2
    split.close()
    second_host.close()
    time.sleep(0.5)
    assert not second_host.ours()
    assert not [pid for pid in started if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
    listed = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout
    assert second_host.netns not in listed
    assert subprocess.run([IP, "link", "show", second_host.veth], capture_output=True).returncode != 0
    assert not any(Path(t).exists() for t in second_host.temps)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    return "Z"
