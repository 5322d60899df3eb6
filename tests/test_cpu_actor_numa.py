"""NUMA topology from a fake two-node sysfs tree, pinning to a CPU we have, and page placement."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from splitspec.numa import first_touch, page_nodes, parse_cpulist, pin_to_cpus, topology


def test_parse_cpulist():
    assert parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("5") == [5]
    assert parse_cpulist("") == []
    assert parse_cpulist("2,0-1,1") == [0, 1, 2]
    for bad in ("3-1", "a", "1-b", "-2"):
        with pytest.raises(ValueError, match="cpulist"):
            parse_cpulist(bad)


def fake_sysfs(root: Path) -> Path:
    for node, cpus, kb in ((0, "0-3,8-11", 16 * 2**20), (1, "4-7,12-15", 8 * 2**20)):
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree: 1 kB\n")
    for other in ("online", "possible", "has_cpu"):
        (root / other).write_text("0-1\n")
    (root / "power").mkdir()
    return root


def test_two_node_topology(tmp_path):
    nodes = topology(fake_sysfs(tmp_path / "node"))
    assert [n.id for n in nodes] == [0, 1]
    assert nodes[0].cpus == (0, 1, 2, 3, 8, 9, 10, 11)
    assert nodes[1].cpus == (4, 5, 6, 7, 12, 13, 14, 15)
    assert nodes[0].mem_bytes == 16 * 2**30 and nodes[1].mem_bytes == 8 * 2**30


def test_topology_without_numa_is_one_node(tmp_path):
    (nodes,) = topology(tmp_path)
    assert nodes.id == 0 and set(nodes.cpus) == os.sched_getaffinity(0)


def test_this_machine_has_a_node_with_our_cpus():
    nodes = topology()
    assert set().union(*(n.cpus for n in nodes)) >= os.sched_getaffinity(0)


def test_pin_to_a_cpu_we_have():
    saved = os.sched_getaffinity(0)
    cpu = min(saved)
    try:
        pin_to_cpus([cpu])
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, saved)
    with pytest.raises(ValueError, match="at least one"):
        pin_to_cpus([])
    with pytest.raises(ValueError, match="do not exist"):
        pin_to_cpus([10_000])


def test_page_nodes_from_fake_maps(tmp_path):
    maps = tmp_path / "maps"
    numa_maps = tmp_path / "numa_maps"
    maps.write_text(
        "1000-3000 rw-p 00000000 00:00 0\n3000-5000 rw-p 00000000 00:00 0\na0000-c00000 rw-p 00000000 00:00 0 [heap]\n"
    )
    numa_maps.write_text(
        "1000 default anon=2 dirty=2 N0=2 kernelpagesize_kB=4\n"
        "3000 bind:1 anon=2 N0=1 N1=1 kernelpagesize_kB=4\n"
        "a0000 default heap anon=1 N1=1 kernelpagesize_kB=2048\n"
    )
    assert page_nodes((0x3100, 0x3200), numa_maps, maps) == {0: 4096, 1: 4096}
    assert page_nodes((0x2000, 0x3001), numa_maps, maps) == {0: 3 * 4096, 1: 4096}
    assert page_nodes((0xB0000, 0xB0001), numa_maps, maps) == {1: 2 * 2**20}
    assert page_nodes((0x6000, 0x7000), numa_maps, maps) == {}
    with pytest.raises(RuntimeError, match="NUMA support"):
        page_nodes((0, 1), tmp_path / "absent", maps)


@pytest.mark.skipif(not Path("/proc/self/numa_maps").exists(), reason="kernel without NUMA support")
def test_first_touched_pages_land_on_our_node():
    node = next(n for n in topology() if n.cpus and set(n.cpus) & os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    try:
        pin_to_cpus([c for c in node.cpus if c in saved])
        # A fresh anonymous mapping: np.empty may reuse heap pages another test already touched.
        buf = np.frombuffer(mmap.mmap(-1, 8 * 2**20), dtype=np.uint8)
        assert sum(page_nodes(buf).values()) < buf.nbytes  # not touched yet
        first_touch(buf)
        placed = page_nodes(buf)
    finally:
        os.sched_setaffinity(0, saved)
    assert placed.get(node.id, 0) >= buf.nbytes
    with pytest.raises(ValueError, match="contiguous"):
        first_touch(np.empty((4, 4))[:, ::2])
