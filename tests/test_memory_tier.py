"""Tier 0 (`--memory-dir`, trainer/storage/memory.py) through the real CLI, on one machine: a
kill -9 after a tier-0 save newer than the newest durable generation restores from tier 0; a
damaged tier-0 generation is refused with one warning and the durable tier serves; a wiped
tier 0 (the node's memory lost) leaves the durable tier to serve; every case ends bit-identical
to the uninterrupted run. A tmp directory stands in for /dev/shm."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import CLI_TIMEOUT_S, attempts, compare, made_once, run_cli, scaled, start, train, wait_until

RUN = ("--epochs", 2, "--recover-every-steps", 4, "--log-every-steps", 100)
"""16 steps, a durable generation every 4."""
TIER0 = ("--memory-every-steps", 3)
"""Tier-0 saves at 3 and 6 (steps 4, 8, 12 and 16 are durable saves)."""
FINAL = "step-00000016"


def tier0(memory: Path) -> tuple:
    return (*TIER0, "--memory-dir", memory)


def stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def kill_after_tier0_save(folder: Path) -> None:
    """The run pauses itself right after publishing tier-0 step-6 (durable: step-4); then it
    is killed from outside with SIGKILL, as a crash or the OOM killer would."""
    process = start(folder / "run", *RUN, *tier0(folder / "shm"), "--memory-every-steps", 6,
                    env={"TRAINER_PAUSE_POINT": "after-memory-save"})
    try:
        wait_until(lambda: process.poll() is not None or stopped(process.pid), "the trainer pausing after its save")
        assert process.poll() is None, process.stderr.read()
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=scaled(CLI_TIMEOUT_S)) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()
        process.stderr.close()


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    return made_once(tmp_path_factory, "memory-tier-killed", kill_after_tier0_save)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return made_once(tmp_path_factory, "memory-tier-baseline", lambda folder: train(folder / "run", *RUN)) / "run"


@pytest.fixture
def crashed(killed, tmp_path) -> tuple[Path, Path]:
    """A copy of the killed run: (run directory, tier 0)."""
    shutil.copytree(killed / "run", tmp_path / "run")
    shutil.copytree(killed / "shm", tmp_path / "shm")
    return tmp_path / "run", tmp_path / "shm"


def names(section: Path) -> list[str]:
    return sorted(p.name for p in section.iterdir() if p.name.startswith("step-"))


def resume(run: Path, memory: Path, *args) -> subprocess.CompletedProcess:
    return train(run, *RUN, "--memory-every-steps", 6, "--memory-dir", memory, "--resume", *args)


def assert_exact(uninterrupted: Path, run: Path) -> None:
    result = compare(uninterrupted / "checkpoints" / FINAL, run / "checkpoints" / FINAL)
    assert result.returncode == 0 and "all equal" in result.stdout, result.stdout


def test_a_kill_after_a_tier0_save_restores_from_tier0_exactly(crashed, uninterrupted):
    run, memory = crashed
    assert names(run / "checkpoints") == ["step-00000004"] and names(memory / "checkpoints") == ["step-00000006"]
    resumed = resume(run, memory)
    assert "restored step-00000006 (step=6 epoch=0 position=6) from tier 0 (memory)" in resumed.stdout
    killed_record, record = attempts(run)
    assert killed_record["memory"]["saves"] == 1 and killed_record["memory"]["newest"] == "step-00000006"
    restored = record["restored"]
    assert restored["tier"] == "memory" and restored["bytes"] > 0 and "refused" not in restored
    assert restored["shards_verified"] == "before loading"  # tier 0 keeps the separate pass (its fallback)
    assert "step-00000006   from tier 0 (memory)" in run_cli("report", run).stdout
    report = json.loads(run_cli("report", run, "--json").stdout)
    # the killed attempt's steps 5-6 were kept in tier 0 and continued from: not lost, not replayed
    (killed_row, row) = report["rows"]
    assert (killed_row["last_step"], killed_row["durable_step"], killed_row["lost"]) == (6, 6, 0), killed_row
    assert (row["restored_step"], row["replayed"], row["restored_from"]) == (6, 0, "memory")
    totals = report["totals"]
    assert (totals["useful"], totals["computed"], totals["lost"], totals["replayed"]) == (16, 16, 0, 0), totals
    assert totals["goodput"] == 1.0 and totals["computed"] == totals["useful"] + totals["lost"]
    assert names(memory / "checkpoints") == []  # completed: tier 0 older than the final generation is given back
    assert_exact(uninterrupted, run)


def test_a_damaged_tier0_generation_is_refused_and_the_disk_serves(crashed, uninterrupted):
    run, memory = crashed
    shard = sorted((memory / "checkpoints" / "step-00000006").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = resume(run, memory)
    output = resumed.stdout + resumed.stderr
    warned = [line for line in output.splitlines() if "tier 0 refused" in line]
    assert len(warned) == 1 and "step-00000006" in warned[0] and "sha256 mismatch" in warned[0], output
    assert "restored step-00000004 (step=4 epoch=0 position=4) from the local disk" in resumed.stdout
    restored = attempts(run)[-1]["restored"]
    assert restored["tier"] == "disk" and restored["refused"][0].startswith("memory step-00000006: ")
    assert restored["shards_verified"] == "while loading"  # the durable one, in one pass
    assert sorted(os.listdir(memory / "checkpoints")) == []  # re-saved at 6 (no superseded copy), then given back
    assert_exact(uninterrupted, run)


def test_a_wiped_tier0_leaves_the_durable_tier_to_serve(crashed, uninterrupted):
    run, memory = crashed
    shutil.rmtree(memory)  # the node's memory is gone (one machine: no peer replica)
    resumed = resume(run, memory)
    assert "restored step-00000004 (step=4 epoch=0 position=4) from the local disk" in resumed.stdout
    assert "tier 0 refused" not in resumed.stdout + resumed.stderr
    assert attempts(run)[-1]["restored"]["tier"] == "disk"
    assert_exact(uninterrupted, run)


def test_going_back_sets_later_tier0_generations_aside(crashed):
    run, memory = crashed
    train(run, *RUN, "--max-steps", 5, "--memory-dir", memory, "--from-generation", "step-00000004")
    record = attempts(run)[-1]
    assert record["restored"]["tier"] == "disk"
    assert record["set_aside"] == [f"{memory / 'checkpoints'}/step-00000006"]
    assert sorted(os.listdir(memory / "checkpoints")) == []  # removed: no superseded copy kept in memory


def test_a_tier0_that_cannot_hold_the_state_is_refused_at_start(tmp_path):
    refused = train(tmp_path / "run", *RUN, *tier0(tmp_path / "shm"), "--memory-tier-max-bytes", 10000, expect=2)
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("trainer: error:")]
    assert "needs 2 x " in line and "bytes of generations" in line and "over its budget of 10000 bytes" in line
    assert not (tmp_path / "run" / "checkpoints").exists() or names(tmp_path / "run" / "checkpoints") == []
    assert names(tmp_path / "shm" / "checkpoints") == []
    lonely = run_cli("--output", tmp_path / "other", "--memory-keep", 3)
    assert lonely.returncode == 2 and "--memory-keep applies only with --memory-dir" in lonely.stderr


def test_a_tier0_generation_of_an_abandoned_line_is_not_restored(crashed):
    """A later attempt went back without tier 0 (so it could not set tier-0 step-6 aside) and
    saved step-5 on its new line: tier-0 step-6 is newer, but belongs to the line it left."""
    run, memory = crashed
    train(run, *RUN, "--max-steps", 5, "--from-generation", "step-00000004")  # no --memory-dir
    resumed = train(run, *RUN, "--max-steps", 7, "--memory-dir", memory, "--resume")
    assert "restored step-00000005 (step=5 epoch=0 position=5) from the local disk" in resumed.stdout
    assert "tier 0 holds step-00000006 of an abandoned line" in resumed.stdout + resumed.stderr


def test_another_runs_tier0_is_never_restored_and_is_given_back(killed, tmp_path):
    shutil.copytree(killed / "shm", tmp_path / "shm")
    fresh = train(tmp_path / "run", *RUN, "--max-steps", 2, *tier0(tmp_path / "shm"), "--resume", "auto")
    assert "held generations of run" in fresh.stdout + fresh.stderr and "restored" not in fresh.stdout
    assert attempts(tmp_path / "run")[-1]["restored"] is None
    assert names(tmp_path / "shm" / "checkpoints") == []


def test_a_fresh_start_over_this_runs_tier0_is_refused_naming_it(crashed):
    """No --resume while this run's tier 0 holds a generation newer than the durable ones: 73,
    like any generation, and the line says where it is."""
    run, memory = crashed
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    refused = train(run, *RUN, *tier0(memory), expect=73)
    assert f"and tier 0 ({memory / 'checkpoints'}) already holds generations (newest step-00000006)" in refused.stderr
    assert names(memory / "checkpoints") == ["step-00000006"]  # touched nothing



def test_the_budget_counts_optimizer_state_that_is_not_created_yet():
    """A fresh start's estimate must not fall below the state after the first step. DCP creates
    the lazy state of the optimizers saved under `optim` when it reads their state dict; an
    optimizer among the workload's own stateful objects keeps none until it steps, so its
    moments are estimated from its param groups (Adam 2 per parameter, AMSGrad 3, SGD 1 with
    momentum, 0 without; others 2). <1 s."""
    import torch

    from trainer.run.state import TrainingState
    from trainer.storage.memory import lazy_optimizer_bytes, state_bytes

    weights = (8 * 4 + 4) * 4
    for make, tensors in [(torch.optim.Adam, 2), (lambda p: torch.optim.AdamW(p, amsgrad=True), 3),
                          (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
                          (lambda p: torch.optim.SGD(p, lr=0.1), 0), (torch.optim.Adamax, 2)]:
        model, critic = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        optimizer, kept = torch.optim.Adam(model.parameters()), make(critic.parameters())
        state = TrainingState(model, optimizer, torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9),
                              torch.amp.GradScaler("cpu", enabled=False), extras={"critic": kept})
        fresh = state_bytes(state.state_dict())
        assert len(optimizer.state) == 2 and not kept.state  # DCP created the main one's, not the extra's
        lazy = lazy_optimizer_bytes(state.optimizers())
        assert lazy == tensors * weights, make
        (model(torch.ones(2, 8)).sum() + critic(torch.ones(2, 8)).sum()).backward()
        optimizer.step()
        kept.step()
        stepped = state_bytes(state.state_dict())
        assert lazy_optimizer_bytes(state.optimizers()) == 0
        assert fresh + lazy >= stepped - 64 and (fresh < stepped or tensors == 0)  # 64: `step` scalars
