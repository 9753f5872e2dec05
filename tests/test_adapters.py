"""Adapters for data where users already are (trainer/workload/adapters.py), through the real
CLI with the real packages: a Hugging Face `datasets.IterableDataset` brought as a stream
resumes exactly with another worker count; HF's buffered shuffle, a bare HF iterable dataset
and a torchdata StatefulDataLoader over one are each refused at start in one line naming the
fix. A StatefulDataLoader returned by `build_dataset` (tests/workloads/loader.py) is adopted,
over map-style data or a stream, and resumes exactly with another worker count, in one process
and in two under torchrun (its batch size the global batch, split across them); what in it
the trainer cannot honour is refused in one line each, and a refusal caused by a setting it
gave names the loader as the setting's source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.cli import REPO, compare, one_error_line, run_cli, train
from support.runs import generation, made_once
from support.torchrun import torchrun, trainer_ranks

WORKLOAD = f"{REPO}/tests/workloads/hf_stream.py:HFRegression"
ARGS = ("--workload", WORKLOAD, "--batch-size", "6", "--shuffle-buffer", "5", "--max-steps", "10",
        "--recover-every-steps", "3", "--recover-every-epochs", "0")
"""24 records in 3 HF shards: 4 batches an epoch, 10 steps cross two epoch ends; generation 3
is mid-epoch."""


@pytest.fixture(scope="session")
def hf_baseline(tmp_path_factory) -> Path:
    """The uninterrupted HF stream run, no workers, shared by the tests below."""
    return made_once(tmp_path_factory, "hf-stream-baseline", lambda folder: train(folder / "run", *ARGS)) / "run"


@pytest.mark.parametrize("form, workers", [("adapted", ("--num-workers", "2")), ("loader-adapted", ())])
def test_a_hugging_face_stream_resumes_exactly_with_other_workers(form, workers, hf_baseline, tmp_path):
    """Interrupted after step 5 with 2 workers, resumed with none: equal to the uninterrupted
    run bit for bit. `adapted` returns the HFStream; `loader-adapted` a StatefulDataLoader built
    over it (the fix the refusal of a loader over a bare HF dataset names), whose 2 workers are
    adopted, and which trains exactly as the stream returned alone. Cost: ~10 s each, plus ~4 s
    once for the baseline (processes importing datasets)."""
    run = tmp_path / "run"
    train(run, *ARGS, "--form", form, *workers, "--interrupt-at-step", "5", expect=75)
    resumed = train(run, *ARGS, "--form", form, "--num-workers", "0", "--resume")
    assert "restored step-00000003" in resumed.stdout
    compared = compare(generation(hf_baseline, "step-00000010"), generation(run, "step-00000010"))
    assert compared.returncode == 0, compared.stdout[-3000:]
    assert "ledgers: same samples in the same order since step 0" in compared.stdout


@pytest.mark.parametrize("form, named", [
    ("shuffled", "drop .shuffle() and pass --shuffle-buffer N"),
    ("raw", "return trainer.workload.adapters.HFStream(dataset)"),
    ("loader", "build the loader over trainer.workload.adapters.HFStream(dataset)"),
])
def test_what_an_adapter_cannot_make_exact_is_refused_in_one_line(form, named, tmp_path):
    """Cost: ~4 s each (the datasets import)."""
    result = run_cli("--output", tmp_path / "run", *ARGS, "--form", form)
    assert result.returncode == 2, result.stderr
    assert named in one_error_line(result)


LOADER = f"{REPO}/tests/workloads/loader.py:LoaderRegression"
LOADER_ARGS = ("--workload", LOADER, "--max-steps", "10", "--recover-every-steps", "3", "--recover-every-epochs", "0")
"""No --batch-size: the loader's 6 is adopted (24 samples, 4 batches an epoch), and its 2 workers
unless --num-workers says otherwise; generation 3 is mid-epoch."""


@pytest.mark.parametrize("form", ["map", "stream"])
def test_a_stateful_dataloader_is_adopted_and_resumes_exactly_with_other_workers(form, tmp_path):
    """The loader's own 2 workers, interrupted after step 5; resumed with --num-workers 1;
    equal bit for bit to an uninterrupted run with none, ledgers included. Its random
    collate_fn runs under the keyed RNGs (the workload fails when it does not run at all), and
    its batch size is fingerprinted, its workers not. Cost: ~12 s each (three small runs, two with
    worker processes)."""
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    train(baseline, *LOADER_ARGS, "--form", form, "--num-workers", "0")
    interrupted = train(run, *LOADER_ARGS, "--form", form, "--interrupt-at-step", "5", expect=75)
    assert "adopted the StatefulDataLoader: batch_size=6 (the global batch, split across processes under " \
           "torchrun), num_workers=2, collate_fn=masking_collate" in interrupted.stdout + interrupted.stderr
    resumed = train(run, *LOADER_ARGS, "--form", form, "--num-workers", "1", "--resume")
    assert "restored step-00000003" in resumed.stdout
    assert "--num-workers 1 instead of its num_workers=2" in resumed.stdout + resumed.stderr
    compared = compare(generation(baseline, "step-00000010"), generation(run, "step-00000010"))
    assert compared.returncode == 0, compared.stdout[-3000:]
    assert "ledgers: same samples in the same order since step 0" in compared.stdout
    config = json.loads((generation(run, "step-00000010") / "manifest.json").read_text())["fingerprint"]["config"]
    assert config["batch_size"] == 6 and "num_workers" not in config


@pytest.mark.parametrize("form, named", [
    ("sequential", "with shuffle=False: the trainer reads map-style data in a permutation drawn from (--seed, epoch)"),
    ("sampler", "with sampler=WeightedRandomSampler: the trainer's seeded order"),
    ("batch-sampler", "with a batch_sampler (or batch_size=None)"),
    ("drop-last", "with drop_last=True: the trainer decides an epoch's last, smaller batch (--last-batch"),
    ("generator", "with a generator: the trainer draws the order"),
    ("worker-init", "with a worker_init_fn"),
    ("iterable", "over a Unresumable, an IterableDataset no resume can make exact"),
])
def test_what_a_stateful_dataloader_cannot_make_exact_is_refused_in_one_line(form, named, tmp_path):
    """Cost: ~2.5 s each (refused before the first step)."""
    result = run_cli("--output", tmp_path / "run", *LOADER_ARGS, "--form", form)
    assert result.returncode == 2, result.stderr
    assert named in one_error_line(result)


@pytest.mark.parametrize("given", ["16"])
def test_a_batch_size_flag_that_disagrees_with_the_loader_is_refused_naming_both(given, tmp_path):
    """Even `--batch-size 16`, the flag's default: given is given. Cost: ~2.5 s."""
    result = run_cli("--output", tmp_path / "run", *LOADER_ARGS, "--batch-size", given)
    assert result.returncode == 2, result.stderr
    assert f"StatefulDataLoader with batch_size=6, but --batch-size {given} was given" in one_error_line(result)


def test_torchs_own_dataloader_is_adopted_and_its_generators_are_refused():
    """torch's DataLoader (not torchdata's) takes the same path; its RandomSampler holds the
    generator it was given, through `generator=` or directly. In-process. Cost: < 1 s."""
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from trainer.config import WorkloadConfig
    from trainer.errors import UsageError
    from trainer.workload.adapters import from_loader

    data = TensorDataset(torch.arange(10.0))
    adopted = from_loader(DataLoader(data, batch_size=4, shuffle=True, num_workers=1), WorkloadConfig(), "w")
    assert adopted.dataset is data and adopted.collate is None
    assert (adopted.config.batch_size, adopted.config.num_workers) == (4, 1)
    given = WorkloadConfig(num_workers=3, given=frozenset({"num_workers"}))
    assert from_loader(DataLoader(data, batch_size=4, shuffle=True), given, "w").config.num_workers == 3
    for seeded in (DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator()),
                   DataLoader(data, batch_size=4, sampler=RandomSampler(data, generator=torch.Generator()))):
        with pytest.raises(UsageError, match="with a generator: the trainer draws the order"):
            from_loader(seeded, WorkloadConfig(), "w")


@pytest.mark.parametrize("form", ["map", "stream"])
def test_a_loaders_batch_size_is_the_global_batch_across_two_processes(form, tmp_path):
    """Real torchrun, 2 processes on gloo: interrupted after step 5 with the loader's own 2
    workers per process, resumed with --num-workers 1; equal bit for bit (ledgers included) to
    an uninterrupted 2-process run with --num-workers 0. Every generation's manifest holds the
    loader's batch size (6, not 12) and each rank's ledger 6/2 = 3 samples per step it covers.
    The reference's and the resume's ranks forked as a launcher starts them (`trainer_ranks`:
    their launch is not under test). Cost: ~13 CPU-s each, one torchrun launch (21-22 with two,
    28-31 before the reference was forked)."""
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    args = (*LOADER_ARGS, "--form", form)
    trainer_ranks(baseline, *args, "--num-workers", "0", nproc=2)  # the reference: its launch is not under test
    interrupted = torchrun(run, *args, "--interrupt-at-step", "5", expect=75, tmp=tmp_path)
    assert "batch_size=6 (the global batch, split across processes under torchrun), num_workers=2" \
           in interrupted.stdout + interrupted.stderr
    resumed = trainer_ranks(run, *args, "--num-workers", "1", "--resume", nproc=2)
    assert "restored step-00000003" in resumed.stdout
    compared = compare(generation(baseline, "step-00000010"), generation(run, "step-00000010"))
    assert compared.returncode == 0, compared.stdout[-3000:]
    assert "ledgers: same samples in the same order since step 0" in compared.stdout
    kept = sorted((run / "checkpoints").glob("step-*"))
    assert {"step-00000006", "step-00000009", "step-00000010"} <= {folder.name for folder in kept}
    for folder in kept:
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["fingerprint"]["config"]["batch_size"] == 6 and manifest["fingerprint"]["world_size"] == 2
        ledger, steps = manifest["ledger"], manifest["step"] - manifest["ledger"]["after_step"]
        assert steps > 0 and ledger["samples"] == 6 * steps, (folder.name, ledger)
        assert {rank: entry["samples"] for rank, entry in ledger["by_rank"].items()} == {"0": 3 * steps, "1": 3 * steps}


def test_a_loader_batch_size_the_processes_cannot_share_is_refused_as_the_flag_is(tmp_path):
    """A loader's batch_size=5 over 24 samples under 2 processes is refused (exit 2, on every
    rank) with the line `--batch-size 5` gets on a plain workload, naming the loader's setting
    instead of the flag. Cost: ~2.4 CPU-s (two launches of 2 forked ranks, `trainer_ranks`, refused
    before the first step; 18 with torchrun)."""
    plain = trainer_ranks(tmp_path / "plain", "--workload", f"{REPO}/tests/workloads/toy.py:ToyWorkload",
                          "--batch-size", "5", "--max-steps", "2", nproc=2, expect=2)
    adopted = trainer_ranks(tmp_path / "loader", *LOADER_ARGS, "--loader-batch-size", "5", nproc=2, expect=2)
    said = "does not divide evenly across 2 processes (each takes an equal share of every batch); choose a " \
           "multiple of 2"
    assert f"trainer: error: --batch-size 5 {said}" in plain.stderr, plain.stderr[-3000:]
    assert f"trainer: error: the loader's batch_size=5 {said}" in adopted.stderr, adopted.stderr[-3000:]
    assert not list((tmp_path / "loader").glob("checkpoints/step-*"))


@pytest.mark.parametrize("workers, named", [((), "with the loader's num_workers=2 that happens in the workers'"),
                                             (("--num-workers", "1"), "with --num-workers 1 that happens in the")])
def test_state_moved_in_a_loaders_workers_is_refused_naming_where_the_worker_count_came_from(workers, named,
                                                                                               tmp_path):
    """A `stateful()` cursor that moves on every fetch, under the loader's 2 workers or under
    --num-workers 1 (which wins): refused at start naming the one that set the count. Cost: < 1 s
    each (forked from the test worker's zygote; ~3 s as a fresh interpreter)."""
    result = run_cli("--output", tmp_path / "run", *LOADER_ARGS, "--form", "moving", *workers)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert "stateful() 'stream' changes when a sample is fetched" in line and named in line, line
