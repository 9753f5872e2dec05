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

from trainer.errors import StorageFailure
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
    """Writes the snapshot in the loop with stock `dcp.save`, then publishes atomically."""

    mode = "sync"

    def __init__(self, store: GenerationStore, attempt_id: str, fault_hook: Callable[[str], None]):
        self.store = store
        self.attempt_id = attempt_id
        self.fault_hook = fault_hook

    def save(self, state_dict: dict, step: int, manifest: dict) -> Published:
        started = time.monotonic()
        temporary = self._begin(step)
        try:
            write_snapshot(state_dict, temporary)
            self.fault_hook("after-write")
            written = time.monotonic()
            sealed = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "recovery",
                      "name": generation_name(step), "attempt": self.attempt_id,
                      "timings": {"write_s": round(written - started, 6), "mode": self.mode}}
            self.store.publish(temporary, step, sealed, self.fault_hook)
        except BaseException as error:
            shutil.rmtree(temporary, ignore_errors=True)
            failure = as_storage_failure(error, f"writing generation {generation_name(step)}")
            if failure is not None:
                raise failure from None
            raise
        elapsed = time.monotonic() - started
        name = generation_name(step)
        return Published(name, step, manifest_digest(self.store.path(name)), elapsed, elapsed)

    def _begin(self, step: int) -> Path:
        try:
            return self.store.begin(step, self.attempt_id)
        except OSError as error:
            raise storage_failure(error, f"creating generation {generation_name(step)}") from None

    def wait_for_staging(self) -> float:
        return 0.0

    def finalize(self) -> list[Published]:
        return []
