"""A second host simulated on this machine: a network namespace (its own addresses and ports, reached
through a veth pair) and a UTS namespace (its own host name, so the channel cannot take it for this host
and picks TCP). The Ray head runs here on the veth address, a Ray worker node inside the namespace, and
one of two CPU actors is placed there; the text must equal the single-host run's. Everything the module
starts (namespace, veth pair, Ray processes) is removed at its end, also when a test fails."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from scheduler_support import ALL_CPUS, unpinned
from splitspec.config import ChannelConfig, EngineConfig, SpecConfig
from splitspec.kernels.shard import head_rows, shard_rows
from splitspec.protocol import HEAD
from splitspec.scheduler.cluster import Deployment, SchedulerConfig, connect_or_start
from splitspec.scheduler.netns import IP, RESOURCE, SecondHost, unavailable
from splitspec.scheduler.probe import row_weights

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

NEW_TOKENS = 40
DROP_TOKENS = 96  # long enough that a drop a third of the way in lands mid-generation
CONFIG = EngineConfig(
    spec=SpecConfig(mode="tree", draft_max=8),  # a fixed shape: both runs verify the same trees
    channel=ChannelConfig(request_timeout_s=10.0, connect_timeout_s=10.0),
)


@pytest.fixture(scope="module")
def second_host() -> Iterator[SecondHost]:
    # joining would otherwise keep a connection another module left open, to another cluster
    assert not ray.is_initialized(), "Ray is still connected from an earlier test module"
    host = SecondHost(cpus=ALL_CPUS)
    try:
        host.create()
        address = host.start_head()
        with unpinned():
            connect_or_start(SchedulerConfig(address=address, node_ip=host.host_ip))
        host.start_worker(address)
        host.wait_nodes(2)
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
    # no row weights given: each actor's share is the read bandwidth of its CPUs, measured where it runs
    assert split.row_weights == row_weights([local["cpus"], remote["cpus"]])
    rows = {group: stop for group, (_, _, stop) in remote["shards"].items()}
    share = CONFIG.actor_head_share(2)  # the lm_head's rows: the same weights, past the engine's part
    for i, actor in enumerate((local, remote)):
        for group, (_, start, stop) in actor["shards"].items():
            w = split.row_weights
            want = head_rows(rows[group], 2, i, w, share) if group == HEAD else shard_rows(rows[group], 2, i, w)
            assert (start, stop) == want, group
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
