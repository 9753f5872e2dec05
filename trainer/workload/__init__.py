"""Workloads: the part of the trainer a user brings with `--workload MODULE:FACTORY`.

`protocol.Workload` is the interface; `example.ExampleWorkload` (an MLP on generated data) is
the default one; `loading` finds a factory. `build_workload` calls the factory and binds the
result: the optional hooks get their no-op defaults here, so the loop calls every hook
unconditionally and never asks what a workload implements.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import StoreConfig, WorkloadConfig
from trainer.errors import UsageError
from trainer.workload.loading import find_factory, first_line
from trainer.workload.protocol import TrainingSteps, Workload

__all__ = ["BoundWorkload", "TrainingSteps", "Workload", "build_workload"]

REQUIRED = ("build_dataset", "build_model", "build_optimizer", "build_scheduler", "loss", "architecture")
"""The protocol's methods without a default; the others are optional hooks."""


def build_workload(config: WorkloadConfig, store: StoreConfig = StoreConfig()) -> BoundWorkload:
    """The workload from its factory, handed its options and the trainer's settings it may
    read (`store_config`: the run's --store-* retries and timeouts, for data in an object
    store, `trainer.workload.objects.ObjectFiles`)."""
    found = find_factory(config.workload)
    options = {**found.defaults(), **dict(config.options)}
    trainer = {"seed": config.seed, "batch_size": config.batch_size, "grad_accum": config.grad_accum,
               "amp": config.amp, "epochs": config.epochs, "store_config": store}
    try:
        workload = found.factory(argparse.Namespace(**options, **trainer))
    except UsageError:
        raise
    except Exception as error:  # the factory refused its options (or failed): one line, as at import
        raise UsageError(f"--workload {config.workload}: its factory failed: {error.__class__.__name__}: "
                         f"{first_line(error)}; fix the option it names (see --workload "
                         f"{config.workload} --help)") from None
    if missing := [name for name in REQUIRED if not callable(getattr(workload, name, None))]:
        raise UsageError(f"--workload {config.workload} returned a {type(workload).__name__}, which lacks "
                         f"{', '.join(missing)}: the factory must return a Workload (trainer/workload/protocol.py)")
    return BoundWorkload(workload, found.source_files(), config.workload)



@dataclass(frozen=True)
class BoundWorkload:
    """A workload with every optional hook present."""

    workload: Workload
    source_files: tuple[Path, ...]
    """The workload's source outside the trainer package (hashed into `source`)."""
    spec: str = "the workload"
    """`--workload` as given, for error lines."""

    def build_dataset(self):
        return self.workload.build_dataset()

    def plan(self, steps: TrainingSteps) -> dict:
        """Tell a workload that plans the run's optimizer steps; returns what that adds to the
        fingerprint's `config` (the total shapes its schedule), nothing for one that does not."""
        hook = getattr(self.workload, "plan", None)
        if hook is None:
            return {}
        hook(steps)
        return {"total_steps": steps.total}

    def build_model(self):
        return self.workload.build_model()

    def build_optimizer(self, model):
        """One optimizer, or several by name (a dict); refused here, before the first step,
        when its state could not be saved or restored."""
        optimizer = self.workload.build_optimizer(model)
        optimizers = by_name(optimizer, torch.optim.Optimizer, "build_optimizer", "torch.optim.Optimizer", self.spec)
        for optimizer_of_name in optimizers.values():
            refuse_foreign_tensors(optimizer_of_name, model, self.spec)
        refuse_shared_parameters(optimizers, self.spec)
        return optimizer

    def build_scheduler(self, optimizer):
        """Given what `build_optimizer` returned; one scheduler, or several by name."""
        scheduler = self.workload.build_scheduler(optimizer)
        by_name(scheduler, torch.optim.lr_scheduler.LRScheduler, "build_scheduler",
                "torch.optim.lr_scheduler.LRScheduler", self.spec)
        return scheduler

    @property
    def has_train_step(self) -> bool:
        """Whether the workload runs its own step (`train_step`) instead of `loss`."""
        return callable(getattr(self.workload, "train_step", None))

    def train_step(self, model, optimizer, batches, tools):
        return self.workload.train_step(model, optimizer, batches, tools)

    def refuse_inexpressible(self, optimizer, scaling: bool, world_size: int) -> None:
        """What the trainer's own step cannot run, said before the first step: a closure
        optimizer (LBFGS) needs the workload's `train_step`, and a GradScaler (AMP on CUDA)
        cannot step one at all. A `train_step` runs in one process only: its forward passes
        may reach the modules inside DDP's wrapper (a GAN's two networks), whose gradients
        would then never be reduced across ranks, silently; no test proves it otherwise yet."""
        if self.has_train_step and world_size > 1:
            raise UsageError(f"--workload {self.spec}: train_step runs in one process only (a forward pass that "
                             f"bypasses the DDP/FSDP wrapper would leave each rank with its own gradients): run it "
                             f"without torchrun, or use loss(model, batch)")
        optimizers = dict(optimizer) if isinstance(optimizer, Mapping) else {"": optimizer}
        for name, each in optimizers.items():
            if not needs_closure(each):
                continue
            called = f"{type(each).__name__}" + (f" {name!r}" if name else "")
            if not self.has_train_step:
                raise UsageError(f"--workload {self.spec}: the optimizer {called} needs a closure, which the "
                                 f"trainer's own step cannot give: define train_step(model, optimizers, batches, "
                                 f"step) and call step.step(optimizer, closure) (see docs/workloads.md, 'The protocol')")
            if scaling:
                raise UsageError(f"--workload {self.spec}: the optimizer {called} needs a closure, which "
                                 f"GradScaler (--amp on CUDA) cannot step: run without --amp")

    def loss(self, model, batch):
        return self.workload.loss(model, batch)

    def architecture(self) -> dict:
        return self.workload.architecture()

    def after_backward(self, model, optimizer) -> None:
        self._optional("after_backward", model, optimizer)

    def after_step(self, model, optimizer) -> None:
        self._optional("after_step", model, optimizer)

    def adopt_config(self, optimizer, scheduler) -> None:
        self._optional("adopt_config", optimizer, scheduler)

    @property
    def adopts_config(self) -> bool:
        """Whether the workload makes an allowed config change take effect on restored state."""
        return callable(getattr(self.workload, "adopt_config", None))

    def stateful(self) -> dict:
        hook = getattr(self.workload, "stateful", None)
        return dict(hook()) if hook is not None else {}

    def _optional(self, name: str, *args) -> None:
        hook = getattr(self.workload, name, None)
        if hook is not None:
            hook(*args)


def refuse_foreign_tensors(optimizer, model, spec: str) -> None:
    """Refuse, before the first step, an optimizer that holds a tensor which is not a
    parameter of the model: a save stores optimizer state by model parameter name, so that
    tensor's state has no name and the first save would fail after training (DCP's
    KeyError). A model parameter the optimizer does not hold is fine (it is saved, not
    trained)."""
    own = {id(parameter) for parameter in model.parameters()}
    foreign = [(index, tuple(tensor.shape)) for group in optimizer.param_groups
               for index, tensor in enumerate(group["params"]) if id(tensor) not in own]
    if foreign:
        index, shape = foreign[0]
        raise UsageError(f"--workload {spec}: build_optimizer gave the optimizer {len(foreign)} tensor(s) that are "
                         f"not parameters of the model (the first: a {shape} tensor); their state could not be "
                         f"saved: make each one an nn.Parameter of the model built by build_model "
                         f"(e.g. model.temperature = nn.Parameter(...)) and pass model.parameters()")


def by_name(built, kind: type, hook: str, expected: str, spec: str) -> dict:
    """`built` as {name: object}, after checking it is one `kind` or a non-empty dict of them
    with string names (a list is refused: names are what the state is saved under)."""
    if isinstance(built, Mapping) and built and all(isinstance(name, str) and name and isinstance(value, kind)
                                                    for name, value in built.items()):
        return dict(built)
    if isinstance(built, kind):
        return {"": built}
    raise UsageError(f"--workload {spec}: {hook} returned a {type(built).__name__}; return one {expected}, or a "
                     f"dict of them by name ({{'generator': ..., 'discriminator': ...}}): the names are what "
                     f"their state is saved under")


def refuse_shared_parameters(optimizers: dict, spec: str) -> None:
    """A parameter held by two optimizers would be stepped twice and saved under two names."""
    holder: dict[int, str] = {}
    for name, optimizer in optimizers.items():
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                other = holder.setdefault(id(parameter), name)
                if other != name:
                    raise UsageError(f"--workload {spec}: build_optimizer gave a {tuple(parameter.shape)} "
                                     f"parameter to both {other!r} and {name!r}; give each parameter to one "
                                     f"optimizer")


def needs_closure(optimizer) -> bool:
    """Whether `optimizer.step` cannot be called without a closure (LBFGS)."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def dataset_fingerprint(dataset) -> str:
    """The fingerprint's `dataset` field: the dataset's own `fingerprint()`, or, without one,
    its class and length (changed data of the same length then goes unnoticed)."""
    own = getattr(dataset, "fingerprint", None)
    if own is not None:
        return own()
    kind = type(dataset)
    return f"unfingerprinted:{kind.__module__}.{kind.__qualname__}:len={len(dataset)}"
