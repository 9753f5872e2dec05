"""The recovery checkpointer: turns live training state into a published generation.

Lifecycle verbs, as the loop sees them: `save()` after a step the cadence picked,
`wait_for_staging()` before the next training step may mutate what was saved, and
`finalize()` before the process exits (normal end, interrupt, preemption). `save()` and
`finalize()` return the generations that became published during the call, so the loop
records them and applies retention only once a generation really exists.

* `SyncCheckpointer` writes and commits inside `save()`; the other two verbs are no-ops.
* `AsyncCheckpointer` stages a host copy of the state and writes it in the background with
  `dcp.async_save`; a background thread commits the generation as soon as the write
  completed, and it is reported at the next `save()`/`finalize()`.

Both write through `HashingFileSystemWriter` (stock DCP format) and commit through the same
commit strategy (checkpoint/commit.py: a rename on one disk, a manifest in an object store),
so they produce the same files and the same manifests, with one process or under torchrun.

Under torchrun an async save is still one DCP checkpoint of every rank's shards. Its
collectives (DCP's planning and its final gather, the commit's agreement) run on background
threads, each on a gloo group of its own (`Coordinator.background()`), never on the group the
loop trains with. A failure on any rank (a write error, a full disk, a lost upload or lease)
reaches every rank at the next `save()` or at `finalize()`, where the ranks agree in the
loop's thread (`raise_if_any_failed`): every rank exits with the same status, none hangs. A
rank whose staging or committer thread failed never enters the save's next background
collective; the others wait for it only as long as the background groups' bound
(`--background-timeout-secs`, re-derived from every save measured: `Coordinator.saved_in`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from trainer import seams
from trainer.config import WriterConfig
from trainer.errors import PeerFailure, TrainerError, as_storage_failure, reraise_as_storage_failure, root_cause
from trainer.checkpoint.commit import Commit
from trainer.checkpoint.coordination import Coordinator, SingleProcess, raise_if_any_failed
from trainer.checkpoint.manifest import GenerationFacts, Manifest
from trainer.checkpoint.snapshot import write_snapshot
from trainer.checkpoint.staging import ReusableStager
from trainer.checkpoint.section import LocalSection, Published
from trainer.layout import generation_name

if TYPE_CHECKING:
    from trainer.checkpoint.writer import HashingFileSystemWriter

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

    def defer(self, tensors: list[torch.Tensor], share: tuple[int, int] = (0, 1)) -> None:
        """`tensors` change only in an optimizer step, which calls `wait_for_staging()` first:
        an async save copies them beside the loop's next forward and backward. `share` (rank,
        world size): they are replicas, each staged and written by one rank (`ReusableStager.defer`)."""

    def completed(self) -> list[Published]:
        """What committed in the background since the last call, without waiting (async, one process)."""

    def drain(self) -> list[Published]:
        """Wait until every save in flight is committed, keeping the checkpointer open."""

    def finalize(self) -> list[Published]:
        """Drain everything in flight before the process exits."""

    def close_after_failure(self) -> list[Published]:
        """After a failure: finish what is in flight; never raises."""

    def committed_without_peers(self) -> list[Published]:
        """After a lost peer: what committed, without a collective (a short bounded wait at most)."""


def effective_mode(requested: str, device: torch.device) -> str:
    """The mode a requested `--checkpoint-mode` (auto | sync | async, validated by the CLI)
    runs as. `auto` is async on CUDA, where staging is a DMA into pinned memory that runs
    beside the GPU's work, and sync on CPU: there async takes less of the loop's own thread
    (bench/loop_bench.py: 7–8 ms a save against 61–94 ms at 98 MB), but its background work needs
    a core the loop does not use and its staged copy doubles the state's host memory. The
    same with one process and under torchrun."""
    if requested == "auto":
        return "async" if device.type == "cuda" else "sync"
    return requested


def build_checkpointer(mode: str, commit: Commit, attempt_id: str, device: torch.device,
                       coordinator: Coordinator = SingleProcess(), config: WriterConfig = WriterConfig()):
    """The checkpointer for an effective mode ("sync" or "async"). Every rank calls it at the
    same point (an async one creates its background process groups)."""
    if mode == "async":
        return AsyncCheckpointer(commit, attempt_id, device, config, coordinator)
    return SyncCheckpointer(commit, attempt_id, config, coordinator)


class _Checkpointer:
    """What both modes share: the commit strategy, the manifest, one-line failures."""

    mode = ""

    def __init__(self, commit: Commit, attempt_id: str, config: WriterConfig, coordinator: Coordinator):
        self.commit = commit
        self.local = commit.local
        self.attempt_id = attempt_id
        self.config = config
        self.coordinator = coordinator
        self._unreported: list[Published] = []
        """Published generations not yet returned to the loop (a save failed right after
        draining them); handed over by `close_after_failure()` so the record stays complete."""

    def _describe(self, facts: GenerationFacts, timings: dict):
        timings = {"mode": self.mode + self.commit.mode_suffix, **timings}
        return lambda files: Manifest.for_generation(facts, self.attempt_id, timings, files)

    @staticmethod
    def _failure(error: BaseException, step: int) -> BaseException:
        """A storage error as StorageFailure (exit 74, one line); anything else unwrapped
        from DCP's per-rank CheckpointException so its message stays one line. Our own errors
        stay as they are (a lost lease explains the failed commit it interrupted)."""
        if isinstance(error, TrainerError):
            return error
        failure = as_storage_failure(error, f"writing generation {generation_name(step)}")
        return failure if failure is not None else root_cause(error)

    def close_after_failure(self) -> list[Published]:
        """After a failure elsewhere in the loop: finish what is in flight (it commits if it
        succeeds, so no writer thread outlives the output lock). Its own error is logged,
        not raised: the original failure is the one to report."""
        unreported, self._unreported = self._unreported, []
        try:
            return unreported + self._finish_quietly()
        except BaseException as error:  # noqa: BLE001 - reporting the first failure matters more
            log.warning("recovery save in flight did not complete: %s", error)
            return unreported

    def _finish_quietly(self) -> list[Published]:
        return []

    def committed_without_peers(self) -> list[Published]:
        """After a lost peer: rank 0's generations committed before it was lost, so the attempt
        record lists every generation on disk. No collective, and no wait beyond the moment a
        commit that was agreeing with the lost peer fails (`_committed_in_background`)."""
        unreported, self._unreported = self._unreported, []
        return unreported + self._committed_in_background() if self.coordinator.is_primary else []

    def _committed_in_background(self) -> list[Published]:
        return []

    def wait_for_staging(self) -> float:
        return 0.0

    def defer(self, tensors: list[torch.Tensor], share: tuple[int, int] = (0, 1)) -> None:
        return None

    def completed(self) -> list[Published]:
        """Saves committed in the background since the last call, without waiting."""
        return []

    def drain(self) -> list[Published]:
        """Wait until every save in flight is committed."""
        return []

    def finalize(self) -> list[Published]:
        return []


class SyncCheckpointer(_Checkpointer):
    """Writes the snapshot in the loop (`dcp.save`, our hashing writer), then commits.

    In a multi-process run all ranks write one DCP checkpoint (into one temporary whose name
    rank 0 chose, or each into its own scratch for an object store), and the commit strategy
    makes it a generation; every rank learns the outcome."""

    mode = "sync"

    def __init__(self, commit: Commit, attempt_id: str, config: WriterConfig = WriterConfig(),
                 coordinator: Coordinator = SingleProcess()):
        super().__init__(commit, attempt_id, config, coordinator)

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        started = time.monotonic()
        step, coordinator = facts.step, self.coordinator
        name = generation_name(step)
        temporary = self.commit.begin(step, self.attempt_id, coordinator)
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="recovery-digest") as digesting:
                # The loop waits for this save anyway: the digest runs beside the write (its
                # kernels and the writer's hash and fsyncs release the GIL).
                resolving = digesting.submit(facts.resolved, state_dict)
                digests = write_snapshot(state_dict, temporary, self.config, alone=not self.coordinator.distributed)
                facts = resolving.result()
            seams.crash_point("after-write")
            timings = {"write_s": time.monotonic() - started}
            committed = self.commit.commit(temporary, step, self._describe(facts, timings), digests, coordinator)
        except BaseException as error:
            self.commit.abandon(temporary, coordinator)
            if isinstance(error, TrainerError):
                raise
            reraise_as_storage_failure(error, f"writing generation {name}")
        elapsed = time.monotonic() - started
        return [Published(name, step, committed.manifest_sha256, elapsed, elapsed, committed.upload_s)]


@dataclass(frozen=True)
class _InFlight:
    step: int
    staging: Future
    """Done when the staged copy is complete and the live state may change again."""
    written: Future
    """Done when DCP wrote every shard."""
    facts: Future
    """The generation's facts, its state digest computed from the staged copy: once done
    (and `written`), the staging buffers may be reused."""
    committed: Future
    """Result: the Published generation (on every rank), once committed."""


PEER_LOSS_SETTLE_S = 2.0
"""After a lost peer, how long rank 0 waits for a commit in flight to finish one way or the
other (its collectives fail as soon as the peer's connections are cut) before the attempt's
record is closed without it."""


class AsyncCheckpointer(_Checkpointer):
    """Stages the state into host memory and writes it in the background (`dcp.async_save`).

    One write at a time (the staging buffers are reused): `save()` first waits for the
    previous write; commits queue behind it, at most `commit.max_pending` at once (one on a
    disk; `--max-pending-uploads` in an object store). A background failure is raised at the
    next `save()` or `finalize()` (with one process also at `wait_for_staging()`); storage
    errors become `StorageFailure` (exit 74).
    """

    mode = "async"

    def __init__(self, commit: Commit, attempt_id: str, device: torch.device,
                 config: WriterConfig = WriterConfig(), coordinator: Coordinator = SingleProcess()):
        super().__init__(commit, attempt_id, config, coordinator)
        self.stager = ReusableStager(device)
        # Two groups of their own: DCP's collectives run on its writer thread, the commit's on
        # the committer thread; a commit may still be agreeing while the next write plans.
        self._write_group = coordinator.background()
        self._commit_group = coordinator.background()
        # One thread that waits for each background write and then commits it, in save order,
        # so a generation is committed as soon as it is written, not at the next save.
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recovery-commit")
        # The exactness witness's digest of each save, from its staged copy, off the loop
        # (`GenerationFacts.digest_later`: one process), beside the write.
        self._digester = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recovery-digest")
        self._in_flight: deque[_InFlight] = deque()
        self._closed = False

    def new_writer(self, directory: Path) -> HashingFileSystemWriter:
        from trainer.checkpoint.writer import HashingFileSystemWriter  # DCP: imported by the first save

        """The DCP storage writer for one generation."""
        return HashingFileSystemWriter(directory, self.config)

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        import torch.distributed.checkpoint as dcp  # imported by the first save, not at start-up

        from trainer.checkpoint.writer import RankZeroCopies

        if self._closed:
            raise RuntimeError("AsyncCheckpointer.save() after finalize()")
        started = time.monotonic()
        step = facts.step
        self._unreported += self._settle(keep=max(0, self.commit.max_pending - 1))
        temporary = self.commit.begin(step, self.attempt_id, self.coordinator)
        failure = None
        try:
            writer = self.new_writer(temporary)
            response = dcp.async_save(state_dict, storage_writer=writer, async_stager=self.stager,
                                      planner=RankZeroCopies(), process_group=self._write_group.group,
                                      no_dist=not self.coordinator.distributed)
        except BaseException as error:  # noqa: BLE001 - every rank must hear of it, below
            self.commit.abandon(temporary, self.coordinator)
            failure = self._failure(error, step)
        else:
            blocked = time.monotonic() - started
            resolved = self._digester.submit(lambda staged=self.stager.staged, facts=facts:
                                             facts.resolved(staged.result()))
            committed = self._committer.submit(self._commit_when_written, response.upload_completion, writer,
                                               temporary, resolved, started, blocked)
            self._in_flight.append(_InFlight(step, response.staging_completion, response.upload_completion,
                                             resolved, committed))
        # A failure of this rank's own part (its staging buffers could not be allocated) must
        # stop every rank here, before the others wait for it inside DCP's collectives.
        if self.coordinator.distributed:
            raise_if_any_failed(self.coordinator, failure, f"starting the save of {generation_name(step)}")
        elif failure is not None:
            raise failure
        done, self._unreported = self._unreported, []
        return done

    def _commit_when_written(self, written: Future, writer: HashingFileSystemWriter, temporary: Path,
                             resolved: Future, started: float, blocked: float) -> Published:
        """Runs on the committer thread: the commit, only after the write completed."""
        try:
            written.result()
            facts = resolved.result()
            if self.stager.torn is not None:  # changed before its copy was safe: never committed
                raise self.stager.torn
            seams.crash_point("after-write")
            timings = {"write_s": time.monotonic() - started, "save_blocked_s": blocked,
                       "staging_s": self.stager.last_staging_s or 0.0}
            committed = self.commit.commit(temporary, facts.step, self._describe(facts, timings), writer.digests,
                                           self._commit_group)
        except BaseException:
            self.commit.abandon(temporary, self.coordinator)
            raise
        return Published(generation_name(facts.step), facts.step, committed.manifest_sha256,
                         time.monotonic() - started, blocked, committed.upload_s)

    def _settle(self, keep: int) -> list[Published]:
        """Wait for the write in flight, and for commits until at most `keep` are pending;
        the ranks then agree on the outcome: any rank's failure is raised on every rank.
        Generations committed before a failure stay unreported, for `close_after_failure()`."""
        published: list[Published] = []
        failure: BaseException | None = None
        if self._in_flight:
            self._in_flight[-1].written.exception()
            self._in_flight[-1].facts.exception()  # the staging buffers are free again
        while failure is None and self._in_flight and (len(self._in_flight) > keep
                                                       or self._in_flight[0].committed.done()):
            done, failure = self._collect(self._in_flight[0])
            published += done
        if failure is not None:
            self._unreported += published
        if not self.coordinator.distributed:
            if failure is not None:
                raise failure
            return published
        try:
            raise_if_any_failed(self.coordinator, failure, "writing a recovery generation")
            # Every rank reports rank 0's publishes, so every rank's record of them agrees.
            published = self.coordinator.decide_on_primary(lambda: published, "reporting the generations committed")
        except PeerFailure:
            if failure is None:  # committed before the peer was lost: `committed_without_peers` reports them
                self._unreported += published
            raise
        for generation in published:  # the same times on every rank, so the same bounds
            self._write_group.saved_in(generation.save_s)
            self._commit_group.saved_in(generation.save_s)
        return published

    def _collect(self, in_flight: _InFlight) -> tuple[list[Published], BaseException | None]:
        """The oldest save's outcome, waiting for it: what it published, or its failure in
        one-line form. Raises only when the wait itself is interrupted (a signal)."""
        try:
            published = in_flight.committed.result()
        except BaseException as error:
            if not in_flight.committed.done():
                raise  # interrupted while waiting: the save is still in flight
            self._in_flight.popleft()
            return [], self._failure(error, in_flight.step)
        self._in_flight.popleft()
        return [published], None

    def defer(self, tensors: list[torch.Tensor], share: tuple[int, int] = (0, 1)) -> None:
        self.stager.defer(tensors, share)

    def wait_for_staging(self) -> float:
        """Block until the staged copy is safe from the loop's next change: its host copies
        made, its device copies ahead of the device's next work (`ReusableStager.fence`: on a
        GPU the host does not wait for them); returns the seconds blocked. With one process a
        failed save is raised here already; with several it waits for the next save, where
        every rank learns of it."""
        if not self._in_flight:
            return 0.0
        in_flight = self._in_flight[-1]
        started = time.monotonic()
        try:
            self.stager.fence()
        except Exception:  # noqa: BLE001 - the staging's own failure (or a torn copy), read below
            in_flight.staging.exception()
        staging_failed = self.stager.torn is not None or (in_flight.staging.done()
                                                          and in_flight.staging.exception() is not None)
        if not self.coordinator.distributed:
            if staging_failed or (in_flight.committed.done() and in_flight.committed.exception() is not None):
                while self._in_flight:  # the write fails with the staging error: raise it in one-line form
                    done, failure = self._collect(self._in_flight[0])
                    self._unreported += done
                    if failure is not None:
                        raise failure
        return time.monotonic() - started

    def completed(self) -> list[Published]:
        """What committed already, without waiting (and without a collective): with one
        process the save in flight once its commit is done (its failure raised, as at the next
        `save()`); with several nothing, they learn it together at the next `save()` or
        `finalize()`."""
        if self.coordinator.distributed or not self._in_flight or not self._in_flight[0].committed.done():
            return []
        return self._settle(keep=0)

    def drain(self) -> list[Published]:
        """Wait until every save in flight is committed (and the ranks agree on it), keeping
        the staging buffers: for a caller that times one save at a time (bench/)."""
        return self._settle(keep=0)

    def finalize(self) -> list[Published]:
        """Commit everything in flight, agree on it, and release the staging buffers."""
        if self._closed:
            return []
        try:
            return self.drain()
        finally:
            if not self._in_flight:
                self._close()

    def _committed_in_background(self) -> list[Published]:
        """The saves in flight whose commit completed, oldest first, up to the first that did
        not. A commit that was agreeing with the lost peer when it was cut off fails (or, on
        rank 0, returns what it published) at about the moment the loop heard of the loss: it
        is given `PEER_LOSS_SETTLE_S` to say which, never more."""
        published = []
        deadline = time.monotonic() + PEER_LOSS_SETTLE_S
        while self._in_flight:
            committed = self._in_flight[0].committed
            wait([committed], timeout=max(0.0, deadline - time.monotonic()))
            if not committed.done() or committed.exception() is not None:
                break
            published.append(self._in_flight.popleft().committed.result())
        return published

    def _finish_quietly(self) -> list[Published]:
        """After a failure: wait for this rank's saves in flight without any collective (the
        other ranks may be gone); rank 0 returns what it committed."""
        published = []
        while self._in_flight:
            in_flight = self._in_flight.popleft()
            error = in_flight.committed.exception()
            if error is None:
                published.append(in_flight.committed.result())
            else:
                log.warning("recovery save of step %d did not complete: %s", in_flight.step,
                            self._failure(error, in_flight.step))
        self._close()
        return published if self.coordinator.is_primary else []

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._committer.shutdown(wait=True)
            self._digester.shutdown(wait=True)
            self.stager.close()
