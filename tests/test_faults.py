"""Fault injection: crashes at every publish step, random kill -9, write failures,
preemption signals, a second writer and crash loops. No fault may lose a completed
generation, select an incomplete one, or change what is trained."""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import TRAINER, compare, finish, one_error_line, run_cli, start, train, trainer_env, wait_for_line
from support.limits import wait_until
from support.runs import SHORT, attempts, generation, made_once
from trainer.__main__ import READ_ONLY
from trainer.cli import COMMANDS


def published_all_verify(output):
    names = sorted(p.name for p in (output / "checkpoints").glob("step-*"))
    if names:
        assert run_cli("verify", output).returncode == 0
    return names


@pytest.fixture(scope="module")
def interrupted_at_10(tmp_path_factory) -> Path:
    """A short run interrupted at step 10 (step-00000008 published): each crash test below
    starts from its own copy of it."""
    return made_once(tmp_path_factory, "interrupted-at-10",
                     lambda folder: train(folder / "run", *SHORT, "--interrupt-at-step", 10, expect=75)) / "run"


@pytest.mark.parametrize("point, mode", [
    ("after-write", "sync"), ("after-files-fsync", "sync"), ("after-manifest", "sync"), ("after-rename", "sync"),
    ("after-write", "async"),  # in the background committer, after the background write
    ("after-manifest", "async"),
])
def test_crash_at_each_publish_point_keeps_complete_generations(tmp_path, short_baseline, interrupted_at_10,
                                                                point, mode):
    run = tmp_path / "run"
    shutil.copytree(interrupted_at_10, run, symlinks=True)
    crashed = run_cli("--output", run, *SHORT, "--resume", "--checkpoint-mode", mode,
                      env={"TRAINER_FAULT_POINT": point})
    assert crashed.returncode == -signal.SIGKILL
    names = published_all_verify(run)
    assert names == (["step-00000008", "step-00000016"] if point == "after-rename" else ["step-00000008"])
    resumed = train(run, *SHORT, "--resume", "auto")
    assert f"restored {names[-1]}" in resumed.stdout
    assert not list((run / "checkpoints").glob(".step-*.tmp-*"))  # the crashed temporary was cleaned
    assert compare(generation(short_baseline, "step-00000024"), generation(run, "step-00000024")).returncode == 0


def test_random_kill_9_while_saving_every_step(tmp_path, baseline):
    """Torture: kill -9 at random instants of training with a save after every step."""
    run = tmp_path / "run"
    rng = random.Random(20261129)
    args = ("--recover-every-steps", 1, "--keep-last", 2, "--resume", "auto", "--max-failed-attempts", 0)
    kills = 0
    while kills < 5:  # paced by kills, not by a deadline: a slow machine takes longer, not fewer
        process = start(run, *args)
        wait_for_line(process, "step=")
        time.sleep(rng.uniform(0.0, 0.15))
        process.kill()
        process.wait()
        if process.returncode == 0:
            break
        kills += 1
        published_all_verify(run)
    train(run, *args)
    print(f"torture: {kills} kill -9 survived, {len(attempts(run))} attempts")
    assert kills >= 3  # 5, unless an attempt completed the run between kills
    assert compare(generation(baseline), generation(run)).returncode == 0


def limit_file_size(limit):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_write_failure_exits_74_keeps_earlier_generations_and_resumes(tmp_path, short_baseline):
    run = tmp_path / "run"
    train(run, *SHORT, "--interrupt-at-step", 10, expect=75)
    failed = run_cli("--output", run, *SHORT, "--resume", preexec_fn=limit_file_size(32 * 1024))
    assert failed.returncode == 74
    line = one_error_line(failed)
    assert "step-00000016" in line and "File too large" in line and "ulimit -f), then rerun with --resume auto" in line
    assert published_all_verify(run) == ["step-00000008"]
    assert not list((run / "checkpoints").glob(".step-*"))  # the failed temporary was removed
    record = attempts(run)[-1]
    assert record["status"] == "failed" and record["exit_code"] == 74 and "File too large" in record["reason"]
    train(run, *SHORT, "--resume")
    assert compare(generation(short_baseline, "step-00000024"), generation(run, "step-00000024")).returncode == 0


LONG = ("--epochs", 40)
"""320 steps: still running when a signal sent after step 20 arrives, however slow the machine."""


@pytest.fixture(scope="module")
def long_baseline(tmp_path_factory) -> Path:
    """The uninterrupted `LONG` run both preemptions below must end equal to (made once)."""
    return made_once(tmp_path_factory, "long-baseline", lambda folder: train(folder / "run", *LONG)) / "run"


@pytest.mark.parametrize("signum, mode", [(signal.SIGTERM, "sync"), (signal.SIGINT, "async")])
def test_preemption_saves_at_the_current_step_and_exits_75(tmp_path, signum, mode, long_baseline):
    run, long = tmp_path / "run", LONG
    process = start(run, *long, "--checkpoint-mode", mode)
    wait_for_line(process, "step=20 ")
    process.send_signal(signum)
    out, err = finish(process)
    assert process.returncode == 75, err
    record = attempts(run)[-1]
    assert record["status"] == "preempted" and signal.Signals(signum).name in record["reason"]
    step = record["last_step"]
    assert step >= 20 and f"preempted by {signal.Signals(signum).name}: saved step {step}" in out
    assert generation(run, f"step-{step:08d}").exists()  # a generation at the step reached, mid-epoch too
    assert record["checkpoint_mode"] == mode
    assert record["witness_step"] == step + 1  # computed after the save for the witness, not saved
    assert not generation(run, f"step-{step + 1:08d}").exists() and f"step {step + 1} computed for the witness" in out
    train(run, *long, "--resume")
    assert compare(generation(long_baseline, "step-00000320"), generation(run, "step-00000320")).returncode == 0
    resumed = attempts(run)[-1]  # the stop's resume is checked too: it replays that step (issue 57)
    assert resumed["steps_replayed"] == 1 and resumed["replay"] == {"matched": 1, "of": 1, "first_mismatch": None,
                                                                    "against": [record["id"]]}, resumed


def test_preemption_grace_too_short_exits_75_without_publishing(tmp_path):
    run = tmp_path / "run"
    process = start(run, "--epochs", 40, "--preempt-grace-secs", "0.000001", "--hidden-size", 512)
    wait_for_line(process, "step=3 ")
    process.send_signal(signal.SIGTERM)
    _, err = finish(process)
    assert process.returncode == 75 and "grace" in err
    published_all_verify(run)


def test_second_signal_exits_at_once_without_damage(tmp_path):
    run = tmp_path / "run"
    process = start(run, "--epochs", 40, "--recover-every-steps", 1, "--hidden-size", 256)
    wait_for_line(process, "step=5 ")
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGTERM)
    finish(process)
    assert process.returncode == 75
    published_all_verify(run)


def test_second_writer_is_refused_and_stale_lock_taken_over(tmp_path):
    run = tmp_path / "run"
    holder = start(run, "--epochs", 400)
    wait_for_line(holder, "step=")
    second = run_cli("--output", run, "--resume", "auto", "--epochs", 1)
    assert second.returncode == 73
    line = one_error_line(second)
    assert f"pid {holder.pid}" in line and "host" in line
    holder.kill()
    holder.wait()
    # The holder died without unlocking: the next trainer takes the lock over and resumes.
    train(run, "--resume", "auto", "--epochs", 1)


def test_crash_loop_stops_instead_of_burning_the_allocation(tmp_path):
    run = tmp_path / "run"
    train(run, *SHORT, "--interrupt-at-step", 10, expect=75)
    for _ in range(3):
        crashed = run_cli("--output", run, *SHORT, "--resume", env={"TRAINER_FAULT_POINT": "after-write"})
        assert crashed.returncode == -signal.SIGKILL
    for _ in range(2):  # a refusal is recorded, and does not break the loop it refused
        refused = run_cli("--output", run, *SHORT, "--resume")
        assert refused.returncode == 70
        line = one_error_line(refused)
        assert "last 3 attempts all started from step-00000008" in line and "--max-failed-attempts 0" in line
    assert [(a["status"], a["exit_code"]) for a in attempts(run)[-2:]] == [("refused", 70)] * 2
    train(run, *SHORT, "--resume", "--max-failed-attempts", 0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_process_group_signal_with_dataloader_workers_stops_after_the_step_in_progress(tmp_path, signum):
    """The whole group, workers included (scancel, kill -TERM -PGID, Ctrl-C). The group is
    frozen while the signal is sent, so the step the trainer is in is known from its progress
    marker, not from log lines a reader sees late (issue #24 saw "signal at 20, stopped at 25"):
    it saves the step in progress, or one more if the signal landed after that step's check."""
    run = tmp_path / "run"
    process = start(run, "--epochs", 40, "--num-workers", 2, start_new_session=True)
    wait_for_line(process, "step=12 ")
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        done = int(next((run / "attempts").iterdir()).joinpath("last_step").read_text())
        os.killpg(process.pid, signum)
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    _, err = finish(process)
    assert process.returncode == 75, err
    assert "Traceback" not in err and attempts(run)[-1]["status"] == "preempted"
    saved = published_all_verify(run)[-1]
    assert saved in (f"step-{done + 1:08d}", f"step-{done + 2:08d}"), (done, saved, err)


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def wait_until_sigterm_is_caught(process):
    """Until the process has installed its own SIGTERM handler (/proc/PID/status SigCgt):
    from then on it is starting up (importing torch), not yet training."""
    def caught() -> bool:
        status = Path(f"/proc/{process.pid}/status").read_text()
        return bool(int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
                    & SIGTERM_BIT)

    wait_until(caught, "the trainer never installed a SIGTERM handler", every=0.005)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_is_one_line_and_75(tmp_path, signum):
    """Ctrl-C or SIGTERM while torch is still importing: no traceback, no bare -15."""
    run = tmp_path / "run"
    process = start(run, "--epochs", 1, fresh=True)  # torch is imported here, not in a zygote
    wait_until_sigterm_is_caught(process)
    process.send_signal(signum)
    out, err = finish(process)
    assert process.returncode == 75, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"trainer: stopped by {signal.Signals(signum).name} outside training" in err
    assert not run.exists()


def test_a_signal_while_a_read_only_command_starts_says_nothing_was_changed(tmp_path):
    """`python -m trainer compare` (list, report, verify) stopped while torch imports: one line
    naming the command, 75, and no advice to resume a training."""
    assert READ_ONLY == set(COMMANDS)
    process = subprocess.Popen([*TRAINER, "compare", str(tmp_path / "a"), str(tmp_path / "b")], env=trainer_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until_sigterm_is_caught(process)
    process.send_signal(signal.SIGINT)
    out, err = finish(process)
    assert (process.returncode, err) == (75, "compare: interrupted by SIGINT; nothing was changed\n")


def test_kill_9_between_saves_counts_the_replayed_steps(tmp_path):
    run = tmp_path / "run"
    process = start(run, "--epochs", 40)
    wait_for_line(process, "step=14 ")
    process.kill()
    process.wait()
    train(run, "--epochs", 2, "--resume")
    killed, resumed = attempts(run)
    assert killed["status"] == "running"  # it never got to say anything: kill -9
    reached = int((run / "attempts" / killed["id"] / "last_step").read_text())  # the per-step marker
    assert reached >= 14 and reached >= killed["last_step"]  # at least as fresh as the last publish
    assert resumed["steps_replayed"] == reached - resumed["restored"]["step"]


def test_allowed_drift_that_changes_shapes_is_refused_in_one_line(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 1)
    for _ in range(4):  # refused each time, never a crash loop (70): a refusal did no work
        result = run_cli("--output", run, "--epochs", 2, "--resume", "--hidden-size", 7, "--allow-drift", "config")
        assert result.returncode == 65
        assert "a shape-changing drift cannot be allowed" in one_error_line(result)
    refused = attempts(run)[-1]
    assert refused["status"] == "refused" and refused["steps_replayed"] is None
    assert refused["considered_generation"] == "step-00000008"


def test_a_replacement_cut_short_by_a_crash_is_undone(tmp_path):
    run = tmp_path / "run"
    train(run, *SHORT, "--interrupt-at-step", 20, expect=75)
    checkpoints = run / "checkpoints"
    # Publishing over step-16 renamed it to .replacing-, then the process died before the new
    # one arrived: the name comes back. Over step-08 it died after: the copy is retired.
    os.rename(checkpoints / "step-00000016", checkpoints / ".step-00000016.replacing-abc123")
    shutil.copytree(checkpoints / "step-00000008", checkpoints / ".step-00000008.replacing-def456")
    listed = run_cli("list", run).stdout
    assert "replacement cut short by a crash (the next trainer puts it back or retires it): .step-00000016" in listed
    resumed = train(run, *SHORT, "--resume")
    assert "restored checkpoints/step-00000016: a crash interrupted its replacement" in resumed.stdout
    assert "restored step-00000016 (step=16" in resumed.stdout
    assert sorted(p.name for p in checkpoints.glob(".step-*")) == [".step-00000008.replaced-def456"]


def test_a_stale_export_temporary_is_removed_by_the_next_trainer(tmp_path):
    run = tmp_path / "run"
    exports_only = ("--epochs", 1, "--recover-every-epochs", 0, "--export-every-steps", 1)
    crashed = run_cli("--output", run, *exports_only, env={"TRAINER_FAULT_POINT": "after-manifest"})
    assert crashed.returncode == -signal.SIGKILL
    assert len(list((run / "exports").glob(".step-00000001.tmp-*"))) == 1
    resumed = train(run, *exports_only, "--resume", "auto")
    assert "removed stale temporary exports/.step-00000001.tmp-" in resumed.stdout
    assert not list((run / "exports").glob(".step-*"))


def test_a_superseded_copy_never_comes_back(tmp_path):
    """Retention may delete the generation that replaced a superseded copy; the copy must
    stay retired, not be taken for an interrupted replacement and resumed from."""
    run = tmp_path / "run"
    train(run, *SHORT, "--interrupt-at-step", 20, expect=75)
    checkpoints = run / "checkpoints"
    os.rename(checkpoints / "step-00000016", checkpoints / ".step-00000016.replaced-abc123")
    resumed = train(run, *SHORT, "--resume")
    assert "restored step-00000008 (step=8" in resumed.stdout
    assert (checkpoints / ".step-00000016.replaced-abc123").is_dir()


def test_publishing_over_a_file_that_is_not_ours_is_refused(tmp_path):
    run = tmp_path / "run"
    train(run, *SHORT, "--interrupt-at-step", 10, expect=75)
    (run / "checkpoints" / "step-00000016").write_text("a user's notes\n")
    result = run_cli("--output", run, *SHORT, "--resume")
    assert result.returncode == 73
    assert "step-00000016 exists and is not a directory this trainer wrote" in one_error_line(result)
    assert (run / "checkpoints" / "step-00000016").read_text() == "a user's notes\n"
    assert not list((run / "checkpoints").glob(".step-*"))  # its temporary was removed
