"""Restore: the mirror of a save. A verified generation goes back into the live state.

`restore()` is the one entry point. It asks the state for a template shaped like what the
generation stored (tensors pre-allocated from the live model and optimizer), refuses a
template whose tensor shapes differ from the stored ones (an allowed config drift that
changed the model: one line instead of a DCP size-mismatch traceback), refuses a template
whose keys differ from the stored ones (DCP would silently skip a stored entry the template
lacks, and training would go on with that part fresh), loads the snapshot with DCP into the
template, and hands it to the state, which restores its RNGs last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from trainer import compat
from trainer.errors import FingerprintMismatch
from trainer.checkpoint.atomic import manifest_digest
from trainer.checkpoint.device_copy import DeviceCopies
from trainer.checkpoint.manifest import Manifest, Verification
from trainer.checkpoint.snapshot import load_snapshot, stored_entries


class Restorable(Protocol):
    """What a restore fills: `trainer.run.state.TrainingState` satisfies it."""

    def template(self, stored_entries: dict) -> dict:
        """A state dict shaped like the stored one, for DCP to load into."""

    def load_state_dict(self, stored: dict) -> None:
        """Take the loaded values; restore RNGs last."""

    def unread_by_design(self, stored_key: str) -> bool:
        """A stored entry the template leaves out on purpose (another rank's RNG or data
        position, a CUDA RNG on a machine without CUDA)."""


@dataclass(frozen=True)
class Restored:
    name: str
    step: int
    manifest: Manifest
    manifest_sha256: str
    """sha256 of the manifest file: names exactly which sealed content was restored."""
    load_s: float
    """Seconds from reading the metadata to the state holding the stored values."""


def restore(generation: Verification, state: Restorable, alone: bool | None = None) -> Restored:
    """Load a verified generation into `state`; raises FingerprintMismatch (65) if the live
    tensors have other shapes than the stored ones. `alone`: a snapshot of this rank's own (a
    tier-0 part), read without the other ranks."""
    if generation.shards_pending:  # its shards' digest is unchecked: only onepass.load_verified may load it
        raise AssertionError(f"{generation.name} was verified without its shards; load it with load_verified")
    return restored_by(generation, state, lambda template, directory: load_snapshot(template, directory, alone))


def restored_by(generation: Verification, state: Restorable, load: Callable[[dict, Path], None]) -> Restored:
    """`load_into` with `load`, timed."""
    started = time.monotonic()
    load_into(generation.name, generation.path, state, load)
    manifest = generation.manifest
    return Restored(generation.name, manifest.step, manifest, manifest_digest(generation.path),
                    time.monotonic() - started)


def load_into(name: str, directory: Path, state: Restorable,
              load: Callable[[dict, Path], None] = load_snapshot) -> None:
    """Template, checks, DCP load (`load`: onepass's hashes the shards as it reads them),
    hand-over: every stored entry is read, or nothing is."""
    stored = stored_entries(directory)
    template = state.template(stored)
    refuse_shape_changes(name, template, stored)
    refuse_unmatched_keys(name, compat.flatten_state_dict(template), stored, state.unread_by_design)
    copies = DeviceCopies(template)  # device tensors: loaded on the host, copied in one batch
    load(copies.template, directory)
    state.load_state_dict(copies.copy_back())


SHOWN_KEYS = 3


def refuse_unmatched_keys(generation: str, template: dict, stored: dict, unread_by_design) -> None:
    """Strict restore: every stored entry is read and every expected one is present.
    DCP loads only the keys the template has, so a stored entry the live state does not
    expect (optimizer state an optimizer creates lazily, extra workload state the code no
    longer declares) would be skipped without a word and training would continue with that
    part fresh; an expected key that was never stored would fail deep inside DCP."""
    unread = sorted(key for key in stored if key not in template and not unread_by_design(key))
    missing = sorted(key for key in template if key not in stored)
    if not unread and not missing:
        return
    parts = []
    if unread:
        parts.append(f"{len(unread)} stored entries this model, optimizer or workload would not read "
                     f"({_some(unread)})")
    if missing:
        parts.append(f"{len(missing)} entries it expects are not stored ({_some(missing)})")
    hint = ""
    if any(key.startswith("optim.state.") for key in unread):
        hint = ("; the optimizer has no state before its first real step (it creates it lazily, as an "
                "accumulating wrapper does) and cannot be restored exactly")
    raise FingerprintMismatch(f"{generation} does not match the live training state: {'; '.join(parts)}{hint}; "
                              f"resume with the code and options that wrote it, or start a new --output")


def _some(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f", … {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")


def refuse_shape_changes(generation: str, template: dict, stored: dict) -> None:
    """An allowed config drift that changes tensor shapes cannot be restored: say so in one
    line instead of letting DCP fail with a size-mismatch traceback."""
    for key, value in compat.flatten_state_dict(template).items():
        entry = stored.get(key)
        if isinstance(value, torch.Tensor) and entry is not None and hasattr(entry, "size") \
                and tuple(entry.size) != tuple(value.shape):
            if key.startswith("workload."):
                raise FingerprintMismatch(lazily_shaped_extra(generation, key, tuple(entry.size), tuple(value.shape)))
            raise FingerprintMismatch(f"{generation} cannot be restored into this model: {key} is "
                                      f"{tuple(entry.size)} there, {tuple(value.shape)} here; a shape-changing "
                                      f"drift cannot be allowed, start a new --output instead")


def lazily_shaped_extra(generation: str, key: str, stored: tuple, built: tuple) -> str:
    """A workload's extra state (`stateful()`) restores in place into tensors of the shape
    it has when built; one that gets its shape later (an EMA allocated at the first step)
    cannot take the stored values."""
    name = key.split(".")[1]
    return (f"{generation} cannot be restored: the workload's stateful() extra {name!r} ({key}) is {stored} in the "
            f"generation but {built} when built; allocate it at its final shape in build_model or the factory "
            f"(not at the first step), so it restores in place")
