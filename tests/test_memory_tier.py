"""Tier 0 (`--memory-dir`, trainer/storage/memory/) through the real CLI, on one machine: a
kill -9 after a tier-0 save newer than the newest durable generation restores from tier 0; a
damaged tier-0 generation is refused with one warning and the durable tier serves; a wiped
tier 0 (the node's memory lost) leaves the durable tier to serve; every case ends bit-identical
to the uninterrupted run. A tmp directory stands in for /dev/shm."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from support.cli import compare, one_error_line, run_cli, start, train
from support.limits import CLI_TIMEOUT_S, scaled, wait_until
from support.runs import attempts, made_once
from support.torchrun import trainer_ranks

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
    assert len(warned) == 1 and "step-00000006" in warned[0] and "blake3 mismatch" in warned[0], output
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


AUTO_LINE = re.compile(r"cadence auto: tier 0 every (\d+) steps")
SAVED_LINE = re.compile(r"saved step-(\d+) to tier 0")


def tier0_saves_follow_the_derived_interval(stdout: str, last: int) -> tuple[list[int], list[int]]:
    """(the tier-0 saves, the intervals logged) of one attempt, asserting that every save lands
    N steps after the save before it (`last`: the restored generation's step, 0 when fresh).
    The first lands max(N, 2) steps after `last`: N is derived from a step time, known at the
    attempt's second step (a loaded machine derives N = 1, which cannot fall on the first)."""
    interval, saves, changes = None, [], []
    for line in stdout.splitlines():
        if found := AUTO_LINE.search(line):
            interval = int(found.group(1))
            changes.append(interval)
        elif found := SAVED_LINE.search(line):
            step = int(found.group(1))
            expected = interval if saves or interval is None else max(interval, 2)
            assert interval is not None and step - last == expected, (step, last, interval, stdout)
            saves.append(step)
            last = step
    return saves, changes


def test_auto_tier0_cadence_saves_at_the_steps_it_derived_and_logs_and_records_each_change(tmp_path):
    """`--memory-every-steps auto`: N from the first step time, re-derived from each tier-0
    save's blocked seconds; every tier-0 save lands N steps after the one before (the first, N
    after the restored generation, or step 0), each change one line and one record entry; the
    next attempt, restored from tier 0, starts from the earlier attempt's C. Cost: two trainer
    processes of 48 and 16 steps (~1 s forked, ~3 s each fresh)."""
    run, auto = tmp_path / "run", ("--epochs", 8, "--recover-every-epochs", 0, "--log-every-steps", 100, "--memory-dir",
                                   tmp_path / "shm", "--memory-every-steps", "auto", "--memory-auto-min-secs", 0.02)
    first = train(run, *auto, "--interrupt-at-step", 48, expect=75)  # no durable generation: tier 0 serves
    saves, changes = tier0_saves_follow_the_derived_interval(first.stdout, 0)
    assert len(saves) >= 2 and len(changes) >= 2, first.stdout
    record = attempts(run)[0]
    recorded = record["memory_cadence_changes"]
    assert [entry["interval_steps"] for entry in recorded] == changes
    assert recorded[0]["step"] == 2 and recorded[0]["cost_s"] is None and recorded[0]["interval_s"] == 0.02
    assert recorded[1]["cost_from"].startswith("this attempt") and recorded[1]["cost_s"] > 0
    assert all(0.02 <= entry["interval_s"] <= 600 and entry["step_s"] > 0 for entry in recorded)
    assert record["memory"]["saves"] == len(saves) and record["memory"]["newest"] == f"step-{saves[-1]:08d}"
    assert "cadence_changes" not in record  # the durable cadence is not auto: its list stays apart

    second = train(run, *auto, "--resume")
    restored = attempts(run)[1]["restored"]
    assert restored["tier"] == "memory" and restored["step"] == saves[-1]
    tier0_saves_follow_the_derived_interval(second.stdout, saves[-1])
    prior = attempts(run)[1]["memory_cadence_changes"][0]
    assert prior["cost_from"] == "earlier attempts" and prior["failures"] == 1
    assert prior["cost_s"] == pytest.approx(record["memory"]["blocked_s"] / record["memory"]["saves"], abs=1e-5)


def test_on_two_ranks_rank_0s_auto_tier0_decision_is_every_ranks(tmp_path):
    """Two processes, `--memory-every-steps auto`: rank 0 decides (its clock, its C) and every
    rank saves its part at the same steps, through the step's one agreement. Interrupted (no
    durable generation: the parts stay). Its 2 ranks forked as torchrun starts them
    (`trainer_ranks`: the agreement is under test, not the launch). Cost: ~3 CPU-s (~10 with torchrun)."""
    run, memory = tmp_path / "run", tmp_path / "shm"
    trainer_ranks(run, "--recover-every-epochs", 0, "--log-every-steps", 100, "--memory-dir", memory,
                  "--memory-every-steps", "auto", "--memory-auto-min-secs", 0.02, "--interrupt-at-step", 20,
                  nproc=2, expect=75)
    parts = [names(memory / f"rank-{rank}-of-2" / "checkpoints") for rank in (0, 1)]
    record = attempts(run)[0]
    assert parts[0] and parts[0] == parts[1] and parts[0][-1] == record["memory"]["newest"], (parts, record["memory"])
    assert record["memory_cadence_changes"][0]["step"] == 2


@pytest.mark.parametrize("args, expected", [
    (("--memory-every-steps", "often"), "--memory-every-steps: must be a positive integer or auto, got often"),
    (("--memory-auto-min-secs", 5), "--memory-auto-min-secs applies only with --memory-every-steps auto"),
    (("--memory-every-steps", "auto", "--memory-auto-min-secs", 9, "--memory-auto-max-secs", 3),
     "--memory-auto-min-secs 9 is above --memory-auto-max-secs 3"),
])
def test_a_bad_tier0_cadence_is_refused_in_one_line(tmp_path, args, expected):
    refused = run_cli("--output", tmp_path / "run", "--memory-dir", tmp_path / "shm", *args)
    assert refused.returncode == 2 and expected in one_error_line(refused), refused.stderr
    assert not (tmp_path / "run").exists()


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


ASYNC = ("--checkpoint-mode", "async")


def test_an_async_tier0_save_survives_a_kill_and_restores_exactly(tmp_path, uninterrupted):
    """Under async saves a tier-0 save stages in the loop and writes and commits in the
    background; it is reported (recorded, then the pause) once committed, at the latest when the
    next tier-0 save waits for it. No durable save before the kill (--recover-every-steps 100),
    so the restore can only come from tier 0; the resumed run (async too, durable every 4 and
    tier 0 every 3 beside them) ends bit-identical to the uninterrupted one."""
    run, memory = tmp_path / "run", tmp_path / "shm"
    process = start(run, *RUN, *ASYNC, "--recover-every-steps", 100, *tier0(memory),
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
    assert not (run / "checkpoints").exists() or names(run / "checkpoints") == []
    assert names(memory / "checkpoints") == ["step-00000003"]
    (killed_record,) = attempts(run)
    saved = killed_record["memory"]
    assert saved["saves"] == 1 and saved["newest"] == "step-00000003"
    assert saved["blocked_s"] < saved["save_s"]  # the loop held only the staging, not the write
    resumed = train(run, *RUN, *ASYNC, *tier0(memory), "--resume")
    assert "restored step-00000003 (step=3 epoch=0 position=3) from tier 0 (memory)" in resumed.stdout
    assert attempts(run)[-1]["restored"]["tier"] == "memory"
    assert attempts(run)[-1]["memory"]["saves"] >= 1  # tier 0 kept saving beside the async durable saves
    assert names(memory / "checkpoints") == []
    assert_exact(uninterrupted, run)


def test_a_kill_during_a_background_tier0_write_leaves_only_a_temporary(tmp_path, uninterrupted):
    """kill -9 once a background tier-0 write has its files and before its commit (the seam
    `memory-after-write`): tier 0 holds a temporary and no generation; the resume never selects
    it, removes it, restores from the durable tier (or starts fresh, if the durable async save
    had not committed yet) and ends bit-identical."""
    run, memory = tmp_path / "run", tmp_path / "shm"
    killed = train(run, *RUN, *ASYNC, *tier0(memory), "--memory-every-steps", 5, expect=-signal.SIGKILL,
                   env={"TRAINER_FAULT_POINT": "memory-after-write"})
    assert "killing at memory-after-write" in killed.stderr
    left = os.listdir(memory / "checkpoints")
    assert names(memory / "checkpoints") == [] and len(left) == 1 and not left[0].startswith("step-"), left
    assert list((memory / "checkpoints" / left[0]).glob("*.distcp"))  # its shards were written
    resumed = train(run, *RUN, *ASYNC, *tier0(memory), "--resume", "auto")
    assert "from tier 0" not in resumed.stdout
    restored = attempts(run)[-1]["restored"]
    assert restored is None or restored["tier"] == "disk", restored
    assert os.listdir(memory / "checkpoints") == []  # the temporary removed at the claim; the rest given back
    assert_exact(uninterrupted, run)


def test_async_tier0_staging_is_counted_twice_in_the_budget(tmp_path):
    """Under async saves the durable saves and tier 0 each keep a host copy of the state: the
    refusal names both. <5 s."""
    refused = train(tmp_path / "run", *RUN, *ASYNC, *tier0(tmp_path / "shm"), "--memory-tier-max-bytes", 10000,
                    expect=2)
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("trainer: error:")]
    assert "bytes of staging (2 host copies: durable and tier-0 saves stage apart)" in line, line


def test_the_budget_counts_optimizer_state_that_is_not_created_yet():
    """A fresh start's estimate must not fall below the state after the first step. DCP creates
    the lazy state of the optimizers saved under `optim` when it reads their state dict; an
    optimizer among the workload's own stateful objects keeps none until it steps, so its
    moments are estimated from its param groups (Adam 2 per parameter, AMSGrad 3, SGD 1 with
    momentum, 0 without; others 2). <1 s."""
    import torch

    from trainer.run.state import TrainingState
    from trainer.storage.memory.budget import lazy_optimizer_bytes, state_bytes

    weights = (8 * 4 + 4) * 4
    for make, tensors in [(torch.optim.Adam, 2), (lambda p: torch.optim.AdamW(p, amsgrad=True), 3),
                          (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
                          (lambda p: torch.optim.SGD(p, lr=0.1), 0), (torch.optim.Adamax, 2)]:
        model, critic = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        optimizer, kept = torch.optim.Adam(model.parameters()), make(critic.parameters())
        state = TrainingState(model, optimizer, torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9),
                              torch.amp.GradScaler("cpu", enabled=False), extras={"critic": kept})
        estimated = state.estimated_bytes()
        assert not optimizer.state and not kept.state  # estimated without taking a step (LBFGS could not)
        fresh = state_bytes(state.state_dict())
        assert len(optimizer.state) == 2 and not kept.state  # DCP created the main one's, not the extra's
        lazy = lazy_optimizer_bytes(state.optimizers())
        assert lazy == tensors * weights, make
        assert estimated >= fresh + lazy - 64  # 64: `step` scalars
        (model(torch.ones(2, 8)).sum() + critic(torch.ones(2, 8)).sum()).backward()
        optimizer.step()
        kept.step()
        stepped = state_bytes(state.state_dict())
        assert lazy_optimizer_bytes(state.optimizers()) == 0
        assert fresh + lazy >= stepped - 64 and (fresh < stepped or tensors == 0)  # 64: `step` scalars


def test_a_tier0_save_in_flight_never_holds_or_touches_a_durable_save(tmp_path, monkeypatch):
    """In process, the trainer's own parts: an async tier-0 save whose commit is held back (the
    seam of its background write) while the loop changes the state and a durable async save
    stages, writes and commits; the durable one is published while tier 0 is still in flight, and
    each generation holds exactly the state of its own step (separate staging buffers). <2 s."""
    import contextlib
    import threading

    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.checkpointer import AsyncCheckpointer
    from trainer.checkpoint.commit import RenameCommit
    from trainer.checkpoint.coordination import SingleProcess
    from trainer.checkpoint.manifest import GenerationFacts
    from trainer.checkpoint.section import LocalSection
    from trainer.config import MemoryTierConfig
    from trainer.storage.memory.saves import MemoryCommit
    from trainer.storage.memory.tier import MemoryDirTier

    release, committing = threading.Event(), threading.Event()
    original = MemoryCommit.commit

    def held(self, *args):
        committing.set()
        assert release.wait(scaled(60))
        return original(self, *args)
    monkeypatch.setattr(MemoryCommit, "commit", held)

    def facts(step: int) -> GenerationFacts:
        return GenerationFacts(step=step, epoch=0, position=step, fingerprint={}, allowed_drift=(), cadence={},
                               created_utc="test")
    cpu, state = torch.device("cpu"), {"w": torch.arange(4096, dtype=torch.float32)}
    tier = MemoryDirTier(MemoryTierConfig(tmp_path / "shm", every_steps=1), None)
    held_open = contextlib.ExitStack()
    tier.claim(held_open)  # as the attempt does: the directory made, its lock held
    saves = tier.saver("a", SingleProcess(), "async", cpu)
    disk = LocalSection(tmp_path / "run" / "checkpoints")
    durable = AsyncCheckpointer(RenameCommit(disk), "a", cpu)
    try:
        assert saves.save(state, facts(1)) == []
        saves.wait_for_staging()
        state["w"].add_(1)  # the next optimizer step
        assert durable.save(state, facts(2)) == []
        durable.wait_for_staging()
        state["w"].add_(1)
        assert committing.wait(scaled(60))
        (published,) = durable.drain()  # committed while tier 0's commit still waits
        assert published.name == "step-00000002" and saves.completed() == [] and tier.own.section.names() == []
    finally:
        release.set()
        (tier0,) = saves.finalize()
        durable.finalize()
        held_open.close()
    assert tier0.name == "step-00000001" and tier0.blocked_s < tier0.save_s
    for section, name, offset in [(tier.own.section, "step-00000001", 0), (disk, "step-00000002", 1)]:
        assert section.verify(name).ok
        loaded = {"w": torch.empty(4096)}
        dcp.load(loaded, checkpoint_id=section.path(name), no_dist=True)
        assert torch.equal(loaded["w"], torch.arange(4096, dtype=torch.float32) + offset), name


def test_a_failed_background_tier0_write_is_a_warning_and_the_next_save_goes_on(tmp_path, monkeypatch, caplog):
    """An async tier-0 save whose background commit fails (a full memory filesystem): one
    warning when it is collected, nothing published, no temporary left, and the next tier-0
    save publishes. <1 s."""
    import contextlib
    import errno

    import torch

    from trainer.checkpoint.coordination import SingleProcess
    from trainer.checkpoint.manifest import GenerationFacts
    from trainer.config import MemoryTierConfig
    from trainer.storage.memory.saves import MemoryCommit
    from trainer.storage.memory.tier import MemoryDirTier

    original, calls = MemoryCommit.commit, []

    def full_once(self, *args):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "tier 0")
        return original(self, *args)
    monkeypatch.setattr(MemoryCommit, "commit", full_once)
    facts = [GenerationFacts(step=step, epoch=0, position=step, fingerprint={}, allowed_drift=(), cadence={},
                             created_utc="test") for step in (1, 2)]
    tier, state = MemoryDirTier(MemoryTierConfig(tmp_path / "shm", every_steps=1), None), {"w": torch.ones(256)}
    with contextlib.ExitStack() as held:
        tier.claim(held)
        saves = tier.saver("a", SingleProcess(), "async", torch.device("cpu"))
        assert saves.save(state, facts[0]) == []
        assert saves.save(state, facts[1]) == []  # waits for step 1: failed, warned, skipped
        (published,) = saves.finalize()
    assert published.name == "step-00000002" and calls == [1, 2]
    warned = [r.getMessage() for r in caplog.records if "tier 0 skipped" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0], warned
    assert sorted(os.listdir(tmp_path / "shm" / "checkpoints")) == ["step-00000002"]


def test_each_rank_replicates_to_the_same_local_rank_on_the_next_node_and_one_node_has_no_partner():
    from trainer.storage.memory.parts import keeper_of, partner

    # 3 nodes x 2 processes: rank r's replica is kept by rank r + 2 (the next node), in a ring.
    assert [partner(rank, 6, 2) for rank in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [keeper_of(partner(rank, 6, 2), 6, 2) for rank in range(6)] == list(range(6))
    assert partner(1, 2, 2) is None and keeper_of(0, 2, 2) is None and partner(0, 1, 1) is None


def test_a_generation_is_offered_only_when_every_ranks_part_can_be_had_in_this_run():
    from trainer.storage.memory.choice import Holding, available_everywhere

    six, nine = "step-00000006", "step-00000009"
    holdings = [Holding(0, {0: ("run-a", {six: "a1", nine: "a1"}), 2: ("run-a", {six: "a1"})}),
                Holding(1, {1: ("run-a", {six: "a1"}), 0: ("run-a", {six: "a1", nine: "a1"})}),
                Holding(2, {}),  # a replaced node: its own part only as rank 0's replica
                ]
    # rank 2's part of step 6 is kept by rank 0 (its replica); step 9 lacks ranks 1 and 2.
    assert available_everywhere(holdings, "run-a") == {six: "a1"}
    assert available_everywhere(holdings, "run-b") == {}  # bound to another run: never offered
    # A part of the same step written by another attempt (another line) is never combined.
    other_line = [Holding(0, {0: ("run-a", {six: "a1"}), 1: ("run-a", {six: "a0"})}), Holding(1, {})]
    assert available_everywhere(other_line, "run-a") == {}
    holdings[0] = Holding(0, {0: ("run-a", {six: "a1"})})
    assert available_everywhere(holdings, "run-a") == {}  # rank 2's part is nowhere


def test_a_part_streams_in_bounded_chunks_and_is_kept_only_when_its_files_match_its_manifest(tmp_path):
    """storage/memory/replication.py's two ends in one process, without the wire: a part sent file by file in
    chunks of at most `chunk_bytes` (here 1000 bytes: a file spans several, the small ones one),
    read from handles opened before it was pruned, hashed and written as it arrives, renamed into
    place only when every file matches its manifest; a flipped byte, another generation than the
    one asked for, and bad names are refused with nothing left behind. <1 s."""
    import torch

    from trainer.checkpoint.manifest import GenerationFacts, Manifest
    from trainer.checkpoint.section import LocalSection
    from trainer.checkpoint.snapshot import write_snapshot
    from trainer.errors import CorruptGeneration
    from trainer.storage.memory.replication import Incoming, Outgoing, Parcel

    source = LocalSection(tmp_path / "source")
    temporary = source.begin(6, "t")
    write_snapshot({"w": torch.arange(1024, dtype=torch.float32)}, temporary)
    facts = GenerationFacts(6, 0, 6, {}, (), {}, "2026-12-03T00:00:00Z")
    source.publish(temporary, 6, lambda files: Manifest.for_generation(facts, "attempt", {}, files))

    def stream(section: LocalSection, damage: bool = False, wanted: str | None = None, parcel=None) -> str:
        with Outgoing(source.path("step-00000006")) as outgoing:
            incoming = Incoming(section, parcel or outgoing.parcel, wanted)
            for index, data in outgoing.chunks(1000):
                assert 0 < len(data) <= 1000
                if damage and outgoing.parcel.files[index][0].endswith(".distcp"):
                    data = bytes(data[:-1]) + b"X"
                incoming.take(index, memoryview(data))
            return incoming.keep()

    with Outgoing(source.path("step-00000006")) as outgoing:
        sizes = dict(outgoing.parcel.files)
        assert sizes["__0_0.distcp"] > 4000 and len(outgoing.parcel.chunks(1000)) > len(sizes)  # several per shard
    kept = LocalSection(tmp_path / "kept")
    assert stream(kept, wanted="step-00000006") == "step-00000006"
    assert kept.names() == ["step-00000006"] and verify_directory_again(kept, "step-00000006")
    for section, kwargs, problem in [(LocalSection(tmp_path / "damaged"), {"damage": True}, "does not verify"),
                                     (LocalSection(tmp_path / "other"), {"wanted": "step-00000009"},
                                      "when step-00000009 was asked for")]:
        with pytest.raises(CorruptGeneration, match=problem):
            stream(section, **kwargs)
        assert not section.root.exists() or not list(section.root.iterdir())
    with Outgoing(source.path("step-00000006")) as outgoing:
        files = outgoing.parcel.files
    for name, listed in [("../step-00000006", files), ("notes", files), ("step-00000006", files + (("../escape", 0),))]:
        with pytest.raises(CorruptGeneration, match="a peer sent"):
            stream(LocalSection(tmp_path / "refused"), parcel=Parcel(name, listed))
    assert not (tmp_path / "escape").exists() and not (tmp_path / "refused").exists()
    with Outgoing(source.path("step-00000006")) as outgoing:  # pruned while it is sent: read whole
        source.remove("step-00000006")
        incoming = Incoming(LocalSection(tmp_path / "late"), outgoing.parcel)
        for index, data in outgoing.chunks(1000):
            incoming.take(index, data)
        assert incoming.keep() == "step-00000006"


def verify_directory_again(section, name: str) -> bool:
    """Every file of `name` read and hashed anew (not the receiver's own digests)."""
    from trainer.checkpoint.manifest import verify_directory

    return verify_directory(section.path(name)).ok


def test_tier0_options_and_processes_per_node_that_differ_between_ranks_are_named_in_one_line():
    """The claim's comparison (storage/memory/choice.py `disagreement`): each of the three settings the
    tier-0 rounds depend on, named with its values and the ranks (as ranges) that gave them;
    --memory-dir on some ranks only; nothing said when every rank agrees. <1 s."""
    from trainer.storage.memory.choice import Agreement, disagreement

    same = [Agreement(10, 2, 2)] * 4
    assert disagreement(same) is None and disagreement([None, None]) is None
    assert disagreement([Agreement(10, 2, 2), Agreement(10, 2, 2), Agreement(5, 2, 2), Agreement(5, 2, 2)]) == \
        "tier 0: --memory-every-steps differs between nodes (10 on ranks 0-1, 5 on ranks 2-3); give the same on every node"
    assert disagreement([Agreement("auto", 2, 1), Agreement(4, 2, 1), Agreement("auto", 2, 1)]) == \
        "tier 0: --memory-every-steps differs between nodes (auto on ranks 0, 2, 4 on rank 1); give the same on every node"
    assert disagreement([Agreement(10, 2, 1), Agreement(10, 3, 1)]) == \
        "tier 0: --memory-keep differs between nodes (2 on rank 0, 3 on rank 1); give the same on every node"
    assert disagreement([Agreement(10, 2, 2), Agreement(10, 2, 2), Agreement(10, 2, 1)]) == \
        ("tier 0: processes per node (torchrun --nproc-per-node, LOCAL_WORLD_SIZE) differs between nodes (2 on "
         "ranks 0-1, 1 on rank 2); start the same number on every node, or drop --memory-dir")
    assert disagreement([Agreement(10, 2, 1), None, None]) == \
        "--memory-dir is given to some ranks but not to rank(s) [1, 2]; give it on every node, or on none"


def test_the_default_budget_is_this_ranks_share_of_the_free_memory_of_the_node(tmp_path):
    """Every local rank writes into the same memory filesystem: by default each counts only
    1/LOCAL_WORLD_SIZE of what it has free (plus what its own parts hold). A state that fits the
    whole free space but not a half is refused with two processes on the node, naming the share,
    and accepted with one. <1 s."""
    import contextlib

    from trainer.checkpoint.coordination import SingleProcess
    from trainer.config import MemoryTierConfig
    from trainer.errors import MemoryTierTooSmall
    from trainer.storage.memory.budget import node_share
    from trainer.storage.memory.parts import Place
    from trainer.storage.memory.tier import MemoryDirTier

    assert node_share(1000, 1) == 1000 and node_share(1000, 4) == 250 and node_share(1001, 2) == 500
    config = MemoryTierConfig(tmp_path / "shm", every_steps=1, keep=1)  # K = 1: the budget is one generation
    with contextlib.ExitStack() as held:
        alone, shared = MemoryDirTier(config, None, Place(0, 1, 1)), MemoryDirTier(config, None, Place(1, 2, 2, 1))
        alone.claim(held)
        shared.claim(held)
        stats = os.statvfs(tmp_path)
        free = stats.f_bavail * stats.f_frsize
        assert alone.parts.limit_bytes(None) == pytest.approx(free, rel=0.05)
        assert shared.parts.limit_bytes(None) == pytest.approx(free / 2, rel=0.05)
        three_quarters = lambda: int(0.7 * free)  # noqa: E731 - the state's estimate, between a half and the whole
        alone.saver("a", SingleProcess(), "sync", torch_cpu()).fits(three_quarters)
        with pytest.raises(MemoryTierTooSmall) as refused:
            shared.saver("a", SingleProcess(), "sync", torch_cpu()).fits(three_quarters)
    assert "of rank 1" in str(refused.value) and \
        "(--memory-tier-max-bytes, or 1/2 of the free memory of its filesystem: 2 processes on this node share it)" \
        in str(refused.value)


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_this_runs_parts_of_another_world_size_are_given_back_and_no_other_runs(crashed):
    """The killed run's tier-0 part, copied as this run's parts of world size 2 (`rank-R-of-2/`,
    as a two-process attempt of this run would leave them), beside a part of another run and one
    held by a live trainer: a one-process resume removes this run's, keeps the other two, and
    says so in one line. Cost: one trainer of 5 steps (~3 s)."""
    from trainer.storage.lock import OutputLock

    run, memory = crashed
    node = memory.parent / "node"
    for name in ("rank-0-of-2", "rank-1-of-2", "rank-0-of-3", "rank-0-of-4"):
        shutil.copytree(memory, node / name)
    identity = json.loads((node / "rank-0-of-3" / "run.json").read_text())
    (node / "rank-0-of-3" / "run.json").write_text(json.dumps({**identity, "run": "another-run"}))
    with OutputLock(node / "rank-0-of-4"):  # a live trainer of this run at world size 4 (it cannot be, but held)
        resumed = train(run, *RUN, "--max-steps", 5, "--memory-dir", node, "--resume")
    said = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "another world size" in line]
    assert len(said) == 1 and "removed rank-0-of-2 (this run), rank-1-of-2 (this run)" in said[0], said
    assert "kept rank-0-of-3 (run another-run's), rank-0-of-4 (held by a live trainer)" in said[0], said
    assert sorted(path.name for path in node.glob("rank-*")) == ["rank-0-of-3", "rank-0-of-4"]
    assert names(node / "rank-0-of-3" / "checkpoints") == ["step-00000006"]
