"""The attempt record's schema, and its one reader.

`attempts/<utc>-<id>/attempt.json` is written by `AttemptRecorder` (trainer/run/attempts.py)
and read by the crash-loop guard, `list`, `report` and the `auto` cadence. What they agree on
lives here: the statuses a record ends with and the outcomes a reader sees, the event lists
(`generations_published`, `exports_published`), the cost fields, the shape a record must have
to be read at all, and how long an attempt ran (`Lifetime`), from which the failure rate M
of the report's advice and of the auto cadence is computed once (`failure_rate`).

`AttemptRecord` is a record parsed once (`read_attempt_records`): `list`, `report`, the
auto cadence, the claim (which reads the run's history once per start and carries it) and
the record's start compute with its typed fields. Pure but for the two readers, and torch-free:
`list` and `report` import it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterable, Mapping, Protocol, Sequence

from trainer.layout import ATTEMPT_RECORD, EXPORTS, GENERATIONS, PROGRESS_MARKER, RunDirectory
from trainer.location import is_url
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


# ----------------------------------------------------------------------------- the typed record
def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _integer(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _mapping(value) -> Mapping:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class PublishedEntry:
    """One entry of `generations_published` / `exports_published`."""

    name: str
    step: int | None
    at_s: float | None
    """Seconds after the attempt started when it was published."""
    save_s: float | None
    blocked_s: float | None
    durable_s: float | None
    """Save start → committed in the store; None until a store committed it (or without one)."""

    @classmethod
    def parse(cls, entry: dict) -> PublishedEntry:
        return cls(entry["name"], _integer(entry.get("step")), _number(entry.get("at_s")),
                   _number(entry.get("save_s")), _number(entry.get("blocked_s")), _number(entry.get("durable_s")))


@dataclass(frozen=True)
class Restored:
    """The record's `restored`: the generation the attempt started from."""

    name: str
    step: int | None
    tier: str | None
    """Where it came from (RESTORED_FROM); None in records written before tiers were kept."""
    bytes: int | None
    refused: tuple[str, ...]
    """Faster sources refused on the way (a damaged tier-0 generation)."""

    @classmethod
    def parse(cls, restored: dict) -> Restored:
        return cls(restored["name"], _integer(restored.get("step")), restored.get("tier"),
                   _integer(restored.get("bytes")), tuple(str(line) for line in restored.get("refused") or ()))


@dataclass(frozen=True)
class Costs:
    """The record's `costs` (COSTS); 0 for a field an older record did not keep (`parse`)."""

    restore_s: float
    """Restoring, verification and download included."""
    verify_s: float
    download_s: float
    save_s: float
    blocked_s: float
    """The loop waiting for saves and exports (all of a sync save)."""
    upload_s: float
    saves: int

    @classmethod
    def parse(cls, costs: Mapping) -> Costs:
        seconds = {name: _number(costs.get(name)) or 0.0 for name in COSTS if name != "saves"}
        return cls(**seconds, saves=int(_number(costs.get("saves")) or 0))


@dataclass(frozen=True)
class AttemptRecord:
    """One `attempt.json`, parsed once: typed where readers compute with it, tolerant of older
    records (a field they did not keep is None, 0 or empty). The witness's and the ledger's own
    shapes stay mappings: their readers (`report`) know them."""

    id: str
    status: str
    exit_code: int | None
    reason: str | None
    restored: Restored | None
    first_step: int | None
    last_step: int | None
    witness_step: int | None
    """The step an attempt stopped by a signal computed after its save, for the next attempt's
    replay check, and did not save (trainer/run/witness.py); None otherwise."""
    steps_replayed: int | None
    wall_s: float | None
    startup_s: float | None
    first_step_s: float | None
    started_unix: float | None
    """The start with millisecond precision; from `started_utc` (whole seconds) in older records."""
    last_step_unix: float | None
    """When its last step ended (an attempt that recorded its end; a killed one's is its marker's mtime)."""
    peer: Mapping
    """A lost or unresponsive peer that ended it: {state, ranks}; empty otherwise."""
    joined: Mapping
    """Under a launcher: {at_s, join_s}, when its process began joining the group and how long
    that took (the imports and the rejoin of its start-up); empty otherwise."""
    store: str | None
    """The object store the attempt trained into (`--output s3://…`), else None."""
    host: str | None
    pid: int | None
    costs: Costs
    generations: tuple[PublishedEntry, ...]
    exports: tuple[PublishedEntry, ...]
    progress: tuple[tuple[int, float], ...]
    """Coarse (step, seconds after the start) points."""
    exactness: Mapping
    restore_check: Mapping | None
    replay: Mapping | None
    ledger: tuple[Mapping, ...]
    memory: Mapping
    """Tier 0's sums (`saves`, `blocked_s`), empty without `--memory-dir`."""
    explicit_generation: bool
    """It restored the operator's choice (`--from-generation`): the line after it was left."""
    fingerprint: Mapping
    """What it trained under: the replay witness compares only attempts of the same one."""
    polyaxon: Mapping
    """The Polyaxon run it belonged to (empty when untracked): tells a resumed run from a fresh one."""

    @classmethod
    def parse(cls, record: dict) -> AttemptRecord:
        """Any record (`read_attempt_records` parses only those `is_well_formed` accepts): a
        field of the wrong type reads as absent."""
        restored, points = _mapping(record.get("restored")), _mapping(record.get("progress")).get("points")
        return cls(
            id=str(record.get("id")), status=str(record.get("status")), exit_code=_integer(record.get("exit_code")),
            reason=_text(record.get("reason")),
            restored=Restored.parse(restored) if isinstance(restored.get("name"), str) else None,
            first_step=_integer(record.get("first_step")), last_step=_integer(record.get("last_step")),
            witness_step=_integer(record.get("witness_step")),
            steps_replayed=_integer(record.get("steps_replayed")), wall_s=_number(record.get("wall_s")),
            startup_s=_number(record.get("startup_s")), first_step_s=_number(record.get("first_step_s")),
            started_unix=_started_unix(record), last_step_unix=_number(record.get("last_step_unix")),
            peer=_mapping(record.get("peer")), joined=_mapping(record.get("joined")), store=_store_of(record),
            host=_text(record.get("host")),
            pid=_integer(record.get("pid")), costs=Costs.parse(_mapping(record.get("costs"))),
            generations=_entries(record, GENERATIONS), exports=_entries(record, EXPORTS),
            progress=tuple((p[0], float(p[1])) for p in points or () if isinstance(p, list) and len(p) == 2
                           and isinstance(p[0], int) and isinstance(p[1], (int, float))),
            exactness=_mapping(record.get("exactness")),
            restore_check=record["restore_check"] if isinstance(record.get("restore_check"), dict) else None,
            replay=record["replay"] if isinstance(record.get("replay"), dict) else None,
            ledger=tuple(entry for entry in record.get("ledger") or () if isinstance(entry, dict)),
            memory=_mapping(record.get("memory")), explicit_generation=record.get("explicit_generation") is True,
            fingerprint=_mapping(record.get("fingerprint")), polyaxon=_mapping(record.get("polyaxon")))

    @property
    def computed_to(self) -> int | None:
        """The newest step it computed: its last step, or the step after its stop's save."""
        steps = [step for step in (self.last_step, self.witness_step) if step is not None]
        return max(steps) if steps else None

    def published(self, kind: str) -> tuple[PublishedEntry, ...]:
        """What it published of one kind (GENERATIONS or EXPORTS)."""
        return self.generations if kind == GENERATIONS else self.exports


def _entries(record: dict, kind: str) -> tuple[PublishedEntry, ...]:
    entries = record.get(PUBLISHED[kind])
    return tuple(PublishedEntry.parse(entry) for entry in entries if isinstance(entry, dict)
                 and isinstance(entry.get("name"), str)) if isinstance(entries, list) else ()


def _started_unix(record: dict) -> float | None:
    if (started := _number(record.get("started_unix"))) is not None:
        return started
    try:
        return datetime.fromisoformat(record.get("started_utc")).timestamp()
    except (TypeError, ValueError):
        return None


def _store_of(record: dict) -> str | None:
    """The record's `store`; in records written before it was kept, the store URL of the
    `--output` in its argv."""
    if "store" in record:
        return _text(record["store"])
    argv = [str(arg) for arg in record.get("argv") or []]
    for option, value in zip(argv, argv[1:] + [""]):
        named = option.partition("=")[2] if option.startswith("--output=") else value if option == "--output" else ""
        if is_url(named):
            return named
    return None


# ----------------------------------------------------------------------------- reading
def read_attempt_records(run_root: Path) -> list[AttemptRecord]:
    """All readable attempt records of the run directory at `run_root`, oldest first (ids start
    with the UTC start time), each parsed once into an `AttemptRecord`."""
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
            records.append(AttemptRecord.parse(record))
    return records


def read_progress_marker(folder: Path) -> int | None:
    try:
        return int((folder / PROGRESS_MARKER).read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def attempts_that_trained(records: Sequence[AttemptRecord]) -> list[AttemptRecord]:
    """The records of attempts that went ahead: a refused one restored nothing and did no
    work, so it is neither the "previous attempt" of the next one nor part of a crash loop."""
    return [record for record in records if record.status != REFUSED]


def went_back(records: Sequence[AttemptRecord]) -> list[tuple[str, int]]:
    """(attempt, the step it restored) of every attempt that went back to the operator's choice
    (`--from-generation`): what was saved after that step by earlier attempts left the line."""
    return [(record.id, record.restored.step) for record in records
            if record.explicit_generation and record.restored and record.restored.step is not None]


def outcome_of(record: AttemptRecord, live: frozenset[str] = frozenset()) -> str:
    """A `running` record is `killed` unless its process is known to be alive (`live` ids):
    offline, a record alone cannot tell a live attempt from one that died without a word."""
    if record.status == RUNNING:
        return RUNNING if record.id in live else KILLED
    return record.status if record.status in OUTCOMES else FAILED


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


def lifetime(record: AttemptRecord, live: frozenset[str] = frozenset(), marker_at_s: float | None = None) -> Lifetime:
    """An attempt's `Lifetime`. One that never ended ran up to the latest of its per-step marker
    (`marker_at_s`: seconds after its start, when the caller knows), its progress points and its
    publishes."""
    outcome = outcome_of(record, live)
    wall, estimated = record.wall_s, False
    if wall is None and outcome in (KILLED, RUNNING):
        ends = [marker_at_s] if marker_at_s is not None else []
        ends += [at_s for _, at_s in record.progress]
        ends += [entry.at_s for entry in record.generations if entry.at_s is not None]
        wall, estimated = (max(0.0, max(ends)), True) if ends else (None, False)
    return Lifetime(outcome, wall, estimated, record.startup_s)


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
