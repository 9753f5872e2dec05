"""Attempt records: what each process restored, what it replayed, what it cost, how it ended.

`attempts/<utc>-<id>/attempt.json` is written at start (`running`) and rewritten atomically
as the attempt progresses and ends. An attempt that held the output but refused to train
(a damaged generation or a changed environment, 65; a crash loop, 70) leaves one `refused`
record, so an orchestrator's retries show up too. Records are informational: the newest
verified generation, not an attempt record, decides where training resumes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from trainer.recovery.atomic import atomic_write_bytes, atomic_write_json

ATTEMPTS_DIR = "attempts"
log = logging.getLogger("trainer")


def new_attempt_id(now: datetime | None = None) -> str:
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def resolved_requirements() -> str:
    """Every installed distribution as name==version, sorted (what actually ran)."""
    pins = {f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]}
    return "\n".join(sorted(pins, key=str.lower)) + "\n"


def read_attempts(output: Path) -> list[dict]:
    """All readable attempt records, oldest first (ids start with the UTC start time)."""
    root = output / ATTEMPTS_DIR
    records = []
    if root.is_dir():
        for folder in sorted(root.iterdir()):
            try:
                record = json.loads((folder / "attempt.json").read_text())
            except (OSError, ValueError):
                continue
            if not is_well_formed(record):
                log.warning("ignoring %s: not an attempt record this trainer wrote", folder / "attempt.json")
                continue
            marker = read_progress_marker(folder)
            if record.get("status") == "running" and marker is not None:
                # Killed: its record is only as fresh as its last publish; the marker is per step.
                record["last_step"] = max(record.get("last_step") or 0, marker)
            records.append(record)
    return records


OPTIONAL_INT = (int, type(None))
RECORD_SHAPE = {"id": (str,), "status": (str,), "exit_code": OPTIONAL_INT, "restored": (dict, type(None)),
                "last_step": OPTIONAL_INT, "steps_replayed": OPTIONAL_INT, "wall_s": (int, float, type(None)),
                "reason": (str, type(None)), "generations_published": (list,), "exports_published": (list,)}
"""The fields whose types readers rely on (the crash-loop guard, `list`, steps replayed)."""


def is_well_formed(record) -> bool:
    """A hand-edited or foreign attempt.json must not crash the next resume or `list`."""
    if not isinstance(record, dict):
        return False
    if not all(isinstance(record.get(field), kinds) for field, kinds in RECORD_SHAPE.items()):
        return False
    restored = record["restored"]
    if restored is not None and not isinstance(restored.get("name"), str):
        return False
    published = record["generations_published"] + record["exports_published"]
    return all(isinstance(entry, dict) and isinstance(entry.get("name"), str) for entry in published)


PROGRESS_MARKER = "last_step"


def read_progress_marker(folder: Path) -> int | None:
    try:
        return int((folder / PROGRESS_MARKER).read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def steps_replayed(previous: dict | None, restored_step: int | None) -> int | None:
    """Work the previous attempt did beyond the generation now restored (lost and redone).

    A killed attempt's `last_step` is only as fresh as its last record update (each publish),
    so for it this is a lower bound.
    """
    if previous is None or previous.get("last_step") is None:
        return None
    return max(0, previous["last_step"] - (restored_step or 0))


def newest_generation(record: dict) -> str | None:
    """The generation an attempt would fall back to now: its newest publish, else what it restored."""
    published = record.get("generations_published") or [record.get("restored") or {}]
    return published[-1].get("name")


UNFINISHED = ("failed", "running")  # "running" in a record nobody holds: the process was killed
REFUSED = "refused"


def attempts_that_trained(records: list[dict]) -> list[dict]:
    """The records of attempts that went ahead: a refused one restored nothing and did no
    work, so it is neither the "previous attempt" of the next one nor part of a crash loop."""
    return [record for record in records if record.get("status") != REFUSED]


def is_crash_loop(records: list[dict], restoring: str | None, limit: int) -> bool:
    """True when the last `limit` attempts that trained all started from `restoring` (None:
    from scratch) and all died before publishing anything newer: trying again would burn
    the allocation."""
    records = attempts_that_trained(records)
    if limit <= 0 or len(records) < limit:
        return False
    recent = records[-limit:]
    return all((r.get("restored") or {}).get("name") == restoring and not r.get("generations_published")
               and r.get("status") in UNFINISHED for r in recent)


def initial_record(attempt_id: str, argv: list[str], fields: dict) -> dict:
    return {
        "id": attempt_id, "status": "running", "exit_code": None, "reason": None,
        "started_utc": utc_now(), "started_unix": round(time.time(), 3), "ended_utc": None, "wall_s": None,
        "host": socket.gethostname(), "pid": os.getpid(), "argv": argv,
        "last_step": None, "generations_published": [], "exports_published": [],
        "costs": {"restore_s": 0.0, "save_s": 0.0, "blocked_s": 0.0, "saves": 0},
        **fields,
    }


class AttemptRecorder:
    def __init__(self, output: Path, attempt_id: str, record: dict, persist: bool = True):
        self.folder = output / ATTEMPTS_DIR / attempt_id
        self.record = record
        self.persist = persist
        """False on ranks other than 0 of a multi-process run: they keep the same record in
        memory (the loop updates it the same way everywhere) but only rank 0 writes it."""
        self._started = time.monotonic()
        self._marker: int | None = None

    def elapsed_s(self) -> float:
        """Seconds since this attempt started: its wall time at the end, and when each
        publish happened (`at_s`), for the recovery report's timeline."""
        return round(time.monotonic() - self._started, 3)

    def mark_step(self, step: int) -> None:
        """Per-step progress for `steps_replayed` after a kill -9: one pwrite into the page
        cache (survives the process, not the node; no fsync on the hot path)."""
        if not self.persist:
            return
        if self._marker is None:
            self._marker = os.open(self.folder / PROGRESS_MARKER, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._marker, f"{step:>12}\n".encode(), 0)

    @classmethod
    def start(cls, output: Path, attempt_id: str, argv: list[str], fields: dict,
              persist: bool = True) -> "AttemptRecorder":
        recorder = cls(output, attempt_id, initial_record(attempt_id, argv, fields), persist)
        recorder._create_folder()
        recorder.flush()
        return recorder

    @classmethod
    def record_refusal(cls, output: Path, attempt_id: str, argv: list[str], exit_code: int, reason: str,
                       fields: dict, started: float) -> None:
        """One write: this attempt held the output and refused to train. `started` is the
        monotonic time the attempt began, for its wall time."""
        recorder = cls(output, attempt_id, initial_record(attempt_id, argv, fields))
        recorder._started = started
        recorder.record["started_unix"] = round(time.time() - (time.monotonic() - started), 3)
        recorder._create_folder()
        recorder.finish(REFUSED, exit_code, reason)

    def _create_folder(self) -> None:
        if self.persist:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.folder / "requirements.txt", resolved_requirements().encode())

    def flush(self) -> None:
        if self.persist:
            atomic_write_json(self.folder / "attempt.json", self.record)

    def update(self, **fields) -> None:
        self.record.update(fields)
        self.flush()

    def add_cost(self, **seconds: float) -> None:
        costs = self.record["costs"]
        for name, value in seconds.items():
            costs[name] = round(costs.get(name, 0.0) + value, 6)

    def finish(self, status: str, exit_code: int, reason: str | None = None, summary: dict | None = None) -> None:
        if self._marker is not None:
            os.close(self._marker)
            self._marker = None
        self.record.update(status=status, exit_code=exit_code, reason=reason, ended_utc=utc_now(),
                           wall_s=self.elapsed_s())
        if summary is not None and self.persist:
            atomic_write_json(self.folder / "summary.json", summary)
        try:
            self.flush()
        except OSError as error:
            if exit_code == 0:
                raise
            # Failing because the disk is full must not hide the original error behind this one.
            log.warning("could not record the end of attempt %s: %s", self.record["id"], error.strerror)
