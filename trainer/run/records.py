"""The attempt record's schema, and its one reader.

`attempts/<utc>-<id>/attempt.json` is written by `AttemptRecorder` (trainer/run/attempts.py)
and read by the crash-loop guard, `list`, `report` and the `auto` cadence. What they agree on
lives here: the statuses a record ends with and the outcomes a reader sees, the event lists
(`generations_published`, `exports_published`), the cost fields, the shape a record must have
to be read at all, and how long an attempt ran (`Lifetime`), from which the failure rate M
of the report's advice and of the auto cadence is computed once (`failure_rate`).

Pure but for `read_attempts`, and torch-free: `list` and `report` import it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

from trainer.layout import ATTEMPT_RECORD, EXPORTS, GENERATIONS, PROGRESS_MARKER, RunDirectory
from trainer.run.interval import FailureRate

log = logging.getLogger("trainer")

# ----------------------------------------------------------------------------- statuses
RUNNING, COMPLETED, INTERRUPTED, PREEMPTED, FAILED = "running", "completed", "interrupted", "preempted", "failed"
REFUSED = "refused"
"""Held the run directory and refused to train (65, 70): restored nothing, did no work."""
KILLED = "killed"
"""Not a status a record holds: a reader's name for a `running` record nobody is running."""
UNFINISHED = (FAILED, RUNNING)  # "running" in a record nobody holds: the process was killed
OUTCOMES = (COMPLETED, INTERRUPTED, PREEMPTED, KILLED, FAILED, REFUSED, RUNNING)
"""Every outcome a reader can give an attempt."""
FAILURES = (INTERRUPTED, PREEMPTED, KILLED, FAILED)
"""Outcomes that count as a failure. `interrupted` is `--interrupt-at-step`, a simulated lost
worker; `preempted` is a signal (an eviction); `killed` a record nobody ended (kill -9, node
loss). Completed and refused attempts do not count."""

# ----------------------------------------------------------------------------- events and costs
PUBLISHED = {GENERATIONS: "generations_published", EXPORTS: "exports_published"}
"""Where a record lists what it published, per kind (GENERATIONS, EXPORTS of trainer/layout.py):
each entry {name, step, save_s, blocked_s, at_s}, plus {durable_s, upload_s} once a store
committed it."""
RESTORED_FROM = {"memory": "tier 0 (memory)", "peer": "tier 0 and a peer's replica (memory)",
                 "disk": "the local disk", "store": "the object store"}
"""Where a restore came from (the record's `restored.tier`): tier 0 (`--memory-dir`), tier 0
with some ranks' parts fetched from their partners' replicas (a lost node), this machine's disk
(the run directory, or an object store's local tier), a download from the store."""
MEMORY, PEER, DISK, STORE = RESTORED_FROM
TIER0 = (MEMORY, PEER)
COSTS = ("restore_s", "verify_s", "download_s", "save_s", "blocked_s", "upload_s", "saves")
"""The fields of a record's `costs`: seconds restoring (verify and download included),
saving, blocked by saves, uploading, and the number of saves."""

OPTIONAL_INT = (int, type(None))
RECORD_SHAPE = {"id": (str,), "status": (str,), "exit_code": OPTIONAL_INT, "restored": (dict, type(None)),
                "last_step": OPTIONAL_INT, "steps_replayed": OPTIONAL_INT, "wall_s": (int, float, type(None)),
                "reason": (str, type(None)), PUBLISHED[GENERATIONS]: (list,), PUBLISHED[EXPORTS]: (list,)}
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
    published = record[PUBLISHED[GENERATIONS]] + record[PUBLISHED[EXPORTS]]
    return all(isinstance(entry, dict) and isinstance(entry.get("name"), str) for entry in published)


# ----------------------------------------------------------------------------- reading
def read_attempts(run_root: Path) -> list[dict]:
    """All readable attempt records of the run directory at `run_root`, oldest first (ids start
    with the UTC start time)."""
    root = RunDirectory(run_root).attempts
    records = []
    if root.is_dir():
        for folder in sorted(root.iterdir()):
            try:
                record = json.loads((folder / ATTEMPT_RECORD).read_text())
            except (OSError, ValueError):
                continue
            if not is_well_formed(record):
                log.warning("ignoring %s: not an attempt record this trainer wrote", folder / ATTEMPT_RECORD)
                continue
            marker = read_progress_marker(folder)
            if record.get("status") == RUNNING and marker is not None:
                # Killed: its record is only as fresh as its last publish; the marker is per step.
                record["last_step"] = max(record.get("last_step") or 0, marker)
            records.append(record)
    return records


def read_progress_marker(folder: Path) -> int | None:
    try:
        return int((folder / PROGRESS_MARKER).read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def attempts_that_trained(records: list[dict]) -> list[dict]:
    """The records of attempts that went ahead: a refused one restored nothing and did no
    work, so it is neither the "previous attempt" of the next one nor part of a crash loop."""
    return [record for record in records if record.get("status") != REFUSED]


def outcome_of(record: dict, live: frozenset[str] = frozenset()) -> str:
    """A `running` record is `killed` unless its process is known to be alive (`live` ids):
    offline, a record alone cannot tell a live attempt from one that died without a word."""
    status = record.get("status")
    if status == RUNNING:
        return RUNNING if record.get("id") in live else KILLED
    return status if status in OUTCOMES else FAILED


# ----------------------------------------------------------------------------- how long it ran
@dataclass(frozen=True)
class Lifetime:
    """How an attempt ended and how long it ran: what the failure rate is measured over."""

    outcome: str
    wall_s: float | None
    """Its wall time; for one that never ended, an estimate (None: nothing to estimate from)."""
    wall_estimated: bool
    startup_s: float | None
    """Process start-up before the record started (interpreter, imports), when measured."""


def lifetime(record: dict, live: frozenset[str] = frozenset(), marker_at_s: float | None = None) -> Lifetime:
    """An attempt's `Lifetime`. One that never ended ran up to the latest of its per-step marker
    (`marker_at_s`: seconds after its start, when the caller knows), its progress points and its
    publishes."""
    outcome = outcome_of(record, live)
    wall, estimated = record.get("wall_s"), False
    if not isinstance(wall, (int, float)) and outcome in (KILLED, RUNNING):
        ends = [marker_at_s] if marker_at_s is not None else []
        progress = record.get("progress") if isinstance(record.get("progress"), dict) else {}
        ends += [p[1] for p in progress.get("points") or () if isinstance(p, list) and len(p) == 2]
        ends += [e.get("at_s") for e in record.get(PUBLISHED[GENERATIONS]) or () if isinstance(e, dict)]
        ends = [end for end in ends if isinstance(end, (int, float))]
        wall, estimated = (max(0.0, max(ends)), True) if ends else (None, False)
    startup = record.get("startup_s")
    return Lifetime(outcome, None if wall is None else float(wall), estimated,
                    float(startup) if isinstance(startup, (int, float)) else None)


class Lived(Protocol):
    outcome: str
    wall_s: float | None
    startup_s: float | None


def exposure_s(lived: Lived) -> float:
    """Seconds the attempt ran, start-up included."""
    return (lived.wall_s or 0.0) + (lived.startup_s or 0.0)


def failure_rate(lives: Iterable[Lived]) -> FailureRate:
    """Failures over the exposure of the attempts that trained (refused ones are left out):
    the M of the report's advice and of `--recover-every-secs auto`, computed here only."""
    trained = [lived for lived in lives if lived.outcome != REFUSED]
    return FailureRate(sum(lived.outcome in FAILURES for lived in trained), sum(map(exposure_s, trained)))
