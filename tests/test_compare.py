"""compare.py finds a planted difference in every class of field, and loosens nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support.cli import REPO, compare
from support.limits import scaled
from support.runs import generation
from trainer.inspect.compare import value_difference
from trainer.checkpoint.manifest import Manifest, read_manifest
from trainer.checkpoint.snapshot import load_flat
from trainer.checkpoint.section import LocalSection


def plant(source, target_root, key, change):
    """A sealed copy of generation `source` whose flat field `key` was altered by `change`."""
    flat = load_flat(source)
    flat[key] = change(flat[key])
    original = read_manifest(source)
    store = LocalSection(target_root)
    temporary = store.begin(original.step, "test")
    dcp.save(flat, checkpoint_id=str(temporary), no_dist=True)
    store.publish(temporary, original.step,
                  lambda files: Manifest.for_generation(original.facts, original.attempt, dict(original.timings), files))
    return target_root / source.name


def bump_tensor(t):
    t = t.clone()
    t.reshape(-1)[0] += 1
    return t


PLANTS = {
    "model.net.0.weight": bump_tensor,
    "optim.state.net.3.bias.momentum_buffer": bump_tensor,
    "optim.param_groups.0.lr": lambda v: v * 2,
    "scheduler.last_epoch": lambda v: v + 1,
    "rng.torch": bump_tensor,
    "rng.numpy.pos": lambda v: v + 1,
    "rng.python.internal": bump_tensor,
    "progress.position": lambda v: v + 1,
    "history.loss": bump_tensor,
}


@pytest.mark.parametrize("key", sorted(PLANTS))
def test_compare_detects_planted_difference(tmp_path, baseline, key):
    planted = plant(generation(baseline), tmp_path, key, PLANTS[key])
    result = compare(generation(baseline), planted, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert [f["field"] for f in report["fields"] if not f["equal"]] == [key]


def test_compare_table_names_the_field_and_first_difference(tmp_path, baseline):
    planted = plant(generation(baseline), tmp_path, "model.net.0.bias", bump_tensor)
    table = compare(generation(baseline), planted)
    assert table.returncode == 1
    row = next(line for line in table.stdout.splitlines() if line.startswith("model.net.0.bias "))
    assert " NO " in row and "at [0]:" in row
    assert table.stdout.strip().endswith("fields compared: 1 differ")


def test_compare_equal_generation_to_itself_and_rejects_unreadable_input(tmp_path, baseline):
    assert compare(generation(baseline), generation(baseline)).returncode == 0
    missing = compare(generation(baseline), tmp_path / "nope")
    assert missing.returncode == 2 and "nope: no such directory" in missing.stderr
    runs = compare(baseline, baseline)  # run directories, not generations: name the one to pass
    assert runs.returncode == 2 and f"pass {baseline}/checkpoints/step-00000064" in runs.stderr
    damaged = tmp_path / "damaged"
    shutil.copytree(generation(baseline), damaged)
    (damaged / "__0_0.distcp").write_bytes(b"garbage")
    result = compare(generation(baseline), damaged)
    assert result.returncode == 2 and "__0_0.distcp" in result.stderr and "Traceback" not in result.stderr


def test_equal_means_equal_bits():
    nan = torch.tensor([float("nan"), 1.0])
    assert value_difference(nan, nan.clone()) == ""  # torch.equal would call these different
    assert value_difference(torch.tensor([0.0]), torch.tensor([-0.0])) != ""
    assert value_difference(0.0, -0.0) != ""
    assert value_difference(float("nan"), float("nan")) == ""
    assert value_difference(1, True) != ""  # no type coercion
    assert value_difference(torch.zeros(2), torch.zeros(2, dtype=torch.float64)).startswith("dtype")
    assert value_difference(torch.zeros(2), torch.zeros(3)).startswith("shape")
    assert "at [1]" in value_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]))


def test_a_reader_that_leaves_early_does_not_change_the_verdict(baseline):
    """`compare.py A B | head -1`: no traceback, and the exit status is still the verdict."""
    process = subprocess.Popen([sys.executable, str(REPO / "compare.py"), "--json", generation(baseline),
                                generation(baseline)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    process.stdout.close()  # the reader is gone before compare writes
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=scaled(600)) == 0 and "Traceback" not in stderr, stderr
