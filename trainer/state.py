"""What is captured and restored: the complete, deterministic training state.

Only values that two equal trainings share go here (no wall-clock times, hosts or attempt
ids: those live in manifests and attempt records), so equal trainings give equal snapshots.
RNG states are restored last because building the model and optimizer consumes randomness.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

RNG_KINDS = ("python", "numpy", "torch", "cuda")


@dataclass
class Progress:
    """Where training stands: optimizer steps done, current epoch, batches done in it."""

    global_step: int = 0
    epoch: int = 0
    position: int = 0

    def advance(self, batches_per_epoch: int) -> bool:
        """Count one optimizer step; True when it completed an epoch."""
        self.global_step += 1
        self.position += 1
        if self.position < batches_per_epoch:
            return False
        self.epoch += 1
        self.position = 0
        return True


@dataclass
class History:
    """Per-step metrics, saved so a resumed run's record equals an uninterrupted one."""

    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"loss": torch.tensor(self.loss, dtype=torch.float64),
                "lr": torch.tensor(self.lr, dtype=torch.float64)}

    def load_state_dict(self, stored: dict) -> None:
        self.loss = stored["loss"].tolist()
        self.lr = stored["lr"].tolist()


def capture_rng() -> dict:
    """Every global RNG, as tensors and plain numbers (comparable bit for bit)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return states


def restore_rng(states: dict, skip: frozenset[str] = frozenset()) -> None:
    """Set every global RNG from `states`; `skip` exists only for the test that proves each
    RNG matters (leaving one out must make the resumed run differ)."""
    if "python" not in skip:
        py = states["python"]
        random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    if "numpy" not in skip:
        npy = states["numpy"]
        keys = npy["keys"].numpy().astype(np.uint32)
        np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    if "torch" not in skip:
        torch.set_rng_state(states["torch"])
    if "cuda" not in skip and "cuda" in states:
        torch.cuda.set_rng_state_all([states["cuda"][str(i)] for i in range(len(states["cuda"]))])


@dataclass
class TrainingState:
    """The Stateful bundle handed to the recovery writer and restored from a generation."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    progress: Progress = field(default_factory=Progress)
    history: History = field(default_factory=History)

    def state_dict(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optim": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": {"global_step": self.progress.global_step, "epoch": self.progress.epoch,
                         "position": self.progress.position},
            "history": self.history.state_dict(),
            "rng": capture_rng(),
        }

    def template(self, stored_entries: dict) -> dict:
        """A state dict shaped like the stored one, for DCP to load into: model and
        optimizer tensors from the live objects (which initializes optimizer state), and
        history sized from the snapshot's metadata."""
        template = self.state_dict()
        for name in template["history"]:
            size = stored_entries[f"history.{name}"].size
            template["history"][name] = torch.empty(size, dtype=torch.float64)
        if "rng.cuda.0" not in stored_entries:
            template["rng"].pop("cuda", None)
        return template

    def load_state_dict(self, stored: dict, skip_rng: frozenset[str] = frozenset()) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=stored["model"],
                       optim_state_dict=stored["optim"])
        self.scheduler.load_state_dict(stored["scheduler"])
        if stored["scaler"]:  # empty when AMP is off
            self.scaler.load_state_dict(stored["scaler"])
        self.progress = Progress(**stored["progress"])
        self.history.load_state_dict(stored["history"])
        restore_rng(stored["rng"], skip_rng)  # last: everything above may consume randomness
