"""Claiming the run directory (rank 0): hold it, choose the generation to restore, verify it.

The order is the contract: hold (flock or lease, so a second writer is refused with 73 before
anything is read), choose (66 or 73 before anything is deleted), know the run's identity (what
a generation must belong to: created with the run directory), let the backend go ahead
(an object store's uncommitted leftovers go), verify and fetch the choice (65 names the way
back), then remove stale temporaries.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from trainer.checkpoint.atomic import manifest_digest
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.resume import choose_candidate
from trainer.config import RunConfig
from trainer.layout import RunDirectory
from trainer.storage.base import NOTHING_MOVED, RunStorage, Transfer

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Claim:
    """What rank 0 found once it held the run directory, handed to every rank."""

    run: RunDirectory
    attempt_id: str
    generation: Verification | None
    """The verified generation to restore (None: a fresh start)."""
    verify_s: float
    manifest_sha256: str | None = None
    """Of the generation to restore: names exactly which sealed content is restored."""
    download: Transfer = NOTHING_MOVED
    """What restoring from an object store downloaded (nothing when the local tier had it)."""


class Claimant:
    """Rank 0's claim. What it found stays readable after a refusal, for the refused record."""

    def __init__(self, config: RunConfig, storage: RunStorage):
        self.config = config
        self.storage = storage
        self.held: RunDirectory | None = None
        """This machine's run directory, once this attempt holds it."""
        self.considered: str | None = None
        """The generation chosen for restore, before it verified."""

    def claim(self, attempt_id: str, held: contextlib.ExitStack) -> Claim:
        config, storage = self.config, self.storage
        storage.claim(attempt_id, held, must_exist=config.resume == "latest" or config.from_generation is not None)
        self.held = storage.local
        started = time.monotonic()
        committed = storage.committed()
        self.considered = choose_candidate(committed, config.resume, config.from_generation,
                                           storage.generations_where)
        storage.go_ahead(attempt_id, config.adopt_from)  # the run's identity: what the generation must belong to
        generation, download = None, NOTHING_MOVED
        if self.considered:
            generation, download = storage.restorable(self.considered, committed)
        if generation is not None and generation.manifest.run is None:
            log.warning("%s names no run (written before run ids): restored as this run's own", generation.name)
        verify_s = time.monotonic() - started - download.seconds
        storage.remove_stale_temporaries()
        return Claim(storage.local, attempt_id, generation, verify_s,
                     manifest_digest(generation.path) if generation else None, download)
