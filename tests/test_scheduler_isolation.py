"""Which cluster ``connect_or_start`` joins when it is given no address: one a user started with ``ray start``,
never another process's embedded one. Each process here is a real ``splitspec`` process on a real Ray
cluster, under a private Ray temp dir (``RAY_TMPDIR``), so that a cluster someone else runs on this
machine is neither found nor disturbed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_support import unpinned
from splitspec.scheduler.cluster import RAY_ENV
from splitspec.scheduler.netns import wait_listening

# connects as ``splitspec generate`` does, says where it landed, and holds the cluster until told to go
JOINER = """
import json, sys
import ray
from splitspec.scheduler.cluster import SchedulerConfig, connect_or_start
cluster = connect_or_start(SchedulerConfig(num_cpus=1))
where = {"address": cluster.address, "started": cluster.started, "node": ray.get_runtime_context().get_node_id()}
print(json.dumps(where), flush=True)
sys.stdin.readline()
cluster.shutdown()
"""


@pytest.fixture
def ray_tmpdir() -> Iterator[str]:
    temp = tempfile.mkdtemp(prefix="ssiso", dir="/tmp")  # short: Ray's socket paths live under it
    yield temp
    shutil.rmtree(temp, ignore_errors=True)


def _env(ray_tmpdir: str) -> dict[str, str]:
    env = {**os.environ, **RAY_ENV, "RAY_TMPDIR": ray_tmpdir, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


@contextlib.contextmanager
def _joiner(env: dict[str, str]) -> Iterator[dict]:
    """A process that ran ``connect_or_start()`` and still holds its connection: where it landed."""
    with unpinned():
        proc = subprocess.Popen(
            [sys.executable, "-c", JOINER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    try:
        line = proc.stdout.readline()
        assert line, f"the process ended before connecting:\n{proc.stderr.read()[-3000:]}"
        yield json.loads(line)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_two_embedded_clusters_do_not_join_each_other(ray_tmpdir):
    env = _env(ray_tmpdir)
    with _joiner(env) as first, _joiner(env) as second:
        assert first["started"] and second["started"], (first, second)
        assert first["address"] != second["address"] and first["node"] != second["node"]
    assert not Path(ray_tmpdir, "ray", "ray_current_cluster").exists()  # nothing recorded for others to find


def test_a_ray_start_cluster_is_joined_beside_an_embedded_one(ray_tmpdir):
    """With an embedded cluster running, ``ray start --head`` (recorded in Ray's temp dir, no RAY_ADDRESS)
    is the one a new process joins; once that head is gone, its record left behind, a new process starts
    its own again."""
    env = _env(ray_tmpdir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1"]
    head += [f"--port={port}", "--num-cpus=1", "--include-dashboard=false", "--object-store-memory=100000000"]
    head += ["--disable-usage-stats", "--block"]
    record = Path(ray_tmpdir, "ray", "ray_current_cluster")
    with _joiner(env) as embedded:
        with unpinned():
            proc = subprocess.Popen(
                head, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
        try:
            wait_listening("127.0.0.1", port, proc)
            while not record.exists():
                assert proc.poll() is None, "ray start --head exited"
                time.sleep(0.2)
            with _joiner(env) as joined:
                assert not joined["started"] and joined["address"] == f"127.0.0.1:{port}", joined
                assert joined["address"] != embedded["address"]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)  # `--block` takes its node's processes with it
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert record.read_text().strip() == f"127.0.0.1:{port}"  # stale now: nothing listens there
        with _joiner(env) as after:
            assert after["started"] and after["address"] not in (embedded["address"], f"127.0.0.1:{port}")
