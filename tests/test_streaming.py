"""Streaming data with a cursor the trainer owns (trainer/data/stream.py), an epoch's ragged
last batch (trainer/data/order.py), the sample ledger (trainer/data/ledger.py), and streams
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

from support.cli import REPO, compare, finish, one_error_line, run_cli, start, train, wait_for_line
from support.runs import attempts, generation, made_once
from support.torchrun import torchrun, trainer_ranks
from trainer.data.ledger import GENESIS, SampleLedger, id_bytes, ledger_problems
from trainer.data.order import EpochBatchOrder, EpochShape
from trainer.data.stream import StreamEpoch, StreamLayout, StreamSource

WORKLOAD = f"{REPO}/examples/stream_lm.py:StreamLM"
STREAM = ("--workload", WORKLOAD, "--lm-shards", "4", "--lm-context", "30", "--batch-size", "6",
          "--shuffle-buffer", "20", "--max-steps", "14", "--recover-every-steps", "4", "--recover-every-epochs", "0")
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


def numbers(sizes=(7, 13, 4, 12), buffer: int = 10, lanes: int | None = None) -> StreamSource:
    return StreamSource(Numbers(list(sizes)), seed=7, buffer=buffer, spec="test", lanes=lanes)


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


def test_the_global_order_is_the_same_at_every_world_size_in_every_epoch_for_lanes_fixed_by_the_run():
    """Cost: ~2 s. The order is a function of the lanes, never of the ranks: for 7 lane counts
    (dividing the batch of 12 or not, beyond it too) and every world size that shares the batch
    (and 8 and 24 ranks on a batch of 24),
    epochs 0 and 1, a ragged last batch (61 records: 1 in the last, the other ranks pad), and a
    resume mid-epoch at another world size, the ranks' micro-batches put back in place are one
    order. The world size alone (no lanes fixed) would give another order per size."""
    sizes, shape = (7, 13, 4, 12, 25), EpochShape(61, 12)
    for lanes in (1, 2, 3, 4, 5, 8, 13):
        for epoch in (0, 1):
            whole = global_order(numbers(sizes, lanes=lanes), 1, 0, epoch=epoch, shape=shape)
            assert sorted(whole) == list(range(61)), "every record once per epoch"
            for world_size in (2, 3, 4, 6, 12):
                assert global_order(numbers(sizes, lanes=lanes), world_size, 0, epoch=epoch, shape=shape) == whole, \
                    (lanes, world_size, epoch)
            for world_size, start_batch in ((3, 2), (4, 3), (2, 5)):
                resumed = global_order(numbers(sizes, lanes=lanes), world_size, 0, start_batch, epoch, shape)
                assert resumed == whole[start_batch * 12:], (lanes, world_size, start_batch)
    wide = EpochShape(61, 24)  # 8 ranks
    for lanes in (8, 3, 16):
        whole = global_order(numbers(sizes, lanes=lanes), 1, 0, shape=wide)
        for world_size in (2, 8, 24):
            assert global_order(numbers(sizes, lanes=lanes), world_size, 0, shape=wide) == whole, (lanes, world_size)
    by_world_size = [global_order(numbers(sizes), world_size, 0, shape=shape) for world_size in (1, 2, 3, 4)]
    assert len({tuple(order) for order in by_world_size}) == 4, "no lanes fixed: one layout per world size"


@pytest.mark.parametrize("lanes, ranks, workers, factor", [
    (1, 1, 1, 1), (2, 2, 2, 1), (4, 4, 2, 1), (8, 2, 3, 1), (12, 3, 2, 1), (12, 4, 1, 1),
    (4, 3, 2, 3), (1, 2, 1, 2), (4, 8, 2, 2), (6, 4, 1, 2)])
def test_each_record_is_read_once_per_epoch_where_the_world_size_divides_the_lanes(lanes, ranks, workers, factor):
    """Cost: < 1 s. Every rank's every worker reads its own chunks (as `StreamEpoch.__iter__`
    deals them out), here in one process so one counter sees every read. Where the world size
    divides the lanes, each rank reads its lanes alone: 1.00x at any worker count. Otherwise a
    rank reads every lane its slots fall in: world size / gcd(lanes, world size) times (3x for
    4 lanes on 3 ranks, 2x for 1 lane on 2), the bound docs/streaming.md gives. Ranks with no
    share of the last batch (1 sample) read its first record, to pad (under 0.01x here)."""
    sizes, shape = [17, 130, 3, 90, 61], EpochShape(301, 24)
    source = numbers(sizes, buffer=64, lanes=lanes)
    layout = source.layout(shape, 0, lanes)
    for rank in range(ranks):
        epoch = StreamEpoch(source, layout, 0, rank, ranks)
        for worker in range(workers):
            for chunk in epoch.chunks()[worker::workers]:
                epoch.chunk_batches(chunk)
    assert factor * sum(sizes) <= source.stream.reads <= factor * sum(sizes) + ranks - 1, source.stream.reads / 301


def test_a_resume_mid_block_continues_the_order_exactly_and_rereads_one_block():
    """Cost: < 1 s. The buffer is rebuilt from the cursor alone, at any worker count."""
    for world_size in (1, 3):
        whole = global_order(numbers(), world_size, 0)
        for start_batch in (1, 3, 5):
            source = numbers()
            assert global_order(source, world_size, 0, start_batch=start_batch) == whole[start_batch * 6:]
            layout = source.layout(EpochShape(36, 6), 0, world_size)
            reread = start_batch % layout.chunk * sum(layout.shares)
            assert source.stream.reads == 36 - start_batch * 6 + reread, (world_size, start_batch)


def test_a_resume_at_another_world_size_keeps_the_lanes_the_run_started_with(caplog):
    """Cost: < 1 s. A run started on 4 processes (lanes 4) stores its lanes in the cursor; a
    resume on 3 adopts them for the rest of the run (`StreamCursor.check`): the rest of the
    epoch and the next one are the 4-process order, and the log says what 4 lanes on 3 cost.
    `--stream-lanes` changed under drift: the epoch in progress finishes in its lanes, the next
    is laid out in the new ones."""
    import logging

    from trainer.run.state import Progress
    from trainer.data.source import cursors

    shape, mid = EpochShape(36, 12), Progress(1, 0, 1)
    four = numbers()
    stored = cursors(four, shape, 4)["stream"].state(mid)
    assert (stored["lanes"], stored["run_lanes"]) == (4, 4)
    three = numbers()
    with caplog.at_level(logging.INFO, logger="trainer"):
        cursors(three, shape, 3)["stream"].check(stored, mid)
    assert "4 lanes on 3 processes: each record is read 3 times per epoch" in caplog.text, caplog.text
    for epoch, start_batch in ((0, 1), (1, 0)):
        assert global_order(three, 3, 0, start_batch, epoch, shape) == global_order(four, 4, 0, start_batch, epoch,
                                                                                    shape)
    changed = numbers(lanes=6)
    cursors(changed, shape, 3)["stream"].check(stored, mid)
    assert global_order(changed, 3, 0, 1, shape=shape) == global_order(four, 4, 0, 1, shape=shape)
    assert global_order(changed, 3, 0, epoch=1, shape=shape) == global_order(numbers(lanes=6), 1, 0, epoch=1,
                                                                             shape=shape)
    assert cursors(changed, shape, 3)["stream"].state(Progress(4, 1, 1))["lanes"] == 6


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


def test_a_padded_share_leaves_batchnorm_statistics_as_they_were():
    """Cost: < 1 s. A rank with no share of a last batch trains on the batch's first sample at
    loss weight 0 (`--last-batch pad`): nothing of it reaches the gradient, and the model's
    buffers (BatchNorm's running mean and variance, and its count) are put back after that
    forward (`trainer.run.stepping.buffers_kept`), so they do not see it either. A weighted
    share (weight 2) moves them, as any trained sample does."""
    from trainer.run.state import TrainingState
    from trainer.run.stepping import OptimizerSteps
    from trainer.workload import BoundWorkload

    class Normed:
        def loss(self, model, batch):
            return model(batch).pow(2).mean()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                          torch.amp.GradScaler("cpu", enabled=False))
    steps = OptimizerSteps(BoundWorkload(Normed(), ()), state, model, torch.device("cpu"), amp=False)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    steps.open_window(1)
    steps.micro_batch(torch.randn(2, 3) + 5, weight=0.0)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert all(parameter.grad is None or not parameter.grad.any() for parameter in model.parameters())
    steps.micro_batch(torch.randn(2, 3) + 5, weight=2.0)
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    assert model[1].num_batches_tracked.item() == 1


def test_cursors_of_earlier_layouts_mid_epoch_and_uneven_shares_for_a_train_step_are_refused():
    """Cost: < 1 s. A stored cursor without the run's lanes cannot say how the rest of its
    run is laid out: one written when each epoch was laid out for its world size, or one from
    the split by sample index, is refused mid-epoch (65) and accepted at an epoch's start; a
    cursor that disagrees with the progress is refused. A workload with its own train_step
    cannot weigh its losses by share (exit 2)."""
    from trainer.errors import CorruptGeneration, UsageError
    from trainer.data.order import require_even_split
    from trainer.run.state import Progress
    from trainer.data.source import cursors
    from trainer.config import WorkloadConfig

    cursor = cursors(numbers(), EpochShape(36, 6), 1)["stream"]
    by_world_size = {"epoch": 0, "consumed": 12, "lanes": 1, "buffer": 10, "blocks": ["part-3@0"]}
    by_index = {"epoch": 0, "consumed": 12, "shard": "part-1", "offset": 3, "buffer": 10}
    for old, why in ((by_world_size, "laid each epoch out for its world size"), (by_index, "by sample index")):
        with pytest.raises(CorruptGeneration, match=why):
            cursor.check(old, Progress(2, 0, 2))
        cursor.check({**old, "consumed": 0}, Progress(6, 1, 0))
    good = cursor.state(Progress(2, 0, 2))
    cursor.check(good, Progress(2, 0, 2))
    with pytest.raises(CorruptGeneration, match="disagrees with the progress"):
        cursor.check({**good, "consumed": 6}, Progress(2, 0, 2))
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


def test_stream_lanes_is_fingerprinted_when_given_and_a_bad_value_is_refused_in_one_line(tmp_path):
    """Cost: ~3 CPU-s (forked CLI runs). Unset, --stream-lanes leaves the fingerprint as it
    was (the run's lanes then live in the cursor); set, it is part of `config`: a resume with
    another count is refused (65) naming it. 0, a negative or a word: exit 2, one line."""
    from trainer.config import WorkloadConfig

    assert "stream_lanes" not in WorkloadConfig().training_relevant()
    assert WorkloadConfig(stream_lanes=12).training_relevant()["stream_lanes"] == 12
    for bad in ("0", "-4", "two"):
        result = run_cli("--output", tmp_path / "bad", "--stream-lanes", bad)
        assert result.returncode == 2 and "--stream-lanes" in one_error_line(result), result.stderr
    run, small = tmp_path / "run", ("--samples", "32", "--batch-size", "8", "--recover-every-steps", "1")
    train(run, *small, "--stream-lanes", "4", "--interrupt-at-step", "2", expect=75)
    refused = run_cli("--output", run, *small, "--stream-lanes", "6", "--resume")
    assert refused.returncode == 65 and "config.stream_lanes 4 → 6" in one_error_line(refused), refused.stderr


def test_a_stream_in_an_object_store_reads_with_the_runs_store_settings(tmp_path):
    """Cost: ~3 CPU-s. The example's shards at a store that does not answer (a closed port),
    with --store-retries 1 --store-backoff-secs 0.1 and a run directory on disk: listing the
    shards fails after 2 tries (exit 74, one line), not after the client's default 5: the
    workload's factory is handed the run's --store-* settings (`options.store_config`)."""
    from support.torchrun import free_port

    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "none",
           "AWS_SECRET_ACCESS_KEY": "none", "AWS_DEFAULT_REGION": "us-east-1"}
    result = run_cli("--output", tmp_path / "run", "--workload", WORKLOAD, "--lm-shard-url", "s3://nowhere/tokens",
                     "--store-retries", "1", "--store-backoff-secs", "0.1", "--store-timeout-secs", "2", env=env)
    assert result.returncode == 74 and "failed after 2 tries" in one_error_line(result), result.stderr


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


ELASTIC = ("--workload", WORKLOAD, "--batch-size", "12", "--shuffle-buffer", "8", "--max-steps", "14",
           "--recover-every-steps", "3", "--recover-every-epochs", "0", "--lm-width", "8")
"""The example's own data (5 shards: 61 records) in batches of 12, which 1, 2, 3 and 4 ranks
share; an epoch's last batch holds 1 sample (the other ranks pad at weight 0). 6 batches an
epoch: 14 steps cross two epoch ends; generations at 3, 6, 9, 12, 14 (3 is mid-epoch and
mid-chunk: a chunk is 2 batches)."""
ELASTIC_FINAL = "step-00000014"


def records_of(shards) -> list[int]:
    """The example's records per shard (windows of 32 + 1 tokens)."""
    return [(path.stat().st_size // 2 - 1) // 32 for path in sorted(shards.glob("tokens-*.bin"))]


def uninterrupted(tmp_path_factory, lanes: int, *args) -> Path:
    """The example uninterrupted on one process laid out in `lanes` lanes: the order of an
    uninterrupted run on `lanes` processes (the order depends on the lanes alone:
    `test_the_global_order_is_the_same_at_every_world_size_...`), at a process's cost. Shared."""
    return made_once(tmp_path_factory, f"stream-{lanes}-lanes", lambda root: train(
        root / "run", *args, "--lm-shard-dir", root / "shards", "--stream-lanes", lanes))


def same_order(baseline: Path, runs, final: str) -> None:
    """compare.py's ledger verdict: each run trained on the baseline's samples in its order."""
    for run in runs:
        compared = compare(generation(baseline, final), generation(run, final))
        assert "ledgers: same samples in the same order since step 0" in compared.stdout, compared.stdout[-3000:]


def test_4_processes_then_3_then_4_train_the_samples_in_the_order_of_the_uninterrupted_run(tmp_path_factory, tmp_path):
    """examples/stream_lm.py on 4 processes, interrupted at step 4 (restored from step 3, mid-
    epoch and mid-chunk), resumed on 3 (2 workers) and interrupted at step 8 (restored from 6,
    inside epoch 1), resumed on 4 to the end. Every epoch is laid out in the 4 lanes the run
    started with: the run trains on the samples, in the order, of the uninterrupted run since
    step 0 (compare.py's ledger verdict against one process on 4 lanes, and the chain computed
    from the layout alone), and `report` finds none repeated or skipped.
    Cost: ~25 CPU-s (one process, 4 then 3 forked ranks (`trainer_ranks`: a launcher changes no
    bit), then torchrun's 4; 53 with torchrun's 4 and 3 first)."""
    baseline = uninterrupted(tmp_path_factory, 4, *ELASTIC)
    shards, run = baseline / "shards", tmp_path / "run"
    args, resume = (*ELASTIC, "--lm-shard-dir", shards), ("--resume", "--allow-drift", "world_size")
    trainer_ranks(run, *args, "--interrupt-at-step", "4", nproc=4, expect=75)  # its launch is not under test
    trainer_ranks(run, *args, *resume, "--num-workers", "2", "--interrupt-at-step", "8", nproc=3, expect=75)  # forked
    torchrun(run, *args, *resume, nproc=4, tmp=tmp_path)
    assert [(r["world_size_change"]["from"], r["world_size_change"]["to"]) for r in attempts(run)[1:]] == [
        (4, 3), (3, 4)]
    same_order(baseline / "run", [run], ELASTIC_FINAL)
    ledger = {entry["step"]: entry for record in attempts(run) for entry in record.get("ledger") or []}
    assert ledger[14]["chain"] == expected_chain(records_of(shards), EpochShape(61, 12), (4, 4, 4), 14, 8)
    assert ledger[14]["chain"] != expected_chain(records_of(shards), EpochShape(61, 12), (4, 3, 3), 14, 8)
    report = run_cli("report", run)
    assert "5 generations from 3 attempts, 146 samples: none repeated or skipped" in report.stdout, report.stdout


def test_8_processes_then_2_train_the_samples_in_the_order_of_the_uninterrupted_run_and_twice_alike(
        tmp_path_factory, tmp_path):
    """The example in batches of 8 on 8 processes (lanes 8; the last batch of an epoch holds 5:
    3 ranks pad), interrupted at step 4 (restored from 3), resumed on 2 to step 10, across the
    epoch end, twice: with 0 and with 2 workers. Both train on the samples, in the order, of
    the uninterrupted run on 8 lanes (compare.py's ledger verdict), each of 2 ranks reading its
    4 lanes alone, and end bit-identical: the same change twice gives the same bits.
    Cost: ~28 CPU-s (one process, 8 forked ranks (`trainer_ranks`), then torchrun's 2 and 2 forked
    ranks; 60 with torchrun's 8 and 2 first)."""
    shape_args = ("--batch-size", "8", "--max-steps", "10")
    baseline = uninterrupted(tmp_path_factory, 8, *ELASTIC, *shape_args)
    shards, once, twice = baseline / "shards", tmp_path / "once", tmp_path / "twice"
    args, resume = (*ELASTIC, *shape_args, "--lm-shard-dir", shards), ("--resume", "--allow-drift", "world_size")
    trainer_ranks(once, *args, "--interrupt-at-step", "4", nproc=8, expect=75)  # its launch is not under test
    shutil.copytree(once, twice)
    torchrun(once, *args, *resume, nproc=2, tmp=tmp_path)
    trainer_ranks(twice, *args, *resume, "--num-workers", "2", nproc=2)  # forked: a launcher changes no bit
    same_order(baseline / "run", [once, twice], "step-00000010")
    alike = compare(generation(once, "step-00000010"), generation(twice, "step-00000010"))
    assert alike.returncode == 0, alike.stdout[-3000:]
    report = run_cli("report", once)
    assert "4 generations from 2 attempts, 77 samples: none repeated or skipped" in report.stdout, report.stdout


def test_1_process_then_2_trains_the_samples_in_the_order_of_the_uninterrupted_run(stream_baseline, tmp_path):
    """The streaming run on one process (lanes 1), interrupted at step 6 (restored from 4, mid-
    epoch and mid-block), resumed on 2 processes: the samples, in the order, of the shared
    uninterrupted one-process run (compare.py's ledger verdict; each rank reads the one lane's
    blocks: 2x for the rest of the run, docs/streaming.md). The 2 ranks forked as a launcher starts
    them (`trainer_ranks`; the 4 → 3 → 4 and 8 → 2 runs end under torchrun). Cost: ~4.5 CPU-s (15 with torchrun)."""
    run, args = tmp_path / "run", (*STREAM, "--lm-shard-dir", stream_baseline / "shards")
    train(run, *args, "--interrupt-at-step", "6", expect=75)
    trainer_ranks(run, *args, "--resume", "--allow-drift", "world_size", nproc=2)
    same_order(stream_baseline / "run", [run], FINAL)
    report = run_cli("report", run)
    assert "4 generations from 2 attempts, 84 samples: none repeated or skipped" in report.stdout, report.stdout


def test_shards_in_the_object_store_resume_exactly_after_kill_9(stream_baseline, s3_bucket, tmp_path):
    """The example's shards uploaded to SeaweedFS and read with --lm-shard-url (ranged GETs,
    trainer/workload/objects.py), 2 workers, kill -9 after step 10; resumed with 1: the final
    generation equals the uninterrupted run over the same shards on disk, bit for bit (same
    bytes, same order), `report` finds none repeated or skipped, and the dataset's fingerprint
    is the objects' sizes and ETags. Cost: ~15 s (two attempts with worker processes)."""
    client = s3_bucket.client()
    for path in sorted((stream_baseline / "shards").glob("tokens-*.bin")):
        client.upload_file(str(path), s3_bucket.name, f"tokens/{path.name}")
    run, args = tmp_path / "run", (*STREAM, "--lm-shard-url", f"{s3_bucket.url}/tokens")
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
    train(run, *STREAM, "--lm-shard-dir", shards, "--interrupt-at-step", "5", expect=75)
    sorted(shards.glob("*.sha256"))[0].write_text("0" * 64 + "\n")
    refused = run_cli("--output", run, *STREAM, "--lm-shard-dir", shards, "--resume")
    assert refused.returncode == 65 and "dataset" in refused.stderr, refused.stderr
