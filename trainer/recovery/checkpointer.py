"""The recovery checkpointer: turns live training state into a published generation.

Lifecycle verbs, as the loop sees them: `save()` after a step the cadence picked,
`wait_for_staging()` right before the next optimizer step mutates parameters, and
`finalize()` before the process exits. In sync mode the save is complete when `save()`
returns, so the other two have nothing to wait for.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.errors import StorageFailure, TrainerError
from trainer.recovery.atomic import is_storage_error, manifest_digest, storage_failure
from trainer.recovery.manifest import FORMAT, FORMAT_VERSION
from trainer.recovery.resume import generation_name
from trainer.recovery.snapshot import write_snapshot
from trainer.recovery.store import GenerationStore


@dataclass(frozen=True)
class Published:
    name: str
    step: int
    manifest_sha256: str
    save_s: float
    """Wall time of the whole save, write + hash/fsync + publish."""
    blocked_s: float
    """Time the training loop was blocked by it (all of it, in sync mode)."""


def root_cause(error: BaseException) -> BaseException:
    """DCP wraps each rank's error in a CheckpointException (a BaseException whose str()
    holds tracebacks); dig out the original so it can be reported in one line."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        return root_cause(inner)
    cause = error.__cause__ or error.__context__
    if not isinstance(error, OSError) and isinstance(cause, BaseException):
        return root_cause(cause)
    return error


def as_storage_failure(error: BaseException, what: str) -> StorageFailure | None:
    cause = root_cause(error)
    return storage_failure(cause, what) if is_storage_error(cause) else None


class SyncCheckpointer:
    """Writes the snapshot in the loop with stock `dcp.save`, then publishes atomically.

    In a multi-process run all ranks write into one temporary whose name rank 0 chose and
    broadcast, so the generation is a single DCP checkpoint with every rank's shards.
    """

    mode = "sync"

    def __init__(self, store: GenerationStore, attempt_id: str, fault_hook: Callable[[str], None], ranks):
        self.store = store
        self.attempt_id = attempt_id
        self.fault_hook = fault_hook
        self.ranks = ranks
        """`trainer.distributed.Ranks`: which rank this is and how ranks agree."""

    def save(self, state_dict: dict, step: int, manifest: dict) -> Published:
        """Every rank calls this with its own state dict. Rank 0 creates the temporary and
        every rank writes its DCP shards into it; after a barrier (every rank finished
        writing) rank 0 alone seals and publishes, and every rank learns the outcome."""
        started = time.monotonic()
        name = generation_name(step)
        temporary = self.ranks.decide_on_primary(lambda: self._begin(step), f"creating generation {name}")
        try:
            write_snapshot(state_dict, temporary)
            self.fault_hook("after-write")
            self.ranks.barrier(f"writing generation {name}")
            written = time.monotonic()
            sealed = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "recovery",
                      "name": name, "attempt": self.attempt_id,
                      "timings": {"write_s": round(written - started, 6), "mode": self.mode}}
            digest = self.ranks.decide_on_primary(lambda: self._publish(temporary, step, sealed),
                                                  f"publishing generation {name}")
        except BaseException as error:
            if self.ranks.is_primary:
                shutil.rmtree(temporary, ignore_errors=True)
            if isinstance(error, TrainerError):
                raise
            failure = as_storage_failure(error, f"writing generation {name}")
            if failure is not None:
                raise failure from None
            raise
        elapsed = time.monotonic() - started
        return Published(name, step, digest, elapsed, elapsed)

    def _publish(self, temporary: Path, step: int, sealed: dict) -> str:
        """Seal and rename (rank 0); a storage error becomes StorageFailure here, so every
        rank exits with its status (74), not just rank 0."""
        try:
            self.store.publish(temporary, step, sealed, self.fault_hook)
        except BaseException as error:
            failure = as_storage_failure(error, f"writing generation {generation_name(step)}")
            if failure is not None:
                raise failure from None
            raise
        return manifest_digest(self.store.path(generation_name(step)))

    def _begin(self, step: int) -> Path:
        try:
            return self.store.begin(step, self.attempt_id)
        except OSError as error:
            raise storage_failure(error, f"creating generation {generation_name(step)}") from None

    def wait_for_staging(self) -> float:
        return 0.0

    def finalize(self) -> list[Published]:
        return []
