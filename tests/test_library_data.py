"""`KeyedData` in a user's own loop (trainer/data/keyed.py): each rank's share of every global
batch is the trainer's own layout, and gradient accumulation counts optimizer steps, resuming
inside an epoch at a window's boundary equal to an uninterrupted run."""

from __future__ import annotations

import torch

from support.cli import compare, run_cli
from support.runs import attempts, generation
from trainer.recovery import KeyedData
from trainer.run.state import Progress


def test_the_ranks_shares_together_are_every_global_batch_once_weighted_to_its_whole():
    """100 samples in batches of 12 at 3 ranks: 8 whole batches shared 4/4/4 and a ragged one of
    4 shared 2/1/1 (`pad`), whose weights make each rank's mean loss count its samples."""
    data = KeyedData(torch.utils.data.TensorDataset(torch.arange(100)), batch_size=12, seed=3)
    alone = list(data.shares(0, 0))
    shares = [list(data.shares(0, 0, rank, 3)) for rank in range(3)]
    assert [len(of_rank) for of_rank in shares] == [9, 9, 9] == [len(alone)] * 3
    for batch, whole in enumerate(alone):
        got = [of_rank[batch] for of_rank in shares]
        assert sorted(torch.cat([share.ids for share in got]).tolist()) == sorted(whole.ids.tolist())
        assert [len(share.ids) for share in got] == ([4, 4, 4] if batch < 8 else [2, 1, 1])
        assert [share.weight for share in got] == ([1.0] * 3 if batch < 8 else [1.5, 0.75, 0.75])
    dropped = KeyedData(data.dataset, batch_size=12, seed=3, last_batch="drop")
    assert dropped.batches_per_epoch == 8 and list(dropped.shares(0, 5, 2, 3))[0].ids.tolist() == \
        shares[2][5].ids.tolist()  # the same order, from a position, without the ragged batch


class Numbers:
    """A stream of three shards of numbered records."""

    def shards(self):
        return [("a", 40), ("b", 35), ("c", 25)]

    def read(self, shard, offset):
        start = {"a": 0, "b": 40, "c": 75}[shard[0]]
        return iter(torch.tensor([start + at]) for at in range(offset, shard[1]))


def test_a_streams_lanes_give_each_rank_its_share_of_every_global_batch():
    """The same global batches at 1 and 3 ranks (an epoch laid out for 3: the lanes), and the
    cursor a generation of 3 ranks stores says so."""
    data = KeyedData(Numbers(), batch_size=12, seed=3, shuffle_buffer=8)
    shares = [list(data.shares(1, 0, rank, 3)) for rank in range(3)]
    assert {len(of_rank) for of_rank in shares} == {data.batches_per_epoch} == {9}
    everything = sorted(sample for of_rank in shares for share in of_rank for sample in share.batch.flatten().tolist())
    assert everything == list(range(100))  # each record once an epoch, whichever rank reads it
    for of_rank in shares:
        for share in of_rank:
            assert share.ids.tolist() == share.batch.flatten().tolist()  # ids number the records in shard order
    assert [share.weight for share in (of_rank[-1] for of_rank in shares)] == [1.5, 0.75, 0.75]
    assert data.cursors(3)["stream"].world_size == 3


def test_a_streams_lanes_given_keep_one_order_at_every_world_size_that_divides_them():
    """`stream_lanes=6` (as --stream-lanes): the run's lanes whatever the world size it starts
    at, so 2 and 3 ranks train the same global batches, and the fingerprint holds the count."""
    data = KeyedData(Numbers(), batch_size=12, seed=3, shuffle_buffer=8, stream_lanes=6)
    assert data.settings().stream_lanes == 6 and data.settings().training_relevant()["stream_lanes"] == 6

    def global_batches(world_size: int) -> list[list[int]]:
        shares = [list(data.shares(0, 0, rank, world_size)) for rank in range(world_size)]
        return [sorted(sample for of_rank in shares for sample in of_rank[batch].ids.tolist())
                for batch in range(data.batches_per_epoch)]

    assert data.cursors(2)["stream"].state(Progress())["run_lanes"] == 6
    assert global_batches(2) == global_batches(3)
    assert global_batches(3) != [sorted(share.ids.tolist()) for share in
                                 KeyedData(Numbers(), batch_size=12, seed=3, shuffle_buffer=8).shares(0, 0)]


ACCUMULATING = """
import sys
import torch
from torch import nn
from trainer import recovery

recovery.seed_everything(0)
inputs = torch.randn(50, 4)
dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
interrupt = int(sys.argv[2]) if len(sys.argv) > 2 else None
with recovery.open_run(sys.argv[1], resume="auto", interrupt_at_step=interrupt,
                       recover=recovery.CadenceConfig(every_steps=2)) as run:
    # 7 micro-batches of 8 an epoch (the last one of 2): windows of 3, 3 and 1
    run.restore(model, optimizer, data=recovery.KeyedData(dataset, batch_size=8, seed=1, grad_accum=3))
    for epoch in run.epochs(3):
        total = 0.0
        for x, y in run.batches():
            loss = nn.functional.mse_loss(model(x), y) * run.weight
            loss.backward()
            total += loss.item()
            if run.window_ends:
                optimizer.step()
                optimizer.zero_grad()
                run.step(total)
                print(f"step={run.progress.global_step} position={run.progress.position} window={run.window}")
                total = 0.0
"""


def test_gradient_accumulation_counts_optimizer_steps_and_resumes_inside_an_epoch_exactly(tmp_path):
    script, baseline, run = tmp_path / "accumulating.py", tmp_path / "baseline", tmp_path / "run"
    script.write_text(ACCUMULATING)
    done = run_cli(script, baseline)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:4] == ["step=1 position=3 window=3", "step=2 position=6 window=3",
                                            "step=3 position=0 window=1", "step=4 position=3 window=3"]
    assert run_cli(script, run, 5).returncode == 75  # lost after step 5; step 4 (epoch 1, 3 micro-batches) saved
    resumed = run_cli(script, run)
    assert resumed.returncode == 0, resumed.stderr
    assert "restored step-00000004 (step=4 epoch=1 position=3)" in resumed.stderr
    assert compare(generation(baseline, "step-00000009"), generation(run, "step-00000009")).returncode == 0
    record = attempts(run)[-1]
    assert record["replay"]["matched"] == record["replay"]["of"] == 1
    assert "150 samples: none repeated or skipped" in run_cli("report", run).stdout
