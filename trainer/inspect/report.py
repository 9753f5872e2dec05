"""The recovery report: what a run's attempts computed, redid, lost and paid, derived from
attempt records alone.

Pure computation (no I/O, no clock): `build_report` takes the records `read_attempt_records`
returns, plus the few facts only the filesystem knows (which attempts are alive, when a
killed attempt last marked a step), so every number here can be checked by hand from the
records. `trainer.inspect.listing.report_run` reads the run and prints; `trainer.inspect.timeline` draws.

Definitions (docs/report.md repeats them):
- computed: `last_step - first_step` (0 when it never started a step, e.g. refused).
- replayed: the first `steps_replayed` of those steps, which an earlier attempt had already
  computed (capped at computed: an attempt killed while replaying redid only that many).
- durable: the step of the newest generation the attempt published (with a store: committed
  there), else the one it restored, else the step it started from; or, when the next attempt
  that trained restored a newer tier-0 generation of it (`restored.tier` "memory", a step
  above that and at most its last), that step: the work up to it was kept and continued from.
- lost: `last_step - durable`: computed after the attempt's newest durable point, so the
  next attempt has to redo it (0 for a completed attempt and for one still running).
- abandoned: durable steps of the attempt that a later attempt went back from
  (`--from-generation` an earlier generation): above the lowest step any later attempt
  restored, so they are kept on disk as superseded copies but are not progress.
- useful: the durable step of the last attempt that trained: progress that is kept.
  computed = useful + lost + abandoned when every attempt restored a generation of the line.
- goodput: useful / sum of computed.
- time goodput: useful steps x the run's mean seconds per step, over the attempts' wall time
  plus their process start-up: the share of the time spent that went into kept training (what
  the advice predicts; start-up is known only where the record has `startup_s`).
- lost in attempts (`wall_lost_s`): lost steps x that attempt's seconds per step, plus every
  restore (verification included), plus the whole wall time of refused attempts. Not process
  start-up, which no attempt's wall time holds: the advice's R (per restart) counts it.
- checkpoint overhead: the seconds the loop waited for saves and exports (`blocked_s`, all
  of a sync save), as a share of the summed wall time of the attempts.

`advise` turns the same rows into the save-interval advice (trainer/run/interval.py): C, R
and M as measured, Daly's interval, and the goodput it and the current cadence predict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from trainer.run.interval import best_interval, expected_goodput, young_interval
from trainer.data.ledger import dropped_by_epoch, ledger_problems
from trainer.run.records import (OUTCOMES, RESTORED_FROM, TIER0, AttemptRecord, PublishedEntry, exposure_s,
                                  failure_rate, lifetime)


@dataclass(frozen=True)
class Publish:
    """One published generation, as the timeline draws it."""

    name: str
    step: int
    at_s: float | None
    """Seconds after the attempt's start (None in records written before it was kept)."""
    blocked_s: float | None = None
    """Seconds the loop was blocked by this save (C of the advice)."""
    to_durable_s: float | None = None
    """Seconds from the save's start until it was durable (published; with a store, committed)."""


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
    abandoned: int
    """Durable steps a later attempt went back from (see the module docstring)."""
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
    startup_s: float | None = None
    """Process start-up before the record started (interpreter, imports); None if unknown."""
    download_s: float = 0.0
    progress: tuple[tuple[int, float], ...] = ()
    """Coarse (step, seconds after the attempt's start) points: where its steps happened."""
    first_step_s: float | None = None
    """Seconds after the attempt's start when its first step completed (build, restore, warm-up)."""
    witness: str | None = None
    """What the exactness witness found (`witness_verdict`); None: nothing to check."""
    mismatch: bool = False
    """The witness saw a replayed step or a restored section differ."""
    checks: tuple[tuple[str, bool], ...] = ()
    """(check, whether it ran) per check the witness had to make: "restore", "replay"."""
    exact_by_configuration: bool = True
    """False when the attempt's configuration said at start that it cannot be exact."""
    restored_from: str | None = None
    """Where its restore came from (records.RESTORED_FROM; None: not recorded, or nothing restored)."""
    restored_bytes: int | None = None
    refused: tuple[str, ...] = ()
    """Faster sources refused on the way (a damaged tier-0 generation)."""
    recovery: "Recovery | None" = None
    """What the failure before it cost, where both ends are known (`recovery_of`)."""


@dataclass(frozen=True)
class Recovery:
    """R of one restart, as the user lives it: from the last step of the attempt before to the
    first step of this one."""

    after: int
    """The number of the attempt it followed (1-based, as the report counts)."""
    total_s: float
    down_s: float | None
    """From that last step to this process's start: detecting the failure, tearing the old
    processes down, starting new ones (torchrun's agent, a scheduler)."""
    startup_s: float | None
    """From this process's start to its record: interpreter, imports, joining, the claim."""
    imports_s: float | None
    join_s: float | None
    """Under a launcher, the start-up's two first parts: to the join, and the join itself."""
    first_step_s: float
    """From its record to its first step: building, restoring, the step itself."""


def _number_in(mapping, key: str) -> float | None:
    value = mapping.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def recovery_of(rows: tuple[AttemptRow, ...], records: list[AttemptRecord],
                markers: dict[str, float]) -> tuple[AttemptRow, ...]:
    """Each restoring attempt's R, where the attempt before it left the time of its last step
    (its record, or a killed one's marker) and this one recorded its first."""
    out, before = [], None
    for number, (row, record) in enumerate(zip(rows, records), 1):
        if row.outcome == "refused":
            out.append(row)
            continue
        last = None if before is None else before[1].last_step_unix or markers.get(before[1].id)
        if row.restored is not None and last is not None and record.started_unix is not None \
                and record.first_step_s is not None:
            started = record.started_unix - record.startup_s if record.startup_s is not None else None
            row = replace(row, recovery=Recovery(
                after=before[0], total_s=record.started_unix + record.first_step_s - last,
                down_s=None if started is None else started - last, startup_s=record.startup_s,
                imports_s=_number_in(record.joined, "at_s"), join_s=_number_in(record.joined, "join_s"),
                first_step_s=record.first_step_s))
        out.append(row)
        before = (number, record)
    return tuple(out)


@dataclass(frozen=True)
class Totals:
    attempts: int
    restarts: int
    outcomes: dict
    useful: int
    computed: int
    replayed: int
    lost: int
    abandoned: int
    goodput: float | None
    time_goodput: float | None
    """Useful steps x mean seconds per step / (wall + start-up of the attempts)."""
    step_s: float | None
    """Mean seconds per training step (after each attempt's first), weighted by steps."""
    wall_s: float
    span_s: float | None
    """From the first attempt's start to the last one's end, gaps between attempts included."""
    wall_lost_s: float
    restore_s: float
    checkpoint_s: float
    checkpoint_share: float | None


@dataclass(frozen=True)
class LedgerCheck:
    """The sample ledgers of the run's generations, across attempts (trainer/data/ledger.py)."""

    generations: int
    """Generations that recorded a ledger."""
    attempts: int
    """Attempts those generations came from."""
    samples: int
    """Samples the ledgers account for (each once, however often its step was replayed)."""
    problems: tuple[str, ...] = ()
    """Samples repeated or skipped between or inside generations: empty when none."""
    dropped: dict[int, int] = field(default_factory=dict)
    """{epoch: samples its ragged last batch left untrained} (`--last-batch drop`)."""
    padded: int = 0
    """Repeated samples trained at loss weight 0 (`--last-batch pad`, a rank with no share)."""
    untracked: str = ""
    """Why no sample is accounted for: the loop read its data itself, in an order of its own
    (the newest attempt's dataset fingerprint says whose); empty when the ledgers track it."""


@dataclass(frozen=True)
class Report:
    rows: tuple[AttemptRow, ...]
    totals: Totals
    ledger: LedgerCheck = LedgerCheck(0, 0, 0)

    def as_dict(self) -> dict:
        return asdict(self)


def durable_entries(record: AttemptRecord) -> list[PublishedEntry]:
    """The attempt's generations that survive its machine: every publish on a local run, only
    those committed in the store (`durable_s`) on a store run."""
    if record.store:
        return [entry for entry in record.generations if entry.durable_s is not None]
    return list(record.generations)


def durable_at_s(entry: PublishedEntry) -> float | None:
    """Seconds into the attempt when a generation became durable (publish, or store commit)."""
    if entry.at_s is None:
        return None
    if entry.durable_s is not None:
        return entry.at_s - (entry.save_s or 0.0) + entry.durable_s
    return entry.at_s


def durable_step(record: AttemptRecord) -> int:
    published = [entry.step for entry in durable_entries(record) if entry.step is not None]
    if published:
        return max(published)
    restored = record.restored.step if record.restored else None
    return restored if restored is not None else (record.first_step or 0)


def attempt_row(record: AttemptRecord, live: frozenset[str], marker_unix: float | None,
                origin: float | None) -> AttemptRow:
    start = record.started_unix
    lived = lifetime(record, live, marker_unix - start if marker_unix is not None and start is not None else None)
    outcome, costs, restored = lived.outcome, record.costs, record.restored
    restored_step = restored.step if restored else None
    first, last = record.first_step, record.computed_to  # a stop's step after its save, computed and lost
    started = first is not None and isinstance(last, int) and outcome != "refused"
    if not started:  # refused, or killed before its first step: nothing computed
        first = first if first is not None else restored_step if restored_step is not None else 0
        last = first
    computed = max(0, last - first)
    durable = durable_step(record) if started else first
    lost = 0 if outcome in ("completed", "running") else max(0, last - durable)
    generations = tuple(Publish(e.name, e.step, e.at_s, e.blocked_s, e.durable_s if e.durable_s is not None
                                else e.save_s) for e in record.generations)
    first_publish = next((at for entry in durable_entries(record) if (at := durable_at_s(entry)) is not None), None)
    return AttemptRow(
        id=record.id, outcome=outcome, exit_code=record.exit_code,
        restored=restored.name if restored else None, restored_step=restored_step,
        first_step=first, last_step=last, computed=computed,
        replayed=min(computed, record.steps_replayed or 0), lost=lost, durable_step=durable, abandoned=0,
        restore_s=costs.restore_s, verify_s=costs.verify_s, save_s=costs.save_s, blocked_s=costs.blocked_s,
        saves=costs.saves, wall_s=lived.wall_s, wall_estimated=lived.wall_estimated, time_to_durable_s=first_publish,
        start_s=None if start is None or origin is None else start - origin,
        generations=generations, reason=record.reason, startup_s=lived.startup_s,
        download_s=costs.download_s, progress=record.progress,
        first_step_s=record.first_step_s if started else None,
        witness=witness_verdict(record), mismatch=witness_mismatch(record), checks=witness_checks(record),
        exact_by_configuration=record.exactness.get("exact") is not False,
        restored_from=restored.tier if restored else None, restored_bytes=restored.bytes if restored else None,
        refused=restored.refused if restored else ())


def witness_verdict(record: AttemptRecord) -> str | None:
    """One phrase per check the exactness witness made (trainer/run/witness.py)."""
    parts = []
    if record.exactness.get("exact") is False:
        parts.append(f"not exact by configuration: {record.exactness.get('reason')}")
    check = record.restore_check
    if check is not None and check.get("compared") is False:
        parts.append(f"restore not compared: {check.get('reason')}")
    elif check is not None:
        differing = check.get("differing") or {}
        parts.append("restore matched the saved state" if check.get("matched") else
                     "restore DIFFERS from the saved state (" +
                     "; ".join(f"rank {rank}: {', '.join(map(str, sections))}" for rank, sections in differing.items())
                     + ")")
    replay = record.replay
    if replay is not None:
        if replay.get("compared") is False:
            parts.append(f"replay not compared: {replay.get('reason')}")
        elif replay.get("first_mismatch") is None:
            parts.append(f"replayed steps matched: {replay.get('matched')} of {replay.get('of')}")
        else:
            parts.append(f"replay DIFFERS from step {replay.get('first_mismatch')} "
                         f"({replay.get('matched')} of {replay.get('of')} matched)")
    return "; ".join(parts) or None


def witness_checks(record: AttemptRecord) -> tuple[tuple[str, bool], ...]:
    """(check, whether it ran) for the restore check and the replay check the record holds; a
    check that did not run says why in `witness_verdict` (an allowed drift, a world-size change)."""
    return tuple((check, found.get("compared") is not False)
                 for check, found in (("restore", record.restore_check), ("replay", record.replay)) if found is not None)


def witness_mismatch(record: AttemptRecord) -> bool:
    return (record.restore_check or {}).get("matched") is False or \
        (record.replay or {}).get("first_mismatch") is not None


def with_abandoned(rows: tuple[AttemptRow, ...], useful: int) -> tuple[AttemptRow, ...]:
    """Each trained row's durable steps above the lowest step a later attempt restored (or the
    run's useful step): the line a `--from-generation` went back from."""
    marked, floor = [], useful
    for row in reversed(rows):
        if row.outcome != "refused":
            abandoned = max(0, row.durable_step - max(row.first_step, floor)) if row.computed else 0
            marked.append(replace(row, abandoned=min(abandoned, row.computed - row.lost)))
            floor = min(floor, row.restored_step if isinstance(row.restored_step, int) else row.first_step)
        else:
            marked.append(row)
    return tuple(reversed(marked))


def with_tier0_restores(rows: tuple[AttemptRow, ...]) -> tuple[AttemptRow, ...]:
    """Each trained row whose next trained row restored a tier-0 generation newer than the
    row's durable step (and not beyond its last): durable up to that step, lost only the steps
    after it. Tier 0 is not durable on its own, so nothing changes until a restore used it."""
    trained = [number for number, row in enumerate(rows) if row.outcome != "refused"]
    marked = list(rows)
    for number, following in zip(trained, trained[1:]):
        row, after = rows[number], rows[following]
        step = after.restored_step
        if after.restored_from in TIER0 and isinstance(step, int) and row.durable_step < step <= row.last_step:
            marked[number] = replace(row, durable_step=step, lost=min(row.lost, row.last_step - step))
    return tuple(marked)


def seconds_per_step(row: AttemptRow) -> float | None:
    """Average wall time of one training step of this attempt: its wall time after its first
    step (else after its restore) without the time it waited for saves, over the steps since."""
    if not row.computed or row.wall_s is None:
        return None
    if row.first_step_s is not None and row.computed > 1:
        return max(0.0, row.wall_s - row.first_step_s - row.blocked_s) / (row.computed - 1)
    return max(0.0, row.wall_s - row.restore_s - row.blocked_s) / row.computed


def warm_up_s(row: AttemptRow) -> float | None:
    """Seconds from the record's start until training ran at its pace: building the model,
    restoring, the first step's extra time."""
    per_step = seconds_per_step(row)
    return None if row.first_step_s is None or per_step is None else max(0.0, row.first_step_s - per_step)


def wall_lost(row: AttemptRow) -> float:
    if row.outcome == "refused":
        return row.wall_s or 0.0
    return row.restore_s + row.lost * (seconds_per_step(row) or 0.0)


def mean_seconds_per_step(rows) -> float | None:
    paced = [(per_step, row.computed) for row in rows if (per_step := seconds_per_step(row)) is not None]
    weight = sum(computed for _, computed in paced)
    return sum(per_step * computed for per_step, computed in paced) / weight if weight else None


def time_goodput(rows: tuple[AttemptRow, ...], useful: int) -> float | None:
    per_step = mean_seconds_per_step(rows)
    spent = sum(map(exposure_s, rows))
    return useful * per_step / spent if per_step is not None and spent else None


def build_report(records: list[AttemptRecord], live: frozenset[str] = frozenset(),
                 markers: dict[str, float] | None = None) -> Report:
    """`records` oldest first; `live`: ids of attempts whose process is alive; `markers`:
    id -> unix time of the attempt's last per-step marker (only used for killed ones)."""
    markers = markers or {}
    starts = [record.started_unix for record in records if record.started_unix is not None]
    origin = min(starts) if starts else None
    rows = with_tier0_restores(tuple(attempt_row(r, live, markers.get(r.id), origin) for r in records))
    rows = recovery_of(rows, records, markers)
    trained = [row for row in rows if row.outcome != "refused"]
    useful = trained[-1].durable_step if trained else 0
    rows = with_abandoned(rows, useful)
    computed = sum(row.computed for row in rows)
    wall = sum(row.wall_s or 0.0 for row in rows)
    checkpoint = sum(row.blocked_s for row in rows)
    ends = [row.start_s + row.wall_s for row in rows if row.start_s is not None and row.wall_s is not None]
    outcomes = {name: sum(row.outcome == name for row in rows) for name in OUTCOMES}
    totals = Totals(
        attempts=len(rows), restarts=max(0, len(rows) - 1),
        outcomes={name: count for name, count in outcomes.items() if count},
        useful=useful, computed=computed, replayed=sum(row.replayed for row in rows),
        lost=sum(row.lost for row in rows), abandoned=sum(row.abandoned for row in rows),
        goodput=useful / computed if computed else None, time_goodput=time_goodput(rows, useful),
        step_s=mean_seconds_per_step(rows),
        wall_s=round(wall, 3), span_s=round(max(ends), 3) if ends else None,
        wall_lost_s=round(sum(wall_lost(row) for row in rows), 3),
        restore_s=round(sum(row.restore_s for row in rows), 3),
        checkpoint_s=round(checkpoint, 3), checkpoint_share=checkpoint / wall if wall else None)
    return Report(rows, totals, check_ledgers(records))


def check_ledgers(records: list[AttemptRecord]) -> LedgerCheck:
    """Every generation's ledger, the newest attempt's where two wrote the same step (going
    back with --from-generation), checked for samples repeated or skipped."""
    entries, sources = {}, {}
    for record in records:
        for entry in record.ledger:
            entries[entry["step"]], sources[entry["step"]] = entry, record.id
    untracked = entries and not any(entry.get("epoch_samples") or entry["samples"] for entry in entries.values())
    return LedgerCheck(len(entries), len(set(sources.values())), sum(entry["samples"] for entry in entries.values()),
                       tuple(ledger_problems(entries)), dropped_by_epoch(entries),
                       sum(entry.get("padded", 0) for entry in entries.values()),
                       str(records[-1].fingerprint.get("dataset", "the loop's own data")) if untracked else "")


@dataclass(frozen=True)
class Advice:
    """How often to save, from the run's own records (Daly's model, trainer/run/interval.py)."""

    saves: int
    """Recovery saves C is measured over."""
    cost_s: float | None
    """C: mean seconds the loop was blocked per recovery save."""
    to_durable_s: float | None
    """Mean seconds from a save's start until it was durable (published; with a store, committed)."""
    restarts: int
    """Attempts that restored a generation, R is measured over."""
    restart_s: float | None
    """R: mean start-up + verify + download + restore of those attempts."""
    startup_s: float | None
    verify_s: float | None
    download_s: float | None
    load_s: float | None
    warm_up_s: float | None
    """Building the model and the first step's extra time, before training runs at its pace."""
    failures: int
    exposure_s: float
    mtbf_s: float | None
    mtbf_from: str
    trusted: bool
    """False: fewer than 3 failures and no --assume-mtbf-secs; the interval is a guess."""
    young_s: float | None
    interval_s: float | None
    formula: str
    predicted_goodput: float | None
    """Share of wall time that is training kept, saving every `interval_s`."""
    current_interval_s: float | None
    """Mean seconds of training between the run's saves so far."""
    current_goodput: float | None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def advise(report: Report, assume_mtbf_s: float | None = None) -> Advice:
    """C, R and M from the rows, and the interval that maximises the expected goodput."""
    rows = [row for row in report.rows if row.outcome != "refused"]
    saves = [g for row in rows for g in row.generations]
    cost = _mean([g.blocked_s for g in saves if g.blocked_s is not None])
    restarts = [row for row in rows if row.restored is not None]
    # start-up is measured when the record starts: after verifying and downloading, which it leaves out
    startup = [max(0.0, row.startup_s - row.verify_s - row.download_s) for row in restarts or rows
               if row.startup_s is not None]  # a fresh start pays it too: the estimate before any restart
    loads = [row.restore_s - row.verify_s - row.download_s for row in restarts]
    warm = [max(0.0, w - load) for row, load in zip(restarts, loads) if (w := warm_up_s(row)) is not None] or \
        [w for row in rows if (w := warm_up_s(row)) is not None]
    parts = {"startup": _mean(startup), "verify": _mean([row.verify_s for row in restarts]),
             "download": _mean([row.download_s for row in restarts]), "load": _mean(loads), "warm_up": _mean(warm)}
    restart = None if not restarts and parts["startup"] is None else sum(v or 0.0 for v in parts.values())
    rate = failure_rate(rows)  # the auto cadence's M too (trainer/run/cadence.py)
    exposure = rate.exposure_s
    mtbf = rate.mtbf(assume_mtbf_s)
    m = mtbf.seconds if mtbf.seconds > 0 else None
    training = sum(max(0.0, (row.wall_s or 0.0) - row.restore_s - row.blocked_s) for row in rows)
    current = training / len(saves) if saves else None
    interval, formula, young = None, "needs a measured save cost and failure interval", None
    if cost is not None and m is not None:
        interval, formula = best_interval(cost, m)
        young = young_interval(cost, m)
    predicted = lambda tau: None if not tau or m is None or cost is None else \
        expected_goodput(tau, cost, restart or 0.0, m)  # noqa: E731
    return Advice(saves=len(saves), cost_s=cost, to_durable_s=_mean([g.to_durable_s for g in saves
                                                                    if g.to_durable_s is not None]),
                  restarts=len(restarts), restart_s=restart, startup_s=parts["startup"], verify_s=parts["verify"],
                  download_s=parts["download"], load_s=parts["load"], warm_up_s=parts["warm_up"], failures=mtbf.rate.failures,
                  exposure_s=round(exposure, 3), mtbf_s=m, mtbf_from=mtbf.source, trusted=mtbf.trusted,
                  young_s=young, interval_s=interval, formula=formula, predicted_goodput=predicted(interval),
                  current_interval_s=current, current_goodput=predicted(current))


def format_advice(advice: Advice) -> list[str]:
    a = advice
    secs = lambda value: cell(value, "{:.3g} s")  # noqa: E731
    lines = ["", "  save interval advice (Daly's model; docs/report.md says when not to trust it)",
             f"    save cost C         {secs(a.cost_s)} blocked per recovery save ({a.saves} saves); "
             f"on average {secs(a.to_durable_s)} from a save's start until it was durable",
             f"    restart cost R      {secs(a.restart_s)} per restart = start-up {secs(a.startup_s)} + verify {secs(a.verify_s)} "
             f"+ download {secs(a.download_s)} + restore {secs(a.load_s)} + build and first step "
             f"{secs(a.warm_up_s)} ({plural(a.restarts, 'restart')})",
             f"    failures            {a.failures} in {a.exposure_s:.1f} s of attempts: M = {secs(a.mtbf_s)} "
             f"({a.mtbf_from})"]
    if not a.trusted:
        lines.append(f"    too few failures ({a.failures}) to estimate M; pass --assume-mtbf-secs S (e.g. the "
                     f"cluster's known rate) for a usable interval")
    if a.interval_s is None:
        return lines + [f"    best interval       - ({a.formula})"]
    lines.append(f"    best interval       {secs(a.interval_s)} of training between saves ({a.formula}; Young "
                 f"sqrt(2CM) {secs(a.young_s)}): predicted goodput {cell(a.predicted_goodput, '{:.1%}')}")
    if a.current_goodput is not None:
        gap = (a.predicted_goodput - a.current_goodput) * 100
        lines.append(f"    current cadence     every {secs(a.current_interval_s)} of training: predicted goodput "
                     f"{a.current_goodput:.1%} ({gap:.1f} points below the best)")
    return lines


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def cell(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def format_restores(rows: tuple[AttemptRow, ...]) -> list[str]:
    """Which tier each restore came from and what it cost (attempts that recorded it)."""
    told = [(number, row) for number, row in enumerate(rows, 1) if row.restored and row.restored_from]
    if not told:
        return []
    lines = ["", "  restores           from where, and what each cost (verify + download + load)"]
    for number, row in told:
        lines.append(f"    {number:>3} {row.restored:<15} from {RESTORED_FROM.get(row.restored_from, row.restored_from)}: "
                     f"{row.restore_s:.3f} s, {cell(row.restored_bytes)} bytes")
        lines += [f"        refused first: {refused}" for refused in row.refused]
        if (r := row.recovery) is not None:
            secs = lambda value: cell(value, "{:.2f}")  # noqa: E731
            parts = f"imports {secs(r.imports_s)}, join {secs(r.join_s)}, claim" if r.join_s is not None else \
                "imports and claim"
            lines.append(f"        R {r.total_s:.2f} s from attempt {r.after}'s last step to this one's first = "
                         f"down {secs(r.down_s)} (detection, teardown, relaunch) + start-up {secs(r.startup_s)} "
                         f"({parts}) + {r.first_step_s:.2f} (build, restore {row.restore_s:.2f}, first step)")
    return lines


def format_witness(rows: tuple[AttemptRow, ...]) -> list[str]:
    """The exactness witness per attempt: did each resume continue exactly?"""
    checked = [(number, row) for number, row in enumerate(rows, 1) if row.witness]
    if not checked:
        return []
    return ["", f"  exactness witness  {witness_headline(rows)}"] + [f"    {number:>3} {row.id:<24} {row.witness}"
                                                                    for number, row in checked]


def witness_headline(rows: tuple[AttemptRow, ...]) -> str:
    """What the witness's checks of every attempt add up to: "every check passed" only when every
    check it had to make ran and matched; the checks that did not run are counted by name."""
    if any(row.mismatch for row in rows):
        return "NOT EXACT (see the attempts below)"
    if not all(row.exact_by_configuration for row in rows):
        return "no mismatch seen, but a configuration that cannot be exact ran (see below)"
    ran = [check for row in rows for check, compared in row.checks if compared]
    skipped = [check for row in rows for check, compared in row.checks if not compared]
    if not skipped:
        return f"every check passed: {counted(ran)} matched"
    return f"{counted(ran) + ' matched; ' if ran else ''}not compared: {counted(skipped)} (see below)"


def counted(checks: list[str]) -> str:
    """"2 restores and 1 replay"."""
    return " and ".join(f"{checks.count(check)} {check}{'s' if checks.count(check) > 1 else ''}"
                        for check in CHECKS if check in checks)


CHECKS = ("restore", "replay")
"""The witness's checks, in the order the headline counts them (trainer/run/witness.py)."""


def format_ledger(check: LedgerCheck) -> list[str]:
    if not check.generations:
        return []
    head = f"  sample ledger      {plural(check.generations, 'generation')} from {plural(check.attempts, 'attempt')}"
    if check.untracked:
        return ["", f"{head}: not tracked: {check.untracked}"]
    head += f", {check.samples} samples: "
    per_epoch = ", ".join(f"epoch {epoch}: {count}" for epoch, count in sorted(check.dropped.items()))
    last_batch = [f"    dropped (--last-batch drop): {per_epoch}"] if check.dropped else []
    if check.padded:
        last_batch.append(f"    padded (--last-batch pad): {check.padded} repeated at loss weight 0, not counted")
    if not check.problems:
        return ["", head + "none repeated or skipped (replayed steps' samples reach a generation once)", *last_batch]
    return ["", head + f"REPEATED OR SKIPPED in {plural(len(check.problems), 'place')}"] + [
        f"    {problem}" for problem in check.problems] + last_batch


def format_report(report: Report, output: str, advice: Advice | None = None) -> str:
    """The terminal table: one row per attempt, then the run's totals (and the advice)."""
    lines = [f"recovery report {output}", ""]
    lines.append(f"  {'#':>3} {'attempt':<24} {'outcome':<11} {'exit':>4} {'restored':<15} {'steps':>11} "
                 f"{'computed':>8} {'replayed':>8} {'lost':>5} {'abandoned':>9} {'restore s':>9} {'verify s':>8} {'save s':>7} "
                 f"{'blocked s':>9} {'1st durable s':>13} {'wall s':>8}")
    for number, row in enumerate(report.rows, 1):
        wall = cell(row.wall_s, "{:.1f}") + ("~" if row.wall_estimated else "")
        lines.append(
            f"  {number:>3} {row.id:<24} {row.outcome:<11} {cell(row.exit_code):>4} {cell(row.restored):<15} "
            f"{f'{row.first_step}..{row.last_step}':>11} {row.computed:>8} {row.replayed:>8} {row.lost:>5} "
            f"{row.abandoned:>9} "
            f"{row.restore_s:>9.3f} {row.verify_s:>8.3f} {row.save_s:>7.3f} {row.blocked_s:>9.3f} "
            f"{cell(row.time_to_durable_s, '{:.2f}'):>13} {wall:>8}")
    t = report.totals
    outcomes = ", ".join(f"{count} {name}" for name, count in t.outcomes.items()) or "none"
    lines += ["", f"  attempts           {t.attempts} ({outcomes})",
              f"  useful steps       {t.useful}",
              f"  steps computed     {t.computed} (replayed {t.replayed}, lost {t.lost}, abandoned {t.abandoned})",
              f"  goodput            {cell(t.goodput, '{:.1%}')} of the steps computed; "
              f"{cell(t.time_goodput, '{:.1%}')} of the time spent (kept steps' training time over all "
              f"attempts' time, process start-up included: low when steps are as short as the demo's)",
              f"  wall time          {t.wall_s:.1f} s in attempts"
              + (f", {t.span_s:.1f} s from first start to last end" if t.span_s is not None else ""),
              f"  lost in attempts   {t.wall_lost_s:.1f} s: lost steps' training, restores {t.restore_s:.1f} s, "
              f"refused attempts (no start-up: R below counts it, per restart)",
              f"  checkpoint overhead {t.checkpoint_s:.2f} s waiting for saves = "
              f"{cell(t.checkpoint_share, '{:.1%}')} of wall time"]
    estimated = [name for name in ("killed", "running") if any(row.wall_estimated and row.outcome == name
                                                                 for row in report.rows)]
    if estimated:
        lines.append(f"  ~ {' or '.join(estimated)}: wall time up to its last step marker (or last publish)")
    lines += format_restores(report.rows) + format_witness(report.rows) + format_ledger(report.ledger)
    return "\n".join(lines + (format_advice(advice) if advice is not None else []))
