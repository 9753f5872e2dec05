"""Shared helpers: run the real CLI in a subprocess, on temporary directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FINAL = "step-00000064"


def run_cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` (or `python compare.py ...` when args start with compare.py)."""
    command = [sys.executable, *map(str, args)] if str(args[0]).endswith(".py") else \
        [sys.executable, "-m", "trainer", *map(str, args)]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def train(output: Path, *args, expect: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    result = run_cli("--output", output, *args, env=env)
    assert result.returncode == expect, f"exit {result.returncode}, wanted {expect}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def compare(a: Path, b: Path, *args) -> subprocess.CompletedProcess:
    return run_cli(REPO / "compare.py", a, b, *args)


def generation(output: Path, name: str = FINAL) -> Path:
    return output / "checkpoints" / name


def attempts(output: Path) -> list[dict]:
    folders = sorted((output / "attempts").iterdir())
    return [json.loads((f / "attempt.json").read_text()) for f in folders]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The stderr of a failed run must be exactly one line, with no traceback."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted default run, shared by every test that compares against it."""
    output = tmp_path_factory.mktemp("baseline") / "run"
    train(output)
    return output
