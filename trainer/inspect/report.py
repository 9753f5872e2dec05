"""The recovery report: what a run's attempts computed, redid, lost and paid, derived from
attempt records alone.

Pure computation (no I/O, no clock): `build_report` takes the records `read_attempts`
returns, plus the few facts only the filesystem knows (which attempts are alive, when a
killed attempt last marked a step), so every number here can be checked by hand from the
records. `trainer.inspect.listing.report_run` reads the run and prints; `trainer.inspect.timeline` draws.

Definitions (the README repeats them):
- computed: `last_step - first_step` (0 when it never started a step, e.g. refused).
- replayed: the first `steps_replayed` of those steps, which an earlier attempt had already
  computed (capped at computed: an attempt killed while replaying redid only that many).
- durable: the step of the newest generation the attempt published (with a store: committed
  there), else the one it restored, else the step it started from.
- lost: `last_step - durable`: computed after the attempt's newest durable point, so the
  next attempt has to redo it (0 for a completed attempt and for one still running).
- useful: the durable step of the last attempt that trained: progress that is kept.
- goodput: useful / sum of computed.
- wall lost to restarts: lost steps x that attempt's seconds per step, plus every restore
  (verification included), plus the whole wall time of refused attempts.
- checkpoint overhead: the seconds the loop waited for saves and exports (`blocked_s`, all
  of a sync save), as a share of the summed wall time of the attempts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

OUTCOMES = ("completed", "interrupted", "preempted", "killed", "failed", "refused", "running")
"""Every outcome a row can have; `killed` is a `running` record nobody is running any more."""


@dataclass(frozen=True)
class Publish:
    """One published generation, as the timeline draws it."""

    name: str
    step: int
    at_s: float | None
    """Seconds after the attempt's start (None in records written before it was kept)."""


@dataclass(frozen=True)
class AttemptRow:
    id: str
    outcome: str
    exit_code: int | None
    restored: str | None
    restored_step: int | None
    first_step: int
    last_step: int
    computed: int
    replayed: int
    lost: int
    durable_step: int
    restore_s: float
    verify_s: float
    save_s: float
    blocked_s: float
    saves: int
    wall_s: float | None
    wall_estimated: bool
    """True for a killed attempt: its end is the time of its last step marker (else its last
    publish), since it never wrote one."""
    time_to_durable_s: float | None
    """Seconds from the attempt's start until its first generation was published."""
    start_s: float | None
    """Seconds after the first attempt's start (None: no readable start time)."""
    generations: tuple[Publish, ...]
    reason: str | None


@dataclass(frozen=True)
class Totals:
    attempts: int
    restarts: int
    outcomes: dict
    useful: int
    computed: int
    replayed: int
    lost: int
    goodput: float | None
    wall_s: float
    span_s: float | None
    """From the first attempt's start to the last one's end, gaps between attempts included."""
    wall_lost_s: float
    restore_s: float
    checkpoint_s: float
    checkpoint_share: float | None


@dataclass(frozen=True)
class Report:
    rows: tuple[AttemptRow, ...]
    totals: Totals

    def as_dict(self) -> dict:
        return asdict(self)


def start_time(record: dict) -> float | None:
    """Unix time the attempt started: `started_unix` (ms), else `started_utc` (whole seconds,
    in records written before `started_unix` was kept)."""
    if isinstance(record.get("started_unix"), (int, float)):
        return float(record["started_unix"])
    try:
        return datetime.fromisoformat(record.get("started_utc")).timestamp()
    except (TypeError, ValueError):
        return None


def outcome_of(record: dict, live: frozenset[str]) -> str:
    """A `running` record is `killed` unless its process is known to be alive: offline, a
    record alone cannot tell a live attempt from one that died without a word."""
    status = record.get("status")
    if status == "running":
        return "running" if record.get("id") in live else "killed"
    return status if status in OUTCOMES else "failed"


def durable_entries(record: dict) -> list[dict]:
    """The attempt's generations that survive its machine: every publish on a local run, only
    those committed in the store (`durable_s`) on a store run."""
    entries = [entry for entry in record.get("generations_published", []) if isinstance(entry, dict)]
    return [entry for entry in entries if "durable_s" in entry] if record.get("store") else entries


def durable_at_s(entry: dict) -> float | None:
    """Seconds into the attempt when a generation became durable (publish, or store commit)."""
    at = entry.get("at_s")
    if not isinstance(at, (int, float)):
        return None
    if isinstance(entry.get("durable_s"), (int, float)):
        return at - _number(entry.get("save_s")) + entry["durable_s"]
    return at


def durable_step(record: dict) -> int:
    published = [entry["step"] for entry in durable_entries(record) if isinstance(entry.get("step"), int)]
    if published:
        return max(published)
    restored = (record.get("restored") or {}).get("step")
    return restored if isinstance(restored, int) else (record.get("first_step") or 0)


def _number(value, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) else default


def attempt_row(record: dict, live: frozenset[str], marker_unix: float | None, origin: float | None) -> AttemptRow:
    outcome = outcome_of(record, live)
    costs = record.get("costs") if isinstance(record.get("costs"), dict) else {}
    first, last = record.get("first_step"), record.get("last_step")
    started = isinstance(first, int) and isinstance(last, int) and outcome != "refused"
    if not started:  # refused, or killed before its first step: nothing computed
        restored_step = (record.get("restored") or {}).get("step")
        first = first if isinstance(first, int) else restored_step if isinstance(restored_step, int) else 0
        last = first
    computed = max(0, last - first)
    durable = durable_step(record) if started else first
    lost = 0 if outcome in ("completed", "running") else max(0, last - durable)
    generations = tuple(Publish(e["name"], e.get("step"), e.get("at_s"))
                        for e in record.get("generations_published", []))
    start = start_time(record)
    wall, estimated = record.get("wall_s"), False
    if not isinstance(wall, (int, float)) and outcome in ("killed", "running"):
        # Never ended: up to its last per-step marker, else its last publish.
        ends = [marker_unix - start] if marker_unix is not None and start is not None else []
        ends += [g.at_s for g in generations if isinstance(g.at_s, (int, float))]
        wall, estimated = (max(0.0, max(ends)), True) if ends else (None, False)
    first_publish = next((at for entry in durable_entries(record) if (at := durable_at_s(entry)) is not None), None)
    return AttemptRow(
        id=str(record.get("id")), outcome=outcome, exit_code=record.get("exit_code"),
        restored=(record.get("restored") or {}).get("name"), restored_step=(record.get("restored") or {}).get("step"),
        first_step=first, last_step=last, computed=computed,
        replayed=min(computed, record.get("steps_replayed") or 0), lost=lost, durable_step=durable,
        restore_s=_number(costs.get("restore_s")), verify_s=_number(costs.get("verify_s")),
        save_s=_number(costs.get("save_s")), blocked_s=_number(costs.get("blocked_s")),
        saves=int(_number(costs.get("saves"))), wall_s=None if wall is None else float(wall),
        wall_estimated=estimated, time_to_durable_s=first_publish,
        start_s=None if start is None or origin is None else start - origin,
        generations=generations, reason=record.get("reason"))


def seconds_per_step(row: AttemptRow) -> float | None:
    """Average wall time of one training step of this attempt: its wall time without the
    restore and the time it waited for saves, over the steps it computed."""
    if not row.computed or row.wall_s is None:
        return None
    return max(0.0, row.wall_s - row.restore_s - row.blocked_s) / row.computed


def wall_lost(row: AttemptRow) -> float:
    if row.outcome == "refused":
        return row.wall_s or 0.0
    return row.restore_s + row.lost * (seconds_per_step(row) or 0.0)


def build_report(records: list[dict], live: frozenset[str] = frozenset(),
                 markers: dict[str, float] | None = None) -> Report:
    """`records` oldest first; `live`: ids of attempts whose process is alive; `markers`:
    id -> unix time of the attempt's last per-step marker (only used for killed ones)."""
    markers = markers or {}
    starts = [s for s in map(start_time, records) if s is not None]
    origin = min(starts) if starts else None
    rows = tuple(attempt_row(r, live, markers.get(r.get("id")), origin) for r in records)
    trained = [row for row in rows if row.outcome != "refused"]
    useful = trained[-1].durable_step if trained else 0
    computed = sum(row.computed for row in rows)
    wall = sum(row.wall_s or 0.0 for row in rows)
    checkpoint = sum(row.blocked_s for row in rows)
    ends = [row.start_s + row.wall_s for row in rows if row.start_s is not None and row.wall_s is not None]
    outcomes = {name: sum(row.outcome == name for row in rows) for name in OUTCOMES}
    totals = Totals(
        attempts=len(rows), restarts=max(0, len(rows) - 1),
        outcomes={name: count for name, count in outcomes.items() if count},
        useful=useful, computed=computed, replayed=sum(row.replayed for row in rows),
        lost=sum(row.lost for row in rows), goodput=useful / computed if computed else None,
        wall_s=round(wall, 3), span_s=round(max(ends), 3) if ends else None,
        wall_lost_s=round(sum(wall_lost(row) for row in rows), 3),
        restore_s=round(sum(row.restore_s for row in rows), 3),
        checkpoint_s=round(checkpoint, 3), checkpoint_share=checkpoint / wall if wall else None)
    return Report(rows, totals)


def _cell(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def format_report(report: Report, output: str) -> str:
    """The terminal table: one row per attempt, then the run's totals."""
    lines = [f"recovery report {output}", ""]
    lines.append(f"  {'#':>3} {'attempt':<24} {'outcome':<11} {'exit':>4} {'restored':<15} {'steps':>11} "
                 f"{'computed':>8} {'replayed':>8} {'lost':>5} {'restore s':>9} {'verify s':>8} {'save s':>7} "
                 f"{'blocked s':>9} {'to durable s':>12} {'wall s':>8}")
    for number, row in enumerate(report.rows, 1):
        wall = _cell(row.wall_s, "{:.1f}") + ("~" if row.wall_estimated else "")
        lines.append(
            f"  {number:>3} {row.id:<24} {row.outcome:<11} {_cell(row.exit_code):>4} {_cell(row.restored):<15} "
            f"{f'{row.first_step}..{row.last_step}':>11} {row.computed:>8} {row.replayed:>8} {row.lost:>5} "
            f"{row.restore_s:>9.3f} {row.verify_s:>8.3f} {row.save_s:>7.3f} {row.blocked_s:>9.3f} "
            f"{_cell(row.time_to_durable_s, '{:.2f}'):>12} {wall:>8}")
    t = report.totals
    outcomes = ", ".join(f"{count} {name}" for name, count in t.outcomes.items()) or "none"
    lines += ["", f"  attempts           {t.attempts} ({outcomes})",
              f"  useful steps       {t.useful}",
              f"  steps computed     {t.computed} (replayed {t.replayed}, lost {t.lost})",
              f"  goodput            {_cell(t.goodput, '{:.1%}')}",
              f"  wall time          {t.wall_s:.1f} s in attempts"
              + (f", {t.span_s:.1f} s from first start to last end" if t.span_s is not None else ""),
              f"  lost to restarts   {t.wall_lost_s:.1f} s (restores {t.restore_s:.1f} s)",
              f"  checkpoint overhead {t.checkpoint_s:.2f} s waiting for saves = "
              f"{_cell(t.checkpoint_share, '{:.1%}')} of wall time"]
    if any(row.wall_estimated for row in report.rows):
        lines.append("  ~ killed: wall time up to its last step marker (or last publish)")
    return "\n".join(lines)
