"""Commit strategies: how the shards every rank wrote become one generation.

A checkpointer (checkpoint/checkpointer.py) decides *when* a save is written, in the loop
(sync) or in the background (async); a commit strategy decides *where* each rank writes and
what makes the result a generation, as Orbax separates its checkpointers from their commit
strategies. There are two:

* `RenameCommit` (here): one disk that every rank sees, a local run or a shared filesystem.
  Every rank writes its shards into one temporary directory rank 0 created; rank 0 seals it
  (a manifest with every file's digest, each checked against what its rank wrote:
  checkpoint/content.py) and renames it into place.
* `ObjectCommit` (storage/object/commit.py): ranks that share no disk. Each rank writes its
  shards to its own disk and uploads them; rank 0 commits the manifest in the object store.

Both run the same way in the loop's thread (sync) and on a background thread (async), with
the coordinator they are handed: the training group's ranks, or a background group's.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from trainer import seams
from trainer.errors import PeerFailure
from trainer.checkpoint.content import checking
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.manifest import Manifest
from trainer.checkpoint.section import LocalSection
from trainer.errors import reraise_as_storage_failure, storage_failure
from trainer.layout import generation_name

Describe = Callable[[dict], Manifest]
"""The manifest for a generation's files ({file: {bytes, digest}})."""


@dataclass(frozen=True)
class Committed:
    manifest_sha256: str
    upload_s: float = 0.0
    """Seconds the slowest rank spent uploading its shards (0: nothing to upload)."""


class Commit(Protocol):
    local: LocalSection
    """This rank's generations on its own disk (where it writes its shards)."""
    mode_suffix: str
    """Appended to the checkpoint mode in the manifest ("-store": committed in an object store)."""
    max_pending: int
    """Saves that may be written and not yet committed at once (async only)."""

    def begin(self, step: int, attempt_id: str, coordinator: Coordinator) -> Path:
        """Every rank: the directory it writes its shards of `step` into (rank 0 names it)."""

    def commit(self, temporary: Path, step: int, describe: Describe, digests: dict[str, dict],
               coordinator: Coordinator) -> Committed:
        """Every rank, once its write is complete: make the shards a generation; every rank
        gets the outcome (or the same error)."""

    def abandon(self, temporary: Path, coordinator: Coordinator) -> None:
        """The write failed on this rank: delete what it left (no collectives)."""


class RenameCommit:
    """One disk every rank sees: one temporary, sealed and renamed by rank 0."""

    mode_suffix = ""
    max_pending = 1

    def __init__(self, local: LocalSection):
        self.local = local

    def begin(self, step: int, attempt_id: str, coordinator: Coordinator) -> Path:
        name = generation_name(step)
        return coordinator.decide_on_primary(lambda: self._create(step, attempt_id), f"creating generation {name}")

    def _create(self, step: int, attempt_id: str) -> Path:
        try:
            return self.local.begin(step, attempt_id)
        except OSError as error:
            raise storage_failure(error, f"creating generation {generation_name(step)}") from None

    def commit(self, temporary: Path, step: int, describe: Describe, digests: dict[str, dict],
               coordinator: Coordinator) -> Committed:
        name = generation_name(step)
        reports = coordinator.gather(digests, f"writing generation {name}")  # every rank's shards are written
        # With several ranks rank 0 hashes every file on the disk while sealing and commits
        # only if each holds exactly what its rank wrote; one process keeps its writer's digests.
        known = digests if not coordinator.distributed else None
        checked = checking(describe, reports, str(temporary), name)
        sealed: list[str] = []

        def publish() -> str:
            sealed.append(self._publish(temporary, step, checked, known))
            return sealed[0]
        try:
            return Committed(coordinator.decide_on_primary(publish, f"publishing generation {name}"))
        except PeerFailure:
            if sealed:  # rank 0 published it before hearing a peer was lost: it is on disk, so it is recorded
                return Committed(sealed[0])
            raise

    def _publish(self, temporary: Path, step: int, describe: Describe, known: dict | None) -> str:
        """Seal and rename (rank 0); a storage error becomes StorageFailure here, so every rank
        exits with its status (74), not just rank 0."""
        try:
            seams.crash_point("before-seal")
            return self.local.publish(temporary, step, describe, known)
        except BaseException as error:
            shutil.rmtree(temporary, ignore_errors=True)
            reraise_as_storage_failure(error, f"writing generation {generation_name(step)}")

    def abandon(self, temporary: Path, coordinator: Coordinator) -> None:
        if coordinator.is_primary:
            shutil.rmtree(temporary, ignore_errors=True)
