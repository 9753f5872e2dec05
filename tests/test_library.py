"""Recovery in a user's own loop (trainer/recovery/, docs/library.md), through the real thing:
the example scripts run as processes, killed with kill -9 and stopped with SIGTERM, resumed,
and compared field by field with an uninterrupted run; the witness's verdict read from the
attempt records that `report` reads."""

from __future__ import annotations

import signal
import subprocess

from conftest import REPO, attempts, compare, generation, run_cli, scaled, trainer_env, zygote

OWN_LOOP = REPO / "examples" / "own_loop.py"
EPOCHS = ("--epochs", "3")  # 12 batches an epoch, a generation every 10 steps: each one mid-epoch
FINAL = "step-00000036"


def run_until(script, output, step: int, stop: int, *args) -> tuple[subprocess.Popen, str]:
    """The script on `output`, sent `stop` once it printed `step=<step>` (or a later step)."""
    process = zygote().spawn([str(script), str(output), *map(str, args)], REPO, trainer_env(), new_session=False)
    for line in process.stdout:
        if line.startswith("step=") and int(line.split()[0].split("=")[1]) >= step:
            process.send_signal(stop)
            break
    out, err = process.communicate(timeout=scaled(300))
    return process, err


def test_own_loop_killed_and_preempted_mid_epoch_resumes_equal_to_an_uninterrupted_run(tmp_path):
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    assert run_cli(OWN_LOOP, baseline, *EPOCHS).returncode == 0

    killed, _ = run_until(OWN_LOOP, run, 13, signal.SIGKILL, *EPOCHS)
    assert killed.returncode == -signal.SIGKILL
    assert generation(run, "step-00000010").is_dir()  # epoch 0, batch 10 of 12

    preempted, err = run_until(OWN_LOOP, run, 24, signal.SIGTERM, *EPOCHS)
    assert preempted.returncode == 75, err
    assert "stopped, resumable (exit 75)" in err
    stopped_at = attempts(run)[-1]["last_step"]
    assert generation(run, f"step-{stopped_at:08d}").is_dir()  # saved at the step reached

    finished = run_cli(OWN_LOOP, run, *EPOCHS)
    assert finished.returncode == 0, finished.stderr
    assert compare(generation(baseline, FINAL), generation(run, FINAL)).returncode == 0
    records = attempts(run)
    assert [record["status"] for record in records] == ["running", "preempted", "completed"]
    resumed = records[1]
    assert resumed["restored"]["name"] == "step-00000010"
    assert resumed["replay"]["matched"] == resumed["replay"]["of"] > 0  # the steps the kill lost, recomputed equal
    assert all(record["restore_check"]["matched"] for record in records[1:])
