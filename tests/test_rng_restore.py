"""Each RNG the state claims to restore matters: leaving any one out breaks equality."""

from __future__ import annotations

import json
import shutil

import pytest

from support.cli import compare, train
from support.runs import generation


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("interrupted") / "run"
    train(run, "--interrupt-at-step", 27, expect=75)
    return run


@pytest.mark.parametrize("rng", ["python", "numpy", "torch"])
def test_skipping_one_rng_restore_makes_compare_fail(tmp_path, baseline, interrupted, rng):
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    train(run, "--resume", env={"TRAINER_DEBUG_SKIP_RNG_RESTORE": rng})
    result = compare(generation(baseline), generation(run), "--json")
    assert result.returncode == 1
    differing = {f["field"] for f in json.loads(result.stdout)["fields"] if not f["equal"]}
    assert "model.net.0.weight" in differing and "history.loss" in differing
