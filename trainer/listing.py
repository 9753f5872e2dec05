"""`list`, `report` and `verify`: a run directory at a glance, what its attempts cost, and an
offline integrity check."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from trainer.attempts import RUNNING, read_attempts
from trainer.errors import CorruptGeneration, NothingToResume, StorageFailure
from trainer.recovery.manifest import verify_directory
from trainer.recovery.store import GenerationStore
from trainer.run_dir import MANIFEST, PROGRESS_MARKER, SECTIONS, RunDirectory, generation_step


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def publish_costs(attempts: list[dict], kind: str) -> dict[str, dict]:
    """name -> {attempt, save_s} for every publish an attempt record mentions (newest wins)."""
    costs = {}
    for attempt in attempts:
        for entry in attempt.get(f"{kind}_published", []):
            costs[entry["name"]] = {"attempt": attempt["id"], "save_s": entry.get("save_s")}
    return costs


def describe_run(output: Path) -> dict:
    attempts = read_attempts(output)
    described = {"output": str(output)}
    for section, folder in SECTIONS.items():
        store = GenerationStore(output / folder)
        costs = publish_costs(attempts, section)
        rows = []
        for name in store.names():
            verification = store.verify(name)
            manifest = verification.manifest
            facts = manifest.facts if manifest else None
            try:
                size = directory_bytes(store.path(name))
            except FileNotFoundError:  # removed by a live trainer's retention meanwhile
                continue
            rows.append({"name": name, "step": generation_step(name), "epoch": manifest and manifest.epoch,
                         "position": facts and facts.position, "bytes": size,
                         "verified": verification.ok, "problem": verification.problem,
                         "attempt": manifest and manifest.attempt,
                         "save_s": costs.get(name, {}).get("save_s")})
        described[section] = rows
        described[f"{section}_uncommitted"] = store.uncommitted()
        described[f"{section}_temporary"] = [p.name for p in store.temporaries()]
        described[f"{section}_replaced"] = store.replaced()
        described[f"{section}_replacing"] = store.interrupted_replacements()
    described["attempts"] = [{
        "id": a.get("id"), "status": a.get("status"), "exit_code": a.get("exit_code"),
        "restored": (a.get("restored") or {}).get("name"), "steps_replayed": a.get("steps_replayed"),
        "last_step": a.get("last_step"), "wall_s": a.get("wall_s"), "reason": a.get("reason"),
    } for a in attempts]
    return described


def _cell(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def side_entries(described: dict, section: str) -> list[str]:
    """The hidden directories of one section, listed under its own table."""
    return ([f"  uncommitted copy without a manifest (never selected, kept): {name}"
             for name in described.get(f"{section}_uncommitted", [])] +
            [f"  unpublished temporary (never selected, removed by the next trainer): {name}"
             for name in described[f"{section}_temporary"]] +
            [f"  superseded copy kept for inspection (never selected; delete when done): {name}"
             for name in described[f"{section}_replaced"]] +
            [f"  replacement cut short by a crash (the next trainer puts it back or retires it): {name}"
             for name in described[f"{section}_replacing"]])


def format_run(described: dict) -> str:
    lines = [f"run {described['output']}", "", "recovery generations"]
    lines.append(f"  {'name':<15} {'epoch':>5} {'pos':>4} {'MB':>9} {'verified':<9} {'save s':>7}  attempt")
    for row in described["generations"]:
        lines.append(f"  {row['name']:<15} {_cell(row['epoch']):>5} {_cell(row['position']):>4} "
                     f"{row['bytes'] / 1e6:>9.3f} {'yes' if row['verified'] else 'NO':<9} "
                     f"{_cell(row['save_s'], '{:.3f}'):>7}  {_cell(row['attempt'])}")
    lines += side_entries(described, "generations")
    lines += ["", "exports"]
    lines.append(f"  {'name':<15} {'epoch':>5} {'MB':>9} {'verified':<9} {'save s':>7}  attempt")
    for row in described["exports"]:
        lines.append(f"  {row['name']:<15} {_cell(row['epoch']):>5} {row['bytes'] / 1e6:>9.3f} "
                     f"{'yes' if row['verified'] else 'NO':<9} {_cell(row['save_s'], '{:.3f}'):>7}  "
                     f"{_cell(row['attempt'])}")
    lines += side_entries(described, "exports")
    lines += ["", "attempts"]
    lines.append(f"  {'id':<24} {'status':<12} {'exit':>4} {'restored from':<15} {'replayed':>8} "
                 f"{'last step':>9} {'wall s':>7}")
    for a in described["attempts"]:
        lines.append(f"  {_cell(a['id']):<24} {_cell(a['status']):<12} {_cell(a['exit_code']):>4} "
                     f"{_cell(a['restored']):<15} {_cell(a['steps_replayed']):>8} {_cell(a['last_step']):>9} "
                     f"{_cell(a['wall_s'], '{:.1f}'):>7}")
    return "\n".join(lines)


def require_run_directory(output: Path) -> None:
    if not output.is_dir():
        raise NothingToResume(f"{output} is not a run directory; pass the --output of a run")
    if problem := RunDirectory(output).inner_part():
        raise NothingToResume(problem)


def list_run(output: Path, as_json: bool) -> int:
    require_run_directory(output)
    described = describe_run(output)
    print(json.dumps(described, indent=2) if as_json else format_run(described))
    return 0


def live_attempts(output: Path, records: list[dict]) -> frozenset[str]:
    """Ids of `running` records whose process is alive: it holds the output lock (the lock
    file names it) and runs on this host. A trainer on another host cannot be seen from here,
    so its record reads as killed."""
    try:
        holder = json.loads(RunDirectory(output).lock.read_text() or "{}")
    except (OSError, ValueError):
        return frozenset()
    if not isinstance(holder, dict) or holder.get("host") != socket.gethostname():
        return frozenset()
    live = set()
    for record in records:
        if record.get("status") != RUNNING or (record.get("host"), record.get("pid")) != \
                (holder["host"], holder.get("pid")):
            continue
        try:
            os.kill(record["pid"], 0)
        except (OSError, TypeError, OverflowError):
            continue
        live.add(record["id"])
    return frozenset(live)


def marker_times(output: Path, records: list[dict]) -> dict[str, float]:
    """id -> when a record still `running` last marked a step (its marker file's mtime)."""
    times = {}
    for record in records:
        if record.get("status") == RUNNING:
            try:
                times[record["id"]] = (RunDirectory(output).attempt_folder(record["id"]) / PROGRESS_MARKER).stat().st_mtime
            except (OSError, ValueError):
                pass
    return times


def run_report(output: Path):
    """The report of a run directory (trainer.report.Report); 66 if it has no attempt records."""
    from trainer.report import build_report

    require_run_directory(output)
    records = read_attempts(output)
    if not records:
        raise NothingToResume(f"no attempt records under {RunDirectory(output).attempts}; pass the --output of "
                              f"a run that has trained")
    return build_report(records, live_attempts(output, records), marker_times(output, records))


def write_timeline(report, png: Path) -> None:
    from trainer.timeline import render_timeline, timeline_title

    try:
        render_timeline(report, png, timeline_title(report))
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise StorageFailure(f"writing the timeline to {png} failed: {reason}; choose a writable path "
                             f"for --png") from None


def report_command(output: Path, as_json: bool, png: Path | None) -> int:
    from trainer.report import format_report

    report = run_report(output)
    if png is not None:
        write_timeline(report, png)
    print(json.dumps({"output": str(output), **report.as_dict()}, indent=2) if as_json
          else format_report(report, str(output)))
    return 0


def targets(path: Path) -> list[Path]:
    """One sealed directory, or every generation and export of a run directory."""
    if (path / MANIFEST).exists() or generation_step(path.name) is not None:
        return [path]
    found = []
    for folder in SECTIONS.values():
        store = GenerationStore(path / folder)
        found += [store.path(name) for name in store.names()]
    return found


def verify_path(path: Path, as_json: bool) -> int:
    if not path.is_dir():
        raise NothingToResume(f"{path} does not exist or is not a directory; pass a run directory or a generation")
    found = targets(path)
    if not found:
        raise NothingToResume(f"no generations or exports under {path}")
    results = [verify_directory(p) for p in found]
    if as_json:
        print(json.dumps([{"path": str(r.path), "verified": r.ok, "problem": r.problem} for r in results], indent=2))
    else:
        for r in results:
            print(f"{'ok' if r.ok else 'DAMAGED':<8} {r.path}" + (f": {r.problem}" if r.problem else ""))
    damaged = [r for r in results if not r.ok]
    if damaged:
        raise CorruptGeneration(f"{len(damaged)} of {len(results)} damaged, first {damaged[0].path}: {damaged[0].problem}")
    return 0
