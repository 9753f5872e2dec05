"""Adapters for data where users already are (trainer/workload/adapters.py), through the real
CLI with the real packages: a Hugging Face `datasets.IterableDataset` brought as a stream
resumes exactly with another worker count; HF's buffered shuffle, a bare HF iterable dataset
and a torchdata StatefulDataLoader are each refused at start in one line naming the fix."""

from __future__ import annotations

import pytest

from conftest import REPO, compare, generation, one_error_line, run_cli, train

WORKLOAD = f"{REPO}/tests/workloads/hf_stream.py:HFRegression"
ARGS = ("--workload", WORKLOAD, "--batch-size", "6", "--shuffle-buffer", "5", "--max-steps", "10",
        "--recover-every-steps", "3", "--recover-every-epochs", "0")
"""24 records in 3 HF shards: 4 batches an epoch, 10 steps cross two epoch ends; generation 3
is mid-epoch."""


def test_a_hugging_face_stream_resumes_exactly_with_other_workers(tmp_path):
    """Interrupted after step 5 with 2 workers, resumed with none: equal to the uninterrupted
    run bit for bit. Cost: ~30 s (three processes importing datasets, ~5 s each)."""
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    train(baseline, *ARGS)
    train(run, *ARGS, "--num-workers", "2", "--interrupt-at-step", "5", expect=75)
    resumed = train(run, *ARGS, "--resume")
    assert "restored step-00000003" in resumed.stdout
    compared = compare(generation(baseline, "step-00000010"), generation(run, "step-00000010"))
    assert compared.returncode == 0, compared.stdout[-3000:]
    assert "ledgers: same samples in the same order since step 0" in compared.stdout


@pytest.mark.parametrize("form, named", [
    ("shuffled", "drop .shuffle() and pass --shuffle-buffer N"),
    ("raw", "return trainer.workload.adapters.HFStream(dataset)"),
    ("loader", "return its dataset (loader.dataset, map-style or a stream) and pass --batch-size 6 --num-workers 2"),
])
def test_what_an_adapter_cannot_make_exact_is_refused_in_one_line(form, named, tmp_path):
    """Cost: ~8 s each (the datasets import)."""
    result = run_cli("--output", tmp_path / "run", *ARGS, "--form", form)
    assert result.returncode == 2, result.stderr
    assert named in one_error_line(result)
