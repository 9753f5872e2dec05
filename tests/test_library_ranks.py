"""The framework adapters on several processes (trainer/recovery/hf.py, accelerated.py,
lightning.py; docs/library.md), through the real frameworks and their real launchers on gloo:
the example scripts, an uninterrupted run made once per world size, then one run that loses a
rank to kill -9 mid-epoch, is resumed, is stopped by SIGTERM (every rank saves, the trainer's
status 75, in TRAINER_EXIT_STATUS_FILE under torchrun), and is resumed to the end: its final
generation equals the uninterrupted run's field by field, and the exactness witness (replayed
steps, restore checks) found nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from support.cli import REPO, compare, run_cli
from support.limits import scaled
from support.runs import attempts, generation, made_once
from support.torchrun import TORCHRUN, TORCHRUN_CHILD_FAILED, clean_environment

HF = ("hf_trainer.py", ("--epochs", "5"))
"""48 sequences, 8 a rank: 3 steps an epoch on 2 ranks, 15 steps; generations every 5 (HF's
save_steps), so step 5's is mid-epoch (epoch 1 is steps 4-6)."""


def launched(script: str, output: Path, *args, nproc: int, status: Path | None = None) -> subprocess.Popen:
    """`torchrun --nproc_per_node NPROC examples/SCRIPT OUTPUT ARGS` (no launcher options beyond
    that: as the example's docstring says), its output piped."""
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), str(REPO / "examples" / script),
               str(output), *map(str, args)]
    env = clean_environment(PYTHONUNBUFFERED="1", **({"TRAINER_EXIT_STATUS_FILE": str(status)} if status else {}))
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen) -> tuple[str, str]:
    try:
        return process.communicate(timeout=scaled(300))
    finally:
        process.kill()


def until_step(process: subprocess.Popen, step: int) -> list[str]:
    """Rank 0's lines up to the first `step=N` with N >= `step` (progress, not time)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("step=") and int(line.split()[0].split("=")[1]) >= step:
            return lines
    raise AssertionError(f"the run ended before step {step}: {''.join(lines)[-2000:]}{process.stderr.read()[-3000:]}")


def worker(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the worker of `rank` among torchrun's children (its environment says)."""
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under torchrun {launcher.pid}")


def uninterrupted(tmp_path_factory, name: str, script: tuple, nproc: int) -> Path:
    def make(folder: Path) -> None:
        status = folder / "status"
        out, err = finished(launched(script[0], folder / "run", *script[1], nproc=nproc, status=status))
        assert int(status.read_text()) == 0, err[-3000:]

    return made_once(tmp_path_factory, f"library-ranks-{name}-{nproc}", make) / "run"


def killed_preempted_and_resumed(tmp_path: Path, script: tuple, nproc: int, kill_at: int, left: str,
                                 stop_at: int) -> Path:
    """kill -9 of the last rank once rank 0 printed `step=KILL_AT` (the newest generation then is
    `left`, mid-epoch); resumed, SIGTERM to rank 0 once it printed `step=STOP_AT` (every rank
    saves the step reached; the trainer's status 75, torchrun's 1); resumed to the end."""
    run, status = tmp_path / "run", tmp_path / "status"
    killing = launched(script[0], run, *script[1], nproc=nproc)
    until_step(killing, kill_at)
    os.kill(worker(killing, nproc - 1), signal.SIGKILL)
    out, err = finished(killing)
    assert killing.returncode == TORCHRUN_CHILD_FAILED, err[-3000:]
    assert sorted(path.name for path in (run / "checkpoints").glob("step-*"))[-1] == left

    stopping = launched(script[0], run, *script[1], nproc=nproc, status=status)
    until_step(stopping, stop_at)
    os.kill(worker(stopping, 0), signal.SIGTERM)
    out, err = finished(stopping)
    assert (stopping.returncode, int(status.read_text())) == (TORCHRUN_CHILD_FAILED, 75), err[-3000:]
    assert "stopped, resumable (exit 75)" in err
    stopped_at = attempts(run)[-1]["last_step"]
    assert stopped_at >= stop_at and generation(run, f"step-{stopped_at:08d}").is_dir()

    out, err = finished(launched(script[0], run, *script[1], nproc=nproc, status=status))
    assert int(status.read_text()) == 0, err[-3000:]
    records = attempts(run)
    assert [record["status"] for record in records[1:]] == ["preempted", "completed"], records
    assert records[1]["restored"]["name"] == left and records[2]["restored"]["step"] == stopped_at
    assert records[1]["replay"]["matched"] == records[1]["replay"]["of"] > 0  # the steps the kill lost, equal
    assert all(record["restore_check"]["matched"] for record in records[1:])
    assert "NOT EXACT" not in run_cli("report", run).stdout
    return run


def test_hugging_face_trainer_on_two_processes_survives_a_killed_rank_and_sigterm_exactly(tmp_path, tmp_path_factory):
    """HF's DDP under torchrun, its own distributed sampler and skip. Cost: four torchrun
    launches of 2 ranks importing transformers, one of them shared."""
    baseline = uninterrupted(tmp_path_factory, "hf", HF, 2)
    run = killed_preempted_and_resumed(tmp_path, HF, 2, kill_at=7, left="step-00000005", stop_at=8)
    compared = compare(generation(baseline, "step-00000015"), generation(run, "step-00000015"))
    assert compared.returncode == 0, compared.stdout[-3000:]
