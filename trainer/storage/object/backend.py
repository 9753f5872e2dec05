"""A run directory in an object store, as the attempt sees it: the claim (`ObjectStorage`)
and two durability strategies.

Rank 0 claims it: reach the object store, take the lease (held until the attempt ends),
bring the attempt history to this machine's local tier, and reconcile the tier with what is
committed once the attempt goes ahead. Two ways to make a save durable:

* `Tiered` (one process): generations and exports are published on the local tier as on a
  local disk, and the `Uploader` makes them durable in the background.
* `Direct` (several processes, which share no disk): every rank writes its own shards and
  uploads them, and rank 0 commits the manifest (storage/object/commit.py): inside the save
  when sync, on background threads when async; exports, written by rank 0 alone, are tiered
  as above.

Every rank other than 0 restores from its own verified download.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.checkpoint.commit import Commit, RenameCommit
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.section import Published
from trainer.checkpoint.signing import Signing
from trainer.config import RetentionConfig, StoreConfig
from trainer.errors import CorruptGeneration
from trainer.layout import GENERATIONS, MANIFEST, RUN_IDENTITY, SECTIONS, RunDirectory
from trainer.location import StoreLocation
from trainer.storage.base import AfterPublish, Durability, Durable, RecordCopy, RunStorage, Transfer
from trainer.storage.local import LocalDurability
from trainer.storage.lock import OutputLock
from trainer.storage.object.client import open_objects
from trainer.storage.object.commit import ObjectCommit
from trainer.storage.object.lease import StoreLease
from trainer.storage.object.section import ObjectSection
from trainer.storage.object.tiering import RemoteRun, StoreRetention, Uploader, apply_store_retention

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class ClaimedStore:
    """What rank 0 holds once it claimed a run directory in an object store."""

    lease: StoreLease
    """The single-writer lease, checked before every write."""
    remote: RemoteRun
    """The object store and this machine's local tier."""


class NotClaimed:
    """The claimed state before `claim()`, and on the ranks that never claim: reaching for it is
    a bug in the caller, said as one (not an AttributeError about a missing attribute)."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"the run directory in the object store is not claimed: its {name} is rank 0's, "
                           f"after claim()")


class ObjectStorage(RunStorage):
    """The claim on a run directory in an object store; `strategy` builds each rank's durability."""

    shares_one_disk = False  # every rank has its own local tier

    def __init__(self, location: StoreLocation, local_tier: RunDirectory, settings: StoreConfig,
                 retention: RetentionConfig, signing: Signing | None, strategy: Strategy):
        super().__init__(local_tier, location.url, f"{location.url}/{SECTIONS[GENERATIONS]}", signing)
        self.location, self.settings, self.retention, self.strategy = location, settings, retention, strategy
        self.claimed: ClaimedStore | NotClaimed = NotClaimed()
        """Rank 0's lease and remote run once it claimed (`claim`); every other rank never does."""

    # ----------------------------------------------------------------- claiming (rank 0)
    def claim(self, attempt_id: str, held: contextlib.ExitStack, must_exist: bool) -> None:
        """`must_exist` does not apply: the local tier of a run in an object store may be new."""
        self.local.prepare(must_exist=False)
        held.enter_context(OutputLock(self.local.root))
        objects = open_objects(self.location, self.settings)
        objects.check_reachable()
        self.claimed = ClaimedStore(held.enter_context(StoreLease(objects, attempt_id, self.settings.lease_ttl_s,
                                                                  self.settings.lease_wait_s)),
                                    RemoteRun(objects, self.local, self.signing))
        self.claimed.remote.adopt_local_tier()
        self.claimed.remote.pull_attempts()
        self.claimed.remote.pull_identity()
        self.records = StoreRecords(self.claimed.remote, self.where)
        self._tidy_local_sections(warn_uncommitted=False)  # reconcile removes them, once the attempt goes ahead

    def committed(self) -> list[str]:
        return self.claimed.remote.generations.committed()

    def go_ahead(self, attempt_id: str, adopt_from: tuple[str, ...]):
        identity = super().go_ahead(attempt_id, adopt_from)
        self.claimed.remote.reconcile()
        return identity

    def restorable(self, name: str, committed: list[str], one_pass: bool = False,
                   damaged: str | None = None) -> tuple[Verification, Transfer]:
        return self.claimed.remote.restorable(name, committed, shards=not one_pass, damaged=damaged)

    def _keep_identity(self, data: bytes) -> None:
        """In the object store (the truth, under the lease), then on the local tier."""
        self.claimed.lease.fence()
        self.claimed.remote.objects.write(RUN_IDENTITY, data)
        super()._keep_identity(data)

    def set_aside_later_than(self, step: int) -> list[str]:
        claimed = self.claimed
        return super().set_aside_later_than(step) + claimed.remote.set_aside_later_than(step, claimed.lease.fence)

    # ----------------------------------------------------------------- every rank
    def join(self, claimed: RunDirectory) -> None:
        return None  # every rank keeps its own local tier

    def local_copy(self, generation: Verification) -> Verification:
        """The generation rank 0 verified, on this rank's own disk: its own download, verified
        while streaming, unless the same copy is already there."""
        local = self.section(GENERATIONS)
        mine = local.path(generation.name)
        if (mine / MANIFEST).is_file():
            present = local.verify(generation.name)
            if present.ok and present.manifest == generation.manifest:
                return present
        if mine.exists():
            local.remove(generation.name)
        fetched, _ = self.own_section().fetch(generation.name, local.root)
        if not fetched.ok:
            raise CorruptGeneration(f"generation {generation.name} is damaged as this rank downloaded it: "
                                    f"{fetched.problem}; resume again (rank 0 verified it moments ago)")
        return fetched

    def own_section(self) -> ObjectSection:
        """The object store's generations through a client of this rank's own (not rank 0's)."""
        return ObjectSection(open_objects(self.location, self.settings), SECTIONS[GENERATIONS], self.signing)

    def durability(self, protected: frozenset[str], attempt_folder: Path, primary: bool) -> Durability:
        return self.strategy(self, protected, attempt_folder, primary)

    def uploads(self, protected: frozenset[str], attempt_folder: Path) -> Tiered:
        """Rank 0: publishes on the local tier made durable by the background uploader."""
        retention = self.retention
        claimed = self.claimed
        uploader = Uploader(claimed.remote, max(1, self.settings.max_pending_uploads), claimed.lease.fence,
                            StoreRetention(retention.keep_last, retention.keep_every, retention.keep_exports),
                            protected, attempt_folder)
        return Tiered(self.section(GENERATIONS), uploader, self.settings.max_pending_uploads == 0)


class StoreRecords(RecordCopy):
    """Rank 0's attempt records, copied to the object store."""

    def __init__(self, remote: RemoteRun, where: str):
        self.remote, self.where = remote, where

    def push(self, folder: Path, step_digests: bool = True) -> None:
        try:
            self.remote.push_attempt(folder, step_digests)
        except Exception as error:  # noqa: BLE001 - the attempt's own outcome is what must reach the user
            log.warning("could not copy the attempt record to %s: %s", self.where, error)

    def note(self, newest_durable: str | None, considered: str | None) -> str | None:
        return f"newest durable in {self.where}: {newest_durable or considered or 'none'}"


class Tiered(Durability):
    """One process: published on the local tier, made durable by the `Uploader`."""

    def __init__(self, generations, uploader: Uploader, wait_for_each: bool):
        self.generations, self.uploader, self.wait_for_each = generations, uploader, wait_for_each

    def commit(self) -> Commit:
        return RenameCommit(self.generations)

    def after_publish(self, kind: str, published: Published, directory: Path) -> AfterPublish:
        """Queue the upload (waiting while too many are not durable yet); with
        `--max-pending-uploads 0`, wait until this one is durable."""
        waiting = time.monotonic()
        self.uploader.submit(kind, published.name, directory, waiting - published.save_s)
        durable = self.uploader.drain() if self.wait_for_each else []
        return AfterPublish(tuple(durable), time.monotonic() - waiting)

    def completed(self) -> tuple[Durable, ...]:
        return tuple(self.uploader.completed())

    def kept_locally(self, kind: str) -> frozenset[str]:
        newest = self.uploader.newest_durable(kind)
        return frozenset(self.uploader.not_durable(kind) | ({newest} if newest else set()))

    def recorded(self, folder: Path) -> None:
        return None  # the uploader pushes the record after each commit

    def drain(self) -> tuple[Durable, ...]:
        return tuple(self.uploader.drain())

    def close(self) -> None:
        self.uploader.close()


class Direct(Durability):
    """Several processes: generations go straight to the object store from every rank; what
    is not a generation (rank 0's exports) goes the way of `others`."""

    def __init__(self, commit: ObjectCommit, others: Durability, prune: Callable[[str], list[str]],
                 records: RecordCopy):
        self._commit, self.others, self.prune, self.records = commit, others, prune, records

    def commit(self) -> Commit:
        """Sync: durable when `save()` returns. Async: the loop waits for staging only; each
        rank uploads in the background, at most `--max-pending-uploads` generations at once."""
        return self._commit

    def after_publish(self, kind: str, published: Published, directory: Path) -> AfterPublish:
        """A generation is durable already (committed inside the save); the object store is
        pruned (the scratch copies are gone: nothing to prune locally)."""
        if kind != GENERATIONS:
            return self.others.after_publish(kind, published, directory)
        durable = Durable(GENERATIONS, published.name, 0, published.upload_s, published.save_s)
        return AfterPublish((durable,), 0.0, tuple(self.prune(published.name)))

    def completed(self) -> tuple[Durable, ...]:
        return self.others.completed()

    def kept_locally(self, kind: str) -> frozenset[str]:
        return self.others.kept_locally(kind)

    def recorded(self, folder: Path) -> None:
        """A direct commit is durable once the checkpointer reports it: the record that now says
        so goes to the object store at once (tiered commits push it from the uploader), without
        the per-step log, which goes up when the attempt ends."""
        self.records.push(folder, step_digests=False)

    def drain(self) -> tuple[Durable, ...]:
        return self.others.drain()

    def close(self) -> None:
        self.others.close()


Strategy = Callable[[ObjectStorage, frozenset, Path, bool], Durability]


def tiered(storage: ObjectStorage, protected: frozenset[str], attempt_folder: Path, primary: bool) -> Durability:
    """One process (always rank 0)."""
    return storage.uploads(protected, attempt_folder)


def direct(storage: ObjectStorage, protected: frozenset[str], attempt_folder: Path, primary: bool) -> Durability:
    """Rank 0 commits through its claim's client and lease, tiers its exports and prunes the
    object store; every other rank uploads its shards through a client of its own."""
    local, pending = storage.section(GENERATIONS), storage.settings.max_pending_uploads
    if not primary:
        commit = ObjectCommit(storage.own_section(), local, lambda: None, pending)
        return Direct(commit, LocalDurability(local), lambda name: [], storage.records)
    uploads, retention, claimed = storage.uploads(protected, attempt_folder), storage.retention, storage.claimed
    generations, fence = claimed.remote.generations, claimed.lease.fence

    def prune(name: str) -> list[str]:
        return apply_store_retention(generations, retention.keep_last, retention.keep_every,
                                     uploads.uploader.protected | {name}, fence)
    return Direct(ObjectCommit(generations, local, fence, pending), uploads, prune, storage.records)


def open_object_storage(location: StoreLocation, local_tier: RunDirectory, settings: StoreConfig,
                        retention: RetentionConfig, processes: int, signing: Signing | None) -> ObjectStorage:
    return ObjectStorage(location, local_tier, settings, retention, signing, direct if processes > 1 else tiered)
