"""benchmarks/report.py: the report from the benchmarks' outputs (the committed quick runs)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("matplotlib")
REPORT_DIR = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "report")
sys.path.insert(0, os.path.dirname(REPORT_DIR))
import report  # noqa: E402


def test_tables_are_the_runs_of_table_lines():
    text = "warming up\n| a | b |\n|---|---|\n| 1 | 2 |\nnote\n\n| c |\n|---|"
    assert report.markdown_tables(text) == ["| a | b |\n|---|---|\n| 1 | 2 |", "| c |\n|---|"]


def test_report_has_every_table_and_chart(tmp_path):
    for name in ("bench_ttft.json", "bench_tiers.json", "bench_agents.json", "bench_ttft.txt",
                 "bench_tiers.txt"):
        shutil.copy(os.path.join(REPORT_DIR, name), tmp_path)
    (tmp_path / "bench_core.txt").write_text("progress\n| x |\n|---|\n| 1 |\n")
    text = open(report.write_report(str(tmp_path))).read()
    for png in (report.TTFT_CHART, report.OVERFLOW_CHART, report.AGENTS_CHART):
        assert f"]({png})" in text
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
    assert "## bench_core" in text and "| x |\n|---|\n| 1 |" in text
    assert "| prompt tokens | cold (s)" in text and "## bench_tiers" in text


def test_a_chart_without_its_input_is_left_out(tmp_path):
    text = open(report.write_report(str(tmp_path))).read()
    assert ".png" not in text and not list(tmp_path.glob("*.png"))
