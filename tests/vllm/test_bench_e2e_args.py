"""benchmarks/bench_e2e.py's ``--async-scheduling``: every engine gets the setting asked
for, kvbackend's included (its ``engine_kwargs`` without a tier leaves it alone)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_e2e  # noqa: E402


@pytest.mark.parametrize("setting, expected", [("on", True), ("off", False), ("default", None)])
def test_every_engine_runs_with_the_async_scheduling_asked_for(setting, expected):
    args = bench_e2e.argparse.Namespace(system_tokens=100, question_tokens=8, output_tokens=2,
                                        async_scheduling=setting)
    for mode in bench_e2e.ENGINES:
        kwargs = bench_e2e.engine_kwargs(mode, "/nonexistent", args, 1 << 20)
        assert kwargs.get("async_scheduling") is expected, mode
