"""Streaming data with a cursor the trainer owns (trainer/run/streaming.py), an epoch's ragged
last batch (trainer/run/batching.py), the sample ledger (trainer/run/ledger.py), and streams
from an object store (trainer/workload/objects.py); docs/streaming.md.

The layout's properties are pure and tested directly (no process): the same order for every
worker count, every record read once per epoch whatever the ranks and workers (counted), a
resume mid-block equal to the rest of the order, an epoch started under 4 ranks finished under
3 in its order, `--last-batch` pad/drop and the weights that make padding count each sample
once. End to end through the real CLI on examples/stream_lm.py (a shuffle buffer smaller than an
epoch and not a multiple of the batch): kill -9 mid-epoch and resume with other --num-workers,
bit-exact against the uninterrupted run, from shards on disk and from SeaweedFS; a 4 -> 3
world-size change whose ledger chain equals the order computed from the layout; dropped last
batches counted per epoch by `report`.
"""

from __future__ import annotations

import hashlib
import json
import signal
import shutil
from array import array

import pytest
import torch

from support.cli import REPO, compare, finish, run_cli, start, train, wait_for_line
from support.runs import attempts, generation, made_once
from support.torchrun import torchrun
from trainer.run.ledger import GENESIS, SampleLedger, id_bytes, ledger_problems
from trainer.run.batching import EpochBatchOrder, EpochShape
from trainer.run.streaming import StreamEpoch, StreamLayout, StreamSource

WORKLOAD = f"{REPO}/examples/stream_lm.py:StreamLM"
STREAM = ("--workload", WORKLOAD, "--shards", "4", "--context", "30", "--batch-size", "6", "--shuffle-buffer", "20",
          "--max-steps", "14", "--recover-every-steps", "4", "--recover-every-epochs", "0")
"""4 shards of a 30-token context: 66 records, 11 global batches of 6 (2 and 3 ranks split them
evenly). 14 steps cross the epoch end; generations at 4, 8, 12, 14: 8 is mid-epoch and
mid-block (48 samples done, block 2 spans 40..59)."""
FINAL = "step-00000014"


class Numbers:
    """A stream of numbered records in shards of the given sizes (record = its own id),
    counting the records its `read` yields (in this process)."""

    def __init__(self, sizes):
        self.sizes, self.reads = sizes, 0

    def shards(self):
        return [(f"part-{number}", size) for number, size in enumerate(self.sizes)]

    def read(self, shard, offset):
        name, size = shard
        first = sum(self.sizes[:int(name.split("-")[1])])
        for record in range(first + offset, first + size):
            self.reads += 1
            yield record


def global_order(source, world_size: int, workers: int, start_batch: int = 0, epoch: int = 0,
                 shape: EpochShape = EpochShape(36, 6)):
    """Every rank's micro-batches of one epoch put back into the global order (a padded
    share left out, as the ledger does)."""
    per_rank = [list(source.loader(shape, epoch, start_batch, rank, world_size, workers))
                for rank in range(world_size)]
    order = []
    for fetched in zip(*per_rank):
        placed = [None] * sum(len(one.ids) for one in fetched if not one.padded)
        for rank, one in enumerate(fetched):
            assert one.ids.tolist() == one.batch.tolist()  # the ledger's ids are the records delivered
            if not one.padded:
                placed[rank::world_size] = one.ids.tolist()
        order += placed
    return order


def numbers(sizes=(7, 13, 4, 12), buffer: int = 10) -> StreamSource:
    return StreamSource(Numbers(list(sizes)), seed=7, buffer=buffer, spec="test")


SIZES = [7, 13, 4, 12]  # 36 records: batches of 6 split evenly across 1, 2 and 3 ranks


def test_the_global_order_is_the_same_for_every_worker_count_and_every_record_comes_once():
    """Cost: ~3 s (DataLoader worker processes). The order depends on the world size an
    epoch is laid out for (one lane per rank), never on the workers."""
    for world_size in (1, 2, 3):
        single = global_order(numbers(), world_size, 0)
        assert sorted(single) == list(range(36)), "every record once per epoch"
        assert single != list(range(36)), "shuffled"
        for workers in (2, 3) if world_size == 2 else (2,) if world_size == 1 else ():
            assert global_order(numbers(), world_size, workers) == single, (world_size, workers)
        assert global_order(numbers(), world_size, 0, epoch=1) != single, "another epoch, another order"


@pytest.mark.parametrize("ranks, workers", [(1, 1), (2, 2), (4, 2), (3, 4)])
def test_each_record_is_read_once_per_epoch_whatever_the_ranks_and_workers(ranks, workers):
    """Cost: < 1 s. Every rank's every worker reads its own chunks (as `StreamEpoch.__iter__`
    deals them out), here in one process so one counter sees every read: the records read
    are the records in the dataset, 1.00x (the measured figure before: ranks x workers)."""
    sizes, shape = [17, 130, 3, 90, 61], EpochShape(301, 12)
    source = numbers(sizes, buffer=64)
    layout = source.layout(shape, 0, ranks)
    for rank in range(ranks):
        epoch = StreamEpoch(source, layout, 0, rank, ranks)
        for worker in range(workers):
            for chunk in epoch.chunks()[worker::workers]:
                epoch.chunk_batches(chunk)
    assert source.stream.reads == sum(sizes) + ranks - 1, "and the ranks with no share of the last batch (1 "\
                                                         "sample) read its first one, to pad"


def test_a_resume_mid_block_continues_the_order_exactly_and_rereads_one_block():
    """Cost: < 1 s. The buffer is rebuilt from the cursor alone, at any worker count."""
    for world_size in (1, 3):
        whole = global_order(numbers(), world_size, 0)
        for start_batch in (1, 3, 5):
            source = numbers()
            assert global_order(source, world_size, 0, start_batch=start_batch) == whole[start_batch * 6:]
            layout = source.layout(EpochShape(36, 6), 0, world_size)
            reread = start_batch % layout.chunk * layout.share * world_size
            assert source.stream.reads == 36 - start_batch * 6 + reread, (world_size, start_batch)


def test_an_epoch_started_under_4_processes_finishes_under_3_in_its_order():
    """Cost: < 1 s. A 4 -> 3 change mid-epoch (`StreamSource.carried`, what the cursor check
    sets on restore): the rest of the epoch is the 4-process order, none repeated or skipped;
    the next epoch is laid out for 3."""
    shape = EpochShape(36, 12)
    four = global_order(numbers(), 4, 0, shape=shape)
    carried = numbers()
    carried.carried[0] = 4
    assert global_order(carried, 3, 0, start_batch=1, shape=shape) == four[12:]
    assert global_order(carried, 3, 0, epoch=1, shape=shape) == global_order(numbers(), 3, 0, epoch=1, shape=shape)


def test_a_ragged_last_batch_is_padded_weighted_or_dropped():
    """Cost: < 1 s. 36 records, batches of 16 on 8 ranks: the last batch holds 4. `pad`:
    ranks 0-3 train one each at weight 8 x 1 / 4 = 2; ranks 4-7 repeat the batch's first
    sample at weight 0 (read alone: 4 more records read). `drop`: 2 batches, the stream's
    last 4 records never read. Map-style data follows the same rule."""
    source = numbers()
    last = [list(source.loader(EpochShape(36, 16), 0, 2, rank, 8, 0))[-1] for rank in range(8)]
    first = last[0].ids.tolist()
    assert [one.weight for one in last] == [2.0] * 4 + [0.0] * 4
    assert [one.ids.tolist() for one in last[4:]] == [first] * 4
    assert source.stream.reads == 4 * 5 + 4, "ranks 0-3 read their lane's block (5 records), 4-7 one each"
    dropping, shape = numbers(), EpochShape(36, 16, "drop")
    assert len(global_order(dropping, 8, 0, shape=shape)) == 32 and dropping.stream.reads == 32
    order = EpochBatchOrder(EpochShape(36, 16), 1, 0, 2, 5, 8)
    assert [(len(keys), weight) for keys, weight in order.weighted()] == [(1, 0.0)]
    assert EpochShape(36, 16, "drop").dropped == 4 and EpochShape(36, 16).trained == 36


def test_weighted_shares_average_to_the_mean_over_the_batch_each_sample_once():
    """Cost: < 1 s. What DDP computes from `pad`'s shares: the mean over ranks of each rank's
    weighted mean loss's gradient. 5 samples on 4 ranks (2, 1, 1, 1) and 2 on 4 (1, 1, and two
    padded ranks repeating sample 0 at weight 0) give the gradient of the plain mean over the
    batch's samples, as one process computes it; unweighted, they would not."""
    torch.manual_seed(0)
    model, inputs, targets = torch.nn.Linear(3, 1), torch.randn(5, 3), torch.randn(5, 1)

    def gradient(rows, weight=1.0):
        model.zero_grad()
        (torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]) * weight).backward()
        return model.weight.grad.clone()

    for samples in (5, 2):
        shape = EpochShape(8 + samples, 8)
        shares = [(list(shape.share(1, rank, 4)) or [0], shape.weight(1, rank, 4)) for rank in range(4)]
        averaged = sum(gradient(rows, weight) for rows, weight in shares) / 4
        assert torch.allclose(averaged, gradient(list(range(samples))), atol=1e-6), samples
        unweighted = sum(gradient(rows) for rows, _ in shares) / 4
        assert not torch.allclose(unweighted, gradient(list(range(samples))), atol=1e-3)


def test_a_cursor_from_before_lanes_mid_epoch_and_uneven_shares_for_a_train_step_are_refused():
    """Cost: < 1 s. A stored cursor without `lanes` (the split by sample index) cannot say
    which samples its epoch read: refused mid-epoch (65), accepted at an epoch's start. A
    workload with its own train_step cannot weigh its losses by share (exit 2)."""
    from trainer.errors import CorruptGeneration, UsageError
    from trainer.run.batching import require_even_split
    from trainer.run.state import Progress
    from trainer.run.streaming import StreamCursor
    from trainer.config import WorkloadConfig

    cursor = StreamCursor(numbers(), EpochShape(36, 6), 1)
    old = {"epoch": 0, "consumed": 12, "shard": "part-1", "offset": 3, "buffer": 10}
    with pytest.raises(CorruptGeneration, match="not into lanes"):
        cursor.check(old, Progress(2, 0, 2))
    cursor.check({**old, "consumed": 0}, Progress(6, 1, 0))
    require_even_split(36, WorkloadConfig(batch_size=16), 8)
    with pytest.raises(UsageError, match="own train_step cannot weigh"):
        require_even_split(36, WorkloadConfig(batch_size=16), 8, own_step=True)
    require_even_split(36, WorkloadConfig(batch_size=16, last_batch="drop"), 8, own_step=True)


def test_object_files_read_ranges_and_fingerprint_sizes_and_etags(s3_bucket, monkeypatch):
    """Cost: ~2 s once the suite's SeaweedFS runs (s3fs imported in-process). Listed once,
    read by ranged GETs (only the bytes asked for), a rewritten object changes the
    fingerprint, an empty prefix is refused in one line (exit 2)."""
    from trainer.errors import UsageError
    from trainer.workload.objects import ObjectFiles

    s3_bucket.use_env(monkeypatch)
    client = s3_bucket.client()
    client.put_object(Bucket=s3_bucket.name, Key="data/a.bin", Body=bytes(range(100)))
    client.put_object(Bucket=s3_bucket.name, Key="data/notes.txt", Body=b"not a shard")
    files = ObjectFiles(f"{s3_bucket.url}/data", suffix=".bin")
    assert files.names() == ["a.bin"] and files.size("a.bin") == 100
    assert files.read("a.bin", 10, 14) == bytes([10, 11, 12, 13]) and files.fetched == 4
    before = files.fingerprint()
    assert before == ObjectFiles(f"{s3_bucket.url}/data", suffix=".bin").fingerprint()
    client.put_object(Bucket=s3_bucket.name, Key="data/a.bin", Body=bytes(range(1, 101)))
    assert ObjectFiles(f"{s3_bucket.url}/data", suffix=".bin").fingerprint() != before, "same size, new ETag"
    with pytest.raises(UsageError, match="no objects ending in '.bin'"):
        ObjectFiles(f"{s3_bucket.url}/nothing", suffix=".bin")


def test_the_layout_is_a_pure_function_of_seed_epoch_buffer_shape_and_lanes():
    """Cost: < 1 s."""
    shape = EpochShape(36, 6)
    ids = [StreamLayout(SIZES, 1, 0, 10, shape, 2).ids(batch, range(6)) for batch in range(6)]
    assert ids == [StreamLayout(SIZES, 1, 0, 10, shape, 2).ids(batch, range(6)) for batch in range(6)]
    assert ids != [StreamLayout(SIZES, 2, 0, 10, shape, 2).ids(batch, range(6)) for batch in range(6)]
    assert EpochShape(32, 6).share(5, 1, 2) == range(1, 2), "the last, short batch"


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
                     lambda root: train(root / "run", *STREAM, "--shard-dir", root / "shards"))


def test_kill_9_mid_epoch_then_other_workers_resumes_exactly(stream_baseline, tmp_path):
    """kill -9 after step 10 (generation step-8 is mid-epoch and mid-block), trained with 2
    workers; resumed with 3: the final generation equals the uninterrupted run's (workers 0)
    bit for bit, cursor included, the ledgers carry the same chain, and `report` finds no
    sample repeated or skipped. Cost: ~15 s (two attempts with worker processes)."""
    shards = stream_baseline / "shards"
    run = tmp_path / "run"
    process = start(run, *STREAM, "--shard-dir", shards, "--num-workers", "2")
    wait_for_line(process, "step=10 ")
    process.send_signal(signal.SIGKILL)
    finish(process)
    assert process.returncode == -signal.SIGKILL
    resumed = train(run, *STREAM, "--shard-dir", shards, "--resume", "--num-workers", "3")
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


def expected_chain(records, shape: EpochShape, lanes_by_epoch, steps: int, buffer: int) -> str:
    """The ledger's chain after `steps` global batches, computed from the layout alone (the
    trainer's default seed), the epochs laid out for the given lanes."""
    chain, done = GENESIS, 0
    for epoch, lanes in enumerate(lanes_by_epoch):
        layout = StreamLayout(records, 1234, epoch, buffer, shape, lanes)
        for batch in range(shape.batches):
            if done == steps:
                return chain
            ids = array("q", layout.ids(batch, range(shape.batch_samples(batch))))
            chain, done = hashlib.sha256(bytes.fromhex(chain) + id_bytes(ids)).hexdigest(), done + 1
    return chain


def test_the_example_runs_on_4_then_3_processes_and_the_ledger_proves_the_order(tmp_path):
    """The example's own data (5 shards: 61 records) at --batch-size 12: the last batch holds 1
    sample, so 3 of 4 ranks (2 of 3) pad at weight 0. Interrupted on 4 processes mid-epoch
    (step 3), resumed on 3 under --allow-drift world_size, through the epoch end: the rest of
    epoch 0 keeps its 4-lane order, epoch 1 is laid out for 3, and the ledger's chain equals
    that order computed from the layout alone; `report` finds none repeated or skipped (61 +
    24 samples) and counts the padding (epoch 0's last batch ran on 3: 2 ranks padded).
    Cost: ~18 s (two torchrun launches, 4 and 3 processes)."""
    shards = tmp_path / "shards"
    args = ("--workload", WORKLOAD, "--shard-dir", shards, "--batch-size", "12", "--shuffle-buffer", "8",
            "--max-steps", "8", "--recover-every-steps", "2", "--recover-every-epochs", "0", "--width", "8")
    run = tmp_path / "run"
    torchrun(run, *args, "--interrupt-at-step", "3", nproc=4, expect=75, tmp=tmp_path)
    torchrun(run, *args, "--resume", "--allow-drift", "world_size", nproc=3, tmp=tmp_path)
    change = attempts(run)[-1]["world_size_change"]
    assert (change["from"], change["to"]) == (4, 3)
    records = [(path.stat().st_size // 2 - 1) // 32 for path in sorted(shards.glob("tokens-*.bin"))]
    assert sum(records) == 61
    ledger = {entry["step"]: entry for record in attempts(run) for entry in record.get("ledger") or []}
    shape = EpochShape(61, 12)
    assert ledger[8]["chain"] == expected_chain(records, shape, (4, 3), 8, 8)
    assert ledger[8]["chain"] != expected_chain(records, shape, (4, 4), 8, 8), "epoch 1 is laid out for 3"
    report = run_cli("report", run)
    assert "4 generations from 2 attempts, 85 samples: none repeated or skipped" in report.stdout, report.stdout
    assert "padded (--last-batch pad): 2 repeated at loss weight 0" in report.stdout, report.stdout


def test_shards_in_the_object_store_resume_exactly_after_kill_9(stream_baseline, s3_bucket, tmp_path):
    """The example's shards uploaded to SeaweedFS and read with --shard-url (ranged GETs,
    trainer/workload/objects.py), 2 workers, kill -9 after step 10; resumed with 1: the final
    generation equals the uninterrupted run over the same shards on disk, bit for bit (same
    bytes, same order), `report` finds none repeated or skipped, and the dataset's fingerprint
    is the objects' sizes and ETags. Cost: ~15 s (two attempts with worker processes)."""
    client = s3_bucket.client()
    for path in sorted((stream_baseline / "shards").glob("tokens-*.bin")):
        client.upload_file(str(path), s3_bucket.name, f"tokens/{path.name}")
    run, args = tmp_path / "run", (*STREAM, "--shard-url", f"{s3_bucket.url}/tokens")
    process = start(run, *args, "--num-workers", "2", env=s3_bucket.env())
    wait_for_line(process, "step=10 ")
    process.send_signal(signal.SIGKILL)
    finish(process)
    assert process.returncode == -signal.SIGKILL
    resumed = train(run, *args, "--resume", "--num-workers", "1", env=s3_bucket.env())
    assert "restored step-00000008" in resumed.stdout
    compared = compare(generation(stream_baseline / "run", FINAL), generation(run, FINAL))
    assert "ledgers: same samples in the same order since step 0" in compared.stdout, compared.stdout[-3000:]
    assert compared.returncode == 0, compared.stdout[-3000:]
    report = run_cli("report", run)
    assert "4 generations from 2 attempts, 84 samples: none repeated or skipped" in report.stdout, report.stdout
    manifest = json.loads((generation(run, FINAL) / "manifest.json").read_text())
    assert manifest["fingerprint"]["dataset"].startswith("objects:")


def test_dropped_last_batches_are_counted_per_epoch_not_called_skipped(tmp_path):
    """Map-style data (the default example, 19 samples in batches of 8) under --last-batch
    drop, interrupted after step 3 (inside epoch 1) and resumed: 2 batches an epoch, 3 samples
    dropped at each epoch's end; `report` counts them per epoch and finds nothing repeated or
    skipped. Cost: ~7 s (two attempts)."""
    args = ("--samples", "19", "--batch-size", "8", "--epochs", "2", "--last-batch", "drop",
            "--recover-every-steps", "1")
    train(tmp_path / "run", *args, "--interrupt-at-step", "3", expect=75)
    train(tmp_path / "run", *args, "--resume")
    report = run_cli("report", tmp_path / "run")
    assert "4 generations from 2 attempts, 32 samples: none repeated or skipped" in report.stdout, report.stdout
    assert "dropped (--last-batch drop): epoch 0: 3, epoch 1: 3" in report.stdout, report.stdout


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
    train(run, *STREAM, "--shard-dir", shards, "--interrupt-at-step", "5", expect=75)
    sorted(shards.glob("*.sha256"))[0].write_text("0" * 64 + "\n")
    refused = run_cli("--output", run, *STREAM, "--shard-dir", shards, "--resume")
    assert refused.returncode == 65 and "dataset" in refused.stderr, refused.stderr
