"""The local path: the scheduler's CPU plan, and CPU actor processes that end with their starter."""

from __future__ import annotations

import os

import pytest

from splitspec.config import EngineConfig
from splitspec.scheduler.cpus import plan_cpus


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
