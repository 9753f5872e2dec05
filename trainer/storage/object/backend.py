"""A run directory in an object store, as the attempt sees it (the `RunStorage` verbs).

Rank 0 claims it: reach the object store, take the lease (held until the attempt ends),
bring the attempt history to this machine's local tier, and reconcile the tier with what is
committed once the attempt goes ahead. Two ways to save:

* `TieredObjectStorage` (one process): generations and exports are published on the local
  tier as on a local disk, and the `Uploader` makes them durable in the background.
* `DirectObjectStorage` (several processes, which share no disk): every rank writes its own
  shards and uploads them, and rank 0 commits the manifest (storage/object/commit.py): inside
  the save when sync, on background threads when async; exports, written by rank 0 alone,
  are tiered as above.

Every rank other than 0 restores from its own verified download.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from trainer.checkpoint.checkpointer import Checkpointer, build_checkpointer
from trainer.checkpoint.commit import RenameCommit
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.section import Published
from trainer.checkpoint.signing import Signing
from trainer.config import RetentionConfig, StoreConfig
from trainer.errors import CorruptGeneration
from trainer.layout import GENERATIONS, MANIFEST, RUN_IDENTITY, SECTIONS, RunDirectory
from trainer.storage.base import AfterPublish, Durable, RunStorage, Transfer
from trainer.storage.location import StoreLocation
from trainer.storage.lock import OutputLock
from trainer.storage.object.client import ObjectStore
from trainer.storage.object.commit import ObjectCommit
from trainer.storage.object.lease import StoreLease
from trainer.storage.object.section import ObjectSection
from trainer.storage.object.tiering import RemoteRun, StoreRetention, Uploader, apply_store_retention

log = logging.getLogger("trainer")


class TieredObjectStorage(RunStorage):
    def __init__(self, location: StoreLocation, local_tier: RunDirectory, settings: StoreConfig,
                 retention: RetentionConfig, signing: Signing | None = None):
        super().__init__(local_tier, location.url, signing)
        self.location = location
        self.settings = settings
        self.retention = retention
        self.remote: RemoteRun | None = None
        """Rank 0, once claimed: the object store and this machine's local tier."""
        self.lease: StoreLease | None = None
        self.uploader: Uploader | None = None
        """Rank 0, once started: makes what is published here durable there."""

    # ----------------------------------------------------------------- claiming (rank 0)
    def claim(self, attempt_id: str, held: contextlib.ExitStack, must_exist: bool) -> None:
        """`must_exist` does not apply: the local tier of a run in an object store may be new."""
        self.local.prepare(must_exist=False)
        held.enter_context(OutputLock(self.local.root))
        objects = ObjectStore(self.location, self.settings)
        objects.check_reachable()
        self.lease = held.enter_context(StoreLease(objects, attempt_id, self.settings.lease_ttl_s,
                                                   self.settings.lease_wait_s))
        self.remote = RemoteRun(objects, self.local, self.signing)
        self.remote.adopt_local_tier()
        self.remote.pull_attempts()
        self.remote.pull_identity()
        self.tidy_local_sections(warn_uncommitted=False)  # reconcile removes them, once the attempt goes ahead

    def committed(self) -> list[str]:
        return self.remote.generations.committed()

    @property
    def generations_where(self) -> str:
        return self.remote.generations.url("").rstrip("/")

    def go_ahead(self) -> None:
        self.remote.reconcile()

    def restorable(self, name: str, committed: list[str]) -> tuple[Verification, Transfer]:
        return self.remote.restorable(name, committed)

    def keep_identity(self, data: bytes) -> None:
        """In the object store (the truth, under the lease), then on the local tier."""
        self.fence()
        self.remote.objects.write(RUN_IDENTITY, data)
        super().keep_identity(data)

    def fence(self) -> None:
        if self.lease is not None:
            self.lease.fence()

    # ----------------------------------------------------------------- every rank
    def needs_one_disk(self) -> bool:
        return False  # every rank has its own local tier

    def objects_section(self) -> ObjectSection:
        """The object store's generations as this rank reaches them (rank 0 reuses its claim)."""
        if self.remote is not None:
            return self.remote.generations
        return ObjectSection(ObjectStore(self.location, self.settings), SECTIONS[GENERATIONS], self.signing)

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
        fetched, _ = self.objects_section().fetch(generation.name, local.root)
        if not fetched.ok:
            raise CorruptGeneration(f"generation {generation.name} is damaged as this rank downloaded it: "
                                    f"{fetched.problem}; resume again (rank 0 verified it moments ago)")
        return fetched

    def checkpointer(self, mode: str, attempt_id: str, coordinator: Coordinator, device) -> Checkpointer:
        return build_checkpointer(mode, RenameCommit(self.section(GENERATIONS)), attempt_id, device, coordinator)

    # ----------------------------------------------------------------- after each publish
    def start_uploads(self, protected: frozenset[str], attempt_folder: Path) -> None:
        if self.remote is None:
            return
        retention = self.retention
        self.uploader = Uploader(self.remote, max(1, self.settings.max_pending_uploads), self.fence,
                                 StoreRetention(retention.keep_last, retention.keep_every, retention.keep_exports),
                                 protected, attempt_folder)

    def after_publish(self, kind: str, published: Published, directory: Path) -> AfterPublish:
        """Queue the upload (waiting while too many are not durable yet); with
        `--max-pending-uploads 0`, wait until this one is durable."""
        if self.uploader is None:
            return AfterPublish()
        waiting = time.monotonic()
        self.uploader.submit(kind, published.name, directory, waiting - published.save_s)
        durable = self.uploader.drain() if self.settings.max_pending_uploads == 0 else []
        return AfterPublish(tuple(durable), time.monotonic() - waiting)

    def completed(self) -> tuple[Durable, ...]:
        return tuple(self.uploader.completed()) if self.uploader else ()

    def kept_locally(self, kind: str) -> frozenset[str]:
        if self.uploader is None:
            return frozenset()
        newest = self.uploader.newest_durable(kind)
        return frozenset(self.uploader.not_durable(kind) | ({newest} if newest else set()))

    def set_aside_later_than(self, step: int) -> list[str]:
        local = super().set_aside_later_than(step)
        return local + (self.remote.set_aside_later_than(step, self.fence) if self.remote is not None else [])

    def push_record(self, folder: Path, step_digests: bool = True) -> None:
        if self.remote is None:
            return
        try:
            self.remote.push_attempt(folder, step_digests)
        except Exception as error:  # noqa: BLE001 - the attempt's own outcome is what must reach the user
            log.warning("could not copy the attempt record to %s: %s", self.where, error)

    def durable_note(self, newest_durable: str | None, considered: str | None) -> str | None:
        if self.remote is None:
            return None
        return f"newest durable in {self.where}: {newest_durable or considered or 'none'}"

    # ----------------------------------------------------------------- the end
    def drain(self) -> tuple[Durable, ...]:
        return tuple(self.uploader.drain()) if self.uploader else ()

    def close(self) -> None:
        if self.uploader is not None:
            self.uploader.close()


class DirectObjectStorage(TieredObjectStorage):
    """Several processes: generations go straight to the object store from every rank."""

    def recorded(self, folder: Path) -> None:
        """A direct commit is durable once the checkpointer reports it: the record that now says
        so goes to the object store at once (tiered commits push it from the uploader), without
        the per-step log, which goes up when the attempt ends."""
        self.push_record(folder, step_digests=False)

    def checkpointer(self, mode: str, attempt_id: str, coordinator: Coordinator, device) -> Checkpointer:
        """Sync: durable when `save()` returns. Async: the loop waits for staging only; each
        rank uploads in the background, at most `--max-pending-uploads` generations at once."""
        commit = ObjectCommit(self.objects_section(), self.section(GENERATIONS), self.fence,
                              self.settings.max_pending_uploads)
        return build_checkpointer(mode, commit, attempt_id, device, coordinator)

    def after_publish(self, kind: str, published: Published, directory: Path) -> AfterPublish:
        """A generation is durable already (committed inside the save); rank 0 prunes the
        object store (the scratch copies are gone: nothing to prune locally)."""
        if kind != GENERATIONS:
            return super().after_publish(kind, published, directory)
        durable = Durable(GENERATIONS, published.name, 0, published.upload_s, published.save_s)
        if self.remote is None:
            return AfterPublish((durable,))
        removed = apply_store_retention(self.remote.generations, self.retention.keep_last, self.retention.keep_every,
                                        self.uploader.protected | {published.name} if self.uploader else
                                        frozenset({published.name}), self.fence)
        return AfterPublish((durable,), 0.0, tuple(removed))


def open_object_storage(location: StoreLocation, local_tier: RunDirectory, settings: StoreConfig,
                        retention: RetentionConfig, processes: int, signing: Signing | None) -> TieredObjectStorage:
    kind = DirectObjectStorage if processes > 1 else TieredObjectStorage
    return kind(location, local_tier, settings, retention, signing)

