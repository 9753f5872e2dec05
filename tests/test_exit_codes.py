"""Every exit code of the command-line contract, each with one clear line and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.cli import REPO, one_error_line, run_cli, train
from support.runs import attempts


@pytest.mark.parametrize("args, needle", [
    (["--epochs", "-3"], "--epochs: must be a positive integer"),
    (["--lr", "abc"], "--lr: not a valid float"),
    (["--resume", "sometimes"], "invalid choice: 'sometimes'"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["--allow-drift", "weather"], "--allow-drift: invalid choice"),
    (["--dropout", "1.5"], "--dropout: must be in [0, 1)"),
    (["--resume", "--from-generation", "step-00000008"], "exclusive"),
])
def test_invalid_options_exit_2_and_write_nothing(tmp_path, args, needle):
    output = tmp_path / "run"
    result = run_cli("--output", output, *args)
    assert result.returncode == 2
    assert needle in one_error_line(result)
    assert not output.exists()


def test_missing_output_is_a_usage_error():
    result = run_cli("--epochs", "1")
    assert result.returncode == 2 and "--output" in one_error_line(result)


def test_output_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("keep me")
    result = run_cli("--output", path)
    assert result.returncode == 2 and "is a file" in one_error_line(result)
    assert path.read_text() == "keep me"


def test_nothing_to_resume_exits_66(tmp_path):
    result = run_cli("--output", tmp_path / "empty", "--resume")
    assert result.returncode == 66 and "nothing to resume" in one_error_line(result)
    assert not (tmp_path / "empty").exists()
    (tmp_path / "empty").mkdir()
    result = run_cli("--output", tmp_path / "empty", "--resume", "latest")
    assert result.returncode == 66 and "--resume auto" in one_error_line(result)


def test_unknown_generation_exits_66(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 2)
    result = run_cli("--output", run, "--from-generation", "step-00000099")
    assert result.returncode == 66 and "step-00000099 does not exist" in one_error_line(result)


def test_existing_generations_without_resume_exit_73_untouched(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 2)
    before = sorted(os.listdir(run / "checkpoints")), len(attempts(run))
    result = run_cli("--output", run)
    assert result.returncode == 73 and "--resume" in one_error_line(result)
    assert (sorted(os.listdir(run / "checkpoints")), len(attempts(run))) == before


def test_empty_output_is_refused_not_taken_for_the_current_directory(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer", "--output", "", "--epochs", "1"], cwd=tmp_path,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "--output: must not be empty" in one_error_line(result)
    assert not os.listdir(tmp_path)


def test_output_below_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("x")
    result = run_cli("--output", tmp_path / "file" / "run", "--epochs", 1)
    assert result.returncode == 2 and "part of the path is a file" in one_error_line(result)


@pytest.mark.parametrize("entry, make", [
    ("checkpoints", lambda path: path.write_text("x")),
    ("attempts", lambda path: path.write_text("x")),
    (".trainer.storage.lock", lambda path: path.mkdir()),
])
def test_misplaced_layout_entries_are_refused_before_any_work(tmp_path, entry, make):
    run = tmp_path / "run"
    run.mkdir()
    make(run / entry)
    result = run_cli("--output", run, "--epochs", 1, "--resume", "auto")
    assert result.returncode == 73 and f"{run / entry} is a" in one_error_line(result)
    assert sorted(os.listdir(run)) == [entry]


def test_interrupt_exits_75_and_records_it(tmp_path):
    run = tmp_path / "run"
    result = train(run, "--interrupt-at-step", 3, expect=75)
    assert one_error_line(result) == ("trainer: stopped, resumable (exit 75): --interrupt-at-step 3: stopped "
                                      "without saving; to continue, rerun with --resume auto")
    record = attempts(run)[-1]
    assert record["status"] == "interrupted" and record["exit_code"] == 75 and record["last_step"] == 3
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")


def test_help_exits_0():
    result = run_cli("--help")
    assert result.returncode == 0 and "--resume" in result.stdout
