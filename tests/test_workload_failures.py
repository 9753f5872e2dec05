"""Nothing hangs on the workload's own failures (issue #30): a DataLoader worker that raises
or is killed, a dataset that raises in the trainer's process, a Dataset subclass without
`__getitem__`. Each ends the attempt within seconds, as one line naming where the exception
came from and what it was, with exit 1 and a `failed` record; a stop signal after that never
makes it a resumable 75. Before the fix, workers ignored the trainer's own SIGTERM and the
interpreter's exit waited for them forever.

Cost: six short CLI runs of the toy workload (one epoch, 3 steps), about 5 to 10 s each."""

from __future__ import annotations

import signal

import pytest

from support.cli import finish, one_error_line, run_cli, start
from support.limits import wait_until
from support.runs import attempts

FAILING = ("--workload", "tests/workloads/failing_data.py:FailingData", "--epochs", 1, "--batch-size", 8)
WITHIN_S = 60
"""Far more than a failure needs (about 5 s); a hang would wait forever."""


@pytest.mark.parametrize("workers, failure, said", [
    (2, "raise-at", "the dataset raised in DataLoader worker 1 at tests/workloads/failing_data.py:"),
    (2, "kill-at", "a DataLoader worker died ("),  # torch says "exited unexpectedly" or "killed by signal: Killed"
    (0, "raise-at", "the dataset raised at tests/workloads/failing_data.py:"),
    (1, "abstract", "the dataset raised at "),  # in the trainer: its probe fetch (a stateful() check) comes first
    (0, "loss", "the model or its loss raised at tests/workloads/failing_data.py:"),
], ids=["worker-raises", "worker-killed", "dataset-raises-in-the-trainer", "no-getitem", "loss-raises"])
def test_a_failing_data_code_ends_the_attempt_at_once_naming_where(tmp_path, workers, failure, said):
    run = tmp_path / "run"
    failed = run_cli("--output", run, *FAILING, "--num-workers", workers, "--failure", failure, timeout=WITHIN_S)
    line = one_error_line(failed)
    assert failed.returncode == 1, line
    assert line.startswith(f"trainer: error: {said}"), line
    if failure == "raise-at":
        assert line.endswith(": ValueError: corrupt record 5") and "in __getitem__" in line
    if failure == "kill-at":
        assert "exited unexpectedly" in line or "killed by signal: Killed" in line, line
    if failure == "loss":
        assert line.endswith("in loss_that_fails: RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x4 and "
                             "5x8)"), line
    if failure == "abstract":
        assert line.endswith("NotImplementedError: Subclasses of Dataset should implement __getitem__."), line
    record = attempts(run)[-1]
    assert (record["status"], record["exit_code"]) == ("failed", 1)
    assert record["reason"] == line.removeprefix("trainer: error: ")


def test_a_stop_signal_after_the_failure_was_recorded_does_not_make_it_resumable(tmp_path):
    run, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    process = start(run, *FAILING, "--failure", "raise-at", "--linger-at-exit", marks)
    wait_until(lambda: (marks / "exiting").exists(), "the failed trainer never reached its exit", timeout=WITHIN_S)
    assert attempts(run)[-1]["status"] == "failed"
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGTERM)  # a second one, which exits at once while training
    (marks / "signalled").touch()
    _, err = finish(process, timeout=WITHIN_S)
    assert process.returncode == 1, err
    [line] = err.strip().splitlines()
    assert line.startswith("trainer: error: the dataset raised at ") and line.endswith("corrupt record 5"), err
    assert attempts(run)[-1]["exit_code"] == 1
