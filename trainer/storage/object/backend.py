"""One attempt's side of a run directory in an object store.

Rank 0 claims it (reach the store, take the lease, bring the attempt history to the local
tier, reconcile), uploads what it publishes and copies its attempt record there. Under
torchrun every rank saves straight to the store and restores from its own verified
download. The loop asks this object, and only when `--output` is a store URL.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from trainer.config import RunConfig
from trainer.errors import CorruptGeneration
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.signing import load_signing
from trainer.storage.object.direct import StoreCheckpointer
from trainer.storage.object.lease import StoreLease
from trainer.storage.location import parse_store_url
from trainer.storage.object.client import ObjectStore
from trainer.storage.object.section import ObjectSection
from trainer.layout import CHECKPOINTS, MANIFEST, RunDirectory
from trainer.storage.object.tiering import RemoteRun, StoreRetention, Uploader

log = logging.getLogger("trainer")


class StoreSide:
    def __init__(self, config: RunConfig):
        self.config = config
        self.url = parse_store_url(config.store).url
        self.remote: RemoteRun | None = None
        """Rank 0, once claimed: the store and this machine's local tier."""
        self.lease: StoreLease | None = None
        self.signing = load_signing(config.signing)

    def claim(self, run: RunDirectory, attempt_id: str, held: contextlib.ExitStack) -> RemoteRun:
        """Rank 0: reach the store, take its lease (held until the attempt ends), bring the
        attempt history to the local tier."""
        settings = self.config.store_config
        objects = ObjectStore(parse_store_url(self.config.store), settings)
        objects.check_reachable()
        self.lease = held.enter_context(StoreLease(objects, attempt_id, settings.lease_ttl_s, settings.lease_wait_s))
        self.remote = RemoteRun(objects, run, self.signing)
        self.remote.adopt_local_tier()
        self.remote.pull_attempts()
        return self.remote

    def fence(self) -> None:
        if self.lease is not None:
            self.lease.fence()

    def section(self) -> ObjectSection:
        """The store's generations as this rank reaches them (rank 0 reuses its claim)."""
        if self.remote is not None:
            return self.remote.generations
        return ObjectSection(ObjectStore(parse_store_url(self.config.store), self.config.store_config), CHECKPOINTS,
                             self.signing)

    def checkpointer(self, attempt_id: str, coordinator: Coordinator) -> StoreCheckpointer:
        """Several processes: every rank saves from its own disk straight to the store."""
        scratch = LocalSection(RunDirectory(self.config.output).checkpoints)
        return StoreCheckpointer(self.section(), scratch, attempt_id, coordinator, self.fence)

    def local_copy(self, generation: Verification) -> Verification:
        """A rank other than 0: the generation rank 0 verified, on this rank's own disk (its
        own download, verified while streaming, unless the same copy is already there)."""
        local = LocalSection(RunDirectory(self.config.output).checkpoints, self.signing)
        mine = local.path(generation.name)
        if (mine / MANIFEST).is_file():
            present = local.verify(generation.name)
            if present.ok and present.manifest == generation.manifest:
                return present
        if mine.exists():
            local.remove(generation.name)
        fetched, _ = self.section().fetch(generation.name, local.root)
        if not fetched.ok:
            raise CorruptGeneration(f"generation {generation.name} is damaged as this rank downloaded it: "
                                    f"{fetched.problem}; resume again (rank 0 verified it moments ago)")
        return fetched

    def uploader(self, protected: frozenset[str], attempt_folder: Path) -> Uploader | None:
        """Rank 0: the background uploader that makes what it publishes durable."""
        if self.remote is None:
            return None
        settings, retention = self.config.store_config, self.config.retention
        return Uploader(self.remote, max(1, settings.max_pending_uploads), self.fence,
                        StoreRetention(retention.keep_last, retention.keep_every, retention.keep_exports),
                        protected, attempt_folder)

    def set_aside_later_than(self, step: int) -> list[str]:
        return self.remote.set_aside_later_than(step, self.fence) if self.remote is not None else []

    def push_record(self, folder: Path) -> None:
        """Copy an attempt record to the store; never raises: the attempt's own outcome is
        what must reach the user."""
        if self.remote is None:
            return
        try:
            self.remote.push_attempt(folder)
        except Exception as error:  # noqa: BLE001
            log.warning("could not copy the attempt record to %s: %s", self.url, error)
