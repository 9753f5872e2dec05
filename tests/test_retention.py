"""Retention: the pure selection, and the real thing across a resume."""

from __future__ import annotations

import os

from support.cli import train
from support.runs import generation
from trainer.checkpoint.retention import Candidate, select_deletions


def names(*steps):
    return [f"step-{s:08d}" for s in steps]


def test_keep_last_counts_only_verified():
    candidates = [Candidate(n, n != "step-00000032") for n in names(8, 16, 24, 32, 40)]
    assert select_deletions(candidates, 2, None, frozenset()) == names(8, 16)
    # the damaged one is neither counted nor deleted (left for inspection)


def test_keep_every_and_protected_are_kept():
    candidates = [Candidate(n, True) for n in names(8, 16, 24, 32, 40, 48)]
    assert select_deletions(candidates, 2, 16, frozenset(names(8))) == names(24)


def test_newest_verified_is_never_deleted():
    candidates = [Candidate(n, True) for n in names(8, 16)] + [Candidate("step-00000024", False)]
    assert select_deletions(candidates, 0, None, frozenset()) == names(8)
    assert select_deletions(candidates, None, None, frozenset()) == []


def test_retention_across_a_resume_keeps_restored_and_ignores_foreign(tmp_path):
    run = tmp_path / "run"
    train(run, "--recover-every-steps", 4, "--keep-last", 2, "--keep-every", 32, "--interrupt-at-step", 22, expect=75)
    assert sorted(os.listdir(run / "checkpoints")) == names(16, 20)
    (run / "checkpoints" / "step-foreign").mkdir()
    (run / "checkpoints" / "README.txt").write_text("operator notes")
    train(run, "--resume", "--recover-every-steps", 4, "--keep-last", 2, "--keep-every", 32)
    kept = sorted(os.listdir(run / "checkpoints"))
    # restored step-20 is protected; 32 is a milestone; 60 and 64 are the newest two
    assert kept == ["README.txt"] + names(20, 32, 60, 64) + ["step-foreign"]
    assert generation(run).exists()


def test_a_removal_later_hides_the_generation_at_once_and_settle_deletes_its_files(tmp_path):
    from trainer.checkpoint.section import LocalSection

    section = LocalSection(tmp_path)
    for name in names(8, 16):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x" * 4096)
    section.remove("step-00000008", later=True)
    assert section.names() == names(16), "no reader sees the removed generation, even while its files go"
    section.remove("step-00000016", later=True)  # waits for the first deletion: one at a time
    section.settle()
    assert os.listdir(tmp_path) == [], "every file of both is deleted once settled, no .deleting- sibling left"
