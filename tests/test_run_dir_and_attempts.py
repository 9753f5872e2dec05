"""The run directory's layout and checks, the test seams, and the attempt-record decisions,
without a subprocess."""

from __future__ import annotations

import json
import os

import pytest

from trainer import seams
from trainer.run.witness import step_digest
from trainer.run.attempts import is_crash_loop, new_attempt_id, previous_attempt, steps_replayed, world_size_change
from trainer.run.records import AttemptRecord
from trainer.errors import NothingToResume, RefuseOverwrite, UsageError
from trainer.layout import (REMOVABLE, REPLACED, RunDirectory, generation_name, generation_step, hidden_name,
                             split_hidden, temporary_name)


# ----------------------------------------------------------------------------- layout
def test_generation_names_sort_by_step_and_parse_back():
    assert generation_name(24) == "step-00000024" and generation_step("step-00000024") == 24
    assert sorted([generation_name(100), generation_name(24)]) == ["step-00000024", "step-00000100"]
    for other in (".step-00000024.tmp-a-b", "step-24", "step-00000024x", "model"):
        assert generation_step(other) is None


def test_hidden_siblings_are_never_generations_and_only_ours_are_removable():
    tag = new_attempt_id()  # the tag a real attempt writes under (to the microsecond: it has a dot)
    temporary = temporary_name("step-00000024", tag)
    assert temporary.startswith(f".step-00000024.tmp-{tag}-") and REMOVABLE.match(temporary)
    assert REMOVABLE.match(hidden_name("step-00000024", ".deleting-"))
    replaced = hidden_name("step-00000024", REPLACED, "abc")
    assert replaced == ".step-00000024.replaced-abc" and not REMOVABLE.match(replaced)
    assert split_hidden(replaced, REPLACED) == ("step-00000024", "abc")
    assert split_hidden("step-00000024", REPLACED) is None
    assert not REMOVABLE.match(".notes.tmp-x")  # not a generation of ours


def test_prepare_refuses_what_is_not_a_run_directory(tmp_path):
    run = RunDirectory(tmp_path / "run")
    with pytest.raises(NothingToResume, match="does not exist"):
        run.prepare(must_exist=True)
    assert not run.root.exists()
    run.prepare(must_exist=False)
    assert run.root.is_dir()
    run.checkpoints.write_text("not a folder")
    with pytest.raises(RefuseOverwrite, match="checkpoints is a file, not a directory"):
        run.prepare(must_exist=False)
    assert run.checkpoints.read_text() == "not a folder"  # nothing was changed
    with pytest.raises(UsageError, match="part of the path is a file"):
        RunDirectory(run.checkpoints / "sub").prepare(must_exist=False)


def test_a_directory_where_the_lock_belongs_is_misplaced(tmp_path):
    run = RunDirectory(tmp_path)
    run.lock.mkdir()
    assert run.misplaced_entry() == f"{run.lock} is a directory, not the lock file"


# ----------------------------------------------------------------------------- seams
def test_seams_come_from_the_environment_and_refuse_typos():
    assert seams.Seams.from_environment({}, rank=0) == seams.Seams()
    chosen = seams.Seams.from_environment({seams.FAULT_ENV: "after-write", seams.FAULT_RANK_ENV: "1",
                                           seams.SKIP_RNG_ENV: "numpy,python"}, rank=1)
    assert chosen == seams.Seams("after-write", frozenset({"numpy", "python"}))
    other_rank = seams.Seams.from_environment({seams.FAULT_ENV: "after-write", seams.FAULT_RANK_ENV: "1"}, rank=0)
    assert other_rank.crash_at is None
    for env in ({seams.FAULT_ENV: "after-wirte"}, {seams.SKIP_RNG_ENV: "numpi"}, {seams.FAULT_RANK_ENV: "one"}):
        with pytest.raises(UsageError):
            seams.Seams.from_environment(env, rank=0)


def test_no_seam_is_installed_in_a_library_process():
    seams.crash_point("after-write")  # would SIGKILL this test process if a crash were installed
    assert seams.skip_rng_restore() == frozenset()


# ----------------------------------------------------------------------------- attempts
def record(status, restored=None, published=(), last_step=None):
    return AttemptRecord.parse({"status": status, "restored": {"name": restored} if restored else None,
                                "generations_published": [{"name": n} for n in published], "last_step": last_step,
                                "id": status})


def test_crash_loop_counts_only_attempts_that_trained_and_published_nothing():
    dead = [record("running", "step-00000016") for _ in range(3)]
    assert is_crash_loop(dead, "step-00000016", 3)
    assert not is_crash_loop(dead, "step-00000016", 4)  # fewer attempts than the limit
    assert not is_crash_loop(dead, "step-00000008", 3)  # they restored another generation
    assert not is_crash_loop(dead, "step-00000016", 0)  # the guard is off
    assert is_crash_loop(dead[:2] + [record("refused")] + dead[2:], "step-00000016", 3)  # refusals don't count
    assert not is_crash_loop(dead[:2] + [record("failed", "step-00000016", ["step-00000024"])], "step-00000016", 3)
    assert not is_crash_loop(dead[:2] + [record("interrupted", "step-00000016")], "step-00000016", 3)
    assert is_crash_loop([record("failed") for _ in range(3)], None, 3)  # from scratch, every time


def test_steps_replayed_and_the_previous_attempt():
    history = [record("interrupted", last_step=27), record("refused")]
    assert previous_attempt(history).status == "interrupted"
    assert steps_replayed(previous_attempt(history), 24) == 3
    assert steps_replayed(previous_attempt(history), 32) == 0  # restored past where it stopped
    assert steps_replayed(None, 24) is None and steps_replayed(record("running"), 24) is None


def test_world_size_change_is_recorded_only_when_it_changed():
    assert world_size_change(None, 2) == {} and world_size_change(2, 2) == {}
    change = world_size_change(1, 2)["world_size_change"]
    assert (change["from"], change["to"], change["exact"]) == (1, 2, False)


def test_a_section_or_a_generation_is_not_a_run_directory(tmp_path):
    for part in ("checkpoints", "exports", "step-00000024"):
        with pytest.raises(UsageError, match="is part of a run directory"):
            RunDirectory(tmp_path / "run" / part).prepare(must_exist=False)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "manifest.json").write_text("{}")
    with pytest.raises(UsageError, match="is part of a run directory"):
        RunDirectory(tmp_path / "elsewhere").prepare(must_exist=False)
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_an_attempt_that_ends_between_publishes_records_the_step_it_reached(tmp_path):
    """A failure or a grace timeout ends without `reached()`: the per-step marker decides, so
    the next attempt counts the steps it redoes."""
    from trainer.run.attempts import AttemptRecorder, AttemptStart
    from trainer.run.records import read_attempt_records

    recorder = AttemptRecorder.start(RunDirectory(tmp_path), "20261201T000000Z-abcdef", [], AttemptStart())
    recorder.reached(10, first=True)
    for step in range(11, 16):
        recorder.mark_step(step, step_digest(1.0, step))
    recorder.ended("failed", 74, "disk full")
    [record] = read_attempt_records(tmp_path)
    assert (record.status, record.first_step, record.last_step) == ("failed", 10, 15)


def test_a_progress_point_is_written_off_the_loops_thread_and_the_end_after_it(tmp_path, monkeypatch):
    """Every 8th step's progress point rewrites the record (two fsyncs): the loop's thread
    hands it to a background writer (issue 55); the end's write waits for it, so the newest
    record is the one that stays."""
    import threading

    from trainer.run.attempts import AttemptRecorder, AttemptStart

    recorder = AttemptRecorder.start(RunDirectory(tmp_path), "20261201T000000Z-abcdef", [], AttemptStart())
    recorder.reached(0, first=True)
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(threading.current_thread().name), fsync(fd)))
    for step in range(1, 17):
        recorder.mark_step(step, step_digest(1.0, step))
    recorder._later.settle()
    assert synced and "trainer-record" in synced and threading.current_thread().name not in synced
    assert [point[0] for point in json.loads((recorder.folder / "attempt.json").read_text())["progress"]["points"]] \
        == [8, 16]
    recorder.ended("completed", 0)
    assert json.loads((recorder.folder / "attempt.json").read_text())["status"] == "completed"
