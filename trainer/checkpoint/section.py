"""A section of a run directory: published `step-%08d` directories under one root (recovery
generations under `checkpoints/`, exports under `exports/`), their hidden siblings, and
publishing through the shared atomic protocol (`LocalSection`); the verbs every section shares,
on a disk or in an object store (`Section`)."""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol, Self

from trainer.checkpoint.atomic import (finish_interrupted_replacements, fsync_dir, manifest_digest, rename_aside,
                                     rename_into_place, seal_directory, set_aside, temporary_sibling,
                                     write_file_durably)
from trainer.checkpoint.manifest import Manifest, Verification, verify_directory
from trainer.checkpoint.identity import adopted, identity_or_problem, trusted
from trainer.checkpoint.signing import Signing, encode_signed
from trainer.errors import CorruptGeneration
from trainer.layout import (DELETING, MANIFEST, REMOVABLE, REPLACED, REPLACING, RUN_IDENTITY, generation_name,
                             generation_step)


@dataclass(frozen=True)
class Published:
    """A directory that became published, and what it cost."""

    name: str
    step: int
    manifest_sha256: str
    save_s: float
    """Wall time of the whole save, write + hash/fsync + publish."""
    blocked_s: float
    """Time the training loop was blocked by it (all of it, in sync mode)."""
    upload_s: float = 0.0
    """Seconds uploading, when the publish is itself the commit in an object store (several
    processes sharing no disk); 0 otherwise."""


class Section(Protocol):
    """What every section of a run directory answers, wherever it lives: `LocalSection` on a
    disk, `ObjectSection` (storage/object/section.py) in an object store. Each commits in its
    own way (a rename, the manifest last); these verbs read, check and copy what is committed."""

    def committed(self) -> list[str]:
        """Names of the committed directories, oldest first."""

    def verify(self, name: str) -> Verification:
        """Every file against the manifest, then name, run and signature (`trusted`)."""

    def trusted(self, verification: Verification, name: str) -> Verification:
        """The check of name, run and signature (identity.py) on a verification."""

    def owned(self, manifest: Manifest) -> Manifest:
        """`manifest`, naming the run this section belongs to (as it is committed here)."""

    def identity_bytes(self) -> bytes | None:
        """The run's `run.json`, None without one."""

    def adopt(self, run: str, attempt: str, how: str) -> None:
        """Record in the run's `run.json` that it continues from `run`'s generations."""

    def copy_committed(self, name: str, source: Self,
                       before_commit: Callable[[Manifest], None] = lambda manifest: None) -> str:
        """Copy `source`'s committed `name` (another run's section of the same kind) here, by this
        section's own commit; returns the manifest's sha256."""

    def remove(self, name: str) -> None:
        """Delete a committed directory so that no reader ever sees it half deleted."""


class LocalSection:
    """Published `step-%08d` directories under one root (recovery generations or exports)."""

    def __init__(self, root: Path, signing: Signing | None = None):
        self.root = root
        self.signing = signing
        """With a key: what this section publishes is signed, and what it verifies must be."""
        # Verification re-hashes every file; remember results per manifest identity so
        # retention after each save does not re-read every kept generation.
        self._verified: dict[tuple[str, int, int, bool], Verification] = {}
        self._deleting: threading.Thread | None = None
        """The files of the last directory removed `later`, being deleted (one at a time)."""

    def names(self) -> list[str]:
        """Committed generation names, oldest first (names sort by step): a `step-%08d`
        directory is committed iff its manifest exists (it is written last)."""
        return [name for name in self._step_directories() if (self.root / name / MANIFEST).exists()]

    def uncommitted(self) -> list[str]:
        """`step-%08d` directories without a manifest: a copy cut short (an interrupted
        `aws s3 sync`, a sidecar, a hand copy). Never selected, never damage, never deleted."""
        return [name for name in self._step_directories() if not (self.root / name / MANIFEST).exists()]

    def committed(self) -> list[str]:
        """`names()`, by the verb `ObjectSection` uses: a copy reads either section alike."""
        return self.names()

    def _step_directories(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and generation_step(p.name) is not None)

    def path(self, name: str) -> Path:
        return self.root / name

    def verify(self, name: str, cached: bool = False, shards: bool = True) -> Verification:
        """Full re-hash against the manifest, then name, run and signature (`trusted`); with
        `cached`, reuse this process's earlier result while the manifest file is unchanged
        (same inode and mtime) and so is the run's identity. `shards` False leaves the
        shards' digest to the load (`verify_directory`, trainer/checkpoint/onepass.py)."""
        try:
            stat = (self.path(name) / MANIFEST).stat()
            key = (name, stat.st_ino, stat.st_mtime_ns, shards)
        except OSError:
            return self.trusted(verify_directory(self.path(name), shards=shards), name)
        if not cached or key not in self._verified:
            self._verified[key] = verify_directory(self.path(name), shards=shards)
        return self.trusted(self._verified[key], name)

    def remember_verified(self, name: str, verification: Verification) -> None:
        """`name` was just renamed into place after its writer hashed every file on the way
        (a peer's transfer): `verify(name, cached=True)` takes that instead of reading it again."""
        stat = (self.path(name) / MANIFEST).stat()
        self._verified[(name, stat.st_ino, stat.st_mtime_ns, True)] = replace(verification, path=self.path(name))

    def trusted(self, verification: Verification, name: str) -> Verification:
        return trusted(verification, name, *identity_or_problem(self.identity_bytes()), self.signing)

    def identity_bytes(self) -> bytes | None:
        """The run's `run.json` (beside this section), None without one (a lone directory)."""
        try:
            return (self.root.parent / RUN_IDENTITY).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def adopt(self, run: str, attempt: str, how: str) -> None:
        """Record in the run's `run.json` that it continues from `run`'s generations (identity.py)."""
        write_file_durably(self.root.parent / RUN_IDENTITY, adopted(self.identity_bytes(), run, attempt, how))

    def owned(self, manifest: Manifest) -> Manifest:
        """`manifest`, naming the run this section belongs to (as it is published)."""
        identity, _ = identity_or_problem(self.identity_bytes())
        return replace(manifest, run=identity.run) if identity else manifest

    def temporaries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and REMOVABLE.match(p.name))

    def recover_interrupted_replacements(self) -> list[str]:
        """Finish replacements a crash cut short (see `rename_into_place`); the names put back."""
        return finish_interrupted_replacements(self.root)

    def replaced(self) -> list[str]:
        """Superseded copies kept for inspection: never selected, never deleted by us."""
        return self._hidden(REPLACED)

    def interrupted_replacements(self) -> list[str]:
        """`.replacing-` leftovers of a crash, which the next trainer puts back or retires."""
        return self._hidden(REPLACING)

    def _hidden(self, suffix: str) -> list[str]:
        return sorted(p.name for p in self.root.glob(f".step-*{suffix}*")) if self.root.is_dir() else []

    def set_aside_later_than(self, step: int) -> list[str]:
        """Retire every published directory after `step`, oldest first: an operator went back
        to an earlier generation, so they belong to an abandoned line and must never be
        resumed from. They stay on disk as superseded copies."""
        later = [name for name in self.names() if generation_step(name) > step]
        for name in later:
            set_aside(self.path(name))
        if later:
            fsync_dir(self.root)
        return later

    def remove(self, name: str, later: bool = False) -> None:
        """Delete a published generation atomically: rename it to a hidden `.deleting-`
        sibling (never selected), make the rename durable, then delete the files. `later`:
        the files are deleted on a thread of its own (a save's retention: unlinking a
        generation costs the kernel about as much as fsyncing it, and the generation is
        already gone for every reader); a crash leaves the `.deleting-` sibling, which the
        next attempt removes with the temporaries. At most one such deletion runs at once;
        `settle()` waits for it."""
        doomed = rename_aside(self.path(name), DELETING)
        fsync_dir(self.root)
        if not later:
            shutil.rmtree(doomed, ignore_errors=True)
            return
        self.settle()
        self._deleting = threading.Thread(target=shutil.rmtree, args=(doomed,), kwargs={"ignore_errors": True},
                                          name="recovery-retention")
        self._deleting.start()

    def settle(self) -> None:
        """Wait until the files of every directory removed `later` are deleted."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def remove_stale_temporaries(self) -> list[str]:
        """Delete temporaries left by crashed attempts. Safe only while holding the output
        lock (no other writer can be filling one)."""
        removed = []
        for path in self.temporaries():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        return removed

    def begin(self, step: int, tag: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return temporary_sibling(self.root, generation_name(step), tag)

    def publish(self, temporary: Path, step: int, describe: Callable[[dict], Manifest],
                known: dict[str, dict] | None = None) -> str:
        """Seal `temporary` with the manifest `describe(files)` makes, and rename it into
        place; `known` are digests its writer computed while writing. Returns the sha256 of
        the manifest now under the name.

        When the name is already published with exactly these files (an export replayed
        after a resume), the existing directory stays and the new copy is dropped: replays
        do not pile up superseded copies."""
        name = generation_name(step)
        sealed = seal_directory(temporary, lambda files: self.owned(describe(files)), known,
                                lambda data: encode_signed(data, self.signing))
        if self.path(name).is_dir() and not self.path(name).is_symlink():
            existing = self.verify(name, cached=True)
            if existing.ok and existing.manifest.files == sealed.files:
                shutil.rmtree(temporary, ignore_errors=True)
                return manifest_digest(self.path(name))
        rename_into_place(temporary, self.path(name))
        stat = (self.path(name) / MANIFEST).stat()
        # Sealing just hashed every file: remember it as verified instead of re-reading.
        self._verified[(name, stat.st_ino, stat.st_mtime_ns, True)] = Verification(self.path(name), sealed, None)
        return manifest_digest(self.path(name))

    def copy_committed(self, name: str, source: LocalSection,
                       before_commit: Callable[[Manifest], None] = lambda manifest: None) -> str:
        """Copy `source`'s committed `name` here by this section's commit: verified there, copied
        into a temporary sibling, fsynced, verified again, `before_commit(manifest)`, renamed into
        place. Returns the sha256 of the manifest now under the name; CorruptGeneration when
        either side does not verify (nothing is left here then)."""
        checked = source.verify(name)
        if not checked.ok:
            raise CorruptGeneration(f"{source.path(name)} does not verify ({checked.problem})")
        self.root.mkdir(parents=True, exist_ok=True)
        temporary = temporary_sibling(self.root, name, "copy")
        for entry in sorted(source.path(name).iterdir()):
            if entry.is_file():
                shutil.copyfile(entry, temporary / entry.name)
        for entry in temporary.iterdir():
            with entry.open("rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(temporary)
        copied = verify_directory(temporary)
        if not copied.ok:
            shutil.rmtree(temporary, ignore_errors=True)
            raise CorruptGeneration(f"{name} copied from {source.path(name)} does not verify ({copied.problem})")
        before_commit(copied.manifest)
        rename_into_place(temporary, self.path(name))
        return manifest_digest(self.path(name))
