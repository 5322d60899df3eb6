"""The local path: the scheduler's CPU plan, and what the actors' packages may import."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from splitspec.config import EngineConfig
from splitspec.scheduler.cpus import plan_cpus

SRC = Path(__file__).parents[1] / "src"


def test_plan_cpus():
    config = EngineConfig()
    allowed = sorted(os.sched_getaffinity(0))
    engine, actors = plan_cpus(2, [[5], [6, 7]], config)
    assert actors == [(5,), (6, 7)]
    assert plan_cpus(1, None, EngineConfig(pin=False)) == (None, [None])
    if len(allowed) >= 2:
        engine, actors = plan_cpus(1, None, config)
        assert engine == (allowed[0],) and actors == [tuple(allowed[1:])]
    with pytest.raises(ValueError, match="2 CPU actors"):
        plan_cpus(2, [[1]], config)


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
