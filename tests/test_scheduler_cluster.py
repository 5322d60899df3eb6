"""The engine and its CPU actors placed and supervised on a real Ray cluster (one embedded cluster for the
module: Ray takes seconds to start), against the direct-subprocess engine of conftest."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

from scheduler_support import ALL_CPUS, alive, interruptible, unpinned, wait_gone
from splitspec.config import ChannelConfig, EngineConfig
from splitspec.deploy.stopping import descendants
from splitspec.numa import cpulist
from splitspec.protocol import AccessRefused, Client, CurveKeys, RequestTimeout
from splitspec.protocol.messages import SHM_PREFIX, SHM_ROOT
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler.cluster import (
    RAY_ENV,
    Deployment,
    SchedulerConfig,
    SchedulerError,
    _wait_dead,
    bundle_cpus,
    connect_or_start,
)
from splitspec.scheduler.netns import wait_listening
from splitspec.scheduler.topology import hosts_from_ray

NEW_TOKENS = 40
KILL_TOKENS = 96  # long enough that a kill a third of the way in lands mid-generation
HEAD_PROMPT = "Name three rivers of Europe."
# a hung actor is noticed after request_timeout_s and probed for connect_timeout_s: short, for the hang test
TIMEOUTS = ChannelConfig(request_timeout_s=10.0, connect_timeout_s=10.0)


def _segments() -> set[str]:
    return {name for name in os.listdir(SHM_ROOT) if name.startswith(SHM_PREFIX)}


@pytest.fixture(scope="module")
def before(engine):
    """This process's children and the shared-memory segments before the cluster: what must remain after
    it (the direct ``engine`` and its actor are started first, so they are among them)."""
    return set(descendants(os.getpid())), _segments()


@pytest.fixture(scope="module")
def cluster(before):
    """One embedded cluster for the module (``address="local"``: never a cluster someone else runs)."""
    with unpinned():
        cluster = connect_or_start(SchedulerConfig(address="local"))
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def deployment(cluster, converted_small):
    """The engine keeps a quarter of the residual (the plan's VRAM share) and the CPU actor the rest, so
    that the text, kill and hang tests cover the rows split between them too."""
    share = ConvertedModel(converted_small).manifest["files"]["residual8.safetensors"]["bytes"] // 4
    with unpinned():
        deployment = Deployment.start(converted_small, 8, EngineConfig(channel=TIMEOUTS, resident_bytes=share))
    with deployment:
        yield deployment


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """The direct engine's greedy tokens for the first prompt, short and long."""
    return {n: engine.generate(prompts[0], n)[0] for n in (NEW_TOKENS, KILL_TOKENS)}


def test_bundles_share_the_cpus_the_plan_pins():
    assert bundle_cpus([0], [[1]], [0, 1]) == [1.0, 1.0]
    assert bundle_cpus([0], [[1], [1]], [0, 1]) == [1.0, 0.5, 0.5]  # two actors on one CPU: half each
    assert bundle_cpus(None, [None], [0, 1]) == [1.0, 1.0]  # unpinned: both share both CPUs
    assert sum(bundle_cpus([0], [[1, 2], [2, 3], [3]], range(4))) == pytest.approx(4, abs=1e-3)


def test_the_cluster_is_this_host(cluster):
    assert cluster.started and cluster.owned and cluster.address.startswith("127.0.0.1:")
    (host,) = hosts_from_ray(ray.nodes())
    assert host.address == "127.0.0.1" and host.cpus == len(ALL_CPUS)
    again = connect_or_start()  # a second caller in this process joins the same connection, and leaves it
    assert (again.address, again.started, again.owned) == (cluster.address, False, False)
    again.shutdown()
    assert ray.is_initialized()


def test_an_actor_that_cannot_start_is_one_error(cluster, tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    with unpinned(), pytest.raises(SchedulerError, match=r"CPU actor 0/1 of .* exited with code 1"):
        Deployment.start(tmp_path, 8, EngineConfig(), SchedulerConfig(start_timeout_s=120))


def test_ray_path_gives_the_direct_path_text(deployment, reference, prompts):
    tokens, summary = deployment.generate(prompts[0], NEW_TOKENS)
    assert tokens == reference[NEW_TOKENS]
    assert summary["checks"] >= 1 and summary["prompt_tokens"] == len(prompts[0]) and summary["recoveries_s"] == []
    info = deployment.info()
    pids = {info["engine"]["pid"], *(a["pid"] for a in info["cpu_actors"])}
    assert os.getpid() not in pids and len(pids) == 2  # the engine and the CPU actor: their own processes
    assert info["engine"]["transports"] == ["shm"]  # the same host: activations in shared memory, not Ray
    assert all("node:127.0.0.1" in bundle for bundle in info["bundles"])  # held to this host, whatever joins
    starts = {group: row_start for group, (_, row_start, _) in info["cpu_actors"][0]["shards"].items()}
    assert all(start > 0 for start in starts.values()), starts  # the rows before these are the engine's
    if len(ALL_CPUS) >= 2:  # pinned as the direct path pins: the engine and the actor on CPUs of their own
        assert set(info["engine"]["cpus"]).isdisjoint(info["cpu_actors"][0]["cpus"])
    lines = deployment.where()
    assert lines[0].startswith("engine: pid") and lines[1].startswith("CPU actor 0: pid") and "127.0.0.1" in lines[1]


@ray.remote(num_cpus=0)
class _Idle:
    """An actor nobody kills: one that still answers when ``close`` gives up waiting for it to end."""


def test_an_actor_still_answering_at_the_deadline_is_logged(cluster, caplog):
    actor = _Idle.remote()
    ray.get(actor.__ray_ready__.remote())
    with caplog.at_level(logging.WARNING, logger="splitspec.scheduler.cluster"):
        _wait_dead(actor, time.monotonic() + 0.5)
    assert "_Idle" in caplog.text and "has not reported it dead in time" in caplog.text
    caplog.clear()
    ray.kill(actor, no_restart=True)
    with caplog.at_level(logging.WARNING, logger="splitspec.scheduler.cluster"):
        _wait_dead(actor, time.monotonic() + 30)
    assert caplog.text == ""


def test_a_process_outside_the_placement_cannot_use_a_cpu_actor(deployment, prompts, reference):
    """The actor listens on its node's address only, and its channel admits the deployment's keys only."""
    endpoint = deployment.info()["cpu_actors"][0]["endpoint"]
    port = endpoint.rpartition(":")[2]
    listening = subprocess.run(["ss", "-ltnH", "sport", "=", f":{port}"], capture_output=True, text=True).stdout
    assert listening.split()[3] == f"127.0.0.1:{port}", listening  # the plan's address, not 0.0.0.0
    # no keys: refused at the handshake (or, when the server hangs up before the client reads its greeting,
    # never served); another cluster's keys: never served
    for keys in (None, CurveKeys.generate()):
        with pytest.raises((AccessRefused, RequestTimeout)):
            Client("any", ChannelConfig(connect_timeout_s=2.0, curve=keys), endpoint)
    assert deployment.generate(prompts[0], NEW_TOKENS)[0] == reference[NEW_TOKENS]  # and it serves on


def test_a_cpu_actor_killed_mid_generation_is_restarted_and_the_text_is_unchanged(deployment, reference, prompts):
    undisturbed = deployment.generate(prompts[0], KILL_TOKENS)[1]["generate_s"]
    victim = deployment.info()["cpu_actors"][0]
    pending = deployment.engine.generate.remote(list(prompts[0]), KILL_TOKENS)
    time.sleep(undisturbed / 3)
    killed_at = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    tokens, summary = ray.get(pending, timeout=300)
    done_at = time.perf_counter()
    assert tokens == reference[KILL_TOKENS]
    assert len(summary["recoveries_s"]) == 1, "the kill landed outside the generation: raise KILL_TOKENS"
    now = deployment.info()["cpu_actors"][0]
    assert now["pid"] != victim["pid"] and now["endpoint"] != victim["endpoint"] and alive({now["pid"]})
    assert not alive({victim["pid"], victim["actor_pid"]})  # the old service and its Ray actor are gone
    print(
        f"\nrecovery: engine reconnected {summary['recoveries_s'][0]:.2f} s after the loss; the generation took "
        f"{summary['generate_s']:.2f} s against {undisturbed:.2f} s undisturbed (kill to result "
        f"{done_at - killed_at:.2f} s)"
    )
    assert deployment.generate(prompts[0], NEW_TOKENS)[0] == reference[NEW_TOKENS]  # and it keeps serving


def test_a_hung_cpu_actor_is_killed_and_replaced_and_the_text_is_unchanged(deployment, reference, prompts):
    undisturbed = deployment.generate(prompts[0], KILL_TOKENS)[1]["generate_s"]
    victim = deployment.info()["cpu_actors"][0]
    pending = deployment.engine.generate.remote(list(prompts[0]), KILL_TOKENS)
    time.sleep(undisturbed / 3)
    os.kill(victim["pid"], signal.SIGSTOP)  # alive, holding its socket and slots, answering nothing
    try:
        tokens, summary = ray.get(pending, timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["pid"], signal.SIGCONT)
    assert tokens == reference[KILL_TOKENS]
    assert len(summary["recoveries_s"]) == 1, "the stop landed outside the generation: raise KILL_TOKENS"
    assert deployment.info()["cpu_actors"][0]["pid"] != victim["pid"] and not alive({victim["pid"]})
    print(
        f"\nhang: engine reconnected {summary['recoveries_s'][0]:.2f} s after its request timed out "
        f"({TIMEOUTS.request_timeout_s:.0f} s); the generation took {summary['generate_s']:.2f} s"
    )


def test_ray_start_head_workflow(engine, converted_small, tokenizer):
    """``ray start --head`` on loopback, ``splitspec generate`` through it (found through RAY_ADDRESS, as
    ``address="auto"`` does), the engine on the CPU ``--engine-cpus`` names and the CPU actor on the rest,
    then the head stopped; its own temp dir keeps it out of other clusters' way."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {**os.environ, **RAY_ENV, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    ray_cli = [str(Path(sys.executable).parent / "ray")]
    head = [*ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", f"--temp-dir={temp}"]
    head += ["--num-cpus=2", "--include-dashboard=false", "--object-store-memory=200000000", "--block"]
    with unpinned():
        proc = subprocess.Popen(
            head, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
    try:
        wait_listening("127.0.0.1", port, proc)
        cli = [sys.executable, "-m", "splitspec.deploy.cli", "generate", "--converted", str(converted_small)]
        *others, last = sorted(ALL_CPUS)
        cli += ["--max-new-tokens", str(NEW_TOKENS), "--draft", "off", "--engine-cpus", str(last), HEAD_PROMPT]
        with unpinned():
            result = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert f"Ray cluster at 127.0.0.1:{port}" in result.stderr, result.stderr
        if others:
            assert f", CPUs {last}, device cpu" in result.stderr, result.stderr
            assert f", CPUs {cpulist(others)}, {len(others)} threads" in result.stderr, result.stderr
        ids = tokenizer.apply_chat_template([{"role": "user", "content": HEAD_PROMPT}], add_generation_prompt=True)
        tokens = engine.generate(ids["input_ids"] if hasattr(ids, "keys") else ids, NEW_TOKENS)[0]
        expected = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        assert result.stdout.strip() == expected
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_cluster_address_where_nothing_listens_is_one_error(converted_small, command):
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])  # free once closed: nothing listens there
    port = ports[0]
    cli = [sys.executable, "-m", "splitspec.deploy.cli", command, "--converted", str(converted_small)]
    own = ["hi"] if command == "generate" else ["--port", str(ports[1])]
    result = subprocess.run([*cli, "--ray-address", f"127.0.0.1:{port}", *own], capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"cannot reach Ray at 127.0.0.1:{port}" in lines[0] and "ray start --head" in lines[0]


def test_ctrl_c_leaves_no_process_and_no_segment(converted_small):
    """``splitspec generate`` on its own embedded cluster, interrupted mid-generation: it says so, exits 130,
    and takes Ray, the engine and the CPU actor with it."""
    segments = _segments()
    cli = [sys.executable, "-m", "splitspec.deploy.cli", "generate", "--converted", str(converted_small)]
    cli += ["--max-new-tokens", "1000", "--draft", "off", "--ray-address", "local", HEAD_PROMPT]
    with unpinned(), interruptible():
        proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while (line := proc.stderr.readline()) and "CPU actor 0:" not in line:
            pass
        assert line, "the CLI ended before placing its actors"
        time.sleep(1.0)  # generating now
        started = set(descendants(proc.pid))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in err, err
    assert len(started) >= 3 and not wait_gone(started), f"left after Ctrl-C: {alive(started)}"
    assert _segments() - segments == set()


def test_shutdown_leaves_no_process_and_no_segment(cluster, deployment, before):
    """Last: ends the module's deployment and cluster, and checks that everything they started is gone."""
    children, segments = before
    info = deployment.info()
    actors = {info["engine"]["pid"], *(a["pid"] for a in info["cpu_actors"])}
    actors |= {a["actor_pid"] for a in info["cpu_actors"]}
    started = set(descendants(os.getpid())) - children
    assert actors <= started and len(started) > len(actors)  # Ray's own processes and the actors'
    deployment.close()
    assert not wait_gone(actors), "an actor's process outlived Deployment.close"
    cluster.shutdown()
    assert not wait_gone(started), f"processes left after ray.shutdown: {alive(started)}"
    assert _segments() - segments == set()
    deployment.close()  # again, as the fixture's teardown does: nothing, and no new cluster
    assert not ray.is_initialized()
