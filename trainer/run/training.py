"""The live training state of one attempt, and its optimizer steps in order.

`build_training` makes the state the loop trains and saves; `train_steps` yields once per
optimizer step, after the ranks agreed on it, so the loop decides what each step leads to
(record, save, stop) and the accumulation of micro-batches stays out of its way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from trainer import compat
from trainer.config import RunConfig
from trainer.parallel.ranks import Ranks, StepAgreement
from trainer.data.order import EpochShape, epoch_shape, training_steps
from trainer.run.cadence import StepPoint
from trainer.data.fetching import refuse_state_moved_by_fetching
from trainer.run.readback import StepReadback
from trainer.run.saving import CadencedSaves
from trainer.run.state import TrainingState
from trainer.run.stepping import OptimizerSteps
from trainer.data.source import DataSource, cursors
from trainer.workload import BoundWorkload


@dataclass(frozen=True)
class Training:
    config: RunConfig
    ranks: Ranks
    state: TrainingState
    steps: OptimizerSteps
    shape: EpochShape
    """An epoch's batches (`--last-batch`)."""
    total_steps: int
    parameters: list
    """This rank's parameters, listed once, for the per-step checksum (`StepReadback`)."""


@dataclass(frozen=True)
class StepDone:
    step: int
    agreed: StepAgreement
    """What every rank does after the step (its loss and digest are read a step later:
    `StepReadback`)."""


def build_training(config: RunConfig, workload: BoundWorkload, ranks: Ranks, dataset: DataSource) -> Training:
    """The live state, and the module to run forward/backward through: the model itself,
    DDP around it, or (under FSDP) the same module sharded in place, which is why the
    optimizer is built after wrapping. What the trainer's step cannot run, and workload
    state that would move inside DataLoader workers, are refused here, before the first step."""
    samples = len(dataset)
    device = ranks.device
    model = workload.build_model().to(device)
    trained: nn.Module = ranks.data_parallel(model, config.workload.data_parallel,
                                               config.workload.gradient_reduction)
    optimizer = workload.build_optimizer(model)
    scheduler = workload.build_scheduler(optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=config.workload.amp and device.type == "cuda")
    workload.refuse_inexpressible(optimizer, scaler.is_enabled(), ranks.world_size)
    # A compiled model (torch.compile) is saved and exported under the model's own names.
    state = TrainingState(compat.uncompiled(model), optimizer, scheduler, scaler, rank=ranks.rank,
                          world_size=ranks.world_size, extras=workload.stateful(),
                          cursors=cursors(dataset, epoch_shape(samples, config.workload), ranks.world_size))
    refuse_state_moved_by_fetching(state.extras, dataset, config.workload, workload.spec)
    steps = OptimizerSteps(workload, state, trained, device, config.workload.amp)
    return Training(config, ranks, state, steps, epoch_shape(samples, config.workload),
                    training_steps(samples, config.workload).total,
                    list(model.parameters()))


def epoch_batches(training: Training, dataset: DataSource):
    """This rank's micro-batches (`Fetched`) for the rest of the current epoch."""
    config, progress, ranks = training.config.workload, training.state.progress, training.ranks
    return dataset.loader(training.shape, progress.epoch, progress.position, ranks.rank, ranks.world_size,
                          config.num_workers)


def train_steps(training: Training, dataset: DataSource, saves: CadencedSaves,
                readback: StepReadback) -> Iterator[StepDone]:
    """Every remaining optimizer step of the run. Micro-batches accumulate into windows of
    --grad-accum; an epoch's last window may be shorter. A step is yielded only once its
    window is complete, so saves and stops never see partial gradients. Every batch's sample
    ids go to the ledger, and its loss weight to the step (`--last-batch pad`). The loop acts
    on each step (records, saves, stops) before the agreement on the next one starts."""
    state, steps, accumulate = training.state, training.steps, training.config.workload.grad_accum
    saves.memory.fits(state.estimated_bytes)  # a tier 0 that cannot hold this state: refused before the first step
    if state.progress.global_step < training.total_steps:  # the first step's decisions, started after the restore
        readback.vote()
    while state.progress.global_step < training.total_steps:
        window, seen = 0, 0
        for fetched in epoch_batches(training, dataset):
            if seen == 0:
                saves.wait_for_staging()  # the staged copy must be complete before parameters change
                window = steps.open_window(min(accumulate, training.shape.batches - state.progress.position))
            steps.micro_batch(fetched.batch, fetched.weight)
            saves.ledger.consumed(fetched.ids, fetched.padded)
            seen += 1
            if seen < window:
                continue
            loss, lr = steps.step()
            epoch_completed = state.progress.advance(window, training.shape.batches)
            step = state.progress.global_step
            agreed = readback.stepped(StepPoint(step, state.progress.epoch, epoch_completed), loss, lr)
            seen = 0
            yield StepDone(step, agreed)
            if step >= training.total_steps:  # --max-steps may end the run inside an epoch
                return
            readback.vote()
