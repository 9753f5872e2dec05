"""Exact resume: interrupted and resumed runs end bit-identical to an uninterrupted one."""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from support.cli import compare, train
from support.runs import attempts, generation


def test_resume_after_interrupts_at_and_after_a_save_matches_baseline(tmp_path, baseline):
    """Interrupted three times: after step 9 (step-8 newest), at step 24 itself (interrupted
    before its save: step-16 newest), after step 27 (step-24 newest); each resume restores the
    newest, and the last ends bit-identical to the uninterrupted run."""
    run = tmp_path / "run"
    train(run, "--interrupt-at-step", 9, expect=75)
    for interrupt_at, restored in ((24, "step-00000008"), (27, "step-00000016"), (None, "step-00000024")):
        assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == restored
        resumed = train(run, "--resume", *(("--interrupt-at-step", interrupt_at) if interrupt_at else ()),
                        expect=75 if interrupt_at else 0)
        assert f"restored {restored}" in resumed.stdout
    result = compare(generation(baseline), generation(run))
    assert result.returncode == 0, result.stdout
    assert "all equal" in result.stdout


def test_resume_mid_epoch_generation_matches_baseline(tmp_path, baseline):
    run = tmp_path / "run"
    train(run, "--recover-every-steps", 5, "--interrupt-at-step", 13, expect=75)
    resumed = train(run, "--resume", "--recover-every-steps", 5)
    assert "restored step-00000010 (step=10 epoch=1 position=2)" in resumed.stdout
    assert compare(generation(baseline), generation(run)).returncode == 0


def test_resume_twice_and_from_an_earlier_generation(tmp_path, baseline):
    run = tmp_path / "run"
    train(run, "--interrupt-at-step", 20, expect=75)
    train(run, "--resume", "--interrupt-at-step", 45, expect=75)
    train(run, "--from-generation", "step-00000016")
    assert compare(generation(baseline), generation(run)).returncode == 0
    records = attempts(run)
    assert [r["status"] for r in records] == ["interrupted", "interrupted", "completed"]
    assert records[2]["restored"]["name"] == "step-00000016" and records[2]["explicit_generation"]
    assert records[2]["steps_replayed"] == 45 - 16
    # Going back set the later generations aside as superseded copies, kept, never deleted.
    assert records[2]["set_aside"] == ["checkpoints/step-00000024", "checkpoints/step-00000032",
                                       "checkpoints/step-00000040"]
    assert len(list((run / "checkpoints").glob(".step-*.replaced-*"))) == 3


def test_a_refused_go_back_abandons_nothing(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 4, "--interrupt-at-step", 30, expect=75)
    before = sorted(os.listdir(run / "checkpoints"))
    refused = train(run, "--epochs", 4, "--from-generation", "step-00000016", "--hidden-size", 7,
                    "--allow-drift", "config", expect=65)
    assert "shape-changing drift" in refused.stderr
    assert sorted(os.listdir(run / "checkpoints")) == before


def test_a_plain_resume_after_going_back_continues_the_new_line(tmp_path, baseline):
    """An operator went back with --from-generation and the new line was interrupted before
    it re-published every later step: the next plain --resume must continue the new line,
    never the abandoned generations with higher steps."""
    run = tmp_path / "run"
    train(run, "--interrupt-at-step", 20, expect=75)
    train(run, "--resume", "--interrupt-at-step", 45, expect=75)
    train(run, "--from-generation", "step-00000016", "--interrupt-at-step", 26, expect=75)
    resumed = train(run, "--resume")
    assert "restored step-00000024 (step=24" in resumed.stdout
    assert compare(generation(baseline), generation(run)).returncode == 0


def test_replayed_exports_do_not_pile_up_superseded_copies(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 4, "--export-every-steps", 1, "--keep-exports", 2, "--interrupt-at-step", 27, expect=75)
    train(run, "--epochs", 4, "--export-every-steps", 1, "--keep-exports", 2, "--resume")
    assert sorted(os.listdir(run / "exports")) == ["step-00000031", "step-00000032"]


def test_resume_with_dataloader_workers_matches_baseline(tmp_path, baseline):
    run = tmp_path / "run"
    train(run, "--num-workers", 2, "--interrupt-at-step", 30, expect=75)
    train(run, "--resume", "--num-workers", 1)
    assert compare(generation(baseline), generation(run)).returncode == 0


def test_resume_with_amp_matches_amp_baseline(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    train(base, "--amp", "--epochs", 4)
    train(run, "--amp", "--epochs", 4, "--interrupt-at-step", 19, expect=75)
    train(run, "--amp", "--epochs", 4, "--resume")
    assert compare(generation(base, "step-00000032"), generation(run, "step-00000032")).returncode == 0


def test_resume_auto_starts_fresh_then_continues(tmp_path, baseline):
    run = tmp_path / "run"
    train(run, "--resume", "auto", "--interrupt-at-step", 5, expect=75)  # no generation yet
    train(run, "--resume", "auto", "--interrupt-at-step", 30, expect=75)  # still none: fresh again
    train(run, "--resume", "auto")
    records = attempts(run)
    assert [r["restored"] and r["restored"]["name"] for r in records] == [None, None, "step-00000024"]
    assert compare(generation(baseline), generation(run)).returncode == 0


def test_extending_epochs_continues_the_same_training(tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    train(short, "--epochs", 4)
    train(short, "--resume", "--epochs", 6)
    train(long, "--epochs", 6)
    assert compare(generation(long, "step-00000048"), generation(short, "step-00000048")).returncode == 0


def test_stock_torch_sees_the_same_state(tmp_path, baseline):
    """Independent of compare.py: convert both DCP generations with stock torch and compare."""
    run = tmp_path / "run"
    train(run, "--interrupt-at-step", 27, expect=75)
    train(run, "--resume")
    loaded = []
    for source in (generation(baseline), generation(run)):
        target = tmp_path / f"{source.parent.parent.name}.pt"
        dcp_to_torch_save(str(source), str(target))
        loaded.append(torch.load(target, weights_only=False))
    a, b = loaded
    assert a.keys() == b.keys()
    tensors = 0
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        if isinstance(value, torch.Tensor):
            tensors += 1
            assert torch.equal(value.reshape(-1).view(torch.uint8), flat_b[key].reshape(-1).view(torch.uint8)), key
        else:
            assert repr(value) == repr(flat_b[key]), key
    assert tensors > 10


def _flatten(value, prefix=""):
    if isinstance(value, dict):
        flat = {}
        for key, inner in value.items():
            flat.update(_flatten(inner, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}
