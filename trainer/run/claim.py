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
from trainer.checkpoint.identity import RunIdentity, identity_or_problem
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.resume import choose_candidate
from trainer.config import RunConfig
from trainer.layout import RunDirectory
from trainer.errors import CorruptGeneration
from trainer.run.records import DISK, MEMORY, STORE, read_attempts
from trainer.storage.base import NOTHING_MOVED, RunStorage, Transfer

log = logging.getLogger("trainer")


def run_identity(run: RunDirectory) -> RunIdentity | None:
    """The run directory's identity as it stands before this attempt goes ahead (None: none yet)."""
    identity, _ = identity_or_problem(run.identity.read_bytes() if run.identity.is_file() else None)
    return identity


@dataclass(frozen=True)
class Claim:
    """What rank 0 found once it held the run directory, handed to every rank."""

    run: RunDirectory
    attempt_id: str
    generation: Verification | None
    """The verified generation to restore (None: a fresh start)."""
    verify_s: float
    """Verifying before the state existed: every file, or (`generation.shards_pending`) all
    but the shards, whose sha256 the load checks as it reads them (trainer/run/restoring.py)."""
    manifest_sha256: str | None = None
    """Of the generation to restore: names exactly which sealed content is restored."""
    download: Transfer = NOTHING_MOVED
    """What restoring from an object store downloaded (nothing when the local tier had it)."""
    tier: str = DISK
    """Where the generation was restored from: MEMORY (tier 0), DISK or STORE."""
    refused: tuple[str, ...] = ()
    """Faster sources refused on the way ("TIER NAME: problem"): a damaged tier-0 generation."""

    @property
    def restored_bytes(self) -> int:
        """The bytes of the restored generation's files."""
        files = self.generation.manifest.files if self.generation is not None else {}
        return sum(int(entry.get("bytes", 0)) for entry in files.values())


class Claimant:
    """Rank 0's claim. What it found stays readable after a refusal, for the refused record."""

    def __init__(self, config: RunConfig, storage: RunStorage, one_pass: bool = False):
        self.config = config
        self.storage = storage
        self.one_pass = one_pass
        """The backend may leave a durable generation's shard hashes to the load (one rank)."""
        self.held: RunDirectory | None = None
        """This machine's run directory, once this attempt holds it."""
        self.considered: str | None = None
        """The generation chosen for restore, before it verified."""

    def claim(self, attempt_id: str, held: contextlib.ExitStack) -> Claim:
        config, storage = self.config, self.storage
        storage.claim(attempt_id, held, must_exist=config.resume == "latest" or config.from_generation is not None)
        storage.memory.claim(held)
        self.held = storage.local
        started = time.monotonic()
        durable = storage.committed()
        newer = storage.memory.newer_than(durable, read_attempts(storage.local.root),  # tier 0 first: the fastest
                                          run_identity(storage.local))
        where = storage.generations_where + (f" and tier 0 ({storage.memory.where})" if newer else "")
        self.considered = choose_candidate(durable + newer, config.resume, config.from_generation, where)
        # the run's identity: what the generation must belong to, in tier 0 too
        storage.memory.bind(storage.go_ahead(attempt_id, config.adopt_from))
        generation, download, tier, refused = None, NOTHING_MOVED, DISK, ()
        if self.considered:
            generation, download, tier, refused = self.fetch(self.considered, durable, newer)
        if generation is not None and generation.manifest.run is None:
            log.warning("%s names no run (written before run ids): restored as this run's own", generation.name)
        verify_s = time.monotonic() - started - download.seconds
        storage.remove_stale_temporaries()
        return Claim(storage.local, attempt_id, generation, verify_s,
                     manifest_digest(generation.path) if generation else None, download, tier, refused)

    def fetch(self, name: str, durable: list[str], newer: list[str]):
        """The generation `name` verified, from the fastest source that holds it: tier 0, else
        the backend (this disk, or a download from the object store). A tier-0 generation that
        does not verify is refused with one warning, and the newest earlier durable one serves."""
        storage, refused = self.storage, ()
        if name in newer:
            verification = storage.memory.restorable(name)
            if verification.ok:
                return verification, NOTHING_MOVED, MEMORY, ()
            earlier = [durable_name for durable_name in durable if durable_name < name]
            instead = f"restoring {earlier[-1]} from {storage.generations_where}" if earlier else \
                "no durable generation to restore instead"
            log.warning("tier 0 refused %s (%s): %s", name, verification.problem, instead)
            if not earlier:
                raise CorruptGeneration(f"tier-0 generation {name} in {storage.memory.where} does not verify "
                                        f"({verification.problem}) and no durable generation is older; remove it "
                                        f"to start over")
            name, refused = earlier[-1], (f"{MEMORY} {name}: {verification.problem}",)
        verification, download = storage.restorable(name, durable, self.one_pass)
        return verification, download, STORE if download.bytes else DISK, refused
