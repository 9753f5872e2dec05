"""The fingerprint guard refuses silent drift; attempt records say what each process did."""

from __future__ import annotations

import json
import re

import pytest

from support.cli import one_error_line, run_cli, train
from support.runs import attempts, generation
from trainer.run.fingerprint import SOURCE_FILES, changed_files, check_fingerprint, fingerprint_diff, source_files
from trainer.errors import FingerprintMismatch


@pytest.fixture()
def interrupted(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 3, "--interrupt-at-step", 10, expect=75)
    return run


def test_changed_config_is_refused_with_a_field_diff(interrupted):
    result = run_cli("--output", interrupted, "--resume", "--epochs", 3, "--lr", "0.1")
    assert result.returncode == 65
    line = one_error_line(result)
    assert "config.lr 0.05 → 0.1" in line and "--allow-drift config" in line
    # The refused start is on record, and the next attempt that trains still counts its
    # replayed work against the interrupted one, not against the refusal.
    interrupted_record, refused = attempts(interrupted)
    assert refused["status"] == "refused" and refused["exit_code"] == 65
    assert "config.lr 0.05 → 0.1" in refused["reason"] and refused["considered_generation"] == "step-00000008"
    assert refused["restored"] is None and refused["last_step"] is None and refused["wall_s"] >= 0
    assert refused["previous_attempt"] == interrupted_record["id"]
    train(interrupted, "--resume", "--epochs", 3)
    resumed = attempts(interrupted)[-1]
    assert resumed["previous_attempt"] == interrupted_record["id"] and resumed["steps_replayed"] == 2


def test_allowed_drift_proceeds_and_is_recorded(interrupted):
    train(interrupted, "--resume", "--epochs", 3, "--lr", "0.1", "--allow-drift", "config")
    record = attempts(interrupted)[-1]
    assert record["allowed_drift"] == ["config"] and record["drift"] == ["config.lr: 0.05 → 0.1"]
    manifest = json.loads((generation(interrupted, "step-00000024") / "manifest.json").read_text())
    assert manifest["allowed_drift"] == ["config.lr: 0.05 → 0.1"]


def test_options_that_do_not_change_training_are_not_drift(interrupted):
    train(interrupted, "--resume", "--epochs", 4, "--num-workers", 1)


def test_fingerprint_diff_is_per_field():
    old = {"source": "a", "config": {"lr": 0.05, "seed": 1}, "torch": "2.12.0", "world_size": 1}
    new = {"source": "a", "config": {"lr": 0.05, "seed": 2}, "torch": "2.13.0", "world_size": 2}
    assert [d[1] for d in fingerprint_diff(old, new)] == ["config.seed", "torch", "world_size"]
    with pytest.raises(FingerprintMismatch) as refused:
        check_fingerprint("step-00000008", old, new, ("torch",))
    assert "--allow-drift config --allow-drift world_size" in str(refused.value)
    assert "torch" not in str(refused.value).split("different environment:")[1].split(";")[0]
    assert len(check_fingerprint("step-00000008", old, new, ("config", "torch", "world_size"))) == 3


def test_source_covers_the_whole_trainer_package_and_a_refusal_names_the_changed_files():
    """Pure: `source` hashes every module of the package (cli.py and the loop alike, not only
    the folder fingerprint.py lives in), and a source refusal names the files, not digests."""
    names = [name for name, _ in source_files()]
    assert {"cli.py", "run/loop.py", "checkpoint/restore.py", "workload/example.py"} <= set(names)
    old = {"source": "a", SOURCE_FILES: {"cli.py": "1", "run/loop.py": "2", "gone.py": "3"}}
    new = {"source": "b", SOURCE_FILES: {"cli.py": "1", "run/loop.py": "9", "workload/mine.py": "4"}}
    with pytest.raises(FingerprintMismatch) as refused:
        check_fingerprint("step-00000008", old, new, ())
    assert "(changed run/loop.py; added workload/mine.py; removed gone.py)" in str(refused.value)
    assert changed_files(None, new[SOURCE_FILES]) == ""  # a generation written before the list was kept


def test_source_change_is_detected(tmp_path, interrupted):
    record = attempts(interrupted)[-1]
    manifest = json.loads((generation(interrupted, "step-00000008") / "manifest.json").read_text())
    assert manifest["fingerprint"] == record["fingerprint"]
    assert len(manifest["fingerprint"]["source"]) == 64
    assert re.fullmatch(r"[0-9a-f]{64}; draws_from_global_rngs=\[\]", manifest["fingerprint"]["dataset"])  # its declaration


def test_attempt_records_describe_each_process(interrupted):
    train(interrupted, "--resume", "--epochs", 3)
    first, second = attempts(interrupted)
    assert (first["status"], first["exit_code"], first["restored"], first["last_step"]) == ("interrupted", 75, None, 10)
    assert second["status"] == "completed" and second["exit_code"] == 0
    assert second["restored"]["name"] == "step-00000008" and second["restored"]["step"] == 8
    assert len(second["restored"]["manifest_sha256"]) == 64
    assert second["previous_attempt"] == first["id"] and second["steps_replayed"] == 2
    assert second["costs"]["restore_s"] > 0 and second["costs"]["save_s"] > 0 and second["costs"]["saves"] == 3
    assert [g["name"] for g in second["generations_published"]] == ["step-00000016", "step-00000024"]
    assert second["argv"][:3] == ["--output", str(interrupted), "--resume"]
    for key in ("host", "pid", "started_utc", "ended_utc", "fingerprint"):
        assert second[key]
    folder = interrupted / "attempts" / second["id"]
    assert "torch==2.13.0" in (folder / "requirements.txt").read_text()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final_step"] == 24 and len(summary["history"]["loss"]) == 24
    assert not (interrupted / "attempts" / first["id"] / "summary.json").exists()


def lr_history(run) -> list[float]:
    newest = sorted((run / "attempts").iterdir())[-1]
    return json.loads((newest / "summary.json").read_text())["history"]["lr"]


def test_an_allowed_lr_change_takes_effect_from_the_restored_step(tmp_path):
    """The restored optimizer and scheduler carry the old rate; an accepted --lr change must
    win over them (the new fingerprint records it), continuing the decay already reached:
    with 0.1 = 2 × 0.05 the schedule equals a run trained at 0.1 from the start, bit for bit."""
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    train(baseline, "--epochs", 2, "--lr", "0.1")
    train(run, "--epochs", 1)
    train(run, "--epochs", 2, "--resume", "--lr", "0.1", "--allow-drift", "config")
    assert lr_history(run)[8:] == lr_history(baseline)[8:]
    assert lr_history(run)[7] == lr_history(baseline)[7] / 2


def test_the_default_workloads_config_fingerprint_is_what_it_always_was():
    """Generations written before --workload and --grad-accum existed must still resume: the
    example's options moved into the workload, and defaults of the new options stay out (a
    reduction is named unless it is per-parameter, the one a resume keeps where none is named)."""
    from pathlib import Path

    from trainer.cli import config_from_args, workload_parser
    from trainer.config import DEFAULT_WORKLOAD
    from trainer.location import OnDisk

    parser, names = workload_parser(DEFAULT_WORKLOAD)
    config = config_from_args(parser.parse_args(["--output", "unused"]), [], OnDisk(Path("unused")), names)
    before = {"samples": 128, "batch_size": 16, "lr": 0.05, "seed": 1234, "hidden_size": 64, "layers": 2,
              "dropout": 0.1, "features": 16, "classes": 4, "amp": False, "threads": 1}
    assert config.workload.training_relevant() == {**before, "gradient_reduction": "fixed-buckets"}
    # a generation that names no reduction was made with per-parameter, which its resume keeps
    assert config.workload.kept_reduction(before).training_relevant() == before
    changed = config_from_args(parser.parse_args(["--output", "unused", "--grad-accum", "2"]), [],
                               OnDisk(Path("unused")), names)
    assert changed.workload.training_relevant()["grad_accum"] == 2
