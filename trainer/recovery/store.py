"""The generation store: published generations under `checkpoints/`, their temporary
siblings, and publishing through the shared atomic protocol."""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

from trainer.recovery.atomic import MANIFEST, fsync_dir, publish_directory, temporary_sibling
from trainer.recovery.manifest import Verification, verify_directory
from trainer.recovery.resume import generation_name, generation_step

# Only directories matching these were created by us and may be removed: temporaries being
# written, and generations being deleted (renamed aside first, so a crash mid-delete never
# leaves a published generation with missing files).
TEMPORARY_NAME = re.compile(r"^\.step-\d{8}\.(tmp|deleting)-[0-9A-Za-z-]+$")


class GenerationStore:
    """Published `step-%08d` directories under one root (recovery generations or exports)."""

    def __init__(self, root: Path):
        self.root = root
        # Verification re-hashes every file; remember results per manifest identity so
        # retention after each save does not re-read every kept generation.
        self._verified: dict[tuple[str, int, int], Verification] = {}

    def names(self) -> list[str]:
        """Published generation names, oldest first (names sort by step)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and generation_step(p.name) is not None)

    def path(self, name: str) -> Path:
        return self.root / name

    def verify(self, name: str, cached: bool = False) -> Verification:
        """Full re-hash against the manifest; with `cached`, reuse this process's earlier
        result while the manifest file is unchanged (same inode and mtime)."""
        try:
            stat = (self.path(name) / MANIFEST).stat()
            key = (name, stat.st_ino, stat.st_mtime_ns)
        except OSError:
            return verify_directory(self.path(name))
        if not cached or key not in self._verified:
            self._verified[key] = verify_directory(self.path(name))
        return self._verified[key]

    def newest_verified(self) -> str | None:
        return next((n for n in reversed(self.names()) if self.verify(n).ok), None)

    def temporaries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and TEMPORARY_NAME.match(p.name))

    def recover_interrupted_replacements(self) -> list[str]:
        """Undo a replacement a crash cut short: publishing over an existing name renames the
        old directory aside first; if the new one never arrived, put the old one back."""
        if not self.root.is_dir():
            return []
        recovered = []
        for aside in sorted(self.root.glob(".step-*.replaced-*")):
            name = aside.name[1:].split(".replaced-")[0]
            if generation_step(name) is not None and not self.path(name).exists():
                os.rename(aside, self.path(name))
                recovered.append(name)
        if recovered:
            fsync_dir(self.root)
        return recovered

    def replaced(self) -> list[str]:
        """Superseded copies kept aside by --from-generation re-publishing (for inspection)."""
        return sorted(p.name for p in self.root.glob(".step-*.replaced-*")) if self.root.is_dir() else []

    def remove(self, name: str) -> None:
        """Delete a published generation atomically: rename it to a hidden `.deleting-`
        sibling (never selected), make the rename durable, then delete the files."""
        doomed = self.root / f".{name}.deleting-{secrets.token_hex(3)}"
        os.rename(self.path(name), doomed)
        fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

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

    def publish(self, temporary: Path, step: int, manifest: dict, fault_hook,
                known: dict[str, dict] | None = None) -> dict:
        """Seal and rename `temporary`; `known` are digests its writer computed while writing."""
        name = generation_name(step)
        sealed = publish_directory(temporary, self.path(name), manifest, fault_hook, known)
        stat = (self.path(name) / MANIFEST).stat()
        # Sealing just hashed every file: remember it as verified instead of re-reading.
        self._verified[(name, stat.st_ino, stat.st_mtime_ns)] = Verification(self.path(name), sealed, None)
        return sealed
