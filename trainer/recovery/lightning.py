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

Several processes (`strategy="ddp", devices=N`, Lightning's own launcher, `python train.py`):

    trainer = L.Trainer(strategy="ddp", devices=2, ..., enable_checkpointing=False)
    lightning.launch(trainer)  # the other ranks start now and run this script from the top
    with recovery.open_run("runs/pl", resume="auto") as run:
        callback = lightning.RecoveryCallback(run, recovery.KeyedData(dataset, batch_size=16))
        trainer.callbacks.append(callback)
        trainer.fit(module, train_dataloaders=callback.batches)

Lightning's launcher starts the other ranks only inside `fit()`, after rank 0 has opened the
run alone, and without `RANK`; `launch` starts them before `open_run` instead (Lightning's
own `_call_children_scripts`, so `fit()` finds them started and starts none) and sets `RANK`
and `LOCAL_WORLD_SIZE` as Lightning computes them, so every rank opens the run together and
`fit()` uses the process group `open_run` joined. Lightning's child-process observer, which
SIGKILLs rank 0 seconds after another rank exits non-zero (75 included), is not started: a
lost rank is the run's to name (75), and rank 0 waits for the others before it exits. Until
the group is joined rank 0 watches the ranks it started: one that ends before is named at
once, and rank 0 exits 75 (`lost_before_join`), not after the join's bound. Lightning's
`accumulate_grad_batches` is the keyed order's `grad_accum`, fingerprinted: a resume with
another is refused (65).
Lightning's DDP model is handed to the run, which gives it the trainer's exact reduction.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import signal
import subprocess
from dataclasses import replace

import torch.distributed
from torch.nn.parallel import DistributedDataParallel

from trainer.origin import missing_extra

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
except ModuleNotFoundError as error:
    raise missing_extra(error, "lightning") from None

from trainer.cli import exit_process, report_exit_status
from trainer.errors import EXIT_INTERRUPTED, UsageError
from trainer.parallel.launch import watch_children
from trainer.data.keyed import KeyedData
from trainer.recovery.run import RecoveryRun

log = logging.getLogger("trainer")


def launch(trainer: pl.Trainer) -> None:
    """Start the trainer's other processes now (see the module's docstring); call it before
    `open_run`. In a process Lightning or torchrun started, and with one process, it only
    sets `RANK` where Lightning left it out."""
    launcher = trainer.strategy.launcher
    if launcher is None:
        return
    if not isinstance(launcher, _SubprocessScriptLauncher):
        raise UsageError(f"recovery.lightning.launch runs Lightning's script launcher (strategy='ddp'); "
                         f"{type(launcher).__name__} starts processes that cannot open the run first: use "
                         f"strategy='ddp' or torchrun")
    environment = launcher.cluster_environment
    if not environment.creates_processes_externally:
        launcher._call_children_scripts()  # what fit() would do, less its observer
        atexit.register(wait_for, launcher.procs)
        first = environment.node_rank() * launcher.num_processes + 1  # the children's ranks, in Lightning's order
        watch_children({first + index: child for index, child in enumerate(launcher.procs)},
                       torch.distributed.is_initialized, lambda line: lost_before_join(launcher.procs, line))
    os.environ.setdefault("RANK", str(environment.node_rank() * launcher.num_processes + environment.local_rank()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(launcher.num_processes))


def lost_before_join(children: list[subprocess.Popen], line: str) -> None:
    """A rank this one started ended before the join (`watch_children`): the others are
    stopped, and this one leaves now, resumable, instead of after the join's bound."""
    for child in children:
        if child.poll() is None:
            child.kill()
    log.error("%s; stopping (exit 75, resumable: run the script again to resume)", line)
    report_exit_status(EXIT_INTERRUPTED)
    exit_process(EXIT_INTERRUPTED)


def wait_for(children: list[subprocess.Popen], bound_s: float = 300.0) -> None:
    """Rank 0 leaves after the ranks it started: they end with the run (their collectives are
    bounded), and a caller that sees rank 0 end may start the next attempt at once."""
    for child in children:
        try:
            child.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


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
        run = self.run
        for fetched in self.data.shares(run.progress.epoch, run.progress.position, run.rank, run.world_size):
            self.pending.append((fetched.ids, fetched.padded))
            yield fetched.batch


class RecoveryCallback(pl.Callback):
    def __init__(self, run: RecoveryRun, data: KeyedData):
        self.run, self.data = run, data
        self.batches = KeyedBatches(run, data)
        self.stop_signals = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        """The run's own handlers (installed by open_run), put back over Lightning's."""
        self.window, self.loss = 0, None
        """Batches (and the sum of their losses) since the last optimizer step."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        signal.signal(signal.SIGTERM, self.stop_signals[0])
        signal.signal(signal.SIGINT, self.stop_signals[1])
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise UsageError(f"recovery.lightning takes one optimizer and at most one scheduler (configure_optimizers "
                             f"gave {len(trainer.optimizers)} and {len(trainer.lr_scheduler_configs)}); use the trainer's "
                             f"own loop (python -m trainer) for several")
        if trainer.world_size != self.run.world_size:
            raise UsageError(f"Lightning trains on {trainer.world_size} processes but the run was opened by "
                             f"{self.run.world_size}: call recovery.lightning.launch(trainer) before open_run")
        accumulate = trainer.accumulate_grad_batches
        if self.data.grad_accum not in (1, accumulate):
            raise UsageError(f"KeyedData(grad_accum={self.data.grad_accum}) but Lightning accumulates "
                             f"accumulate_grad_batches={accumulate}: leave grad_accum out, Lightning's is the run's")
        self.data = self.batches.data = replace(self.data, grad_accum=accumulate)  # fingerprinted: another is refused (65)
        schedulers = trainer.lr_scheduler_configs
        model = trainer.strategy.model  # DDP on several processes: the run gives it its exact reduction
        progress = self.run.restore(model if isinstance(model, DistributedDataParallel) else module, trainer.optimizers[0],
                                    schedulers[0].scheduler if schedulers else None, data=self.data)
        if progress.position % accumulate:  # a drift allowed (--allow-drift grad_accum) into a split window
            raise UsageError(f"accumulate_grad_batches={accumulate} does not divide the restored position "
                             f"({progress.position} batches into epoch {progress.epoch}): resume with the "
                             f"accumulation the run was saved with")
        loop = trainer.fit_loop
        for counter in (loop.epoch_progress.current, loop.epoch_progress.total):
            counter.ready = counter.started = counter.processed = counter.completed = progress.epoch
        steps = loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        steps.ready = steps.completed = progress.global_step
        loop.epoch_loop._batches_that_stepped = progress.global_step
        if loop._data_fetcher is not None:
            iter(loop._data_fetcher)  # made before the restore: its length, and the epoch's batches, from here

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        """After every batch: its samples to the ledger; after the batch that ended an
        accumulation window (`accumulate_grad_batches`; Lightning stepped the optimizer), the
        run's step over the window's batches, with the sum of their losses."""
        self.run.consumed(*self.batches.pending.popleft())
        loss = (outputs["loss"] if isinstance(outputs, dict) else outputs).detach()
        self.window, self.loss = self.window + 1, loss if self.loss is None else self.loss + loss
        if trainer.global_step == self.run.progress.global_step:
            return  # inside a window: Lightning did not step the optimizer
        self.run.window, loss, self.window, self.loss = self.window, self.loss, 0, None  # what step() counts
        self.run.step(loss)
