"""Lightning with the trainer's recovery (docs/library.md).

    with recovery.open_run("runs/pl", resume="auto") as run:
        callback = lightning.RecoveryCallback(run, recovery.KeyedData(dataset, batch_size=16))
        trainer = L.Trainer(max_epochs=3, callbacks=[callback], enable_checkpointing=False)
        trainer.fit(module, train_dataloaders=callback.batches)

Lightning's own resume (`fit(ckpt_path="last")`) is not exact: its checkpoint holds no RNG
state (dropout differs from the first resumed step) and a mid-epoch resume starts a new
shuffle (issue #40's measurements). Here Lightning keeps its loop and the generations replace
its checkpoints: `fit` starts as if fresh, and at `on_train_start` (the optimizers and
schedulers exist) the newest verified generation is restored into the module, optimizer,
scheduler and RNGs, and Lightning's epoch and step counters are set to the restored progress;
`callback.batches` gives the rest of that epoch in the trainer's keyed order, then whole
epochs. After each optimizer step (`on_train_batch_end`) the witness, the cadences and
preemption run as in `run.step`; SIGTERM saves the step reached and exits 75 (the stop signal
stays the run's: Lightning's own handler would end `fit` before a save).
"""

from __future__ import annotations

import collections
import signal

from trainer.origin import missing_extra

try:
    import lightning.pytorch as pl
except ModuleNotFoundError as error:
    raise missing_extra(error, "lightning") from None

from trainer.errors import UsageError
from trainer.recovery.data import KeyedData
from trainer.recovery.run import RecoveryRun


class KeyedBatches:
    """The train dataloader Lightning iterates: the rest of the current epoch from the run's
    position, in the keyed order. The sample ids wait in `pending` until their step is done."""

    def __init__(self, run: RecoveryRun, data: KeyedData):
        self.run, self.data = run, data
        self.pending: collections.deque = collections.deque()

    def __len__(self) -> int:
        """The batches of the epoch still to come: Lightning ends an epoch (and steps its
        per-epoch schedulers) when it has fetched this many."""
        done = self.run.progress.position if self.run.state is not None else 0
        return self.data.batches_per_epoch - done

    def __iter__(self):
        progress = self.run.progress
        for ids, batch in self.data.epoch_batches(progress.epoch, progress.position):
            self.pending.append(ids)
            yield batch


class RecoveryCallback(pl.Callback):
    def __init__(self, run: RecoveryRun, data: KeyedData):
        self.run, self.data = run, data
        self.batches = KeyedBatches(run, data)
        self.stop_signals = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        """The run's own handlers (installed by open_run), put back over Lightning's."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        signal.signal(signal.SIGTERM, self.stop_signals[0])
        signal.signal(signal.SIGINT, self.stop_signals[1])
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise UsageError(f"recovery.lightning takes one optimizer and at most one scheduler (configure_optimizers "
                             f"gave {len(trainer.optimizers)} and {len(trainer.lr_scheduler_configs)}); use the trainer's "
                             f"own loop (python -m trainer) for several")
        schedulers = trainer.lr_scheduler_configs
        progress = self.run.restore(module, trainer.optimizers[0], schedulers[0].scheduler if schedulers else None,
                                    data=self.data)
        loop = trainer.fit_loop
        for counter in (loop.epoch_progress.current, loop.epoch_progress.total):
            counter.ready = counter.started = counter.processed = counter.completed = progress.epoch
        steps = loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        steps.ready = steps.completed = progress.global_step
        loop.epoch_loop._batches_that_stepped = progress.global_step
        if loop._data_fetcher is not None:
            iter(loop._data_fetcher)  # made before the restore: its length, and the epoch's batches, from here

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.run.consumed(self.batches.pending.popleft())
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.run.step(loss.detach())
