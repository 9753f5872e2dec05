"""What a workload is told and what it may not hide (issue #29): the run's optimizer steps
for its schedules (the total fingerprinted), and state that moves inside DataLoader workers,
refused at start instead of training on other data than --num-workers 0 would."""

from __future__ import annotations

import json
import math

from support.cli import compare, one_error_line, run_cli, train
from support.runs import generation

PLANNED = ("--workload", "tests/workloads/edge_cases.py:Planned", "--batch-size", 8)  # 3 batches per epoch
STREAM = ("--workload", "tests/workloads/edge_cases.py:StreamInDataset", "--epochs", 1, "--batch-size", 8)


def test_a_planning_workload_builds_its_schedule_from_the_runs_steps(tmp_path):
    """Warmup and cosine over `steps.total` (3 epochs of 3 batches in windows of 2: 2 steps
    per epoch, 6 in all); the total is in the fingerprint, so a longer run is a drift the
    operator accepts by name. ~6 s."""
    run = tmp_path / "run"
    train(run, *PLANNED, "--epochs", 3, "--grad-accum", 2, "--recover-every-steps", 2, "--interrupt-at-step", 3,
          expect=75)
    manifest = json.loads((generation(run, "step-00000002") / "manifest.json").read_text())
    assert manifest["fingerprint"]["config"]["total_steps"] == 6
    longer = run_cli("--output", run, *PLANNED, "--epochs", 4, "--grad-accum", 2, "--resume")
    assert longer.returncode == 65 and "config.total_steps 6 → 8" in one_error_line(longer)
    train(run, *PLANNED, "--epochs", 3, "--grad-accum", 2, "--resume")
    config = json.loads((run / "exports" / "step-00000006" / "config.json").read_text())
    assert (config["steps_per_epoch"], config["total_steps"]) == (2, 6)
    newest = sorted((run / "attempts").iterdir())[-1]
    learning_rates = json.loads((newest / "summary.json").read_text())["history"]["lr"]
    warmup = 6 // 4
    assert learning_rates == [0.05 * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / 6))
                              for step in range(6)]


def test_state_that_moves_in_dataloader_workers_is_refused_at_start(tmp_path):
    """A map-style dataset that ignores its index and advances a cursor it returns from
    stateful(): with workers the cursor moves in their copies only, and the run used to
    train on other data than with --num-workers 0, silently. Now exit 2 before the first
    step; with --num-workers 0 it trains. ~4 s."""
    refused = run_cli("--output", tmp_path / "workers", *STREAM, "--num-workers", 2)
    line = one_error_line(refused)
    assert refused.returncode == 2 and "stateful() 'stream' changes when a sample is fetched" in line, line
    assert "--num-workers 0" in line and "Traceback" not in refused.stderr
    assert not list((tmp_path / "workers").glob("checkpoints/step-*"))
    train(tmp_path / "main", *STREAM, "--num-workers", 0)


def test_a_dataset_that_draws_from_a_global_rng_it_does_not_declare_is_refused_at_start(tmp_path):
    """`draws_from_global_rngs = ("torch",)` on a dataset whose augmentation also draws from
    NumPy's and Python's RNGs: those draws would go unkeyed (other samples with other worker
    counts), so one sample fetched at start refuses it, exit 2, naming the declaration to
    write, before anything is written. ~0.3 CPU-s."""
    refused = run_cli("--output", tmp_path / "run", "--workload", "tests/workloads/edge_cases.py:TorchOnlyClaimed",
                      "--epochs", 1, "--batch-size", 8)
    line = one_error_line(refused)
    assert refused.returncode == 2 and "drew from random's global RNG" in line, line
    assert "declare draws_from_global_rngs = ('random', 'numpy', 'torch')" in line and "Traceback" not in refused.stderr
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


def test_a_random_collator_resumes_exactly_with_any_worker_count(tmp_path):
    """MLM-style masking drawn in `collate` with the global RNG: the trainer runs it under
    seeds keyed by the batch, so a run fetched by 2 workers, killed mid-epoch and resumed
    by the main process equals one fetched by the main process throughout (it used to
    depend on which worker collated and where the resume started). ~8 s."""
    masked = ("--workload", "tests/workloads/edge_cases.py:MaskedCollate", "--epochs", 3, "--batch-size", 8)
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    train(baseline, *masked, "--num-workers", 0)
    train(run, *masked, "--num-workers", 2, "--recover-every-steps", 2, "--interrupt-at-step", 5, expect=75)
    train(run, *masked, "--num-workers", 0, "--resume")
    result = compare(generation(baseline, "step-00000009"), generation(run, "step-00000009"))
    assert result.returncode == 0, result.stdout
