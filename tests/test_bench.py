"""Every benchmark runs at its --quick size, so a signature change cannot break one silently."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

BENCHMARKS = sorted(path for path in (REPO / "bench").glob("*.py") if "--quick" in path.read_text())


def test_every_benchmark_script_is_covered():
    assert {path.name for path in BENCHMARKS} >= {"checkpoint_bench.py", "loop_overhead.py"}


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda path: path.name)
def test_benchmark_runs_at_its_quick_size(script, tmp_path):
    result = subprocess.run([sys.executable, str(script), "--quick", "--dir", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "|---" in result.stdout, result.stdout[-2000:]  # it printed its table
    assert "Traceback" not in result.stderr
