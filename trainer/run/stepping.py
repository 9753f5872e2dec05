"""One optimizer step from a window of micro-batches (gradient accumulation).

The loop opens a window, feeds it `--grad-accum` micro-batches (fewer at the end of an
epoch), and closes it with `step()`. Each micro-batch's loss is weighted 1/window, so the
window's gradients are the mean over its micro-batches; the workload's `after_backward` hook
sees true gradients (after the scaler unscales them under AMP), and the LR schedule moves
once per optimizer step.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer import seams
from trainer.run.fetching import to_device
from trainer.run.state import TrainingState
from trainer.workload import BoundWorkload


class OptimizerSteps:
    def __init__(self, workload: BoundWorkload, state: TrainingState, trained: nn.Module, device: torch.device,
                 amp: bool):
        self.workload, self.state, self.trained, self.device, self.amp = workload, state, trained, device, amp
        self.autocast_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.micro_batches = 0
        """Micro-batches this attempt has trained on (for a test seam)."""

    def open_window(self, size: int) -> int:
        """Start accumulating `size` micro-batches; returns `size`. Every gradient of the
        model is cleared, not only the optimizer's: a parameter the optimizer does not hold
        would otherwise carry gradients over from earlier steps (into gradient clipping, say),
        which a resumed process, starting with none, could not repeat."""
        self.state.optimizer.zero_grad(set_to_none=True)
        self.state.model.zero_grad(set_to_none=True)
        return size

    def micro_batch(self, batch, window: int) -> torch.Tensor:
        """Forward and backward of one micro-batch of a `window`; returns its weighted loss."""
        state = self.state
        batch = to_device(batch, self.device)
        state.model.train()
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.amp):
            loss = self.workload.loss(self.trained, batch)
        if window > 1:
            loss = loss / window
        state.scaler.scale(loss).backward()
        self.micro_batches += 1
        seams.micro_batch_done(self.micro_batches)
        return loss.detach()

    def step(self) -> float:
        """Close the window: the optimizer step, the hooks around it, the scheduler step.
        Returns the learning rate the step used."""
        state, workload = self.state, self.workload
        state.scaler.unscale_(state.optimizer)  # the hook sees true gradients (a no-op without AMP)
        workload.after_backward(state.model, state.optimizer)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        workload.after_step(state.model, state.optimizer)
        lr = state.scheduler.get_last_lr()[0]
        state.scheduler.step()
        return lr
