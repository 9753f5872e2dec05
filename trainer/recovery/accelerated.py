"""Accelerate's `save_state` / `load_state` through the trainer's generations (docs/library.md).

    with recovery.open_run("runs/acc", resume="auto") as run:    # first: it joins the process group
        accelerator = Accelerator(cpu=True)      # on a CPU host; Accelerator() there is not distributed
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        accelerated.load_state(accelerator, run, data=recovery.KeyedData(dataset, batch_size=16, seed=0),
                               model=model)       # the DDP wrapper: exact at 3 ranks or more
        for epoch in run.epochs(8):
            for x, y in accelerated.batches(accelerator, run):  # on accelerator.device
                loss = nn.functional.mse_loss(model(x), y) * run.weight
                accelerator.backward(loss); optimizer.step(); scheduler.step(); optimizer.zero_grad()
                run.step(loss)

What `accelerator.prepare` and `register_for_checkpointing` hold (the model, optimizer and
scheduler, the GradScaler of mixed precision, the registered objects) becomes the run's state,
restored in place from the newest verified generation; `save_state` writes a generation of it.
Accelerate's own resume is not exact (a skipping DataLoader draws a new shuffle; with a
seedable sampler creating its iterator takes a draw from the restored RNG): read the data
through `batches(accelerator, run)` (the trainer's keyed order, on `accelerator.device` as a
prepared DataLoader's batches are) instead of a prepared DataLoader.

On several processes (under torchrun) `KeyedData.batch_size` is the global
batch and each rank trains its share of it, as Accelerate's `split_batches=True` has it: so
the prepared scheduler steps once per optimizer step (Accelerate steps it once per process
otherwise, for a prepared DataLoader whose length shrinks with the number of processes). The
prepared DDP model is handed to the run, which gives it the trainer's exact gradient reduction.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.origin import missing_extra

try:
    from accelerate import Accelerator
    from accelerate.utils import send_to_device
except ModuleNotFoundError as error:
    raise missing_extra(error, "accelerate") from None

from trainer.errors import UsageError
from trainer.data.keyed import KeyedData
from trainer.recovery.run import RecoveryRun
from trainer.run.state import Progress


def load_state(accelerator: Accelerator, run: RecoveryRun, data: KeyedData | None = None,
               model: nn.Module | None = None) -> Progress:
    """`accelerator.load_state()` from the run's newest verified generation (a fresh start: the
    state as prepared); call it once, after `accelerator.prepare`. Returns where to continue.
    `model`: the model as `prepare` returned it; on several processes its DDP wrapper, which
    the run gives the trainer's exact reduction (Accelerate keeps only the unwrapped one), and
    required there: without it, one line and exit 2."""
    if accelerator.num_processes != run.world_size:
        raise UsageError(f"accelerator.num_processes is {accelerator.num_processes} but the run has {run.world_size} "
                         f"ranks: the ranks would train unsynchronised; on a CPU host create the accelerator with "
                         f"Accelerator(cpu=True) (Accelerator() there is not distributed)")
    models, optimizers, schedulers = accelerator._models, accelerator._optimizers, accelerator._schedulers
    if len(models) != 1 or len(optimizers) != 1 or len(schedulers) > 1:
        raise UsageError(f"accelerated.load_state takes one prepared model and optimizer and at most one scheduler "
                         f"(prepared: {len(models)}, {len(optimizers)}, {len(schedulers)}); prepare them in one "
                         f"accelerator.prepare(model, optimizer[, scheduler]) call")
    if run.world_size > 1 and not isinstance(model, DistributedDataParallel):
        raise UsageError(f"accelerated.load_state on {run.world_size} processes needs model=, the model as "
                         f"accelerator.prepare returned it (its DistributedDataParallel wrapper, which Accelerate does "
                         f"not keep): without it the run cannot give the ranks its exact reduction, and the resume "
                         f"would not be exact")
    if data is not None and schedulers:
        schedulers[0].split_batches = True  # one step per optimizer step: see the module's docstring
    extras = {f"registered_{index}": kept for index, kept in enumerate(accelerator._custom_objects)}
    model = model if isinstance(model, DistributedDataParallel) else accelerator.unwrap_model(models[0])
    return run.restore(model, optimizers[0].optimizer,
                       schedulers[0].scheduler if schedulers else None, scaler=accelerator.scaler, data=data,
                       extras=extras)


def save_state(run: RecoveryRun) -> None:
    """`accelerator.save_state()`: a generation of everything `load_state` handed over."""
    run.save()


def batches(accelerator: Accelerator, run: RecoveryRun) -> Iterator:
    """`run.batches()` moved to `accelerator.device`, as a prepared DataLoader yields them: the
    keyed order is fetched on the CPU (in worker processes, with `num_workers`)."""
    for batch in run.batches():
        yield send_to_device(batch, accelerator.device, non_blocking=accelerator.non_blocking)
