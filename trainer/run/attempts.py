"""Attempt records: what each process restored, what it replayed, what it cost, how it ended.

`attempts/<utc>-<id>/attempt.json` is written at start (`running`) and rewritten atomically
as the attempt progresses and ends. An attempt that held the output but refused to train
(a damaged generation or a changed environment, 65; a crash loop, 70) leaves one `refused`
record, so an orchestrator's retries show up too. Records are informational: the newest
verified generation, not an attempt record, decides where training resumes.

Its schema (statuses, event lists, costs) and its one reader are trainer/run/records.py.
The record is changed only through `AttemptRecorder`'s methods, each named for the event it
records (`start`, `restored`, `set_aside`, `reached`, `mark_step`, `waited`, `published`,
`ended`, `refused`, `cadence_changed`).

Coarse progress (`progress`: [step, seconds since the start] every `every` steps) lets the
timeline and the goodput simulator replay real step times; it stays bounded by thinning
(MAX_PROGRESS_POINTS: every other point is dropped and `every` doubles).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from trainer.errors import CrashLoop, TrainerError
from trainer.checkpoint.atomic import atomic_write_bytes, atomic_write_json, encode_json
from trainer.run.witness import ReplayWitness, StepDigestLog
from trainer.parallel.launch import process_age_s
from trainer.parallel.spare import from_spare
from trainer.layout import ATTEMPT_RECORD, ATTEMPT_REQUIREMENTS, ATTEMPT_SUMMARY, EXPORTS, GENERATIONS, PROGRESS_MARKER, RunDirectory
from trainer.run.records import PUBLISHED, REFUSED, RUNNING, UNFINISHED, AttemptRecord, attempts_that_trained

if TYPE_CHECKING:  # `list` and `report` read records without importing torch
    from trainer.checkpoint.restore import Restored
    from trainer.checkpoint.section import Published

log = logging.getLogger("trainer")

PROGRESS_EVERY, MAX_PROGRESS_POINTS = 8, 128
"""Coarse progress: a point every 8 steps at first; past 128 points, every other one goes."""
MAX_CADENCE_CHANGES = 64
"""The newest auto-cadence changes an attempt keeps in its record."""


def new_attempt_id(now: datetime | None = None) -> str:
    """The start time to the microsecond, then a random tag: ids sort in start order, which
    `read_attempt_records` and the crash-loop check rely on, even for attempts that die and restart
    within one second (a restart loop of a fast failure)."""
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%dT%H%M%S.%f}Z-{secrets.token_hex(3)}"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def resolved_requirements() -> str:
    """Every installed distribution as name==version, sorted (what actually ran). Name and
    Version are read from each METADATA header only: `Distribution.metadata` parses the whole
    file, long description included, which cost 0.2 s of every start."""
    pins = set()
    for distribution in metadata.distributions():
        header = (distribution.read_text("METADATA") or distribution.read_text("PKG-INFO") or "").split("\n\n", 1)[0]
        fields = dict(line.split(": ", 1) for line in header.splitlines() if ": " in line and not line[:1].isspace())
        if fields.get("Name") and fields.get("Version"):
            pins.add(f"{fields['Name']}=={fields['Version']}")
    return "\n".join(sorted(pins, key=str.lower)) + "\n"


# ----------------------------------------------------------------------------- decisions
def steps_replayed(previous: AttemptRecord | None, restored_step: int | None) -> int | None:
    """Work the previous attempt did beyond the generation now restored (lost and redone).

    A killed attempt's `last_step` is only as fresh as its progress marker (every step, in
    the page cache), so for a node loss this is a lower bound. A stopped attempt's step after
    its save (`witness_step`) counts: it was computed, and is computed again.
    """
    if previous is None or previous.computed_to is None:
        return None
    return max(0, previous.computed_to - (restored_step or 0))


def newest_generation(record: dict) -> str | None:
    """The generation an attempt would fall back to now: its newest publish, else what it restored."""
    published = record.get(PUBLISHED[GENERATIONS]) or [record.get("restored") or {}]
    return published[-1].get("name")


def previous_attempt(records: Sequence[AttemptRecord]) -> AttemptRecord | None:
    trained = attempts_that_trained(records)
    return trained[-1] if trained else None


def is_crash_loop(records: Sequence[AttemptRecord], restoring: str | None, limit: int) -> bool:
    """True when the last `limit` attempts that trained all started from `restoring` (None:
    from scratch) and all died before publishing anything newer: trying again would burn
    the allocation."""
    records = attempts_that_trained(records)
    if limit <= 0 or len(records) < limit:
        return False
    recent = records[-limit:]
    return all((r.restored.name if r.restored else None) == restoring and not r.generations
               and r.status in UNFINISHED for r in recent)


def refuse_crash_loop(records: Sequence[AttemptRecord], restoring: str | None, limit: int, attempts_dir: Path) -> None:
    if is_crash_loop(records, restoring, limit):
        raise CrashLoop(f"the last {limit} attempts all started from {restoring or 'scratch'} and died "
                        f"before publishing a newer generation; inspect {attempts_dir}, fix the "
                        f"cause, then rerun (or pass --max-failed-attempts 0)")


def world_size_change(stored_world_size: int | None, world_size: int) -> dict:
    """Record fields for a resume at a different world size (allowed only with
    --allow-drift world_size): what changed, and that exactness is not promised across it."""
    if stored_world_size in (None, world_size):
        return {}
    return {"world_size_change": {
        "from": stored_world_size, "to": world_size, "exact": False,
        "note": "exactness across a world-size change is not promised: the global batch order and "
                "position continue unchanged, but each rank's random streams (dropout, noise) now "
                "cover a different slice of every batch, ranks that did not exist start from fresh "
                "per-rank seeds, and gradients are summed in a different order"}}


# ----------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class AttemptStart:
    """What an attempt knows when its record starts: the typed half of attempt.json (the
    recorder's events add the rest). `fields()` is its one serialisation."""

    restored: dict | None = None
    """{name, step, manifest_sha256} of the generation this attempt restores."""
    explicit_generation: bool = False
    """The operator chose it (--from-generation)."""
    previous_attempt: str | None = None
    steps_replayed: int | None = None
    allowed_drift: tuple[str, ...] = ()
    drift: tuple[str, ...] = ()
    checkpoint_mode: str | None = None
    device: str | None = None
    fingerprint: dict = field(default_factory=dict)
    store: str | None = None
    """The object store URL of the run directory (None: on this disk)."""
    polyaxon: dict | None = None
    world_size: int = 1
    world_size_change: dict | None = None
    """From `world_size_change()`, when the world size differs from the restored one's."""
    allow_unsigned: bool = False
    """--allow-unsigned: unsigned generations were adopted under a signing key."""
    exactness: dict = field(default_factory=lambda: {"exact": True})
    """`Exactness.as_record()`: whether this configuration resumes bit-exactly, and why not."""
    joined: dict | None = None
    """Under a launcher: `{"at_s": process age when the join began, "join_s": how long it took}`
    (`Ranks.joined`), the imports and the rejoin parts of a restart's start-up."""

    def fields(self) -> dict:
        fields = {"restored": self.restored, "explicit_generation": self.explicit_generation, "set_aside": [],
                  "previous_attempt": self.previous_attempt, "steps_replayed": self.steps_replayed,
                  "allowed_drift": list(self.allowed_drift), "drift": list(self.drift),
                  "checkpoint_mode": self.checkpoint_mode, "device": self.device, "fingerprint": self.fingerprint,
                  "store": self.store, "polyaxon": self.polyaxon, "world_size": self.world_size,
                  "allow_unsigned": self.allow_unsigned, "exactness": self.exactness}
        return fields | ({"world_size_change": self.world_size_change} if self.world_size_change else {}) \
            | ({"joined": self.joined} if self.joined else {})


@dataclass(frozen=True)
class RefusedStart:
    """The record of an attempt that held the run directory and refused to train (65, 70)."""

    considered_generation: str | None
    previous_attempt: str | None
    polyaxon: dict | None

    def fields(self) -> dict:
        return {"restored": None, "considered_generation": self.considered_generation,
                "previous_attempt": self.previous_attempt, "polyaxon": self.polyaxon}


def initial_record(attempt_id: str, argv: list[str], fields: dict) -> dict:
    return {
        "id": attempt_id, "status": RUNNING, "exit_code": None, "reason": None,
        "started_utc": utc_now(), "started_unix": round(time.time(), 3), "ended_utc": None, "wall_s": None,
        "host": socket.gethostname(), "pid": os.getpid(), "argv": argv,
        "last_step": None, PUBLISHED[GENERATIONS]: [], PUBLISHED[EXPORTS]: [],
        "costs": {"restore_s": 0.0, "save_s": 0.0, "blocked_s": 0.0, "saves": 0},  # the rest of COSTS when paid
        "startup_s": process_age_s(), "warm_spare": from_spare(os.environ), "progress": {"every": PROGRESS_EVERY, "points": []},
        **fields,
    }


class LaterWrites:
    """The record's writes that need not hold the loop (the per-step path's progress points):
    written atomically by one background thread, newest first (a write still waiting is
    replaced by a newer one), so the loop's thread pays for encoding the record, not for its
    two fsyncs. `settle()` waits for what was handed over: every write made on the loop's
    thread comes after it, so an older record never replaces a newer one."""

    def __init__(self, path: Path):
        self.path = path
        self._pending: bytes | None = None
        self._writing = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def later(self, data: bytes) -> None:
        with self._changed:
            self._pending = data
            self._changed.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._write, name="trainer-record", daemon=True)
            self._thread.start()

    def settle(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._pending is None and not self._writing)

    def _write(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None)
                data, self._pending, self._writing = self._pending, None, True
            try:
                atomic_write_bytes(self.path, data)
            except OSError as error:  # a full disk: the next write on the loop's thread says it
                log.warning("could not write %s in the background: %s", self.path, error.strerror)
            finally:
                with self._changed:
                    self._writing = False
                    self._changed.notify_all()


class AttemptRecorder:
    """This attempt's record. `persist` is False on ranks other than 0 of a multi-process
    run: they keep the same record in memory (the loop reports the same events everywhere)
    but only rank 0 writes it."""

    def __init__(self, run: RunDirectory, attempt_id: str, record: dict, persist: bool = True,
                 started: float | None = None, replay: ReplayWitness | None = None):
        self.folder = run.attempt_folder(attempt_id)
        self._record = record
        self.persist = persist
        self.replay = replay or ReplayWitness({})
        """Compares each step with what earlier attempts computed for it (the exactness witness)."""
        self._digests = StepDigestLog(self.folder, persist)
        self._started = time.monotonic() if started is None else started
        self._marker: int | None = None
        self._marked: int | None = None
        """The last step `mark_step` recorded: where training stood if it ends without a
        `reached()` (a failure, a grace timeout)."""
        self._marked_unix = 0.0
        self._later = LaterWrites(self.folder / ATTEMPT_RECORD)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, run: RunDirectory, attempt_id: str, argv: list[str], start: AttemptStart,
              persist: bool = True, replay: ReplayWitness | None = None) -> "AttemptRecorder":
        """Write the `running` record; its wall time counts from here."""
        recorder = cls(run, attempt_id, initial_record(attempt_id, argv, start.fields()), persist, replay=replay)
        recorder._create_folder()
        recorder._flush()
        return recorder

    @classmethod
    def refused_before_start(cls, run: RunDirectory, attempt_id: str, argv: list[str], refusal: TrainerError,
                             start: RefusedStart, started: float) -> None:
        """One write: this attempt held the output and refused to train. `started` is the
        monotonic time the attempt began, for its wall time."""
        exit_code, reason = refusal.exit_code, str(refusal)
        recorder = cls(run, attempt_id, initial_record(attempt_id, argv, start.fields()), started=started)
        recorder._record["started_unix"] = round(time.time() - (time.monotonic() - started), 3)
        recorder._create_folder()
        recorder.ended(REFUSED, exit_code, reason)

    def refused(self, exit_code: int, reason: str, considered: str | None) -> None:
        """A refusal found after the record started (while restoring): nothing was restored."""
        self._record.update(restored=None, steps_replayed=None, considered_generation=considered)
        self.ended(REFUSED, exit_code, reason)

    def ended(self, status: str, exit_code: int, reason: str | None = None, summary: dict | None = None) -> None:
        if self._marker is not None:
            os.close(self._marker)
            self._marker = None
        self._digests.close()
        if self._marked is not None and self._marked > (self._record["last_step"] or 0):
            self._record["last_step"] = self._marked  # ended between publishes: the work it did counts
        if self._marked is not None:  # when its last step ended: where the next attempt's restart cost R starts
            self._record["last_step_unix"] = round(self._marked_unix, 3)
        self._record.update(status=status, exit_code=exit_code, reason=reason, ended_utc=utc_now(),
                            wall_s=self.elapsed_s())
        if summary is not None and self.persist:
            atomic_write_json(self.folder / ATTEMPT_SUMMARY, summary)
        try:
            self._flush()
        except OSError as error:
            if exit_code == 0:
                raise
            # Failing because the disk is full must not hide the original error behind this one.
            log.warning("could not record the end of attempt %s: %s", self._record["id"], error.strerror)

    # ------------------------------------------------------------------ events
    def peer_failed(self, state: str, ranks: tuple[int, ...]) -> None:
        """The attempt ends because another rank was lost or stopped answering (`peer`)."""
        self._record["peer"] = {"state": state, "ranks": list(ranks)}

    def restore_checked(self, differing: dict[int, list[str]], not_compared: str | None = None) -> None:
        """The restored state against the digest its save stored: {rank: differing sections},
        or why it was not compared."""
        if not_compared is not None:
            self._record["restore_check"] = {"compared": False, "reason": not_compared}
        else:
            self._record["restore_check"] = {"matched": not differing,
                                             **({"differing": {str(r): s for r, s in differing.items()}}
                                                if differing else {})}
        self._flush()

    def restored(self, restored: "Restored", verify_s: float) -> None:
        """Restore cost: verifying the generation (before the record existed) plus loading it."""
        self._add_cost(restore_s=restored.load_s + verify_s, verify_s=verify_s)

    def set_aside(self, names: list[str]) -> None:
        if names:
            self._record["set_aside"] = names
            self._flush()

    def reached(self, step: int, first: bool = False) -> None:
        """Training stands at `step` (with `first`, the step this attempt starts from); the
        witness's step after a stop's save (`witnessed`) is not where it stands."""
        if (witness := self._record.get("witness_step")) is not None:
            step = min(step, witness - 1)
        if first:
            self._record["first_step"] = step
        self._record["last_step"] = step
        self._flush()

    def mark_step(self, step: int, digest: str) -> None:
        """Per-step progress for `steps_replayed` after a kill -9: one pwrite into the page
        cache (survives the process, not the node; no fsync on the hot path); and the step's
        digest (`witness.step_digest`), appended and checked against what an earlier attempt
        computed for it."""
        if not self.persist:
            return
        self._digests.append(step, digest)
        first_mismatch = self.replay.step(step, digest)
        if (replay := self.replay.as_record()) is not None:
            self._record["replay"] = replay
        if first_mismatch:
            self._flush()
        if self._marker is None:
            self._marker = os.open(self.folder / PROGRESS_MARKER, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._marker, f"{step:>12}\n".encode(), 0)
        if self._marked is None:  # what the restart cost before training ran: build, restore, first step
            self._record["first_step_s"] = self.elapsed_s()
        self._marked, self._marked_unix = step, time.time()
        progress = self._record["progress"]
        if step % progress["every"] == 0:
            progress["points"].append([step, self.elapsed_s()])
            if len(progress["points"]) > MAX_PROGRESS_POINTS:
                progress["every"] *= 2
                progress["points"] = [p for p in progress["points"] if p[0] % progress["every"] == 0]
            self._flush(later=True)  # at most MAX_PROGRESS_POINTS writes per doubling of the steps

    def witnessed(self, step: int, digest: str) -> None:
        """The step computed after a stop signal's save, not saved: its digest for the next
        attempt's replay check (and this attempt's own), recorded as `witness_step`, never as
        where training stands (`last_step` stays the saved step)."""
        if not self.persist:
            return
        self._digests.append(step, digest)
        self.replay.step(step, digest)
        if (replay := self.replay.as_record()) is not None:
            self._record["replay"] = replay
        self._record["witness_step"] = step

    def cadence_changed(self, change: dict, key: str = "cadence_changes") -> None:
        """An auto cadence re-derived its interval (`change`: CadenceChange.as_record, or
        StepsChange's under `memory_cadence_changes` for tier 0)."""
        changes = self._record.setdefault(key, [])
        changes.append(change)
        del changes[:-MAX_CADENCE_CHANGES]
        self._flush()

    def restored_from(self, tier: str) -> None:
        """The restore's source changed while loading (a damaged local copy downloaded again)."""
        self._record["restored"] = {**self._record["restored"], "tier": tier, "shards_verified": "before loading"}
        self._flush()

    def downloaded(self, download_s: float, size: int) -> None:
        """The restored generation came from the store (no matching local-tier copy)."""
        self._add_cost(download_s=download_s, restore_s=download_s)
        self._record["downloaded_bytes"] = size

    def durable(self, kind: str, name: str, upload_s: float, durable_s: float) -> None:
        """A published generation (GENERATIONS) or export (EXPORTS) was committed in the store."""
        for entry in reversed(self._record[PUBLISHED[kind]]):
            if entry["name"] == name:
                entry.update(durable_s=round(durable_s, 6), upload_s=round(upload_s, 6))
                break
        self._record.setdefault("durable", {})[PUBLISHED[kind]] = name
        self._add_cost(upload_s=upload_s)
        self._flush()

    def waited(self, blocked_s: float) -> None:
        """The loop waited for async staging before a step."""
        if blocked_s:
            self._add_cost(blocked_s=blocked_s)

    def published(self, kind: str, published: "Published", step: int | None = None, ledger: dict | None = None) \
            -> None:
        """A generation (GENERATIONS) or export (EXPORTS) was published while training stood
        at `step` (None: where it last stood); `ledger`: its sample ledger (`sample_ledger`),
        in the same write of the record (each write is two fsyncs on the loop's thread)."""
        self._record[PUBLISHED[kind]].append({"name": published.name, "step": published.step,
                                   "save_s": round(published.save_s, 6), "blocked_s": round(published.blocked_s, 6),
                                   "at_s": self.elapsed_s()})
        if ledger:
            self._record.setdefault("ledger", []).append({"step": published.step, **ledger})
        self._add_cost(save_s=published.save_s, blocked_s=published.blocked_s)
        self._record["costs"]["saves"] += 1
        self.reached(step if step is not None else (self._record["last_step"] or 0))

    def memory_saved(self, published: "Published") -> None:
        """A tier-0 generation (trainer/storage/memory/): not durable, so not among the
        published generations, nor in `costs` (C of the advice is the durable saves' cost); the
        loop was held for its `blocked_s` (all of `save_s` when sync, the staging when async).
        Flushed: a kill -9 right after it still leaves it in the record, which the next attempt
        may restore it from."""
        memory = self._record.setdefault("memory", {"saves": 0, "save_s": 0.0, "blocked_s": 0.0})
        memory.update(saves=memory["saves"] + 1, save_s=round(memory["save_s"] + published.save_s, 6),
                      blocked_s=round(memory.get("blocked_s", 0.0) + published.blocked_s, 6), newest=published.name)
        self._flush()

    def sample_ledger(self, step: int, ledger: dict) -> None:
        """A published generation's sample ledger (trainer/data/ledger.py), for `report`."""
        if ledger:
            self._record.setdefault("ledger", []).append({"step": step, **ledger})
            self._flush()

    # ------------------------------------------------------------------ reading
    def elapsed_s(self) -> float:
        """Seconds since this attempt started: its wall time at the end, and when each
        publish happened (`at_s`), for the recovery report's timeline."""
        return round(time.monotonic() - self._started, 3)

    @property
    def record(self) -> dict:
        """A copy of the record as it stands (for observers and the exit line)."""
        return json.loads(json.dumps(self._record))

    @property
    def newest_generation(self) -> str | None:
        return newest_generation(self._record)

    @property
    def newest_durable(self) -> str | None:
        """The newest generation this attempt made durable in a store."""
        return self._record.get("durable", {}).get(PUBLISHED[GENERATIONS])

    @property
    def restore_s(self) -> float:
        return self._record["costs"]["restore_s"]

    # ------------------------------------------------------------------ private
    def _add_cost(self, **seconds: float) -> None:
        costs = self._record["costs"]
        for name, value in seconds.items():
            costs[name] = round(costs.get(name, 0.0) + value, 6)

    def _create_folder(self) -> None:
        if self.persist:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.folder / ATTEMPT_REQUIREMENTS, resolved_requirements().encode())

    def _flush(self, later: bool = False) -> None:
        """The record written (`later`: by `LaterWrites`' thread, off the loop's)."""
        if not self.persist:
            return
        if later:
            self._later.later(encode_json(self._record))
            return
        self._later.settle()
        atomic_write_json(self.folder / ATTEMPT_RECORD, self._record)
