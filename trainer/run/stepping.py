"""One optimizer step from a window of micro-batches (gradient accumulation).

The loop opens a window, feeds it `--grad-accum` micro-batches (fewer at the end of an
epoch), and closes it with `step()`. Each micro-batch's loss is weighted 1/window, so the
window's gradients are the mean over its micro-batches; the workload's `after_backward` hook
sees true gradients (after the scaler unscales them under AMP), and every LR schedule moves
once per optimizer step.

A workload with its own `train_step(model, optimizers, batches, step)` (a GAN's two
updates, distillation, a closure optimizer) gets the window's micro-batches at once, on the
device, and a `StepTools` that keeps what the trainer owns: autocast, the 1/window weight
and the scaler in `backward`, unscaling and the `after_backward` hook in `step`. The trainer
still clears gradients, updates the scaler, calls `after_step`, steps every scheduler, and
saves only between windows.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from trainer import seams
from trainer.data.fetching import to_device
from trainer.run.state import TrainingState, named
from trainer.workload import BoundWorkload


class StepTools:
    """What a custom `train_step` calls instead of `loss.backward()` and `optimizer.step()`."""

    def __init__(self, steps: OptimizerSteps, window: int):
        self._steps, self.window = steps, window
        self.stepped: list[torch.optim.Optimizer] = []

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision as the trainer runs it (--amp), a no-op otherwise."""
        steps = self._steps
        return torch.autocast(steps.device.type, dtype=steps.autocast_dtype, enabled=steps.amp)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss` of one micro-batch, weighted 1/window and scaled under AMP."""
        self._steps.state.scaler.scale(loss / self.window if self.window > 1 else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, closure=None):
        """Unscale, the workload's `after_backward(model, optimizer)` (clipping), then the step;
        a closure optimizer (LBFGS) re-evaluates through `closure`, the hook after each call."""
        steps = self._steps
        state = steps.state
        if closure is None:
            state.scaler.unscale_(optimizer)
            steps.workload.after_backward(state.model, optimizer)
            result = state.scaler.step(optimizer)
        else:
            def evaluated():
                value = closure()
                steps.workload.after_backward(state.model, optimizer)
                return value
            result = state.scaler.step(optimizer, evaluated)
        self.stepped.append(optimizer)
        return result


@contextlib.contextmanager
def buffers_kept(model: nn.Module, keep: bool):
    """With `keep`, the model's buffers (BatchNorm's running statistics and its count) are put
    back after the forward and backward (autograd checks the versions of what the forward
    saved, running statistics included, until then): a padded share (weight 0, `--last-batch pad`) adds nothing to the
    gradient, and so nothing to the statistics either."""
    kept = [(buffer, buffer.detach().clone()) for buffer in model.buffers()] if keep else []
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


class OptimizerSteps:
    def __init__(self, workload: BoundWorkload, state: TrainingState, trained: nn.Module, device: torch.device,
                 amp: bool):
        self.workload, self.state, self.trained, self.device, self.amp = workload, state, trained, device, amp
        self.autocast_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.micro_batches = 0
        """Micro-batches this attempt has trained on (for a test seam)."""
        self.window, self.held, self.loss = 0, [], None

    def open_window(self, size: int) -> int:
        """Start accumulating `size` micro-batches; returns `size`. Every gradient of the
        model is cleared, not only the optimizers': a parameter no optimizer holds would
        otherwise carry gradients over from earlier steps (into gradient clipping, say),
        which a resumed process, starting with none, could not repeat."""
        for optimizer in named(self.state.optimizer).values():
            optimizer.zero_grad(set_to_none=True)
        self.state.model.zero_grad(set_to_none=True)
        self.window, self.held, self.loss = size, [], None
        return size

    def micro_batch(self, batch, weight: float = 1.0) -> None:
        """One micro-batch of the window: forward and backward now, or held for the
        workload's own `train_step`. `weight`: its share's loss weight (an epoch's last batch
        shared unevenly, `trainer.data.order.EpochShape.weight`; a `train_step` workload is
        refused such shares at start)."""
        batch = to_device(batch, self.device)
        self.state.model.train()
        if self.workload.has_train_step:
            self.held.append(batch)
        else:
            with buffers_kept(self.state.model, weight == 0.0):
                with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.amp):
                    loss = self.workload.loss(self.trained, batch)
                if self.window > 1:
                    loss = loss / self.window
                if weight != 1.0:
                    loss = loss * weight
                self.state.scaler.scale(loss).backward()
            self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
        self.micro_batches += 1
        seams.micro_batch_done(self.micro_batches)

    def step(self) -> tuple[torch.Tensor, float]:
        """Close the window: the optimizer steps, the hooks around them, the scheduler steps.
        Returns the window's loss and the learning rate the step used."""
        state, workload = self.state, self.workload
        if workload.has_train_step:
            tools = StepTools(self, self.window)
            loss = torch.as_tensor(workload.train_step(self.trained, state.optimizer, self.held, tools)).detach()
        else:
            for optimizer in named(state.optimizer).values():
                state.scaler.unscale_(optimizer)  # the hook sees true gradients (a no-op without AMP)
            workload.after_backward(state.model, state.optimizer)
            for optimizer in named(state.optimizer).values():
                state.scaler.step(optimizer)
            loss = self.loss
        state.scaler.update()
        workload.after_step(state.model, state.optimizer)
        schedulers = list(named(state.scheduler).values())
        lr = schedulers[0].get_last_lr()[0]
        for scheduler in schedulers:
            scheduler.step()
        self.held = []
        return loss, lr
