"""The `Workload` protocol: everything the training loop asks of a model, its data and its
optimizer. The loop depends on this protocol only, never on a particular workload, so a
workload is brought with `--workload MODULE:FACTORY` without touching the trainer.

The factory is called with an `argparse.Namespace`: the options the workload declared with
`FACTORY.add_options(group)` (optional; argparse's `add_argument` on the group, and
`set_defaults` for fixed settings), plus the trainer's `seed`, `batch_size`, `grad_accum`,
`amp`, `epochs` and `store_config` (the run's --store-* retries and timeouts: hand it to
`trainer.workload.objects.ObjectFiles` for data in an object store). Every declared option enters the fingerprint's `config`; its module (or
its top-level package, or the .py files beside a lone module) enters `source`. `epochs` is
not fingerprinted (a run may be extended): use it to refuse a run your schedule cannot cover,
never to shape training.

What the trainer owns (and a workload must not do itself): seeding, the batch order and the
position inside an epoch (`trainer.data.order`), fetching (every sample is fetched with the
global RNGs seeded from (seed, epoch, index): `trainer.data.fetching`), moving batches to the
device, mixed precision, gradient accumulation, and saving and restoring everything,
including the global Python, NumPy and torch RNGs the workload may use in the main process.
A workload must not keep randomness or state the trainer cannot see: a private
`random.Random`/`np.random.Generator`/`torch.Generator` that advances during training, a
counter, a moving average, unless it is returned by `stateful()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class Dataset(Protocol):
    """A map-style dataset. One epoch is `ceil(len(dataset) / batch_size)` batches in a
    permutation that is a pure function of (seed, epoch); the last batch of an epoch may be
    smaller (drop_last=False). Batches are collated by the default collate function, so an
    item may be a tensor, a tuple, a dict or a dataclass of tensors.

    Optional:
    - `fingerprint() -> str`: a digest of the data (the fingerprint's `dataset` field).
      Without it the trainer records the class and length only, so changed data with the
      same length would go unnoticed.
    - `sample_at(epoch, index)`: called instead of `dataset[index]` when present, for a
      dataset that derives its randomness from the epoch itself (the example does).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class Stream(Protocol):
    """Streaming data: records read in order from an offset, never fetched by index (token
    shards, JSONL files, objects in a bucket). The trainer owns the shard order per (seed,
    epoch), a deterministic shuffle buffer (`--shuffle-buffer`), the split into one lane per
    rank and chunks per DataLoader worker (each record read once per epoch), and the cursor
    saved in every generation (trainer/data/stream.py, docs/streaming.md): a resume is exact
    mid-epoch, for any `--num-workers`, and an epoch in progress finishes in its global order
    across a world-size change. Records are collated like map-style items.

    Optional: `fingerprint()` (without it, the shards' names and record counts),
    `collate(samples)` (run with the global RNGs keyed by the batch's first position), and a
    third parameter of `read`, `stop`: the record the trainer stops before, so a reader that
    fetches ahead (ranged GETs: `trainer.workload.objects.ObjectFiles`) asks for no more.
    """

    def shards(self) -> list:
        """[(name, records), ...] or objects with `name` and `records`: every record counts,
        so a resume and every rank agree on where each sample is."""

    def read(self, shard, offset: int):
        """The records of `shard` (as `shards()` gave it) from `offset` on, in order (to its
        end, or to `stop` when `read` takes a third parameter)."""


def is_stream(dataset) -> bool:
    """Whether a dataset is a stream (shards and a reader) rather than map-style."""
    return callable(getattr(dataset, "shards", None)) and callable(getattr(dataset, "read", None))


@dataclass(frozen=True)
class TrainingSteps:
    """The run's optimizer steps, for a workload's `plan(steps)` (a warmup and cosine schedule
    needs its length): `per_epoch` over the dataset at this batch size and --grad-accum,
    `total` over --epochs, or --max-steps when given. When a workload plans, `total` enters the fingerprint's `config`
    (`config.total_steps`): extending the run changes its schedule, an explicit drift."""

    per_epoch: int
    total: int


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Workload(Protocol):
    """Required methods. Optional ones (the trainer supplies a no-op when absent):

    - `after_backward(model, optimizer)`: after the last backward of an optimizer step, before
      the step; gradients are unscaled (after `GradScaler.unscale_` under AMP), so gradient
      clipping goes here.
    - `after_step(model, optimizer)`: after each optimizer step (an EMA update).
    - `stateful() -> dict[str, Stateful]`: extra state the workload keeps (EMA weights, a
      curriculum, a sampler), saved under `workload.<name>`, restored and compared like the
      rest; called once, after the model, optimizer and scheduler are built.
    - `plan(steps: TrainingSteps)`: called once the dataset is built, before `build_model`;
      build schedules from `steps.total` instead of reading `epochs`.
    - `train_step(model, optimizers, batches, step)`: the workload's own optimizer step (a
      GAN, distillation, a closure optimizer) over the window's micro-batches (already on the
      device), instead of `loss`; it calls `step.autocast()`, `step.backward(loss)` and
      `step.step(optimizer[, closure])` (`trainer.run.stepping.StepTools`) so mixed
      precision, accumulation and `after_backward` stay the trainer's; returns the loss to
      record. The trainer clears gradients before and steps every scheduler after.
    - `adopt_config(optimizer, scheduler)`: after a restore under an allowed `config` drift,
      make changed options that restored state holds (the learning rate) take effect.
    """

    def build_dataset(self) -> Dataset | Stream:
        """Map-style data or a stream; or a `DataLoader` (torchdata's `StatefulDataLoader`)
        over either, whose batch size, workers and collate_fn the trainer adopts and whose
        sampler and state it replaces (trainer/workload/adapters.py `from_loader`)."""

    def build_model(self) -> nn.Module: ...

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | dict[str, torch.optim.Optimizer]:
        """One optimizer, or several by name (each saved under its name; a parameter belongs
        to at most one). Hooks receive it as returned."""

    def build_scheduler(self, optimizer) -> torch.optim.lr_scheduler.LRScheduler | dict:
        """Given what `build_optimizer` returned; one scheduler or several by name, each
        stepped once per optimizer step (not per micro-batch, not per epoch)."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one (micro-)batch, already on the device, through `model`."""

    def architecture(self) -> dict:
        """What an export's config.json needs to rebuild the model without this package."""
