"""Each RNG the state claims to restore matters: leaving any one out breaks equality."""

from __future__ import annotations

import json

import pytest

from conftest import compare, generation, train


@pytest.mark.parametrize("rng", ["python", "numpy", "torch"])
def test_skipping_one_rng_restore_makes_compare_fail(tmp_path, baseline, rng):
    run = tmp_path / "run"
    train(run, "--interrupt-at-step", 27, expect=75)
    train(run, "--resume", env={"TRAINER_DEBUG_SKIP_RNG_RESTORE": rng})
    result = compare(generation(baseline), generation(run), "--json")
    assert result.returncode == 1
    differing = {f["field"] for f in json.loads(result.stdout)["fields"] if not f["equal"]}
    assert "model.net.0.weight" in differing and "history.loss" in differing
