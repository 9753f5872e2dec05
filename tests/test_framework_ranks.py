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
import sys
from dataclasses import dataclass
from pathlib import Path

from support.cli import REPO, compare, run_cli
from support.limits import scaled
from support.runs import attempts, generation, made_once
from support.torchrun import TORCHRUN, TORCHRUN_CHILD_FAILED, clean_environment

@dataclass(frozen=True)
class Cell:
    """An example script on `nproc` processes: under torchrun (the trainer's status read from
    TRAINER_EXIT_STATUS_FILE, torchrun's own 0 or 1), or under Lightning's own launcher
    (`python SCRIPT --devices N`: rank 0 is the process started, its status the trainer's)."""

    script: str
    args: tuple
    nproc: int
    lightning: bool = False

    def launch(self, output: Path, status: Path, *extra, restarts: int = 0) -> subprocess.Popen:
        """`extra`: the script's options beyond `args`; `restarts`: torchrun's --max-restarts."""
        script, args = str(REPO / "examples" / self.script), (*self.args, *map(str, extra))
        command = [sys.executable, script, str(output), *args, "--devices", str(self.nproc)] if self.lightning \
            else [str(TORCHRUN), "--standalone", "--nproc_per_node", str(self.nproc), "--max-restarts", str(restarts),
                  script, str(output), *args]
        env = clean_environment(PYTHONUNBUFFERED="1", TRAINER_EXIT_STATUS_FILE=str(status))
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def worker(self, process: subprocess.Popen, rank: int) -> int:
        """The pid of `rank`: among torchrun's children, or among rank 0's under Lightning."""
        if self.lightning and rank == 0:
            return process.pid
        variable = f"{'LOCAL_RANK' if self.lightning else 'RANK'}={rank}".encode()
        for child in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split():
            if variable in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                return int(child)
        raise AssertionError(f"no process of rank {rank} under {process.pid}")

    def ended(self, process: subprocess.Popen, status: Path, expect: int) -> str:
        """Its stderr, once it ended with the trainer's status `expect`."""
        try:
            out, err = process.communicate(timeout=scaled(300))
        finally:
            process.kill()
        if self.lightning:
            assert process.returncode == expect, err[-3000:]
        else:
            assert process.returncode == (0 if expect == 0 else TORCHRUN_CHILD_FAILED), err[-3000:]
            assert int(status.read_text()) == expect, err[-3000:]
        return err


def until_step(process: subprocess.Popen, step: int) -> None:
    """Rank 0's lines up to the first `step=N` with N >= `step` (progress, not time)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("step=") and int(line.split()[0].split("=")[1]) >= step:
            return
    raise AssertionError(f"the run ended before step {step}: {''.join(lines)[-2000:]}{process.stderr.read()[-3000:]}")


def uninterrupted(tmp_path_factory, name: str, cell: Cell) -> Path:
    def make(folder: Path) -> None:
        status = folder / "status"
        cell.ended(cell.launch(folder / "run", status), status, expect=0)

    return made_once(tmp_path_factory, f"library-ranks-{name}-{cell.nproc}", make) / "run"


def killed_preempted_and_resumed(tmp_path: Path, cell: Cell, kill_at: int, left: str, stop_at: int) -> Path:
    """kill -9 of the last rank once rank 0 printed `step=KILL_AT` (the newest generation then is
    `left`, mid-epoch: rank 0 names the lost rank, 75); resumed, SIGTERM to rank 0 once it
    printed `step=STOP_AT` (every rank saves the step reached, 75); resumed to the end."""
    run, status = tmp_path / "run", tmp_path / "status"
    killing = cell.launch(run, status)
    until_step(killing, kill_at)
    os.kill(cell.worker(killing, cell.nproc - 1), signal.SIGKILL)
    cell.ended(killing, status, expect=75)
    assert sorted(path.name for path in (run / "checkpoints").glob("step-*"))[-1] == left

    stopping = cell.launch(run, status)
    until_step(stopping, stop_at)
    os.kill(cell.worker(stopping, 0), signal.SIGTERM)
    assert "stopped, resumable (exit 75)" in cell.ended(stopping, status, expect=75)
    stopped_at = attempts(run)[-1]["last_step"]
    assert stopped_at >= stop_at and generation(run, f"step-{stopped_at:08d}").is_dir()

    cell.ended(cell.launch(run, status), status, expect=0)
    records = attempts(run)
    assert [record["status"] for record in records] == ["interrupted", "preempted", "completed"], records
    assert records[0]["peer"]["ranks"] == [cell.nproc - 1]
    assert records[1]["restored"]["name"] == left and records[2]["restored"]["step"] == stopped_at
    assert records[1]["replay"]["matched"] == records[1]["replay"]["of"] > 0  # the steps the kill lost, equal
    assert all(record["restore_check"]["matched"] for record in records[1:])
    assert "NOT EXACT" not in run_cli("report", run).stdout
    return run


HF = Cell("hf_trainer.py", ("--epochs", "5"), 2)
"""48 sequences, 8 a rank: 3 steps an epoch on 2 ranks, 15 steps; generations every 5 (HF's
save_steps), so step 5's is mid-epoch (epoch 1 is steps 4-6)."""


def test_hugging_face_trainer_on_two_processes_survives_a_killed_rank_and_sigterm_exactly(tmp_path, tmp_path_factory):
    """HF's DDP under torchrun, its own distributed sampler and skip. Cost: four torchrun
    launches of 2 ranks importing transformers, one of them shared."""
    baseline = uninterrupted(tmp_path_factory, "hf", HF)
    run = killed_preempted_and_resumed(tmp_path, HF, kill_at=7, left="step-00000005", stop_at=8)
    compared = compare(generation(baseline, "step-00000015"), generation(run, "step-00000015"))
    assert compared.returncode == 0, compared.stdout[-3000:]


ACCELERATE = Cell("accelerate_loop.py", (), 2)
"""192 samples in global batches of 16: 12 steps an epoch, 36 steps; a generation every 10."""


def test_accelerate_on_two_processes_survives_a_killed_rank_and_sigterm_exactly(tmp_path, tmp_path_factory):
    """Accelerate under torchrun (the prepared DDP model and scheduler, the keyed order's shares).
    Cost: four torchrun launches of 2 ranks importing accelerate, one of them shared."""
    baseline = uninterrupted(tmp_path_factory, "accelerate", ACCELERATE)
    run = killed_preempted_and_resumed(tmp_path, ACCELERATE, kill_at=13, left="step-00000010", stop_at=24)
    compared = compare(generation(baseline, "step-00000036"), generation(run, "step-00000036"))
    assert compared.returncode == 0, compared.stdout[-3000:]


LIGHTNING = Cell("lightning_loop.py", ("--accumulate", "2"), 2, lightning=True)
"""192 samples in global batches of 16, accumulate_grad_batches=2: 12 batches, 6 optimizer steps
an epoch, 18 steps; a generation every 10 steps, so step 10's is mid-epoch (position 8 of 12).
Its lines say `step=N` for each batch of step N."""


def test_lightning_ddp_on_two_processes_survives_a_killed_rank_and_sigterm_exactly(tmp_path, tmp_path_factory):
    """Lightning's `strategy="ddp"`, `devices=2`, started by its own launcher (`python SCRIPT`,
    `lightning.launch`): no SIGKILL of rank 0 when the other rank exits, no refusal; with
    `accumulate_grad_batches=2` (the position counted in optimizer steps). Cost: four launches
    of 2 processes importing Lightning, one of them shared."""
    baseline = uninterrupted(tmp_path_factory, "lightning", LIGHTNING)
    run = killed_preempted_and_resumed(tmp_path, LIGHTNING, kill_at=12, left="step-00000010", stop_at=14)
    compared = compare(generation(baseline, "step-00000018"), generation(run, "step-00000018"))
    assert compared.returncode == 0, compared.stdout[-3000:]


ACCELERATE_3 = Cell("accelerate_loop.py", ("--batch-size", "24"), 3)
"""192 samples in global batches of 24, 8 a rank: 8 steps an epoch, 24 steps."""


def test_accelerate_on_three_processes_restarts_in_place_from_tier0_and_resumes_exactly(tmp_path, tmp_path_factory):
    """3 processes (a sum of three depends on its order) under `torchrun --max-restarts 1` with
    tier 0 every step: kill -9 of rank 2 mid-epoch, torchrun's agent restarts every worker in
    place and they restore from tier 0; SIGTERM to rank 0 (75, the restart spent, torchrun 1);
    a new launch resumes to the end, equal to an uninterrupted 3-process run. Cost: three
    torchrun launches of 3 ranks (the first one's restarted), one shared."""
    baseline = uninterrupted(tmp_path_factory, "accelerate", ACCELERATE_3)
    run, status, memory = tmp_path / "run", tmp_path / "status", tmp_path / "memory"
    restarting = ACCELERATE_3.launch(run, status, "--memory-dir", memory, restarts=1)
    until_step(restarting, 13)  # steps 11-13 saved to tier 0 only (the durable one is step 10's)
    os.kill(ACCELERATE_3.worker(restarting, 2), signal.SIGKILL)
    until_step(restarting, 18)  # the restarted workers' lines: none printed step 18 before the kill
    os.kill(ACCELERATE_3.worker(restarting, 0), signal.SIGTERM)
    assert "stopped, resumable (exit 75)" in ACCELERATE_3.ended(restarting, status, expect=75)
    ACCELERATE_3.ended(ACCELERATE_3.launch(run, status, "--memory-dir", memory), status, expect=0)

    killed, stopped, completed = attempts(run)
    assert killed["status"] == "interrupted" and 2 in killed["peer"]["ranks"], killed  # the lost rank named (and any it took along)
    assert stopped["status"] == "preempted" and stopped["restored"]["tier"] == "memory", stopped
    assert 12 <= stopped["restored"]["step"] < 18 and completed["restored"]["step"] == stopped["last_step"]
    replay = stopped.get("replay")  # none when tier 0 held the very step the kill ended on
    assert replay is None or replay["matched"] == replay["of"], replay
    assert all(record["restore_check"]["matched"] for record in (stopped, completed))
    assert "NOT EXACT" not in run_cli("report", run).stdout
    compared = compare(generation(baseline, "step-00000024"), generation(run, "step-00000024"))
    assert compared.returncode == 0, compared.stdout[-3000:]
