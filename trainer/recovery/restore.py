"""Restore: the mirror of a save. A verified generation goes back into the live state.

`restore()` is the one entry point. It asks the state for a template shaped like what the
generation stored (tensors pre-allocated from the live model and optimizer), refuses a
template whose tensor shapes differ from the stored ones (an allowed config drift that
changed the model: one line instead of a DCP size-mismatch traceback), loads the snapshot
with DCP into the template, and hands it to the state, which restores its RNGs last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from trainer import compat
from trainer.errors import FingerprintMismatch
from trainer.recovery.atomic import manifest_digest
from trainer.recovery.manifest import Manifest, Verification
from trainer.recovery.snapshot import load_snapshot, stored_entries


class Restorable(Protocol):
    """What a restore fills: `trainer.state.TrainingState` satisfies it."""

    def template(self, stored_entries: dict) -> dict:
        """A state dict shaped like the stored one, for DCP to load into."""

    def load_state_dict(self, stored: dict) -> None:
        """Take the loaded values; restore RNGs last."""


@dataclass(frozen=True)
class Restored:
    name: str
    step: int
    manifest: Manifest
    manifest_sha256: str
    """sha256 of the manifest file: names exactly which sealed content was restored."""
    load_s: float
    """Seconds from reading the metadata to the state holding the stored values."""


def restore(generation: Verification, state: Restorable) -> Restored:
    """Load a verified generation into `state`; raises FingerprintMismatch (65) if the live
    tensors have other shapes than the stored ones."""
    started = time.monotonic()
    stored = stored_entries(generation.path)
    template = state.template(stored)
    refuse_shape_changes(generation.name, template, stored)
    load_snapshot(template, generation.path)
    state.load_state_dict(template)
    manifest = generation.manifest
    return Restored(generation.name, manifest.step, manifest, manifest_digest(generation.path),
                    time.monotonic() - started)


def refuse_shape_changes(generation: str, template: dict, stored: dict) -> None:
    """An allowed config drift that changes tensor shapes cannot be restored: say so in one
    line instead of letting DCP fail with a size-mismatch traceback."""
    for key, value in compat.flatten_state_dict(template).items():
        entry = stored.get(key)
        if isinstance(value, torch.Tensor) and entry is not None and hasattr(entry, "size") \
                and tuple(entry.size) != tuple(value.shape):
            raise FingerprintMismatch(f"{generation} cannot be restored into this model: {key} is "
                                      f"{tuple(entry.size)} there, {tuple(value.shape)} here; a shape-changing "
                                      f"drift cannot be allowed, start a new --output instead")
