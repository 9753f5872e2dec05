"""The recovery checkpointer: turns live training state into a published generation.

Lifecycle verbs, as the loop sees them: `save()` after a step the cadence picked,
`wait_for_staging()` before the next training step may mutate what was saved, and
`finalize()` before the process exits (normal end, interrupt, preemption). `save()` and
`finalize()` return the generations that became published during the call, so the loop
records them and applies retention only once a generation really exists.

* `SyncCheckpointer` writes and publishes inside `save()`; the other two verbs are no-ops.
* `AsyncCheckpointer` stages a host copy of the state and writes it in the background with
  `dcp.async_save`; the generation is published (manifest, fsync, rename) by a background
  thread as soon as the write completed, and reported at the next `save()`/`finalize()`.

Both write through `HashingFileSystemWriter` (stock DCP format) and publish through
`LocalSection.publish`, so they produce the same files and the same manifests.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp

from trainer import seams
from trainer.errors import TrainerError, as_storage_failure, reraise_as_storage_failure, root_cause, storage_failure
from trainer.checkpoint.coordination import Coordinator, SingleProcess
from trainer.checkpoint.manifest import GenerationFacts, Manifest
from trainer.checkpoint.snapshot import single_process, write_snapshot
from trainer.checkpoint.staging import ReusableStager
from trainer.checkpoint.section import LocalSection, Published
from trainer.checkpoint.writer import HashingFileSystemWriter, WriterConfig
from trainer.layout import generation_name

log = logging.getLogger("trainer")


class Checkpointer(Protocol):
    """What the attempt needs of a recovery checkpointer (sync, async, or direct to an object
    store). `save()` and `finalize()` return the generations that became published during the
    call, so they are recorded (and pruned) only once they really exist."""

    mode: str
    local: LocalSection
    """Where it publishes on this machine (a scratch directory, for a direct checkpointer)."""

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]: ...

    def wait_for_staging(self) -> float:
        """Block until a staged copy is complete (before parameters change); the seconds waited."""

    def finalize(self) -> list[Published]:
        """Drain everything in flight before the process exits."""

    def close_after_failure(self) -> list[Published]:
        """After a failure: finish what is in flight; never raises."""


def effective_mode(requested: str, device: torch.device, world_size: int = 1) -> str:
    """The mode a requested `--checkpoint-mode` (auto | sync | async, validated by the CLI)
    runs as. `auto` is async on CUDA, where staging is a DMA into pinned memory that runs
    beside the GPU's work, and sync on CPU, where staging is a memcpy on the same cores the
    loop needs, so async saves little there (bench/loop_overhead.py measures it).

    Multi-process runs write sync: the async path publishes from a background thread of one
    process, and the cross-rank protocol (rank 0 creates, all write, barrier, rank 0
    publishes) is not built for it yet; the CLI refuses an explicit `async` there."""
    if world_size > 1:
        return "sync"
    if requested == "auto":
        return "async" if device.type == "cuda" else "sync"
    return requested


def build_checkpointer(mode: str, local: LocalSection, attempt_id: str, device: torch.device,
                       coordinator: Coordinator = SingleProcess(), config: WriterConfig = WriterConfig()):
    """The checkpointer for an effective mode ("sync" or "async")."""
    if mode == "async":
        return AsyncCheckpointer(local, attempt_id, device, config)
    return SyncCheckpointer(local, attempt_id, config, coordinator)


class _Checkpointer:
    """What both modes share: temporaries, sealing the manifest, one-line failures."""

    mode = ""

    def __init__(self, local: LocalSection, attempt_id: str, config: WriterConfig):
        self.local = local
        self.attempt_id = attempt_id
        self.config = config
        self._unreported: list[Published] = []
        """Published generations not yet returned to the loop (a save failed right after
        draining them); handed over by `close_after_failure()` so the record stays complete."""

    def _begin(self, step: int) -> Path:
        try:
            return self.local.begin(step, self.attempt_id)
        except OSError as error:
            raise storage_failure(error, f"creating generation {generation_name(step)}") from None

    def _publish(self, temporary: Path, facts: GenerationFacts, timings: dict, digests: dict | None) -> str:
        timings = {"mode": self.mode, **timings}
        return self.local.publish(temporary, facts.step,
                                  lambda files: Manifest.for_generation(facts, self.attempt_id, timings, files),
                                  digests)

    @staticmethod
    def _failure(error: BaseException, step: int) -> BaseException:
        """A storage error as StorageFailure (exit 74, one line); anything else unwrapped
        from DCP's per-rank CheckpointException so its message stays one line."""
        failure = as_storage_failure(error, f"writing generation {generation_name(step)}")
        return failure if failure is not None else root_cause(error)

    def close_after_failure(self) -> list[Published]:
        """After a failure elsewhere in the loop: finish what is in flight (it publishes if
        it succeeds, so no writer thread outlives the output lock). Its own error is logged,
        not raised: the original failure is the one to report."""
        unreported, self._unreported = self._unreported, []
        try:
            return unreported + self.finalize()
        except BaseException as error:  # noqa: BLE001 - reporting the first failure matters more
            log.warning("recovery save in flight did not complete: %s", error)
            return unreported

    def wait_for_staging(self) -> float:
        return 0.0

    def finalize(self) -> list[Published]:
        return []


class SyncCheckpointer(_Checkpointer):
    """Writes the snapshot in the loop (`dcp.save`, our hashing writer), then publishes.

    In a multi-process run all ranks write into one temporary whose name rank 0 chose and
    broadcast, so the generation is a single DCP checkpoint with every rank's shards; after
    a barrier rank 0 alone seals and publishes, and every rank learns the outcome.
    """

    mode = "sync"

    def __init__(self, local: LocalSection, attempt_id: str, config: WriterConfig = WriterConfig(),
                 coordinator: Coordinator = SingleProcess()):
        super().__init__(local, attempt_id, config)
        self.coordinator = coordinator

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        started = time.monotonic()
        step, coordinator = facts.step, self.coordinator
        name = generation_name(step)
        temporary = coordinator.decide_on_primary(lambda: self._begin(step), f"creating generation {name}")
        try:
            digests = write_snapshot(state_dict, temporary, self.config)
            seams.crash_point("after-write")
            coordinator.barrier(f"writing generation {name}")
            timings = {"write_s": time.monotonic() - started}
            # Rank 0 knows the digests of its own shards only; with several ranks it hashes
            # the others' (already fsynced by their writers) while sealing.
            known = digests if not coordinator.distributed else None
            digest = coordinator.decide_on_primary(lambda: self._publish_or_fail(temporary, facts, timings, known),
                                                   f"publishing generation {name}")
        except BaseException as error:
            if coordinator.is_primary:
                shutil.rmtree(temporary, ignore_errors=True)
            if isinstance(error, TrainerError):
                raise
            reraise_as_storage_failure(error, f"writing generation {name}")
        elapsed = time.monotonic() - started
        return [Published(name, step, digest, elapsed, elapsed)]

    def _publish_or_fail(self, temporary: Path, facts: GenerationFacts, timings: dict, known) -> str:
        """Seal and rename (rank 0); a storage error becomes StorageFailure here, so every
        rank exits with its status (74), not just rank 0."""
        try:
            return self._publish(temporary, facts, timings, known)
        except BaseException as error:
            reraise_as_storage_failure(error, f"writing generation {generation_name(facts.step)}")


@dataclass(frozen=True)
class _InFlight:
    step: int
    staging: Future
    """Done when the staged copy is complete and the live state may change again."""
    published: Future
    """Result: the Published generation, once written, sealed and renamed."""


class AsyncCheckpointer(_Checkpointer):
    """Stages the state into host memory and writes it in the background (`dcp.async_save`).

    At most one save is in flight: `save()` first waits for the previous one to be published
    (its staging buffers are reused). A background failure is raised at the next `save()`,
    `wait_for_staging()` or `finalize()`; storage errors become `StorageFailure` (exit 74).
    """

    mode = "async"

    def __init__(self, local: LocalSection, attempt_id: str, device: torch.device,
                 config: WriterConfig = WriterConfig()):
        super().__init__(local, attempt_id, config)
        self.stager = ReusableStager(device)
        # One thread that waits for each background write and then publishes it, so a
        # generation becomes durable as soon as it is written, not at the next save.
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recovery-publish")
        self._in_flight: _InFlight | None = None
        self._closed = False

    def new_writer(self, directory: Path) -> HashingFileSystemWriter:
        """The DCP storage writer for one generation."""
        return HashingFileSystemWriter(directory, self.config)

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        if self._closed:
            raise RuntimeError("AsyncCheckpointer.save() after finalize()")
        started = time.monotonic()
        step = facts.step
        self._unreported += self.drain()
        temporary = self._begin(step)
        try:
            writer = self.new_writer(temporary)
            response = dcp.async_save(state_dict, storage_writer=writer, async_stager=self.stager,
                                      no_dist=single_process())
        except BaseException as error:
            shutil.rmtree(temporary, ignore_errors=True)
            raise self._failure(error, step) from None
        blocked = time.monotonic() - started
        published = self._publisher.submit(self._publish_when_written, response.upload_completion, writer,
                                           temporary, facts, started, blocked)
        self._in_flight = _InFlight(step, response.staging_completion, published)
        done, self._unreported = self._unreported, []
        return done

    def _publish_when_written(self, upload: Future, writer: HashingFileSystemWriter, temporary: Path,
                              facts: GenerationFacts, started: float, blocked: float) -> Published:
        """Runs on the publisher thread: the atomic publish, only after the write completed."""
        try:
            upload.result()
            seams.crash_point("after-write")
            timings = {"write_s": time.monotonic() - started, "save_blocked_s": blocked,
                       "staging_s": self.stager.last_staging_s or 0.0}
            digest = self._publish(temporary, facts, timings, writer.digests)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return Published(generation_name(facts.step), facts.step, digest, time.monotonic() - started, blocked)

    def drain(self) -> list[Published]:
        """Wait for the save in flight to be published; raise its failure if it failed."""
        in_flight = self._in_flight
        if in_flight is None:
            return []
        try:
            published = in_flight.published.result()
        except BaseException as error:
            if not in_flight.published.done():
                raise  # interrupted while waiting: the save is still in flight
            self._in_flight = None
            raise self._failure(error, in_flight.step) from None
        self._in_flight = None
        return [published]

    def wait_for_staging(self) -> float:
        """Block until the staged copy is complete; returns the seconds blocked."""
        in_flight = self._in_flight
        if in_flight is None:
            return 0.0
        started = time.monotonic()
        try:
            in_flight.staging.result()
        except Exception:
            self.drain()  # the write fails with the staging error: raise it in one-line form
            raise
        published = in_flight.published
        if published.done() and published.exception() is not None:
            self.drain()
        return time.monotonic() - started

    def finalize(self) -> list[Published]:
        """Drain the save in flight (publishing it) and release the staging buffers."""
        if self._closed:
            return []
        try:
            return self.drain()
        finally:
            if self._in_flight is None:
                self._closed = True
                self._publisher.shutdown(wait=True)
                self.stager.close()
