"""The scheduler's view of the hardware: this host from the kernel, other hosts from Ray's node table."""

from __future__ import annotations

import os

from scheduler_support import fake_sysfs
from splitspec.numa import cpulist, parse_cpulist
from splitspec.scheduler.topology import Host, hosts_from_ray, local_gpus, local_host


def test_this_host_is_what_this_process_may_use():
    host = local_host()
    allowed = sorted(os.sched_getaffinity(0))
    assert host.cpu_ids == tuple(allowed) and host.cpus == len(allowed)
    assert host.gpus == local_gpus() >= 0
    assert host.numa, "at least one NUMA node (the whole machine without NUMA support)"
    assert sorted(c for n in host.numa for c in n.cpus) == allowed  # every allowed CPU on exactly one node
    assert host.memory_bytes is None or host.memory_bytes > 2**28
    assert host.address in host.describe() and "node 0" in host.describe()


def test_numa_nodes_are_cut_to_the_allowed_cpus(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    far = max(allowed) + 8  # a CPU this process may not use
    sysfs = fake_sysfs(
        tmp_path, {0: (cpulist(allowed), 1024), 1: (f"{far}-{far + 3}", 2048)}
    )  # node 1 holds none of ours
    host = local_host(sysfs=sysfs, gpus=0)
    assert [n.id for n in host.numa] == [0]
    assert host.numa[0].cpus == tuple(allowed) and host.memory_bytes == 1024 * 1024
    assert host.describe() == f"127.0.0.1: {len(allowed)} CPUs, 0 GPUs, 0 GiB (node 0: CPUs {cpulist(allowed)})"


def test_cpulist_round_trips():
    for cpus in ([0], [0, 1, 2, 3], [0, 2, 3, 4, 8, 10, 11]):
        assert parse_cpulist(cpulist(cpus)) == cpus
    assert cpulist([3, 1, 2, 7]) == "1-3,7"


def test_hosts_from_ray_nodes():
    """The fields ``ray.nodes()`` returns; dead nodes are not hosts (the cluster test reads a live one)."""
    nodes = [
        {"NodeManagerAddress": "10.0.0.2", "Alive": True, "Resources": {"CPU": 32.0, "GPU": 1.0, "memory": 6.4e10}},
        {"NodeManagerAddress": "10.0.0.3", "Alive": False, "Resources": {"CPU": 8.0}},
        {"NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"CPU": 16.0}},
    ]
    assert hosts_from_ray(nodes) == [
        Host("10.0.0.1", 16, 0, None),
        Host("10.0.0.2", 32, 1, 64_000_000_000),
    ]
