"""`splitspec plan`: the scheduler's plan and the cost model's prediction, for this host or a described one.

Kept out of ``deploy.cli`` (which only hooks ``add_parser``), and light: it needs neither torch nor Ray
unless it measures this host.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from splitspec.config import KV_DTYPES, BatchConfig, EngineConfig
from splitspec.deploy.args import CliError, positive_int, residual_width


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan",
        parents=[common],
        help="who streams which residual rows, and the predicted verify time and tok/s (a prediction)",
    )
    p.add_argument("--machine", help="a machine described in TOML (default: this host, measured once and cached)")
    p.add_argument("--model", help="a model's shape in TOML (layers, hidden, intermediate, heads, vocab, ...)")
    p.add_argument("--converted", help="a folder written by `splitspec convert` (the shape it streams)")
    p.add_argument("--bits", type=residual_width, default=None, help="residual width (default: the model's)")
    p.add_argument("--vram-budget-gb", type=float, default=None, help="cap the residual held in GPU memory")
    p.add_argument("--draft-max", type=positive_int, default=16, help="largest draft tree the plan weighs")
    mib = BatchConfig.kv_budget_bytes // 2**20
    p.add_argument(
        "--kv-budget-mb",
        type=positive_int,
        default=mib,
        help="K/V memory a GPU engine keeps for requests (serve's --kv-budget-mb), not given to the residual",
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=EngineConfig.kv_dtype, help="the K/V cache's element")
    p.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    from splitspec.scheduler.machine import machine_from_toml, model_from_converted, model_from_toml
    from splitspec.scheduler.plan import describe, make_plan

    if (args.model is None) == (args.converted is None):
        raise CliError("give the model as exactly one of --model FILE.toml or --converted FOLDER")
    if args.vram_budget_gb is not None and args.vram_budget_gb < 0:
        raise CliError(f"--vram-budget-gb must be >= 0, got {args.vram_budget_gb}")
    try:
        if args.converted is not None:
            bits = args.bits or _widest(args.converted)
            model = model_from_converted(args.converted, bits)
        else:
            model = model_from_toml(args.model)
            if args.bits is not None:
                model = replace(model, residual_bits=args.bits)
        if args.machine is not None:
            machine = machine_from_toml(args.machine)
        else:
            from splitspec.scheduler.probe import local_machine

            machine = local_machine()
    except ValueError as e:  # a bad description (MachineFileError), a corrupt folder, a width it lacks
        raise CliError(str(e)) from e
    budget = None if args.vram_budget_gb is None else args.vram_budget_gb * 1e9
    kv = {"kv_bytes": args.kv_budget_mb * 2**20, "kv_element": 4 if args.kv_dtype == "float32" else 2}
    try:
        plan = make_plan(machine, model, budget, draft_max=args.draft_max, **kv)
    except ValueError as e:  # a group with fewer tiles than there are CPU actors (one per NUMA node) to split it
        raise CliError(f"cannot split {model.name} over one CPU actor per NUMA node of {machine.name}: {e}") from e
    print(describe(plan))
    return 0


def _widest(folder: str) -> int:
    if not (Path(folder) / "manifest.json").is_file():
        raise CliError(f"{folder}: not a converted folder (no manifest.json); give the output of `splitspec convert`")
    from splitspec.quantize.format import ConvertedModel

    return ConvertedModel(folder).residual_bits[-1]
