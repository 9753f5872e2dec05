"""The run directory on this machine's disk: committed by atomic rename, held by a flock.

Everything published is as durable as this disk when the publish returns, so nothing
happens after a publish; local retention is the only pruning.
"""

from __future__ import annotations

import contextlib

from trainer.checkpoint.checkpointer import Checkpointer, build_checkpointer
from trainer.checkpoint.commit import RenameCommit
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.resume import verify_candidate
from trainer.checkpoint.signing import Signing
from trainer.layout import GENERATIONS, RunDirectory
from trainer.storage.base import NOTHING_MOVED, RunStorage, Transfer
from trainer.storage.lock import OutputLock


class LocalStorage(RunStorage):
    def __init__(self, local: RunDirectory, signing: Signing | None = None):
        super().__init__(local, str(local.root), signing)

    def claim(self, attempt_id: str, held: contextlib.ExitStack, must_exist: bool) -> None:
        self.local.prepare(must_exist=must_exist)
        held.enter_context(OutputLock(self.local.root))
        self.tidy_local_sections(warn_uncommitted=True)

    def join(self, claimed: RunDirectory) -> None:
        self.local, self.where = claimed, str(claimed.root)  # the one disk every rank shares

    def committed(self) -> list[str]:
        return self.section(GENERATIONS).names()

    @property
    def generations_where(self) -> str:
        return str(self.local.checkpoints)

    def restorable(self, name: str, committed: list[str]) -> tuple[Verification, Transfer]:
        return verify_candidate(self.section(GENERATIONS), name), NOTHING_MOVED

    def checkpointer(self, mode: str, attempt_id: str, coordinator: Coordinator, device) -> Checkpointer:
        return build_checkpointer(mode, RenameCommit(self.section(GENERATIONS)), attempt_id, device, coordinator)
