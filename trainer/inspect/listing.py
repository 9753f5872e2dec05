"""`list`, `report` and `verify`: a run directory at a glance, what its attempts cost, and an
offline integrity check."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Callable

from trainer.inspect.report import cell
from trainer.run.records import RUNNING, AttemptRecord, read_attempt_records
from trainer.errors import CorruptGeneration, NothingToResume, StorageFailure
from trainer.checkpoint.manifest import Manifest, Verification
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.signing import Signing
from trainer.layout import MANIFEST, PROGRESS_MARKER, SECTIONS, RunDirectory, generation_step, not_a_run


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def publish_costs(attempts: list[AttemptRecord], kind: str) -> dict[str, dict]:
    """name -> {attempt, save_s} for every publish an attempt record mentions (newest wins)."""
    return {entry.name: {"attempt": attempt.id, "save_s": entry.save_s}
            for attempt in attempts for entry in attempt.published(kind)}


def sealed_row(name: str, manifest: Manifest | None, size: int, costs: dict[str, dict],
               verified: bool | None, problem: str | None) -> dict:
    """One row of the generations or exports table, wherever the directory lives; `verified`
    None: committed in a store, not re-hashed (`verify` does that)."""
    facts = manifest.facts if manifest else None
    return {"name": name, "step": generation_step(name), "epoch": manifest and manifest.epoch,
            "position": facts and facts.position, "bytes": size, "verified": verified, "problem": problem,
            "attempt": manifest and manifest.attempt, "save_s": costs.get(name, {}).get("save_s")}


def judged(section: LocalSection, name: str) -> Verification:
    """Every check `--resume` applies to a local directory: its files re-hashed, name, run and
    signature (`LocalSection.verify`), and every stored value loaded through the safe loader
    (`judged_by_loading`, which imports torch only when a generation gets that far)."""
    verification = section.verify(name, shards=False)
    if not verification.shards_pending:
        return verification
    from trainer.checkpoint.onepass import judged_by_loading

    return judged_by_loading(verification)


def local_row(section: LocalSection, name: str, costs: dict[str, dict]) -> dict | None:
    """A local directory's row, judged as `verify` judges it; None if a live trainer's retention
    removed it meanwhile."""
    verification = judged(section, name)
    try:
        size = directory_bytes(section.path(name))
    except FileNotFoundError:
        return None
    return sealed_row(name, verification.manifest, size, costs, verification.ok, verification.problem)


def attempt_rows(attempts: list[AttemptRecord]) -> list[dict]:
    """Replayed and abandoned steps as `report` counts them (trainer.inspect.report), so the
    two commands agree: replayed is capped at what the attempt computed."""
    from trainer.inspect.report import build_report

    counted = build_report(attempts).rows
    return [{
        "id": a.id, "status": a.status, "exit_code": a.exit_code, "restored": a.restored and a.restored.name,
        "steps_replayed": None if a.steps_replayed is None else row.replayed, "abandoned": row.abandoned,
        "last_step": a.last_step, "wall_s": a.wall_s, "reason": a.reason,
    } for a, row in zip(attempts, counted)]


def describe_run(output: Path, signing: Signing | None = None) -> dict:
    attempts = read_attempt_records(output)
    described = {"output": str(output), "tier_of": store_named_by(attempts)}
    for kind, folder in SECTIONS.items():
        section = LocalSection(output / folder, signing)
        costs = publish_costs(attempts, kind)
        described[kind] = [row for name in section.names() if (row := local_row(section, name, costs))]
        described[f"{kind}_uncommitted"] = section.uncommitted()
        described[f"{kind}_temporary"] = [p.name for p in section.temporaries()]
        described[f"{kind}_replaced"] = section.replaced()
        described[f"{kind}_replacing"] = section.interrupted_replacements()
    described["attempts"] = attempt_rows(attempts)
    return described


def store_named_by(attempts: list[AttemptRecord]) -> str | None:
    """The store URL the newest attempt trained into (`--output s3://…`), when this directory
    is its local tier: `list` then says how to see what is durable."""
    return next((record.store for record in reversed(attempts) if record.store), None)


UNCOMMITTED = {False: "uncommitted copy without a manifest (never selected, kept)",
               True: "uncommitted prefix without a manifest (never selected; the next trainer removes it)"}
"""A store's leftovers are cleaned up under the next trainer's lease; a local copy is never deleted."""


def side_entries(described: dict, section: str) -> list[str]:
    """The hidden directories of one section, listed under its own table."""
    uncommitted = UNCOMMITTED["store" in described]
    return ([f"  {uncommitted}: {name}" for name in described.get(f"{section}_uncommitted", [])] +
            [f"  unpublished temporary (never selected, removed by the next trainer): {name}"
             for name in described[f"{section}_temporary"]] +
            [f"  superseded copy kept for inspection (never selected; delete when done): {name}"
             for name in described[f"{section}_replaced"]] +
            [f"  replacement cut short by a crash (the next trainer puts it back or retires it): {name}"
             for name in described[f"{section}_replacing"]])


Column = tuple[str, str, Callable[[dict], str]]
"""(header, format spec, cell of a row)."""
LOCAL_CELLS = {"same": "yes", "absent": "no", "different": "differs", "only": "only", "stale": "stale"}
"""This machine's local tier against the store: the same copy (manifest bytes equal), none,
another copy (not the committed one; the next trainer drops it), a copy the store lacks (not
uploaded yet), or an old copy the store no longer holds."""
LOCAL_NOTES = {"only": "local only: published on this machine, not (yet) in the store",
               "stale": "local stale: an old copy on this machine that the store no longer holds (its retention "
                        "removed it); never restored: the store is the truth"}


def verified_cell(row: dict) -> str:
    return "committed" if row["verified"] is None else "yes" if row["verified"] else "NO"


def sealed_columns(section: str, tiered: bool) -> list[Column]:
    """The generations (with position) or exports table; a run in a store adds durable/local."""
    columns: list[Column] = [("name", "<15", lambda r: r["name"]), ("epoch", ">5", lambda r: cell(r["epoch"]))]
    if section == "generations":
        columns.append(("pos", ">4", lambda r: cell(r["position"])))
    columns += [("MB", ">9", lambda r: f"{r['bytes'] / 1e6:.3f}"), ("verified", "<9", verified_cell)]
    if tiered:
        columns += [("durable", "<7", lambda r: "yes" if r["durable"] else "no"),
                    ("local", "<7", lambda r: LOCAL_CELLS[r["local"]])]
    return columns + [("save s", ">7", lambda r: cell(r["save_s"], "{:.3f}")),
                      (" attempt", "", lambda r: " " + cell(r["attempt"]))]


ATTEMPT_COLUMNS: list[Column] = [
    ("id", "<24", lambda a: cell(a["id"])), ("status", "<12", lambda a: cell(a["status"])),
    ("exit", ">4", lambda a: cell(a["exit_code"])), ("restored from", "<15", lambda a: cell(a["restored"])),
    ("replayed", ">8", lambda a: cell(a["steps_replayed"])), ("abandoned", ">9", lambda a: cell(a["abandoned"])),
    ("last step", ">9", lambda a: cell(a["last_step"])),
    ("wall s", ">7", lambda a: cell(a["wall_s"], "{:.1f}"))]


def table(columns: list[Column], rows: list[dict]) -> list[str]:
    def line(cells):
        return "  " + " ".join(f"{cell:{spec}}" for cell, (_, spec, _) in zip(cells, columns))
    return [line([header for header, _, _ in columns])] + [line([cell(row) for _, _, cell in columns])
                                                           for row in rows]


def run_header(described: dict) -> list[str]:
    lines = [f"run {described['output']}"]
    if "store" in described:
        found = described["local_tier_found"]
        lines.append(f"local tier {described['local_tier']}" + ("" if found else ": not on this machine"))
    elif described.get("tier_of"):
        lines.append(f"local tier of {described['tier_of']} (add --store {described['tier_of']} to see what "
                     f"is durable there)")
    return lines


def format_run(described: dict) -> str:
    tiered = "store" in described
    lines = run_header(described)
    for section, title in (("generations", "recovery generations"), ("exports", "exports")):
        lines += ["", title] + table(sealed_columns(section, tiered), described[section])
        lines += side_entries(described, section)
        lines += [f"  {note}" for key, note in LOCAL_NOTES.items()
                  if any(row.get("local") == key for row in described[section])]
    lines += ["", "attempts"] + table(ATTEMPT_COLUMNS, described["attempts"])
    return "\n".join(lines)


def not_a_folder(path: Path, wanted: str) -> str:
    """Why `path`, which is not a directory, cannot be what the command `wanted` (and what to pass)."""
    if path.name == MANIFEST and path.is_file():
        return f"{path} is a generation's manifest file; pass its folder, {path.parent}"
    if not path.exists():
        return f"{path} does not exist; pass {wanted}"
    return f"{path} is a file, not a folder; pass {wanted}"


def require_run_directory(output: Path) -> None:
    if not output.is_dir():
        raise NothingToResume(not_a_folder(output, "the --output of a run"))
    if problem := RunDirectory(output).inner_part():
        raise NothingToResume(problem)
    if not RunDirectory(output).holds_a_run():
        raise NothingToResume(not_a_run(output))


def print_run(described: dict, as_json: bool) -> int:
    print(json.dumps(described, indent=2) if as_json else format_run(described))
    return 0


def live_attempts(output: Path, records: list[AttemptRecord]) -> frozenset[str]:
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
        if record.status != RUNNING or (record.host, record.pid) != (holder["host"], holder.get("pid")):
            continue
        try:
            os.kill(record.pid, 0)
        except (OSError, TypeError, OverflowError):
            continue
        live.add(record.id)
    return frozenset(live)


def marker_times(output: Path, records: list[AttemptRecord]) -> dict[str, float]:
    """id -> when a record still `running` last marked a step (its marker file's mtime)."""
    times = {}
    for record in records:
        if record.status == RUNNING:
            try:
                times[record.id] = (RunDirectory(output).attempt_folder(record.id) / PROGRESS_MARKER).stat().st_mtime
            except (OSError, ValueError):
                pass
    return times


def run_report(output: Path):
    """The report of a run directory (trainer.inspect.report.Report); 66 if it has no attempt records."""
    from trainer.inspect.report import build_report

    require_run_directory(output)
    records = read_attempt_records(output)
    if not records:
        raise NothingToResume(f"no attempt records under {RunDirectory(output).attempts}; pass the --output of "
                              f"a run that has trained")
    return build_report(records, live_attempts(output, records), marker_times(output, records))


def write_timeline(report, png: Path, for_dashboard: bool = False) -> None:
    """The timeline as `report --png` draws it, or shaped for Polyaxon's image widget."""
    from trainer.inspect.timeline import DASHBOARD, REPORT, render_timeline, timeline_title

    try:
        render_timeline(report, png, timeline_title(report), DASHBOARD if for_dashboard else REPORT)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise StorageFailure(f"writing the timeline to {png} failed: {reason}; choose a writable path "
                             f"for --png") from None


def print_report(report, output: str, as_json: bool, png: Path | None, assume_mtbf_s: float | None = None) -> int:
    """The report of a run, wherever its attempt records came from, with the save-interval
    advice (`assume_mtbf_s`: the M to plan with while the run has seen few failures)."""
    from dataclasses import asdict

    from trainer.inspect.report import advise, format_report

    advice = advise(report, assume_mtbf_s)
    if png is not None:
        write_timeline(report, png)
    print(json.dumps({"output": output, **report.as_dict(), "advice": asdict(advice)}, indent=2) if as_json
          else format_report(report, output, advice))
    if png is not None:  # on stderr under --json, so stdout stays one JSON document
        print(f"timeline written to {png}", file=sys.stderr if as_json else sys.stdout)
    return 0


def targets(path: Path) -> list[Path]:
    """One sealed directory, or every generation and export of a run directory."""
    if (path / MANIFEST).exists() or generation_step(path.name) is not None:
        return [path]
    found = []
    for folder in SECTIONS.values():
        section = LocalSection(path / folder)
        found += [section.path(name) for name in section.names()]
    return found


def local_verifications(path: Path, signing: Signing | None = None) -> list[tuple[str, Verification]]:
    if not path.is_dir():
        raise NothingToResume(not_a_folder(path, "a run directory or a generation"))
    found = targets(path)
    if not found:
        raise NothingToResume(f"no generations or exports under {path}")
    return [(str(p), judged(LocalSection(p.parent, signing), p.name)) for p in found]


def print_verifications(results: list[tuple[str, Verification]], as_json: bool) -> int:
    """One line (or JSON entry) per directory, wherever it lives; 65 if any is damaged."""
    if as_json:
        print(json.dumps([{"path": where, "verified": r.ok, "problem": r.problem} for where, r in results],
                         indent=2))
    else:
        for where, r in results:
            print(f"{'ok' if r.ok else 'DAMAGED':<8} {where}" + (f": {r.problem}" if r.problem else ""))
    damaged = [(where, r) for where, r in results if not r.ok]
    if damaged:
        where, first = damaged[0]
        raise CorruptGeneration(f"{len(damaged)} of {len(results)} damaged, first {where}: {first.problem}")
    return 0
