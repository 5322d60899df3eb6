"""Real CPU actor processes: they serve their rows over the protocol, fail loudly and leave nothing behind."""

from __future__ import annotations

import glob
import os
import signal

import numpy as np
import pytest
import torch

from splitspec.config import ChannelConfig
from splitspec.cpu_actor.service import CpuActorError, start_cpu_actor
from splitspec.protocol import Client
from splitspec.quantize import packing
from splitspec.quantize.activations import round_activations
from splitspec.quantize.format import ConvertedModel
from test_protocol_support import hello_without_attaching

BITS = 7
SHM_GLOB = "/dev/shm/splitspec-*"


@pytest.fixture(scope="module")
def model(converted_small):
    return ConvertedModel(converted_small)


@pytest.fixture(scope="module")
def two_actors(model):
    """Two actors splitting every group's rows, one kernel thread each (the test machine has two cores); the
    first multiplies fp32 activations, the second the default int16 ones."""
    actors = []
    try:
        for index, activations in enumerate(("fp32", None)):
            actors.append(
                start_cpu_actor(model.folder, BITS, index=index, n_shards=2, threads=1, activations=activations)
            )
        yield actors
    finally:
        for actor in actors:
            actor.stop()


def _client(actor, transport: str = "auto") -> Client:
    info = actor.shard_info
    return Client(info.model_hash, ChannelConfig(transport=transport), endpoint=actor.endpoint, shards=info.shards)


def _whole_product(model: ConvertedModel, layer: int, group: str, x: np.ndarray) -> np.ndarray:
    return x @ model.residual_weights(BITS, layer, group).T


def _expected(model: ConvertedModel, actors: list, layer: int, group: str, x: np.ndarray) -> np.ndarray:
    """What the actors' parts together should be: each multiplies x as its ``activations`` mode says."""
    exact = _whole_product(model, layer, group, x)
    rounded = _whole_product(model, layer, group, round_activations(torch.from_numpy(x)).numpy())
    parts = []
    for actor in actors:
        shard = actor.shard_info.shards[group]
        ref = rounded if actor.ready["activations"] == "int16" else exact
        parts.append(ref[:, shard.row_start : shard.row_stop])
    return np.concatenate(parts, axis=1)


def _assert_close(got: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("n", [1, 16])
def test_two_actors_together_answer_the_whole_product(model, two_actors, n):
    clients = [_client(actor) for actor in two_actors]
    rng = np.random.default_rng(n)
    try:
        for layer in range(len(model.layers)):
            for group, layout in model.layers[layer].items():
                x = rng.standard_normal((n, layout.d_in)).astype(np.float32)
                got = np.concatenate([c.call(layer, group, x) for c in clients], axis=1)
                _assert_close(got, _expected(model, two_actors, layer, group, x))
        assert all(c.transport == "shm" for c in clients)
        assert clients[0].ping()["requests"] >= 2 * len(model.layers[0])
    finally:
        for c in clients:
            c.close()


def test_ready_line_describes_the_shard(model, two_actors):
    first, second = two_actors
    assert first.shard_info.model_hash == model.conversion_id
    for group, layout in model.layers[0].items():
        a, b = first.shard_info.shards[group], second.shard_info.shards[group]
        assert (a.row_start, a.row_stop, b.row_start, b.row_stop) == (0, b.row_start, a.row_stop, layout.rows)
    total = sum(packing.residual_nbytes(g.rows, g.d_in, BITS) for layer in model.layers for g in layer.values())
    assert first.ready["nbytes"] + second.ready["nbytes"] == total
    assert first.ready["threads"] == 1 and first.ready["compile_s"] >= 0
    assert (first.ready["activations"], second.ready["activations"]) == ("fp32", "int16")


def test_tcp_transport_gives_the_same_answer(model, two_actors):
    layout = model.group(0, "gate_up")
    x = np.random.default_rng(3).standard_normal((3, layout.d_in)).astype(np.float32)
    with _client(two_actors[0], "tcp") as tcp, _client(two_actors[0], "shm") as shm:
        assert tcp.transport == "tcp"
        np.testing.assert_array_equal(tcp.call(0, "gate_up", x), shm.call(0, "gate_up", x))


def test_a_bad_folder_fails_with_the_actors_message(tmp_path):
    with pytest.raises(CpuActorError, match="not a splitspec converted folder"):
        start_cpu_actor(tmp_path, BITS, timeout_s=60)


@pytest.mark.parametrize("how", ["shutdown", "sigterm"])
def test_stop_leaves_no_process_and_no_shared_memory(model, how):
    before = set(glob.glob(SHM_GLOB))
    actor = start_cpu_actor(model.folder, BITS, threads=1)
    with _client(actor) as client:
        x = np.ones((2, model.group(0, "o").d_in), np.float32)
        _assert_close(client.call(0, "o", x), _expected(model, [actor], 0, "o", x))
    # an attached client deleted its slots' directory at once: only slots no client attached are the actor's to
    # remove as it stops
    unattached = hello_without_attaching(actor.endpoint, actor.shard_info.model_hash)
    assert os.path.isdir(unattached)
    if how == "sigterm":
        os.kill(actor.pid, signal.SIGTERM)
        assert actor.wait(10) == 0
    stats = actor.stop()
    assert stats is not None and stats["calls"] == 1, "the actor did not exit through its cleanup"
    assert stats["bytes_streamed"] == sum(a.nbytes for a in model.residual(BITS, 0, "o").values())
    with pytest.raises(ProcessLookupError):
        os.kill(actor.pid, 0)
    assert not os.path.exists(unattached) and set(glob.glob(SHM_GLOB)) - before == set()


# Run in a user and mount namespace of its own, over a /dev/shm of 256 KiB: too small for the slots.
SHM_FULL = """\
import sys
from splitspec.config import ChannelConfig
from splitspec.cpu_actor.service import start_cpu_actor
from splitspec.protocol import Client

actor = start_cpu_actor(sys.argv[1], 7, threads=1)
try:
    info = actor.shard_info
    try:
        Client(info.model_hash, ChannelConfig(transport="shm"), endpoint=actor.endpoint, shards=info.shards)
        print("connected")
    except Exception as e:
        print(type(e).__name__, e)
    print("tcp", Client(info.model_hash, ChannelConfig(transport="tcp"), endpoint=actor.endpoint).transport)
finally:
    actor.stop()
"""


def test_a_full_dev_shm_refuses_the_slots_in_words_and_the_actor_serves_on(model, own_mounts):
    """The slots' segment is allocated when the actor creates it, so a /dev/shm without room for it is a
    refusal that says so at the handshake, not a SIGBUS at the first write into a sparse mapping; the
    actor goes on serving (here a TCP session)."""
    import subprocess
    import sys

    script = f"mount -t tmpfs -o size=256k tmpfs /dev/shm && exec {sys.executable} -c '{SHM_FULL}' {model.folder}"
    cmd = [*own_mounts, "sh", "-c", script]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    refused, tcp = run.stdout.strip().splitlines()
    assert refused.startswith("RemoteError CPU actor replied INVALID: no room in /dev/shm for the channel's slots (")
    assert "free some or give it more (df -h /dev/shm" in refused and tcp == "tcp tcp", run.stdout
