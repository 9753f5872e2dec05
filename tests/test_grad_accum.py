"""`--grad-accum N`: optimizer steps are what steps, cadence and the LR schedule count, and a
stop inside an accumulation window saves only at the window's end (issue #13, silent failure
3: a save inside the window lost the partial gradients)."""

from __future__ import annotations

import json

import pytest

from support.cli import compare, train
from support.runs import attempts, generation

TOY = "tests/workloads/toy.py:ToyWorkload"
# 24 samples in batches of 4: 6 micro-batches per epoch, windows of 4 and 2, 2 steps per epoch.
RUN = ("--workload", TOY, "--epochs", 3, "--batch-size", 4, "--grad-accum", 4)
FINAL = "step-00000006"


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    output = tmp_path_factory.mktemp("accumulated") / "run"
    train(output, *RUN, "--recover-every-steps", 1)
    return output


def test_steps_cadence_and_schedule_count_optimizer_steps(accumulated):
    assert sorted(p.name for p in (accumulated / "checkpoints").iterdir())[-3:] == [
        "step-00000004", "step-00000005", FINAL]
    summary = json.loads(next((accumulated / "attempts").glob("*/summary.json")).read_text())
    assert summary["final_step"] == 6 and summary["epochs"] == 3
    assert summary["history"]["lr"] == pytest.approx([0.05 / (1 + step) for step in range(6)])
    manifest = json.loads((generation(accumulated, "step-00000005") / "manifest.json").read_text())
    assert (manifest["epoch"], manifest["position"]) == (2, 4)  # 4 micro-batches into epoch 2
    assert manifest["fingerprint"]["config"]["grad_accum"] == 4


def test_a_stop_inside_a_window_saves_at_its_end_and_resumes_exactly(tmp_path, accumulated):
    run = tmp_path / "run"
    # SIGTERM during the 2nd micro-batch of epoch 1's first window (micro-batch 8 overall).
    stopped = train(run, *RUN, "--num-workers", 2, expect=75, env={"TRAINER_SIGNAL_AT_MICRO_BATCH": "8"})
    assert "saved step 3" in stopped.stdout + stopped.stderr
    manifest = json.loads((generation(run, "step-00000003") / "manifest.json").read_text())
    assert (manifest["step"], manifest["epoch"], manifest["position"]) == (3, 1, 4)
    assert attempts(run)[-1]["status"] == "preempted"
    resumed = train(run, *RUN, "--resume")
    assert "restored step-00000003 (step=3 epoch=1 position=4)" in resumed.stdout
    result = compare(generation(accumulated, FINAL), generation(run, FINAL))
    assert result.returncode == 0, result.stdout
