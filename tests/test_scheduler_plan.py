"""The plan: row shares, the GPU's share of the residual, descriptions in TOML, this host, `splitspec plan`."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from splitspec.config import SpecConfig
from splitspec.deploy.cli import main
from splitspec.kernels.shard import held_rows, shard_rows
from splitspec.quantize.packing import TILE
from splitspec.scheduler import cost
from splitspec.scheduler.machine import (
    Engine,
    Host,
    Machine,
    MachineFileError,
    ModelShape,
    Node,
    llama_groups,
    machine_from_toml,
    model_from_converted,
    model_from_toml,
    quantity,
)
from splitspec.scheduler.plan import describe, make_plan, resident_budget
from splitspec.scheduler.probe import local_machine

MACHINES = Path(__file__).parents[1] / "benchmarks" / "machines"


def _machine(bandwidths: list[float], gpu_memory: float | None = None, extra: Host | None = None) -> Machine:
    gpu = dict(memory=gpu_memory, reserve=1e9, pcie=12e9) if gpu_memory else {}
    engine = Engine(1e12 if gpu_memory else 10e9, 1e13 if gpu_memory else 50e9, 40e-6, 80e-6, **gpu)
    nodes = tuple(Node(8, bw, 1e12) for bw in bandwidths)
    return Machine("test", engine, (Host("main", nodes), *([extra] if extra else [])))


MODEL = ModelShape("m", 32, llama_groups(4096, 14336, 32, 8, 128), 4096, 128256, 8, ((0.7, 0.15, 0.05),))


def _rows_per_group(plan) -> dict[str, list[tuple[int, int]]]:
    return {g: sorted([(0, plan.resident_rows[g])] + [a.rows[g] for a in plan.actors]) for g, _, _ in MODEL.groups}


def test_plan_partitions_rows_by_bandwidth_and_fits_the_budget():
    plan = make_plan(_machine([30e9, 10e9], gpu_memory=8e9), MODEL)
    for g, rows, _ in MODEL.groups:  # the engine's rows and the actors' cover each group exactly once
        spans = _rows_per_group(plan)[g]
        assert spans[0][0] == 0 and spans[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert 0 < plan.resident_bytes <= resident_budget(plan.machine.engine, MODEL)
    fast, slow = (a.weights(MODEL) for a in plan.actors)
    assert fast / slow == pytest.approx(3, rel=0.02)
    assert make_plan(plan.machine, MODEL, budget=0).resident_bytes == 0
    assert make_plan(_machine([30e9]), MODEL).resident_bytes == 0  # an engine on a CPU core holds none


def test_the_gpu_keeps_room_for_the_requests_k_v():
    """The K/V a GPU engine keeps for requests (serve's budget) is not the residual's: the resident rows
    shrink to fit beside it, and the plan says how much context that holds. A CPU engine's K/V is in RAM."""
    model = replace(MODEL, kv_token_values=2 * 32 * 8 * 128)
    machine, kv = _machine([30e9], gpu_memory=8e9), 2 * 2**30
    engine = machine.engine
    assert resident_budget(engine, model, kv) == pytest.approx(resident_budget(engine, model) - kv)
    roomy, kept = make_plan(machine, model), make_plan(machine, model, kv_bytes=kv)
    assert kept.resident_bytes <= resident_budget(engine, model, kv) < roomy.resident_bytes
    assert "K/V kept on the GPU for requests: 2.15 GB (serve --kv-budget-mb 2048): 8192 tokens" in describe(kept)
    half = make_plan(machine, model, kv_bytes=kv, kv_element=2)  # a bfloat16 cache: twice the tokens
    assert "(serve --kv-budget-mb 2048): 16384 tokens" in describe(half)
    on_cpu = make_plan(_machine([30e9]), model, kv_bytes=kv)
    assert on_cpu.kv_bytes == 0 and "K/V" not in describe(on_cpu)


def test_plan_rows_are_the_rows_the_actors_take():
    """Each actor's planned rows are what a CPU actor started with the plan's weights and resident budget
    takes (``kernels.shard.shard_rows``), so the plan shows the split that will run."""
    plan = make_plan(_machine([36e9, 20e9, 20e9], gpu_memory=8e9), MODEL)
    weights = [a.bandwidth for a in plan.actors]
    for g, rows, _ in MODEL.groups:
        want = [shard_rows(rows, 3, k, weights, plan.resident_rows[g]) for k in range(3)]
        assert [a.rows[g] for a in plan.actors] == want, g


def test_a_gpu_with_room_for_the_whole_residual_leaves_each_actor_a_tile():
    """The engine never runs without its CPU actors: a GPU that could hold every row holds all but a few
    tiles of each group, so that every actor, the slow ones too, still gets a whole tile of each."""
    for bandwidths, held in (([36e9], 0.985), ([36e9, 20e9, 20e9], 0.97), ([36e9, 2e9], 0.9)):
        plan = make_plan(_machine(bandwidths, gpu_memory=80e9), MODEL)
        assert plan.resident_bytes > held * MODEL.residual_bytes()
        for g, rows, _ in MODEL.groups:
            spans = _rows_per_group(plan)[g]
            assert spans[-1][1] == rows and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            assert all(b - a >= TILE for a, b in spans[1:]), (bandwidths, g, spans)
        assert len(plan.parts.actors) == len(bandwidths) and plan.parts.residual_s(1) > 0
    # a group of 4 tiles: none left for the engine beside 4 actors, and 5 cannot split it
    tiny = ModelShape("tiny", 2, llama_groups(64, 128, 4, 4, 16), 64, 100, 8)
    plan = make_plan(_machine([36e9] * 4, gpu_memory=80e9), tiny)
    assert plan.resident_budget == 0 and [a.rows["o"] for a in plan.actors] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    with pytest.raises(ValueError, match="leaves 4 tiles of 16 rows, too few for 5 shards"):
        make_plan(_machine([36e9] * 5, gpu_memory=80e9), tiny)


def test_the_printed_resident_gb_gives_the_engine_the_plans_rows():
    """``--resident-gb`` as the plan prints it, read back as generate and serve read it (whole bytes,
    ``deploy.args.engine_config``), makes the engine hold the plan's rows (``held_rows``), not a tile fewer."""
    rows = {g: r for g, r, _ in MODEL.groups}
    for memory in (6e9, 7e9, 7.3e9, 8e9, 9.1e9, 10e9, 80e9):
        plan = make_plan(_machine([36e9], gpu_memory=memory), MODEL)
        flag = re.search(r"--resident-gb (\S+)\)", describe(plan)).group(1)
        assert held_rows(rows, round(float(flag) * 1e9) / MODEL.residual_bytes()) == plan.resident_rows, memory
        assert plan.resident_budget <= resident_budget(plan.machine.engine, MODEL)


def test_plan_prediction_is_the_cost_models_choice_over_its_parts():
    plan = make_plan(_machine([36e9], gpu_memory=8e9), MODEL)
    costs = cost.pass_costs(plan.parts, 17)
    assert plan.choice == cost.choose(MODEL.rank_stats, costs, 0, 16, min_gain=SpecConfig.min_gain)
    nbytes = plan.actors[0].weights(MODEL) * (8 + 8 / 128) / 8
    assert plan.parts.actors[0].fixed_s == pytest.approx(nbytes / 36e9)  # bytes over the node's bandwidth
    alone = make_plan(plan.machine, replace(MODEL, rank_stats=None))
    assert alone.choice.shape.nodes == 0 and alone.choice.tok_s == pytest.approx(1e3 / alone.verify_ms(1))
    # a second host halves the local share and adds its link's latency to each round trip
    far = Host("far", (Node(8, 36e9, 1e12),), link_bandwidth=1.25e9, link_latency=100e-6)
    two = make_plan(_machine([36e9], gpu_memory=8e9, extra=far), MODEL)
    assert two.parts.latency_s == pytest.approx(140e-6)
    assert two.parts.actors[0].fixed_s == pytest.approx(plan.parts.actors[0].fixed_s / 2, rel=0.02)


def test_model_bytes_match_a_converted_folder(converted_small):
    """The shape's byte counts against the files the converter wrote (planes padded to whole tiles)."""
    shape = model_from_converted(converted_small, 8)
    files = json.loads((converted_small / "manifest.json").read_text())["files"]
    assert shape.layers == 2 and shape.rank_stats is not None
    assert shape.residual_bytes() == pytest.approx(files["residual8.safetensors"]["bytes"], rel=0.03)
    assert shape.base_bytes() == pytest.approx(files["base.safetensors"]["bytes"], rel=0.03)
    with pytest.raises(ValueError, match="no 5-bit residual"):
        model_from_converted(converted_small, 5)


def test_shipped_descriptions_parse():
    box = machine_from_toml(MACHINES / "writeup_box.toml")
    assert box.engine.memory == 32e9 and box.hosts[0].nodes[0].bandwidth == 36e9
    assert len(machine_from_toml(MACHINES / "two_socket.toml").hosts[0].nodes) == 2
    model = model_from_toml(MACHINES / "model_31b.toml")
    assert model.base_bytes() == pytest.approx(7.78e9, rel=0.03)  # the write-up's 2-bit codes of its 31B
    assert model.rank_stats[0][0] == 0.853 and sum(model.rank_stats[0]) == pytest.approx(0.996)
    gemma = model_from_toml(MACHINES / "gemma4_31b.toml")  # its global layers: their own qkv and o
    assert gemma.base_bytes() == pytest.approx(7.78e9, rel=0.005)
    sliding = 50 * (16384 * 5376 + 5376 * 8192)
    assert gemma.linear_params == sliding + 10 * (18432 * 5376 + 5376 * 16384) + 60 * 3 * 21504 * 5376
    assert gemma.kv_token_values == 2 * (50 * 16 * 256 + 10 * 4 * 512)
    # its sliding layers' K/V in rings of window + slack slots: one sequence then grows by the global layers' alone
    assert gemma.sliding_window == 1024 and gemma.sliding_token_values == 2 * 50 * 16 * 256
    budget, ring = 4 * 2**30, 1024 + 22
    assert gemma.context_tokens(budget, 2, 0) == budget // 2 // gemma.kv_token_values
    grown = (budget // 2 - ring * gemma.kv_token_values) // (2 * 10 * 4 * 512)
    assert gemma.context_tokens(budget, 2, 22) == ring + grown > 8 * gemma.context_tokens(budget, 2, 0)
    assert gemma.context_tokens(2**20, 2, 22) == gemma.context_tokens(2**20, 2, 0)  # not even one window
    qwen = model_from_toml(MACHINES / "qwen3_5_27b.toml")  # 48 DeltaNet layers, then 16 with gated q
    mlp = 64 * 3 * 17408 * 5120
    attention = 16 * ((2 * 24 + 2 * 4) * 256 * 5120 + 5120 * 6144)
    assert qwen.linear_params == 48 * (10240 + 6144 + 96) * 5120 + 48 * 5120 * 6144 + attention + mlp
    assert qwen.kv_token_values == 2 * 16 * 4 * 256 and dict(qwen.group_layers) == {"qkv": 48, "qkv#1": 16}
    assert qwen.state_bytes == 2 * 4 * 48 * (48 * 128 * 128 + 3 * 10240)
    budget = 4 * 2**30
    assert qwen.context_tokens(budget, 2, 0) == (budget - qwen.state_bytes) // 2 // qwen.kv_token_values
    plan = make_plan(machine_from_toml(MACHINES / "writeup_box.toml"), gemma)
    assert plan.actors[0].weights(gemma) + plan.resident_bytes / (gemma.residual_weight_bits / 8) == pytest.approx(
        gemma.linear_params
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[gpu]\nmemory = "32 GB"\n', "missing field 'bandwidth'"),
        ('[engine]\nbandwidth = "36 GB"\n', r"bandwidth = '36 GB': give a number with a unit, one of B/s"),
        ("[engine]\nbandwidth = 36\n", "give a number with a unit"),
        ("name = 'x'\n", r"needs a \[gpu\] table"),
        ("[gpu\n", "not valid TOML"),
        ('[engine]\nbandwidth = "0 GB/s"\n', r"engine.bandwidth = '0 GB/s': must be more than 0"),
    ],
)
def test_machine_file_errors_name_the_field(tmp_path, text, message):
    path = tmp_path / "box.toml"
    path.write_text(text)
    with pytest.raises(MachineFileError, match=message):
        machine_from_toml(path)


@pytest.mark.parametrize(
    ("figure", "zero", "field"),
    [
        ('"13 GB/s"', '"0 GB/s"', "gpu.pcie"),
        ('"36 GB/s"', '"0.0 GB/s"', ".numa[0].bandwidth"),
        ('"2.7 TFLOP/s"', '"0 TFLOP/s"', ".numa[0].flops"),
        ('"40 us"', '"0 us"', "gpu.round_trip"),
    ],
)
def test_a_zero_rate_or_time_is_refused(tmp_path, figure, zero, field):
    """A zero PCIe bandwidth would make the bus free, a zero node bandwidth leave its actor no rows: both
    are refused where the file is read, naming the field."""
    path = tmp_path / "box.toml"
    path.write_text((MACHINES / "writeup_box.toml").read_text().replace(figure, zero))
    with pytest.raises(
        MachineFileError, match=rf"box.toml.*{re.escape(field)} = '{re.escape(zero[1:-1])}': must be more"
    ):
        machine_from_toml(path)


def test_model_file_errors(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("layers = 2\nhidden = 64\nintermediate = 128\nheads = 4\nvocab = 100\nresidual_bits = 5\n")
    with pytest.raises(MachineFileError, match="residual_bits = 5"):
        model_from_toml(path)
    path.write_text("layers = 2\nhidden = 64\nheads = 4\n")
    with pytest.raises(MachineFileError, match="missing field 'intermediate'"):
        model_from_toml(path)
    assert quantity("25 us", "time", "x") == pytest.approx(25e-6)
    assert quantity("1.5 GiB", "bytes", "x") == 1.5 * 2**30


def test_this_host_is_measured_once_and_cached(tmp_path):
    cache = tmp_path / "machine.json"
    first = local_machine(cache)
    assert cache.is_file() and all(n.bandwidth > 1e8 and n.flops > 1e8 for n in first.hosts[0].nodes)
    assert local_machine(cache) == first  # read back, not measured again


def test_cli_plan(capsys, tmp_path):
    args = ["plan", "--machine", str(MACHINES / "writeup_box.toml"), "--model", str(MACHINES / "model_31b.toml")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "PREDICTION" in out and "tok/s" in out and "actor 0" in out
    per_token = 2 * 60 * 16 * 128 * 4  # the 31B's K and V over its layers, fp32
    assert f"(serve --kv-budget-mb 2048): {2 * 2**30 // per_token} tokens" in out  # serve's default budget
    assert main([*args, "--kv-budget-mb", "4096", "--kv-dtype", "bfloat16"]) == 0
    assert f"(serve --kv-budget-mb 4096): {8 * 2**30 // per_token} tokens" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text((MACHINES / "writeup_box.toml").read_text().replace('"32 GB"', '"32 parsecs"'))
    assert main(["plan", "--machine", str(bad), "--model", str(MACHINES / "model_31b.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "32 parsecs" in err and "bad.toml" in err
    assert main(["plan", "--machine", str(bad)]) == 2
    assert "exactly one of --model" in capsys.readouterr().err
    big = tmp_path / "big.toml"  # room for the whole residual: the engine holds nearly all, the actor a tile
    big.write_text((MACHINES / "writeup_box.toml").read_text().replace('"32 GB"', '"80 GB"'))
    assert main(["plan", "--machine", str(big), "--model", str(MACHINES / "model_31b.toml")]) == 0
    assert re.search(r"--resident-gb 21\.\d\d\); on CPU actors: 0\.\d\d GB", capsys.readouterr().out)
    crowded = tmp_path / "crowded.toml"  # more NUMA nodes than a group of the model has tiles
    crowded.write_text(
        (MACHINES / "writeup_box.toml").read_text()
        + '\n[[numa]]\ncores = 1\nbandwidth = "36 GB/s"\nflops = "1 TFLOP/s"\n' * 4
    )
    tiny = tmp_path / "tiny.toml"
    tiny.write_text("layers = 2\nhidden = 64\nintermediate = 128\nheads = 4\nvocab = 100\nresidual_bits = 8\n")
    assert main(["plan", "--machine", str(crowded), "--model", str(tiny)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot split tiny over one CPU actor per NUMA node" in err and "at most 4" in err
