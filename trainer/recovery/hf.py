"""Hugging Face `transformers.Trainer` with the trainer's recovery (docs/library.md).

    with recovery.open_run("runs/hf", resume="auto") as run:
        trainer = Trainer(model, args, train_dataset=dataset)
        recovery.hf.train(trainer, run)

HF's own resume is exact (it skips the trained batches and restores the RNGs after fetching
the first one); what it lacks is a verified, atomic, signed checkpoint, a witness, and a
SIGTERM that saves the step reached and exits 75 instead of dying (143) or returning 0 with
mid-run weights. So HF keeps the loop and the data position, and `RecoveryCallback` replaces
its checkpoint files with our generations:

- at HF's save points (`save_steps`, `save_strategy`) and on our cadence, a generation of
  the model, optimizer, scheduler, RNGs and HF's `TrainerState`, written where HF would write
  its checkpoint-N directory (`Trainer._save_checkpoint`, after the step's log entry), which
  HF then no longer writes;
- every optimizer step feeds the witness (its digest: the step's loss, summed over its
  micro-batches as `training_step` returned them, and the parameters) and the preemption
  check (SIGTERM: save, then `Stopped`, exit 75, out of `trainer.train()`);
- the final generation is saved at the last step's save point, before `train()` appends its
  end-of-training summary (wall-clock runtimes) to `log_history`: an uninterrupted run and one
  resumed from its last step store the same `TrainerState`;
- on resume, `train` gives HF a `resume_from_checkpoint` directory holding only what HF reads
  before its loop (`trainer_state.json` at the restored step: the batches to skip, and the
  arguments HF checks it against), and the generation is restored into HF's live model,
  optimizer and scheduler at `on_train_begin`; HF's `rng_state.pth` is written from the
  restored RNGs, for HF to apply where it does.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.origin import missing_extra

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import TrainerState
except ModuleNotFoundError as error:
    raise missing_extra(error, "hf") from None

from trainer.parallel.ranks import StepAgreement
from trainer.data.keyed import UnkeyedData
from trainer.recovery.run import RecoveryRun

TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.pth"
HF_ORDER = UnkeyedData("Hugging Face Trainer's data order is its own (its sampler, its skip of the trained batches "
                       "on resume)")


def train(trainer: Trainer, run: RecoveryRun, **train_options):
    """`trainer.train()` saving into `run`'s generations and resuming from its newest one."""
    callback = RecoveryCallback(run, trainer)
    trainer.add_callback(callback)
    with tempfile.TemporaryDirectory(prefix="hf-resume-") as resume:
        if run.restoring_step is not None:
            callback.resume_dir = Path(resume)
            placeholder(trainer.args, run.restoring_step).save_to_json(str(callback.resume_dir / TRAINER_STATE))
            # The weights come from the generation (on_train_begin), not from files HF looks for here.
            trainer._load_from_checkpoint = lambda *args, **kwargs: None
        return trainer.train(resume_from_checkpoint=resume if run.restoring_step is not None else None,
                             **train_options)


def placeholder(args, step: int) -> TrainerState:
    """What HF reads of a checkpoint's `trainer_state.json` before its loop: the step (the
    batches to skip), and the values it warns about when they differ from `args` (the logging,
    evaluation and save intervals and the batch size, as given), which are then `args`' own.
    The generation's stored TrainerState replaces it at `on_train_begin`."""
    return TrainerState(global_step=step, train_batch_size=args.train_batch_size, logging_steps=args.logging_steps,
                        eval_steps=args.eval_steps, save_steps=args.save_steps)


PROCESS_FACTS = ("is_local_process_zero", "is_world_process_zero")
"""TrainerState fields that say which process holds it, not where training is: left out of the
stored state, which is the same on every rank (and stored once), and never restored."""


class HFTrainerState:
    """HF's `TrainerState` (step, epoch, log history, callbacks' state) as one stored JSON text.
    Empty until restored or trained, so a restore allocates it at its stored size."""

    def __init__(self, state: TrainerState):
        self.state, self.live = state, False

    def state_dict(self) -> dict:
        if not self.live:
            return {}
        values = {name: value for name, value in asdict(self.state).items() if name not in PROCESS_FACTS}
        text = json.dumps(values, sort_keys=True).encode()
        return {"json": torch.frombuffer(bytearray(text), dtype=torch.uint8)}

    def load_state_dict(self, stored: dict) -> None:
        values = json.loads(bytes(stored["json"].tolist()).decode())
        for name in (field.name for field in fields(TrainerState)):
            if name in values and name not in PROCESS_FACTS:
                setattr(self.state, name, values[name])
        self.live = True


class RecoveryCallback(TrainerCallback):
    """Counts and witnesses every step; saves where HF would write its checkpoint (after the
    step's log line, so the saved TrainerState holds it), through `trainer._save_checkpoint`."""

    def __init__(self, run: RecoveryRun, trainer: Trainer):
        self.run, self.trainer = run, trainer
        self.resume_dir: Path | None = None
        """Where `train` pointed HF's resume: HF reads the restored RNGs from here."""
        self.agreed: StepAgreement | None = None
        self.loss = None
        """The step's loss so far: the sum of what `training_step` returned for its micro-batches."""
        trainer._save_checkpoint = self.save_checkpoint  # HF's save point writes a generation instead
        training_step = trainer.training_step

        def counted(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            self.loss = loss if self.loss is None else self.loss + loss
            return loss

        trainer.training_step = counted

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        trainer_state = HFTrainerState(state)
        wrapped = self.trainer.model_wrapped  # DDP under torchrun: the run gives it its exact reduction
        self.run.restore(wrapped if isinstance(wrapped, DistributedDataParallel) else model,
                         unwrapped(optimizer, "optimizer"), unwrapped(lr_scheduler, "scheduler"), data=HF_ORDER,
                         shared_extras={"hf_trainer_state": trainer_state}, architecture=architecture(model))
        trainer_state.live = True
        if self.resume_dir is not None:
            rng_file = RNG_STATE if args.world_size == 1 else f"rng_state_{args.process_index}.pth"  # HF's names
            torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                        "cpu": torch.random.get_rng_state()}, self.resume_dir / rng_file)
            if state.global_step >= state.max_steps:
                self.run.save()  # restored at the last step: the final generation, before HF's summary

    def on_step_end(self, args, state, control, **kwargs):
        loss, self.loss = self.loss, None
        agreed = self.run.stepped(loss if loss is not None else 0.0)
        if (control.should_save or state.global_step >= state.max_steps) and not (agreed.recover or agreed.preempt):
            # HF's save point (its callback decided before this one) or the last step: a generation
            # even where tier 0 saves this step too, so the final one is saved before HF's summary.
            agreed = replace(agreed, recover=True)
        self.agreed = agreed
        if agreed.recover or agreed.preempt or agreed.memory or agreed.export:
            control.should_save = True  # HF logs the step, then calls save_checkpoint

    def save_checkpoint(self, model, trial=None) -> None:
        """In place of HF's checkpoint-N directory: the generation (or tier-0 save, or export)
        our cadence called for at this step, or a generation at HF's own save point."""
        self.trainer.store_flos()  # as HF's own save does: the FLOPs so far enter the saved state
        agreed = self.agreed
        if not (agreed.recover or agreed.preempt or agreed.memory or agreed.export):
            agreed = replace(agreed, recover=True)
        self.run.saved_on_cadence(agreed)


def unwrapped(wrapped, inner: str):
    """Accelerate's `AcceleratedOptimizer` / `AcceleratedScheduler` hold the torch object."""
    return getattr(wrapped, inner, wrapped)


def architecture(model) -> dict:
    """An export's config.json: the model's own config, loadable with `from_pretrained`."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    return {**config.to_dict(), "architectures": [type(model).__name__]}
