"""Streaming data with a cursor the trainer owns (trainer/run/streaming.py), and the sample ledger
(trainer/run/ledger.py).

The order's properties are pure and tested directly (no process): the same global sample order
for every worker count and world size, a resume mid-block equal to the rest of the order, every
record once per epoch. End to end through the real CLI on examples/stream_lm.py (token shards
on disk, a shuffle buffer smaller than an epoch and not a multiple of the batch): kill -9
mid-epoch and resume with other --num-workers, bit-exact against the uninterrupted run, with
the ledgers equal and `report` finding nothing repeated or skipped; and a 2 → 3 world-size
change under --allow-drift world_size that continues the same global sample order.
"""

from __future__ import annotations

import signal
import shutil

import pytest
import torch

from conftest import (REPO, attempts, compare, finish, generation, made_once, run_cli, start, torchrun, train,
                      wait_for_line)
from trainer.run.ledger import GENESIS, SampleLedger, ledger_problems
from trainer.run.streaming import StreamOrder, StreamSource, rank_positions

WORKLOAD = f"{REPO}/examples/stream_lm.py:StreamLM"
STREAM = ("--workload", WORKLOAD, "--lm-shards", "4", "--lm-context", "30", "--batch-size", "6",
          "--shuffle-buffer", "20", "--max-steps", "14", "--recover-every-steps", "4", "--recover-every-epochs", "0")
"""4 shards of a 30-token context: 66 records, 11 global batches of 6 (2 and 3 ranks split them
evenly). 14 steps cross the epoch end; generations at 4, 8, 12, 14: 8 is mid-epoch and
mid-block (48 samples done, block 2 spans 40..59)."""
FINAL = "step-00000014"


class Numbers:
    """A stream of numbered records in shards of the given sizes (record = its own id)."""

    def __init__(self, sizes):
        self.sizes = sizes

    def shards(self):
        return [(f"part-{number}", size) for number, size in enumerate(self.sizes)]

    def read(self, shard, offset):
        name, size = shard
        first = sum(self.sizes[:int(name.split("-")[1])])
        return iter(range(first + offset, first + size))


def global_order(sizes, world_size: int, workers: int, start_batch: int = 0, epoch: int = 0, batch: int = 6):
    """Every rank's batches of one epoch put back into the global order."""
    source = StreamSource(Numbers(sizes), seed=7, buffer=10, spec="test")
    per_rank = [list(source.loader(epoch, batch, start_batch, rank, world_size, workers)) for rank in range(world_size)]
    order = []
    for batches in zip(*per_rank):
        placed = [None] * sum(len(ids) for ids, _ in batches)
        for rank, (ids, samples) in enumerate(batches):
            assert ids.tolist() == samples.tolist()  # the ledger's ids are the records delivered
            placed[rank::world_size] = ids.tolist()
        order += placed
    return order


SIZES = [7, 13, 4, 12]  # 36 records: batches of 6 split evenly across 1, 2 and 3 ranks


def test_the_global_order_is_the_same_for_every_world_size_and_worker_count():
    """Cost: ~2 s (DataLoader worker processes)."""
    single = global_order(SIZES, 1, 0)
    assert sorted(single) == list(range(36)), "every record once per epoch"
    assert single != list(range(36)), "shuffled"
    for world_size, workers in ((2, 0), (3, 0), (1, 2), (2, 3)):
        assert global_order(SIZES, world_size, workers) == single, (world_size, workers)
    assert global_order(SIZES, 1, 0, epoch=1) != single, "another epoch, another order"


def test_a_resume_mid_block_continues_the_order_exactly():
    """Cost: < 1 s. The buffer (10 records) is rebuilt from the cursor alone."""
    single = global_order(SIZES, 1, 0)
    for start_batch in (1, 3, 5):
        assert global_order(SIZES, 1, 0, start_batch=start_batch) == single[start_batch * 6:]
        assert global_order(SIZES, 3, 2, start_batch=start_batch) == single[start_batch * 6:]


def test_the_order_is_a_pure_function_of_seed_epoch_and_buffer():
    """Cost: < 1 s."""
    a, b = StreamOrder(SIZES, 1, 0, 10), StreamOrder(SIZES, 1, 0, 10)
    assert a.ids(range(36)) == b.ids(range(36))
    assert StreamOrder(SIZES, 2, 0, 10).ids(range(36)) != a.ids(range(36))
    assert list(rank_positions(5, 6, 32, 1, 2)) == [31], "the last, short batch"


def test_the_ledger_finds_samples_repeated_or_skipped():
    """Cost: < 1 s. The report's check, on ledgers that went wrong (a resume that restarted
    its data at row 0; one that skipped ahead; one that trained twice on a sample)."""
    ledger = SampleLedger(epoch_samples=36, batch_size=6)
    ledger.consumed(torch.arange(6))
    assert [list(ids) for ids in ledger.micro_batches] == [[0, 1, 2, 3, 4, 5]]
    first = {"step": 1, **ledger.entry([ledger.micro_batches], 1, 0, 1)}
    assert first["from"] == [0, 0] and first["to"] == [0, 6] and first["chain"] != GENESIS
    good = {**first, "after_step": 1, "from": [0, 6], "to": [0, 12]}
    assert ledger_problems({1: first, 2: good}) == []
    restarted = {**good, "from": [0, 0], "to": [0, 6]}
    assert ledger_problems({1: first, 2: restarted}) == ["step 2: starts at [0, 0], but step 1 ended at [0, 6]: "
                                                         "6 samples repeated"]
    skipped = {**good, "from": [0, 12], "to": [0, 18]}
    assert "6 samples skipped" in ledger_problems({1: first, 2: skipped})[0]
    doubled = {**good, "samples": 7}
    assert "7 samples trained, but the cursor moved 6" in ledger_problems({1: first, 2: doubled})[0]


def test_the_ledger_of_two_ranks_equals_the_ledger_of_one():
    """Cost: < 1 s. Each rank's slices are put back in the global order: the global digest and
    the chain do not depend on the world size; the per-rank digests do."""
    one, two = SampleLedger(36, 6), [SampleLedger(36, 6), SampleLedger(36, 6)]
    for batch in (torch.arange(6), torch.arange(6, 12)):
        one.consumed(batch)
        for rank, ledger in enumerate(two):
            ledger.consumed(batch[rank::2])
    single = one.entry([one.micro_batches], 2, 0, 2)
    pair = two[0].entry([ledger.micro_batches for ledger in two], 2, 0, 2)
    assert (single["sha256"], single["chain"], single["samples"]) == (pair["sha256"], pair["chain"], pair["samples"])
    assert pair["by_rank"]["0"]["samples"] == 6 and pair["by_rank"]["0"] != pair["by_rank"]["1"]


@pytest.fixture(scope="module")
def stream_baseline(tmp_path_factory):
    """The uninterrupted streaming run, one process, no workers. Cost: ~6 s."""
    return made_once(tmp_path_factory, "stream-baseline",
                     lambda root: train(root / "run", *STREAM, "--lm-shard-dir", root / "shards"))


def test_kill_9_mid_epoch_then_other_workers_resumes_exactly(stream_baseline, tmp_path):
    """kill -9 after step 10 (generation step-8 is mid-epoch and mid-block), trained with 2
    workers; resumed with 3: the final generation equals the uninterrupted run's (workers 0)
    bit for bit, cursor included, the ledgers carry the same chain, and `report` finds no
    sample repeated or skipped. Cost: ~15 s (two attempts with worker processes)."""
    shards = stream_baseline / "shards"
    run = tmp_path / "run"
    process = start(run, *STREAM, "--lm-shard-dir", shards, "--num-workers", "2")
    wait_for_line(process, "step=10 ")
    process.send_signal(signal.SIGKILL)
    finish(process)
    assert process.returncode == -signal.SIGKILL
    resumed = train(run, *STREAM, "--lm-shard-dir", shards, "--resume", "--num-workers", "3")
    assert "restored step-00000008" in resumed.stdout
    compared = compare(generation(stream_baseline / "run", FINAL), generation(run, FINAL))
    assert compared.returncode == 0, compared.stdout[-3000:]
    assert "stream.consumed" in compared.stdout
    assert "ledgers: same samples in the same order since step 0" in compared.stdout
    ledger = attempts(run)[-1]["ledger"]
    assert [(entry["step"], entry["from"], entry["to"]) for entry in ledger] == [
        (12, [0, 48], [1, 6]), (14, [1, 6], [1, 18])]
    report = run_cli("report", run)
    assert report.returncode == 0, report.stderr
    assert "4 generations from 2 attempts, 84 samples: none repeated or skipped" in report.stdout


def test_a_world_size_change_keeps_the_global_sample_order(tmp_path):
    """2 processes interrupted after step 10, resumed by 3 under --allow-drift world_size: the
    cursor and the global sample order (the ledger's chain since step 0) equal the
    uninterrupted 2-process run's; the weights do not, and that is said (3 ranks sum gradients
    in another order: docs/architecture.md). Cost: ~25 s (three torchrun launches)."""
    shards = tmp_path / "shards"
    args = (*STREAM, "--lm-shard-dir", shards)
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    torchrun(baseline, *args, nproc=2, tmp=tmp_path)
    torchrun(run, *args, "--interrupt-at-step", "10", nproc=2, expect=75, tmp=tmp_path)
    torchrun(run, *args, "--resume", "--allow-drift", "world_size", nproc=3, tmp=tmp_path)
    change = attempts(run)[-1]["world_size_change"]
    assert (change["from"], change["to"], change["exact"]) == (2, 3, False)
    compared = compare(generation(baseline, FINAL), generation(run, FINAL))
    assert "ledgers: same samples in the same order since step 0" in compared.stdout, compared.stdout[-3000:]
    for field in ("stream.consumed", "stream.epoch", "stream.shard", "stream.offset", "progress.position"):
        assert any(line.split()[:2] == [field, "yes"] for line in compared.stdout.splitlines()), field
    assert compared.returncode == 1, "3 ranks sum gradients in another order than 2"


def test_an_iterable_dataset_that_is_not_a_stream_is_refused_in_one_line(tmp_path):
    """Cost: ~2 s. Today's traceback (`object of type 'ShardStream' has no len()`)."""
    result = run_cli("--output", tmp_path / "run", "--workload", f"{REPO}/tests/workloads/edge_cases.py:NotAStream")
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "neither map-style" in line and "shards()" in line and "read(shard, offset)" in line
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


def test_a_changed_shard_refuses_the_resume(stream_baseline, tmp_path):
    """The fingerprint reads each shard's stored .sha256 (trainer/workload/files.py) instead of
    hashing it: a shard whose digest changed refuses the resume (65) naming `dataset`. Cost: ~5 s."""
    shards = tmp_path / "shards"
    shutil.copytree(stream_baseline / "shards", shards)
    run = tmp_path / "run"
    train(run, *STREAM, "--lm-shard-dir", shards, "--interrupt-at-step", "5", expect=75)
    sorted(shards.glob("*.sha256"))[0].write_text("0" * 64 + "\n")
    refused = run_cli("--output", run, *STREAM, "--lm-shard-dir", shards, "--resume")
    assert refused.returncode == 65 and "dataset" in refused.stderr, refused.stderr
