"""The framework adapters on several processes (trainer/recovery/hf.py, accelerated.py,
lightning.py; docs/library.md), through the real frameworks and their real launchers on gloo
(torchrun, `accelerate launch`, Lightning's own): the example scripts, an uninterrupted run
made once per framework and world size, then one run that loses a rank to kill -9 mid-epoch,
is resumed (by a new launch, or in place under --max-restarts from tier 0), is stopped by
SIGTERM (every rank saves, the trainer's status 75, in TRAINER_EXIT_STATUS_FILE under an
agent) and is resumed to the end: its final generation equals the uninterrupted run's field
by field, and the exactness witness (replayed steps, restore checks) found nothing. The
launches under test (the kill, the SIGTERM) are the launchers'; the last resume and the
uninterrupted run fork their ranks from the zygote with the variables a launcher sets (a
launcher changes no bit). What a cell costs is almost all interpreters' start (torch and the
framework imported by every rank and agent): besides those forked ranks a cell takes 2 x its
world size of them, restarted in place or not (`accelerate launch` and Lightning's rank 0 forked too).
The HF example's forked ranks find transformers imported by the zygote (`Cell.preload`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.cli import REPO, compare, forked, run_cli, zygote
from support.limits import scaled
from support.runs import attempts, generation, made_once
from support.torchrun import TORCHRUN_CHILD_FAILED, clean_environment, forked_ranks, free_port, launch
from trainer.parallel.launch import watch_children

ACCELERATE_LAUNCH = ("-m", "accelerate.commands.accelerate_cli")
"""What the `accelerate` console script runs."""


@dataclass(frozen=True)
class Cell:
    """An example script on `nproc` processes, started by `launcher`: `torchrun` or `accelerate`
    (`accelerate launch`, which runs torchrun's agent in its own process: the trainer's status
    read from TRAINER_EXIT_STATUS_FILE, the launcher's own 0 or 1), or `lightning` (Lightning's
    own launcher, `python SCRIPT --devices N`: rank 0 is the process started, its status the
    trainer's). Both launchers are forked from the zygote as any `python` the suite runs; the
    ranks they start are fresh interpreters."""

    script: str
    args: tuple
    nproc: int
    launcher: str = "torchrun"
    preload: str | None = None
    """What the zygote imports before it forks the script's ranks (tests/forking.py PRELOADABLE)."""

    def launch(self, output: Path, status: Path, *extra, restarts: int = 0) -> subprocess.Popen:
        """`extra`: the script's options beyond `args`; `restarts`: the agent's --max-restarts."""
        script, args = str(REPO / "examples" / self.script), (str(output), *self.args, *map(str, extra))
        env = clean_environment(PYTHONUNBUFFERED="1", TRAINER_EXIT_STATUS_FILE=str(status))
        if self.launcher == "torchrun":  # its agent forked from the zygote (support.torchrun.launch)
            return launch(["--standalone", "--nproc_per_node", self.nproc, "--max-restarts", restarts, script, *args], env)
        # Lightning's: `python SCRIPT`; accelerate's: `accelerate launch` (the console script's
        # module), its agent in the same process. Each forked from the zygote as any `python`
        # the suite runs; the ranks they start are fresh interpreters.
        command = [script, *args, "--devices", str(self.nproc)] if self.launcher == "lightning" else [
            *ACCELERATE_LAUNCH, "launch", "--multi_gpu", "--num_processes", str(self.nproc), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            "--max_restarts", str(restarts), script, *args]
        if forked(env, {}):
            return zygote().spawn(command, REPO, env, new_session=False)
        return subprocess.Popen([sys.executable, *command], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def run_through(self, output: Path, *extra) -> None:
        """The script to its end with every rank forked from the zygote and given the variables
        any launcher sets (`forked_ranks`: no agent, no fresh interpreters; a launcher changes
        no bit, as the uninterrupted runs' compare proves): a resume whose launch is not under
        test."""
        devices = ("--devices", self.nproc) if self.launcher == "lightning" else ()
        forked_ranks(REPO / "examples" / self.script, output, *self.args, *extra, *devices, nproc=self.nproc,
                     preload=self.preload)

    def worker(self, process: subprocess.Popen, rank: int) -> int:
        """The pid of `rank`: among the agent's children, or among rank 0's under Lightning."""
        lightning = self.launcher == "lightning"
        if lightning and rank == 0:
            return process.pid
        variable = f"{'LOCAL_RANK' if lightning else 'RANK'}={rank}".encode()
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
        if self.launcher == "lightning":  # every rank's stderr: no exit handler's traceback on any (its sys.exit)
            assert process.returncode == expect, err[-3000:]
            assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
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
    """The cell's script run through to the end at its world size, made once per session for
    every cell of that framework and world size, its ranks forked from the zygote with the
    variables any launcher sets (`forked_ranks`: no agent, no fresh interpreters; the bits are
    the launcher's, as the cells' compare proves)."""
    return made_once(tmp_path_factory, f"library-ranks-{name}-{cell.nproc}",
                     lambda folder: cell.run_through(folder / "run")) / "run"


def killed_preempted_and_resumed(tmp_path: Path, cell: Cell, kill_at: int, left: str, stop_at: int) -> Path:
    """kill -9 of the last rank once rank 0 printed `step=KILL_AT` (the newest generation then is
    `left`, mid-epoch: rank 0 names the lost rank, 75); resumed, SIGTERM to the last rank alone
    once rank 0 printed `step=STOP_AT` (every rank saves the step reached, 75; rank 0 says it was
    another rank's signal); resumed to the end (its ranks
    forked: `Cell.run_through`)."""
    run, status = tmp_path / "run", tmp_path / "status"
    killing = cell.launch(run, status)
    until_step(killing, kill_at)
    os.kill(cell.worker(killing, cell.nproc - 1), signal.SIGKILL)
    cell.ended(killing, status, expect=75)
    assert sorted(path.name for path in (run / "checkpoints").glob("step-*"))[-1] == left

    stopping = cell.launch(run, status)
    until_step(stopping, stop_at)
    os.kill(cell.worker(stopping, cell.nproc - 1), signal.SIGTERM)  # one rank, not rank 0: it says whose it was
    said = "stopped, resumable (exit 75): a signal to another rank after step "
    assert said in cell.ended(stopping, status, expect=75)
    assert attempts(run)[-1]["reason"].startswith("a signal to another rank after step "), attempts(run)[-1]
    stopped_at = attempts(run)[-1]["last_step"]
    assert stopped_at >= stop_at and generation(run, f"step-{stopped_at:08d}").is_dir()

    cell.run_through(run)  # resumed to the end
    records = attempts(run)
    assert [record["status"] for record in records] == ["interrupted", "preempted", "completed"], records
    assert records[0]["peer"]["ranks"] == [cell.nproc - 1]
    assert records[1]["restored"]["name"] == left and records[2]["restored"]["step"] == stopped_at
    assert records[1]["replay"]["matched"] == records[1]["replay"]["of"] > 0  # the steps the kill lost, equal
    assert all(record["restore_check"]["matched"] for record in records[1:])
    assert "NOT EXACT" not in run_cli("report", run).stdout
    return run


def restarted_in_place_preempted_and_resumed(tmp_path: Path, cell: Cell, kill_at: int, stop_at: int,
                                             *first: str) -> Path:
    """Under the agent's --max-restarts 1 with tier 0 every step: kill -9 of the last rank once
    rank 0 printed `step=KILL_AT` (the steps since the newest generation saved to tier 0 only);
    the agent restarts every worker in place and they restore from tier 0; SIGTERM to rank 0
    once a restarted rank 0 printed `step=STOP_AT` (75, the restart spent, the launcher 1); a
    new start resumes to the end (its ranks forked: `Cell.run_through`). One launch fewer than
    `killed_preempted_and_resumed`. `first`: the restarting launch's options that create the
    process group before open_run (it must rejoin: trainer/parallel/rendezvous.py)."""
    run, status, memory = tmp_path / "run", tmp_path / "status", tmp_path / "memory"
    restarting = cell.launch(run, status, "--memory-dir", memory, *first, restarts=1)
    until_step(restarting, kill_at)
    os.kill(cell.worker(restarting, cell.nproc - 1), signal.SIGKILL)
    until_step(restarting, stop_at)  # the restarted workers' lines: no rank passed step KILL_AT + 1 before the kill
    os.kill(cell.worker(restarting, 0), signal.SIGTERM)
    assert "stopped, resumable (exit 75)" in cell.ended(restarting, status, expect=75)
    cell.run_through(run, "--memory-dir", memory)  # resumed to the end

    killed, stopped, completed = attempts(run)
    assert killed["status"] == "interrupted" and cell.nproc - 1 in killed["peer"]["ranks"], killed  # the lost rank named (and any it took along)
    assert stopped["status"] == "preempted" and stopped["restored"]["tier"] == "memory", stopped
    assert kill_at - 1 <= stopped["restored"]["step"] < stop_at and completed["restored"]["step"] == stopped["last_step"]
    replay = stopped["replay"]  # not compared when tier 0 held the very step the kill ended on
    assert replay.get("compared") is False or replay["matched"] == replay["of"], replay
    assert all(record["restore_check"]["matched"] for record in (stopped, completed))
    assert "NOT EXACT" not in run_cli("report", run).stdout
    return run


def equal_at(baseline: Path, run: Path, final: str) -> None:
    compared = compare(generation(baseline, final), generation(run, final))
    assert compared.returncode == 0, compared.stdout[-3000:]


HF = Cell("hf_trainer.py", ("--epochs", "5"), 2, preload="transformers")
"""48 sequences, 8 a rank: 3 steps an epoch on 2 ranks, 15 steps; generations every 5 (HF's
save_steps), so step 5's is mid-epoch (epoch 1 is steps 4-6)."""


def test_hugging_face_trainer_on_two_processes_survives_a_killed_rank_and_sigterm_exactly(tmp_path, tmp_path_factory):
    """HF's DDP under torchrun, its own distributed sampler and skip. Cost: two torchrun
    launches of 2 ranks importing transformers, then 2 forked ranks twice (the resume, the
    shared uninterrupted run)."""
    baseline = uninterrupted(tmp_path_factory, "hf", HF)
    run = killed_preempted_and_resumed(tmp_path, HF, kill_at=7, left="step-00000005", stop_at=8)
    equal_at(baseline, run, "step-00000015")


HF_3 = Cell("hf_trainer.py", ("--epochs", "7"), 3, preload="transformers")
"""48 sequences, 8 a rank: 2 steps an epoch on 3 ranks, 14 steps; the kill at step 7 is
mid-epoch (epoch 3 is steps 7-8)."""


def test_hugging_face_trainer_on_three_processes_restarts_in_place_from_tier0_and_resumes_exactly(
        tmp_path, tmp_path_factory):
    """HF's DDP on 3 processes (a sum of three depends on its order) under `torchrun
    --max-restarts 1` with tier 0 every step (HF's save point writes it), `TrainingArguments`
    built before open_run (HF creates the group through `env://`: it rejoins). Cost: one torchrun
    launch of 3 ranks importing transformers (restarted once), then 3 forked ranks twice (the
    resume, the shared uninterrupted run)."""
    baseline = uninterrupted(tmp_path_factory, "hf", HF_3)
    run = restarted_in_place_preempted_and_resumed(tmp_path, HF_3, 7, 11, "--arguments-first")
    equal_at(baseline, run, "step-00000014")


ACCELERATE = Cell("accelerate_loop.py", (), 2, launcher="accelerate")
"""192 samples in global batches of 16: 12 steps an epoch, 36 steps; a generation every 10."""


def test_accelerate_launched_on_two_processes_survives_a_killed_rank_and_sigterm_exactly(tmp_path, tmp_path_factory):
    """`accelerate launch --multi_gpu --num_processes 2` (on the CPU; its launcher exits 1 for a
    failed worker, as torchrun does: the trainer's 75 is in TRAINER_EXIT_STATUS_FILE), the
    prepared DDP model and scheduler, the keyed order's shares. Cost: two launches of 2 ranks
    importing accelerate (the launcher too), then 2 forked ranks twice (the resume, the shared
    uninterrupted run)."""
    baseline = uninterrupted(tmp_path_factory, "accelerate", ACCELERATE)
    run = killed_preempted_and_resumed(tmp_path, ACCELERATE, kill_at=13, left="step-00000010", stop_at=24)
    equal_at(baseline, run, "step-00000036")


ACCELERATE_3 = Cell("accelerate_loop.py", ("--batch-size", "24"), 3)
"""192 samples in global batches of 24, 8 a rank: 8 steps an epoch, 24 steps."""


def test_accelerate_on_three_processes_restarts_in_place_from_tier0_and_resumes_exactly(tmp_path, tmp_path_factory):
    """3 processes (a sum of three depends on its order) under `torchrun --max-restarts 1`
    with tier 0 every step, `Accelerator()` created before open_run (its group rejoins); the
    kill at step 13 is mid-epoch (epoch 1 is steps 9-16). Cost:
    one torchrun launch of 3 ranks (restarted once), then 3 forked ranks twice (the resume, the
    shared uninterrupted run)."""
    baseline = uninterrupted(tmp_path_factory, "accelerate", ACCELERATE_3)
    run = restarted_in_place_preempted_and_resumed(tmp_path, ACCELERATE_3, 13, 18, "--accelerator-first")
    equal_at(baseline, run, "step-00000024")


LIGHTNING = Cell("lightning_loop.py", ("--accumulate", "2", "--devices", "2"), 2)
"""192 samples in global batches of 16, accumulate_grad_batches=2: 12 batches, 6 optimizer steps
an epoch, 18 steps; the kill at step 8 is mid-epoch (epoch 1 is steps 7-12). Its lines say
`step=N` for each batch of step N."""


def test_lightning_ddp_on_two_processes_under_torchrun_restarts_in_place_from_tier0_and_resumes_exactly(
        tmp_path, tmp_path_factory):
    """Lightning's `strategy="ddp"`, `devices=2` under `torchrun --max-restarts 1` (Lightning
    finds torchrun's ranks and starts none) with tier 0 every step and
    `accumulate_grad_batches=2` (the position counted in optimizer steps). Cost: one torchrun
    launch of 2 ranks importing Lightning (restarted once), then 2 forked ranks twice (the
    resume, the shared uninterrupted run)."""
    baseline = uninterrupted(tmp_path_factory, "lightning", LIGHTNING)
    run = restarted_in_place_preempted_and_resumed(tmp_path, LIGHTNING, kill_at=8, stop_at=13)
    equal_at(baseline, run, "step-00000018")


LIGHTNING_3 = Cell("lightning_loop.py", ("--batch-size", "24"), 3, launcher="lightning")
"""192 samples in global batches of 24, 8 a rank: 8 steps an epoch, 24 steps; a generation
every 10 steps, so step 10's is mid-epoch (epoch 1 is steps 9-16)."""


def test_lightning_ddp_on_three_processes_survives_a_killed_rank_and_sigterm_exactly(tmp_path, tmp_path_factory):
    """Lightning's `strategy="ddp"`, `devices=3`, started by its own launcher (`python SCRIPT`,
    `lightning.launch`): no SIGKILL of rank 0 when another rank exits, no refusal. Cost: two
    launches of 3 processes importing Lightning, then 3 forked ranks twice (the resume, the
    shared uninterrupted run)."""
    baseline = uninterrupted(tmp_path_factory, "lightning", LIGHTNING_3)
    # Lightning prints step=N before step N runs, and a step's digest is read as the next one is
    # queued (trainer/run/readback.py): at step=13 rank 0 has recorded step 11, one to replay.
    run = killed_preempted_and_resumed(tmp_path, LIGHTNING_3, kill_at=13, left="step-00000010", stop_at=14)
    equal_at(baseline, run, "step-00000024")


def test_a_rank_that_ends_before_the_join_is_named_at_once_and_none_after_it():
    """Lightning's launcher starts the other ranks from rank 0 (`lightning.launch`): one that
    ends before every rank joined is named with its status at once (rank 0 then leaves 75,
    `lightning.lost_before_join`), not after the join's bound; once joined, the run's own
    collectives and heartbeats watch it instead. Real child processes, no Lightning."""
    quick = [sys.executable, "-c", "raise SystemExit(3)"]
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        said: list[str] = []
        watch_children({1: living, 2: subprocess.Popen(quick)}, lambda: False, said.append, poll_s=0.01).join(scaled(30))
        assert len(said) == 1 and said[0].startswith("rank 2 (pid ") and "ended with status 3 before every rank joined" \
            in said[0], said
        ended = subprocess.Popen(quick)
        ended.wait()
        watch_children({1: ended}, lambda: True, said.append, poll_s=0.01).join(scaled(30))
        assert len(said) == 1, said
    finally:
        living.kill()
        living.wait()
