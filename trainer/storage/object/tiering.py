"""Tiered saves: a generation is published on this machine's local tier, then made durable
in the store by a background uploader, so the loop pays for the local write only.

Two facts per generation: *published* (complete on the local tier, what the loop waited for)
and *durable* (its manifest committed in the store, `durable_s` after the save started).

Back-pressure, stated: at most `max_pending_uploads` generations (and exports) are published
locally and not yet durable. A save that would exceed it first waits for the oldest upload to
finish; that wait is training time lost to a slow store and is counted as blocked time. So a
store slower than the cadence slows training down to the store's pace instead of queueing
without bound (and the local tier never holds more than that many non-durable generations).

Uploads run one generation at a time, in publish order (each one's objects in parallel), on
a thread of rank 0's process. An upload that fails after the store's retry bound fails the
run (exit 74) at the loop's next save or at its end.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.errors import RefuseOverwrite, TrainerError, option
from trainer.checkpoint.atomic import manifest_digest, write_file_durably
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.resume import require_verified
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.signing import Signing
from trainer.storage.object.client import ObjectClient
from trainer.storage.base import Durable, Transfer
from trainer.storage.object.lease import lost_lease
from trainer.storage.object.section import ObjectSection
from trainer.storage.object.streaming import fetch_streaming
from trainer.checkpoint.retention import Candidate, select_deletions
from trainer.layout import (ATTEMPTS, EXPORTS, GENERATIONS, MANIFEST, RUN_IDENTITY, SECTIONS, STEP_DIGESTS,
                            STORE_MARKER, RunDirectory)

log = logging.getLogger("trainer")
STREAMING = ".streaming"
"""The local tier's folder for a download the load is reading (`RemoteRun.streaming_folder`)."""


@dataclass(frozen=True)
class StoreRetention:
    keep_last: int | None
    keep_every: int | None
    keep_exports: int | None

    def limits(self, kind: str) -> tuple[int | None, int | None]:
        """(keep_last, keep_every) for generations or exports."""
        return (self.keep_last, self.keep_every) if kind == GENERATIONS else (self.keep_exports, None)


class RemoteRun:
    """A run directory in a store, and this machine's local tier of it."""

    def __init__(self, objects: ObjectClient, local: RunDirectory, signing: Signing | None = None):
        self.objects = objects
        self.local = local
        self.signing = signing
        self.sections = {kind: ObjectSection(objects, folder, signing) for kind, folder in SECTIONS.items()}

    @property
    def url(self) -> str:
        return self.objects.url

    @property
    def generations(self) -> ObjectSection:
        return self.sections[GENERATIONS]

    def adopt_local_tier(self) -> None:
        """The local tier is this store run's working copy, or empty: reconcile deletes what the
        store does not hold, so a directory of another run (a local run, another store's tier)
        must never be taken for one. The tier remembers its store URL in `.trainer-store`."""
        marker = self.local.root / STORE_MARKER
        if marker.is_file():
            owner = marker.read_text().strip()
            if owner != self.url:
                raise RefuseOverwrite(f"{option('--local-tier', self.local.root)} is the local tier of {owner}, not "
                                      f"{self.url}; nothing was changed: choose another {option('--local-tier')}")
            return
        if any(section.is_dir() and any(section.iterdir())
               for section in (self.local.checkpoints, self.local.exports, self.local.attempts)):
            raise RefuseOverwrite(f"{option('--local-tier', self.local.root)} already holds a run directory that is not "
                                  f"a local tier of {self.url}; nothing was changed: choose an empty {option('--local-tier')}")
        marker.write_text(self.url + "\n")

    def pull_attempts(self) -> int:
        """Copy attempt records the local tier lacks (a new pod starts with none), so crash-loop
        detection, `steps_replayed` and the report see every earlier attempt."""
        pulled = 0
        for key in self.objects.list(ATTEMPTS):
            target = self.local.root / key
            if target.exists():
                continue
            data = self.objects.read(key)
            if data is None:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            pulled += 1
        return pulled

    def pull_identity(self) -> None:
        """The store's `run.json` on the local tier, which the local sections check against
        (none there: none here)."""
        data = self.objects.read(RUN_IDENTITY)
        if data is None:
            self.local.identity.unlink(missing_ok=True)
        elif not self.local.identity.is_file() or self.local.identity.read_bytes() != data:
            write_file_durably(self.local.identity, data)

    def local_section(self, kind: str) -> LocalSection:
        return LocalSection(self.local.section(kind), self.signing)

    def reconcile(self) -> list[str]:
        """Under the lease, before choosing: the store is the truth. Remove uncommitted
        prefixes (a warning each, never damage), and drop local-tier copies that are not the
        committed ones (not durable, or another line's). Returns the committed generations."""
        committed = {}
        for kind, section in self.sections.items():
            scan = section.scan()
            for name in scan.uncommitted:
                log.warning("%s has no %s: an uncommitted leftover of a writer that died before its commit; "
                            "never selected, removed", section.url(name), MANIFEST)
                section.discard(name)
            local = self.local_section(kind)
            for name in local.names():
                if name not in scan.committed or section.manifest_digest(name) != manifest_digest(local.path(name)):
                    log.warning("dropped the local copy of %s/%s: it is not the generation committed in %s",
                                local.root.name, name, self.url)
                    local.remove(name)
            committed[kind] = scan.committed
        return committed[GENERATIONS]

    def restorable(self, name: str, committed: list[str], shards: bool = True,
                   damaged: str | None = None) -> tuple[Verification, Transfer]:
        """The committed generation `name` on the local tier, verified: the local copy when its
        manifest is the committed one (reconcile made sure) and it still verifies, else a
        download streamed through the digest. A damaged generation is refused (65) naming the
        newest earlier one that verifies in the store. `shards` False: the local copy's shard
        hashes are left to the load (`shards_pending`), which downloads it again if one fails
        (`damaged`: the problem it found; trainer/run/restoring.py); a download is hashed while
        it streams, every file; with `shards` False it is streamed into the load instead
        (`streaming.fetch_streaming`: `shards_pending`, and the shards' `arrivals`)."""
        local = self.local_section(GENERATIONS)
        if name in local.names():
            verification = local.verify(name, shards=shards) if damaged is None else None
            if verification is not None and verification.ok:
                return verification, Transfer(0, 0.0)
            problem = damaged if verification is None else verification.problem
            log.warning("the local copy of %s does not verify (%s): downloading it again", name, problem)
            local.remove(name)
        if shards:
            verification, transfer = self.generations.fetch(name, local.root)
        else:  # one process: its load reads the shards as they arrive (trainer/storage/object/streaming.py)
            verification, transfer = fetch_streaming(self.generations, name, self.streaming_folder(), local.root)
        require_verified(verification, [earlier for earlier in committed if earlier < name], self.generations.verify)
        return verification, transfer

    def streaming_folder(self) -> Path:
        """Where a streamed download lands until its load verified it, outside the sections (a
        section's temporaries are removed once the claim is made, while this one is still being
        written); emptied first: only a dead attempt's download can be there (the lease is held)."""
        folder = self.local.root / STREAMING
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def set_aside_later_than(self, step: int, fence: Callable[[], None]) -> list[str]:
        """Going back with --from-generation: later committed generations and exports in the
        store are copied to hidden superseded prefixes and removed (exports first, as locally)."""
        abandoned = []
        for kind in (EXPORTS, GENERATIONS):
            section = self.sections[kind]
            for name in section.committed():
                if int(name.split("-")[1]) > step:
                    fence()
                    section.set_aside(name)
                    abandoned.append(f"{section.url(name)}")
        return abandoned

    def push_attempt(self, folder: Path, step_digests: bool = True) -> None:
        """Copy one attempt's record files to the store (small; whole files each time).
        `step_digests` False leaves out the per-step log, which grows with the run: pushed
        after every commit it would cost the square of the run's length; it goes up when the
        attempt ends (its steps past the last commit are what a resume replays)."""
        if not folder.is_dir():
            return
        for path in sorted(folder.iterdir()):
            if path.is_file() and not path.name.startswith(".") and (step_digests or path.name != STEP_DIGESTS):
                self.objects.write(f"{ATTEMPTS}/{folder.name}/{path.name}", path.read_bytes())


class Uploader:
    """Background copies of published local directories into the store (see module doc)."""

    def __init__(self, remote: RemoteRun, max_pending: int, fence: Callable[[], None],
                 retention: StoreRetention, protected: frozenset[str], attempt_folder: Path | None = None):
        self.remote = remote
        self.attempt_folder = attempt_folder
        """Copied to the store after every commit, so a killed attempt's record survives its machine."""
        self.max_pending = max_pending
        self.fence = fence
        self.retention = retention
        self.protected = protected
        self._queue: deque[tuple[str, str, Path, float]] = deque()
        self._pending: list[tuple[str, str]] = []
        self._done: list[Durable] = []
        self._failure: BaseException | None = None
        self._newest_durable: dict[str, str] = {}
        self._condition = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="uploader", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- the loop's side
    def submit(self, kind: str, name: str, directory: Path, save_started: float) -> float:
        """Queue a published directory; blocks while `max_pending` are not yet durable.
        Returns the seconds it waited (back-pressure)."""
        started = time.monotonic()
        with self._condition:
            while len(self._pending) >= self.max_pending and self._failure is None:
                self._condition.wait()
            self._raise_failure()
            self._pending.append((kind, name))
            self._queue.append((kind, name, directory, save_started))
            self._condition.notify_all()
        return time.monotonic() - started

    def completed(self) -> list[Durable]:
        """Uploads finished since the last call; raises the upload failure, if any."""
        with self._condition:
            done, self._done = self._done, []
            if not done:
                self._raise_failure()
            return done

    def drain(self, timeout_s: float | None = None) -> list[Durable]:
        """Wait until everything queued is durable (or `timeout_s` passed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while self._pending and self._failure is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._condition.wait(remaining)
        return self.completed()

    @property
    def failed(self) -> bool:
        """An upload failed: the next `submit`, `completed` or `drain` raises it."""
        with self._condition:
            return self._failure is not None

    def not_durable(self, kind: str) -> set[str]:
        """Names published locally whose upload has not committed: local retention keeps them."""
        with self._condition:
            return {name for pending_kind, name in self._pending if pending_kind == kind}

    def newest_durable(self, kind: str) -> str | None:
        with self._condition:
            return self._newest_durable.get(kind)

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._queue.clear()
            self._condition.notify_all()
        self._thread.join(timeout=5)

    def push_record(self) -> None:
        if self.attempt_folder is not None:
            self.remote.push_attempt(self.attempt_folder, step_digests=False)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            self._pending.clear()
            raise failure

    # ----------------------------------------------------------------- the uploader's side
    def _work(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if self._closed:
                    return
                kind, name, directory, save_started = self._queue[0]
            try:
                transfer = self.remote.sections[kind].commit(name, directory, self.fence)
                durable = Durable(kind, name, transfer.bytes, transfer.seconds, time.monotonic() - save_started)
                self._apply_retention(kind, name)
                self.push_record()
            except BaseException as error:  # noqa: BLE001 - handed to the loop's thread
                error = lost_lease(self.fence) or error  # a takeover explains any failure that follows it
                with self._condition:
                    self._failure = error if isinstance(error, TrainerError) else _as_failure(error, self.remote.url)
                    self._queue.clear()
                    self._condition.notify_all()
                continue
            with self._condition:
                self._queue.popleft()
                self._pending.remove((kind, name))
                self._newest_durable[kind] = max(name, self._newest_durable.get(kind, ""))
                self._done.append(durable)
                self._condition.notify_all()

    def _apply_retention(self, kind: str, committed_now: str) -> None:
        keep_last, keep_every = self.retention.limits(kind)
        apply_store_retention(self.remote.sections[kind], keep_last, keep_every, self.protected | {committed_now},
                              self.fence)


def apply_store_retention(section: ObjectSection, keep_last: int | None, keep_every: int | None,
                          protected: frozenset[str], fence: Callable[[], None]) -> list[str]:
    """The store keeps what the local tier keeps, counted over committed names (each one's
    objects were checked when it was committed); `protected` (the newest durable one, the
    restored one) is never deleted. Removal uncommits first (the manifest), then deletes."""
    if keep_last is None:
        return []
    committed = section.committed()
    doomed = select_deletions([Candidate(name, True) for name in committed], keep_last, keep_every, protected)
    for name in doomed:
        fence()
        section.remove(name)
        log.info("retention removed %s from the store", section.url(name))
    return doomed


def _as_failure(error: BaseException, url: str) -> TrainerError:
    from trainer.errors import StorageFailure, as_storage_failure
    failure = as_storage_failure(error, f"uploading to {url}")
    return failure or StorageFailure(f"uploading to {url} failed: {error.__class__.__name__}: {error}; "
                                     f"earlier generations are intact; rerun with {option('--resume', 'auto')}")
