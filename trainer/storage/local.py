"""The run directory on this machine's disk: committed by atomic rename, held by a record lock (storage/lock.py).

Everything published is as durable as this disk when the publish returns, so nothing
happens after a publish (`LocalDurability`); local retention is the only pruning.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from trainer.checkpoint.commit import Commit, RenameCommit
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.resume import refuse_damaged, verify_candidate
from trainer.checkpoint.section import LocalSection, Published
from trainer.checkpoint.signing import Signing
from trainer.layout import GENERATIONS, RunDirectory
from trainer.storage.base import NOTHING_MOVED, AfterPublish, Durability, Durable, RunStorage, Transfer
from trainer.storage.lock import OutputLock


class LocalStorage(RunStorage):
    def __init__(self, local: RunDirectory, signing: Signing | None = None):
        super().__init__(local, str(local.root), str(local.checkpoints), signing)

    def claim(self, attempt_id: str, held: contextlib.ExitStack, must_exist: bool) -> None:
        self.local.prepare(must_exist=must_exist)
        held.enter_context(OutputLock(self.local.root))
        self._tidy_local_sections(warn_uncommitted=True)

    def join(self, claimed: RunDirectory) -> None:
        self.local, self.where = claimed, str(claimed.root)  # the one disk every rank shares
        self.generations_where = str(claimed.checkpoints)

    def committed(self) -> list[str]:
        return self.section(GENERATIONS).names()

    def restorable(self, name: str, committed: list[str], one_pass: bool = False,
                   damaged: str | None = None) -> tuple[Verification, Transfer]:
        section = self.section(GENERATIONS)
        if damaged is not None:  # the only copy: refused as the claim would have refused it
            refuse_damaged(section, Verification(section.path(name), None, damaged))
        return verify_candidate(section, name, shards=not one_pass), NOTHING_MOVED

    def durability(self, protected: frozenset[str], attempt_folder: Path, primary: bool) -> Durability:
        return LocalDurability(self.section(GENERATIONS))


class LocalDurability(Durability):
    """A publish on this disk is durable when the rename returns: nothing follows it."""

    def __init__(self, generations: LocalSection):
        self.generations = generations

    def commit(self) -> Commit:
        return RenameCommit(self.generations)

    def after_publish(self, kind: str, published: Published, directory: Path) -> AfterPublish:
        return AfterPublish()  # durable already; the record says so when it is published

    def completed(self) -> tuple[Durable, ...]:
        return ()

    def kept_locally(self, kind: str) -> frozenset[str]:
        return frozenset()  # local retention alone decides

    def recorded(self, folder: Path) -> None:
        return None  # the record is on this disk

    def drain(self) -> tuple[Durable, ...]:
        return ()

    def close(self) -> None:
        return None
