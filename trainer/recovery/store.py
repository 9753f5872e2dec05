"""The generation store: published generations under `checkpoints/`, their temporary
siblings, and publishing through the shared atomic protocol."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from trainer.recovery.atomic import MANIFEST, publish_directory, temporary_sibling
from trainer.recovery.manifest import Verification, verify_directory
from trainer.recovery.resume import generation_name, generation_step

# Only directories matching this were created by us as temporaries and may be removed.
TEMPORARY_NAME = re.compile(r"^\.step-\d{8}\.tmp-[0-9A-Za-z-]+$")


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
