"""The `fixed-buckets` gradient reduction (trainer/parallel/reduction.py): its plan decided by
the model alone, the same bits whatever DDP's own layout is at 3 and 4 ranks (where a sum's
order shows), and a run made with `per-parameter` (the default before it) resuming with its
own reduction through the fingerprint, bit-exact, instead of drifting or being refused.

The resumes at 3 and 4 processes with the default reduction, end to end, are
test_exact_matrix.py's cells (DDP at 3 on disk, at 4 in the object store); a user's own DDP
model gets it in test_library_ranks.py (DDP at 3).
"""

from __future__ import annotations

import json
import shutil

import pytest

from support.cli import REPO, compare, one_error_line, train
from support.runs import MATRIX_ARGS, attempts, generation
from support.torchrun import forked_ranks, trainer_ranks
from trainer.config import WorkloadConfig
from trainer.parallel.reduction import bucket_plan

FINAL = "step-00000012"


def test_the_plan_takes_parameters_in_reverse_with_a_small_first_bucket():
    sizes = [("f32", 4), ("f32", 4), ("f32", 8), ("f32", 1), ("f32", 6)]
    assert bucket_plan(sizes, first_bytes=5, cap_bytes=10) == [[4], [3, 2, 1], [0]]


def test_the_plan_keeps_one_dtype_per_bucket_in_the_order_of_its_first_tensor():
    sizes = [("f32", 4), ("bf16", 2), ("f32", 4), ("bf16", 2), ("f32", 4)]
    assert bucket_plan(sizes, first_bytes=8, cap_bytes=8) == [[4, 2], [3, 1], [0]]
    assert bucket_plan([], first_bytes=8, cap_bytes=8) == []


@pytest.mark.parametrize("world_size", [3, 4])
def test_fixed_buckets_give_the_same_bits_whatever_ddps_layout(world_size):
    """DDP's first backward (its initial buckets) and the later ones (rebuilt in ready order),
    with DDP's buckets the plan's or spanning several of them: one set of bits. DDP's own
    all-reduce, in the same processes, changes its bits when it rebuilds (the failure this
    prevents)."""
    (line,) = [text for text in forked_ranks(REPO / "tests" / "reduction_ranks.py", nproc=world_size) if text]
    seen = json.loads(line)
    assert seen["aligned_steady"] and seen["spanning_steady"] and seen["ways_agree"], seen
    assert seen["own_steady"] is False, "DDP's own reduction drifts here: the check can fail"
    assert seen["aligned_sent"][0] > 0, "DDP's buckets laid out as the plan's are sent without a copy"
    assert seen["spanning_sent"][0] == 0 and seen["spanning_sent"][1] > 0


def test_a_resume_keeps_its_generations_reduction_unless_one_is_given():
    default = WorkloadConfig()
    assert default.gradient_reduction == "fixed-buckets"
    assert default.kept_reduction({}).gradient_reduction == "per-parameter", "a fingerprint without one"
    assert default.kept_reduction({"gradient_reduction": "bucketed"}).gradient_reduction == "bucketed"
    given = WorkloadConfig(gradient_reduction="fixed-buckets", given=frozenset({"gradient_reduction"}))
    assert given.kept_reduction({}) is given, "named on the command line: the fingerprint decides"
    assert "gradient_reduction" not in WorkloadConfig(gradient_reduction="per-parameter").training_relevant()
    assert default.training_relevant()["gradient_reduction"] == "fixed-buckets"


def test_a_run_made_with_per_parameter_resumes_with_it_bit_exact(tmp_path):
    """A generation written before `fixed-buckets` (its fingerprint names no reduction: the
    default then, `per-parameter`) resumes at 3 processes without naming one: no refusal, the
    same fingerprint, and the final generation equal to the uninterrupted per-parameter run's,
    which the default reduction would not give. Naming another reduction is the fingerprint's
    drift (65), as for any option."""
    baseline = tmp_path / "baseline"
    trainer_ranks(baseline, *MATRIX_ARGS, "--gradient-reduction", "per-parameter", "--checkpoint-mode", "sync",
                  nproc=3)  # the reference: its launch is not under test
    stored = json.loads((generation(baseline, FINAL) / "manifest.json").read_text())["fingerprint"]["config"]
    assert "gradient_reduction" not in stored, "as a generation written before fixed-buckets"
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    for section in ("checkpoints", "exports"):
        shutil.rmtree(run / section / FINAL)
    refused = train(run, *MATRIX_ARGS, "--gradient-reduction", "fixed-buckets", "--resume", expect=65)
    assert "config.gradient_reduction None → fixed-buckets" in one_error_line(refused)
    resumed = trainer_ranks(run, *MATRIX_ARGS, "--checkpoint-mode", "sync", "--resume", nproc=3)
    assert "restored step-00000008" in resumed.stdout
    record = attempts(run)[-1]
    assert record["exactness"] == {"exact": True} and record["drift"] == []
    assert "gradient_reduction" not in record["fingerprint"]["config"]
    assert record["replay"]["matched"] == record["replay"]["of"] == 4, record["replay"]
    assert compare(generation(baseline, FINAL), generation(run, FINAL)).returncode == 0
