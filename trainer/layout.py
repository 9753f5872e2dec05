"""The run directory's layout: every section, file and directory name, defined once.

```
OUTPUT/.trainer.storage.lock                   single-writer lock (a POSIX record lock), names its holder
OUTPUT/run.json                        the run's id (every manifest names it) and the runs it adopted
OUTPUT/checkpoints/step-00000024/      a published recovery generation (manifest.json last)
OUTPUT/checkpoints/.step-…tmp-TAG-R    a generation being written: never selected, removed later
OUTPUT/checkpoints/.step-…deleting-R   a generation being deleted by retention
OUTPUT/checkpoints/.step-…replacing-R  a directory whose name a new one is taking over
OUTPUT/checkpoints/.step-…replaced-R   a superseded copy kept for inspection, never selected
OUTPUT/exports/step-00000024/          a weights export, with the same hidden siblings
OUTPUT/attempts/<utc>-<id>/            attempt.json, requirements.txt, summary.json, last_step
```

Names only and the checks that go with them; no I/O beyond looking at what exists. The
loop, the stores, retention, `list` and the attempt records all take their names from here.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import NothingToResume, RefuseOverwrite, UsageError, option, storage_failure

GENERATIONS, EXPORTS = "generations", "exports"
"""The two kinds of sealed directory a run directory holds (one word each, everywhere)."""
SECTIONS = {GENERATIONS: "checkpoints", EXPORTS: "exports"}
"""Each kind's folder in the run directory (and prefix in an object store)."""
ATTEMPTS = "attempts"
LOCK = ".trainer.storage.lock"
RUN_IDENTITY = "run.json"
"""The run's id and the runs whose generations it adopted (trainer/checkpoint/identity.py)."""
STORE_MARKER = ".trainer-store"
"""In a local tier: the store URL whose working copy it is (a tier serves one store run)."""

MANIFEST = "manifest.json"
SNAPSHOT_INDEX = ".metadata"
"""DCP's index of a recovery snapshot; the shards are `__R_N.distcp`."""
SNAPSHOT_SHARD_SUFFIX = ".distcp"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
ATTEMPT_RECORD = "attempt.json"
ATTEMPT_SUMMARY = "summary.json"
ATTEMPT_REQUIREMENTS = "requirements.txt"
PROGRESS_MARKER = "last_step"
"""Per-step progress of a running attempt (one pwrite per step), read after a kill -9."""
STEP_DIGESTS = "step_digests"
"""Every step's number, loss bits and parameter checksum, appended (trainer/run/witness.py):
what a resume replays against."""

GENERATION_NAME = re.compile(r"^step-(\d{8})$")
TEMPORARY = ".tmp-"
DELETING = ".deleting-"
REPLACING = ".replacing-"
"""Suffix of a directory being replaced (its name is about to be taken over)."""
REPLACED = ".replaced-"
"""Suffix of a superseded directory kept for inspection; never selected or restored."""
REMOVABLE = re.compile(r"^\.step-\d{8}\.(tmp|deleting)-[0-9A-Za-z.-]+$")
"""Hidden directories we created and may remove: temporaries being written, and
generations being deleted (renamed aside first, so a crash mid-delete never leaves a
published generation with missing files)."""


def generation_name(step: int) -> str:
    return f"step-{step:08d}"


def generation_step(name: str) -> int | None:
    match = GENERATION_NAME.match(name)
    return int(match.group(1)) if match else None


def hidden_name(name: str, suffix: str, token: str | None = None) -> str:
    """`.NAME<suffix>TOKEN`: a sibling of NAME that is never taken for a published one."""
    return f".{name}{suffix}{token or secrets.token_hex(3)}"


def temporary_name(name: str, tag: str) -> str:
    return hidden_name(name, TEMPORARY, f"{tag}-{secrets.token_hex(3)}")


def split_hidden(hidden: str, suffix: str) -> tuple[str, str] | None:
    """(NAME, TOKEN) of a `.NAME<suffix>TOKEN` entry, or None if it is not one."""
    if not hidden.startswith(".") or suffix not in hidden:
        return None
    name, token = hidden[1:].split(suffix, 1)
    return name, token


def file_temporary(path: Path) -> Path:
    """Where a file is written before it atomically replaces `path`."""
    return path.with_name(hidden_name(path.name, TEMPORARY))


@dataclass(frozen=True)
class RunDirectory:
    root: Path

    def section(self, kind: str) -> Path:
        """The folder of GENERATIONS or EXPORTS."""
        return self.root / SECTIONS[kind]

    @property
    def checkpoints(self) -> Path:
        return self.section(GENERATIONS)

    @property
    def exports(self) -> Path:
        return self.section(EXPORTS)

    @property
    def attempts(self) -> Path:
        return self.root / ATTEMPTS

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def identity(self) -> Path:
        return self.root / RUN_IDENTITY

    def attempt_folder(self, attempt_id: str) -> Path:
        return self.attempts / attempt_id

    def misplaced_entry(self) -> str | None:
        """An existing entry of the layout that has the wrong kind (a file where a folder
        belongs, or the reverse), found before any work instead of at the first save."""
        for section in (self.checkpoints, self.exports, self.attempts):
            if section.exists() and not section.is_dir():
                return f"{section} is a file, not a directory"
        if self.lock.is_dir():
            return f"{self.lock} is a directory, not the lock file"
        return None

    def prepare(self, must_exist: bool) -> None:
        """Create the directory if needed and check it can hold a run, before any work.
        `must_exist`: the operator asked to resume, so a missing directory is an error."""
        root = self.root
        if root.exists() and not root.is_dir():
            raise UsageError(f"{option('--output', root)} is a file, not a directory; choose a directory path")
        if problem := self.inner_part():
            raise UsageError(f"--output {problem}")
        if not root.exists() and must_exist:
            raise NothingToResume(f"nothing to resume: {root} does not exist; "
                                  f"check {option('--output')}, or start without {option('--resume')}")
        try:
            root.mkdir(parents=True, exist_ok=True)
            os.listdir(root)
        except (NotADirectoryError, FileExistsError):
            raise UsageError(f"{option('--output', root)}: part of the path is a file, not a directory; "
                             f"choose a directory path") from None
        except OSError as error:
            raise storage_failure(error, f"preparing --output {root}") from None
        if problem := self.misplaced_entry():
            raise RefuseOverwrite(f"{problem}; this is not a run directory of ours, so nothing was changed: "
                                  f"move it away or choose another {option('--output')}")

    def holds_a_run(self) -> bool:
        """Whether anything of the layout is here: a trainer has worked on this directory."""
        return any(path.exists() for path in (self.checkpoints, self.exports, self.attempts, self.lock,
                                              self.root / STORE_MARKER))

    def inner_part(self) -> str | None:
        """Why this directory looks like a part of a run directory (its `checkpoints/`, or one
        generation) rather than one: training there would nest a second run inside the first."""
        if self.root.name in SECTIONS.values() or generation_step(self.root.name) is not None \
                or (self.root / MANIFEST).exists():
            return (f"{self.root} is part of a run directory (a section or a generation), not one; "
                    f"pass the run directory that contains it")
        return None


RUNS_NAMED = 5
"""How many runs beneath a folder that is not one an error line names."""


def runs_beneath(folder: Path, depth: int = 3, limit: int = RUNS_NAMED) -> list[Path]:
    """Run directories at most `depth` levels below `folder` (`list outputs` names the runs
    in it), the first `limit` in sorted order; hidden folders and the sections of a run are
    not searched."""
    found: list[Path] = []
    level = [folder]
    for _ in range(depth):
        below = []
        for parent in level:
            try:
                children = sorted(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            for child in children:
                if RunDirectory(child).holds_a_run():
                    found.append(child)
                elif child.name not in SECTIONS.values():
                    below.append(child)
        level = below
    return sorted(found)[:limit]


def not_a_run(folder: Path) -> str:
    """Why `folder` cannot be listed or reported, naming the runs beneath it if there are any."""
    runs = runs_beneath(folder)
    if not runs:
        return (f"{folder} is not a run directory (no attempt records, generations or exports) and holds none "
                f"beneath it; pass the --output of a run")
    more = ", …" if len(runs) == RUNS_NAMED else ""
    return (f"{folder} is not a run directory; runs beneath it: {', '.join(str(run) for run in runs)}{more}; "
            f"pass one of them")
