"""The local path: the scheduler's CPU plan, CPU actor processes that end with their starter, and what the
actors' packages may import."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler_support import fake_sysfs, unpinned
from splitspec.config import EngineConfig
from splitspec.numa import NumaNode, cpulist
from splitspec.protocol.messages import SHM_PREFIX, SHM_ROOT
from splitspec.scheduler.cpus import plan_cpus
from splitspec.scheduler.topology import Host, local_host

SRC = Path(__file__).parents[1] / "src"


def test_plan_cpus():
    config = EngineConfig()
    allowed = sorted(os.sched_getaffinity(0))
    engine, actors = plan_cpus(2, [[5], [6, 7]], config)
    assert engine == (allowed[0],) and actors == [(5,), (6, 7)]  # the engine on the first allowed CPU
    engine, actors = plan_cpus(2, [[5], [6, 7]], EngineConfig(engine_cpus=(allowed[-1],)))
    assert engine == (allowed[-1],) and actors == [(5,), (6, 7)]
    assert plan_cpus(1, None, EngineConfig(pin=False)) == (None, [None])
    with pytest.raises(ValueError, match="2 CPU actors"):
        plan_cpus(2, [[1]], config)
    with pytest.raises(ValueError, match=r"the engine's CPUs .* are not all among the CPUs this process may use"):
        plan_cpus(1, None, EngineConfig(engine_cpus=(max(allowed) + 1,)))


def test_plan_cpus_keeps_the_engine_off_the_actors_cpus():
    with unpinned():  # the session's engine fixture pins this process to one CPU
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 2:
            pytest.skip(f"this machine has {len(allowed)} CPU: with one, plan_cpus pins nothing")
        assert plan_cpus(1, None, EngineConfig()) == ((allowed[0],), [tuple(allowed[1:])])
        last = EngineConfig(engine_cpus=(allowed[-1],))
        assert plan_cpus(1, None, last) == ((allowed[-1],), [tuple(allowed[:-1])])
        assert plan_cpus(1, [allowed[1:]], EngineConfig()) == ((allowed[0],), [tuple(allowed[1:])])


def test_plan_cpus_gives_each_numa_node_its_actors(tmp_path):
    """Actors that come a whole number per NUMA node split their node's CPUs (less the engine's), the CPUs
    whose bandwidth ``probe`` measured for that node's actor; other counts take runs of all the CPUs."""
    nodes = (NumaNode(0, (0, 1, 2, 3), None), NumaNode(1, tuple(range(4, 16)), None))
    host = Host("127.0.0.1", 16, 0, None, nodes, tuple(range(16)))
    config = EngineConfig()
    assert plan_cpus(2, None, config, host) == ((0,), [(1, 2, 3), tuple(range(4, 16))])
    assert plan_cpus(4, None, config, host) == ((0,), [(1,), (2, 3), tuple(range(4, 10)), tuple(range(10, 16))])
    assert plan_cpus(3, None, config, host) == ((0,), [tuple(range(1, 6)), tuple(range(6, 11)), tuple(range(11, 16))])
    assert plan_cpus(1, None, config, host) == ((0,), [tuple(range(1, 16))])
    engine_apart = EngineConfig(engine_cpus=(4, 5))  # an engine on node 1 leaves node 0 whole to its actor
    assert plan_cpus(2, None, engine_apart, host) == ((4, 5), [(0, 1, 2, 3), tuple(range(6, 16))])
    with unpinned():  # the session's engine fixture pins this process to one CPU
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 2:
            pytest.skip(f"this machine has {len(allowed)} CPU: too few for two NUMA nodes of its own")
        # this process's own CPUs on a fake two-node tree: node 0 holds only the engine's CPU, which its actor
        # shares
        sysfs = fake_sysfs(tmp_path, {0: (cpulist(allowed[:1]), 1024), 1: (cpulist(allowed[1:]), 1024)})
        here = local_host(sysfs=sysfs, gpus=0)
        assert plan_cpus(2, None, config, here) == ((allowed[0],), [(allowed[0],), tuple(allowed[1:])])


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaps (as good as gone: it holds no memory or segment)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _segments() -> set[str]:
    return {p.name for p in Path(SHM_ROOT).glob(f"{SHM_PREFIX}*")}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_cpu_actors_die_with_the_engine_process(converted_small, sig):
    """An engine process killed without a chance to clean up takes its CPU actors and their slots with it."""
    before = _segments()
    script = (
        "import sys, time\n"
        "from splitspec.config import EngineConfig\n"
        "from splitspec.scheduler.local import start_local\n"
        f"engine = start_local({str(converted_small)!r}, 8, config=EngineConfig(prefill='split'))\n"
        "engine.generate([1, 2, 3], 2)\n"  # a session: the actor maps its shared-memory slots
        "print(engine.actors[0].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        actor = int(proc.stdout.readline())
        assert not _gone(actor)
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while not _gone(actor) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(actor), f"CPU actor {actor} outlived its engine process (signal {sig.name})"
        deadline = time.monotonic() + 5  # other tests' handshakes make short-lived segments too
        while _segments() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _segments() - before
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import in a source file, relative ones resolved."""
    package = ".".join(path.relative_to(SRC).with_suffix("").parts[:-1])
    found = []
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            found += [(f"{module}.{alias.name}", id(node) in top) for alias in node.names]
    return found


def _modules(package: str) -> list[Path]:
    return sorted((SRC / package.replace(".", "/")).rglob("*.py"))


def test_gpu_actor_imports_nothing_of_cpu_actor():
    """What both actors need lives in ``splitspec.kernels``: the engine reaches CPU actors only through the
    protocol and the scheduler."""
    offending = [
        f"{path.relative_to(SRC)}: {module}"
        for path in _modules("splitspec.gpu_actor")
        for module, _ in _imports(path)
        if module == "splitspec.cpu_actor" or module.startswith("splitspec.cpu_actor.")
    ]
    assert not offending


def test_scheduler_modules_do_not_import_torch_at_module_level():
    """The scheduler wires and supervises; tensor work is the engine's. Torch only inside the functions that
    ask about the hardware (GPU count, a compute probe), so that planning never loads it by itself."""
    at_module_level = [
        f"{path.relative_to(SRC)}: {module}"
        for path in _modules("splitspec.scheduler")
        for module, at_top in _imports(path)
        if at_top and module.split(".")[0] == "torch"
    ]
    assert not at_module_level


def test_actors_sharing_rows_by_weight_give_the_same_text(converted_small, prompts, tokenizer):
    """Two CPU actors holding 3/4 and 1/4 of every group's rows (as a plan sizes them by bandwidth)
    serve the same residual: the greedy text equals one actor's."""
    from splitspec.config import SpecConfig
    from splitspec.scheduler.local import start_local

    config = EngineConfig(prefill="split", spec=SpecConfig(mode="off"))
    with start_local(converted_small, 8, n_cpu_actors=1, config=config) as one:
        expected = one.generate(prompts[0], 12, tokenizer.eos_token_id)[0]
    with start_local(converted_small, 8, n_cpu_actors=2, config=config, row_weights=(3, 1)) as two:
        rows = [a.shard_info.shards["qkv"] for a in two.actors]
        assert rows[0].row_stop - rows[0].row_start > 2 * (rows[1].row_stop - rows[1].row_start)
        assert two.generate(prompts[0], 12, tokenizer.eos_token_id)[0] == expected


def test_engine_holding_a_share_of_the_residual_gives_the_same_text(converted_small, prompts, tokenizer):
    """The engine keeps a third of the residual (``resident_bytes``, the plan's VRAM share) and multiplies it
    in every pass; two CPU actors started with the same figure serve only the rows after it. Each group's
    y_r equals the whole residual's (an in-process reference over every row), and the greedy text the one
    of an engine that keeps none.

    The two actors also multiply two thirds of the lm_head (``head_share``'s default): the engine's logits
    through them equal its own whole head's, bit for bit, for one row, for more than one request of rows,
    and past what the slots hold (then the engine's whole head runs); the engine it is compared with keeps
    the whole head (``head_share=0``)."""
    import torch

    from splitspec.config import SpecConfig
    from splitspec.gpu_actor.residual import LocalResidual
    from splitspec.protocol import HEAD, HEAD_TOKENS
    from splitspec.quantize.format import ConvertedModel
    from splitspec.quantize.packing import residual_nbytes
    from splitspec.scheduler.local import start_local

    converted = ConvertedModel(converted_small)
    total = sum(residual_nbytes(g.rows, g.d_in, 8) for layer in converted.layers for g in layer.values())
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="off"), resident_bytes=total // 3)
    whole = LocalResidual.load(converted_small, 8)
    with start_local(converted_small, 8, n_cpu_actors=2, config=config) as engine:
        held = engine.device_residual.rows
        for group, rows in held.items():
            starts = [a.shard_info.shards[group].row_start for a in engine.actors]
            assert 0 < rows == starts[0] < starts[1], (group, rows, starts)
        torch.manual_seed(0)
        for name, layout in converted.layers[1].items():
            x = torch.randn(3, layout.d_in)
            want = whole.gather(whole.submit(1, name, x))
            got = engine.residual.gather(engine.residual.submit(1, name, x))
            assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), name
        assert engine.device_residual.held_s > 0
        vocab = converted.spec.vocab
        heads = [a.shard_info.shards[HEAD] for a in engine.actors]
        assert engine.residual.head_start == heads[0].row_start == int(vocab / 3 / 16) * 16
        assert heads[0].row_stop == heads[1].row_start and heads[1].row_stop == vocab
        model = engine.model
        for n in (1, HEAD_TOKENS + 3, engine.residual.max_head_rows + 1):  # the last: more than the slots hold
            h = torch.randn(n, converted.spec.hidden, generator=torch.Generator().manual_seed(n))
            assert torch.equal(model.logits(h, residual=engine.residual), model.logits(h))
        text = engine.generate(prompts[0], 12, tokenizer.eos_token_id)[0]
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="off"), head_share=0)
    with start_local(converted_small, 8, n_cpu_actors=1, config=config) as plain:
        assert text == plain.generate(prompts[0], 12, tokenizer.eos_token_id)[0]


def test_engine_holding_every_row_leaves_the_actors_nothing_and_says_so(converted_small):
    from splitspec.cpu_actor.service import CpuActorError
    from splitspec.scheduler.local import start_local

    config = EngineConfig(prefill="split", resident_bytes=10**12)
    with pytest.raises(CpuActorError, match=r"lower EngineConfig\.resident_bytes"):
        start_local(converted_small, 8, config=config)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="compares one CPU's bandwidth with two CPUs'")
def test_actors_without_weights_split_the_rows_by_their_cpus_bandwidth(converted_small):
    """No ``row_weights``: each actor's share is the read bandwidth of its CPUs, as the plan splits rows (one
    CPU against two here, which read at different rates); their part of the lm_head is split the same way."""
    from splitspec.config import SpecConfig
    from splitspec.kernels.shard import head_rows, shard_rows
    from splitspec.protocol import HEAD
    from splitspec.scheduler.local import start_local
    from splitspec.scheduler.probe import row_weights

    cpus = [[0], [0, 1]]
    weights = row_weights(cpus)
    if abs(weights[1] / weights[0] - 1) <= 0.1:  # then the split could not be told from an even one
        pytest.skip(f"one CPU and two read at {weights} B/s here, within 10%: this VM cannot tell them apart")
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="off"))
    with start_local(converted_small, 8, n_cpu_actors=2, cpus=cpus, config=config) as two:
        served = [a.shard_info.shards for a in two.actors]
    rows = {group: shard.row_stop for group, shard in served[1].items()}
    share = config.actor_head_share(2)
    for i, shards in enumerate(served):
        for group, shard in shards.items():
            split = head_rows(rows[group], 2, i, weights, share) if group == HEAD else None
            assert (shard.row_start, shard.row_stop) == (split or shard_rows(rows[group], 2, i, weights)), group
