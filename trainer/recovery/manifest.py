"""Reading and verifying sealed directories (recovery generations and exports).

A directory is *verified* when its manifest parses, has a known format, lists every file a
loader of its kind reads (and the files that kind requires), and every file it lists exists
with the recorded size and sha256. Verification never modifies anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trainer.recovery.atomic import MANIFEST, file_digest

FORMAT = "training-recovery"
FORMAT_VERSION = 1
REQUIRED_FILES = {"recovery": (".metadata",), "export": ("model.safetensors", "config.json")}
"""What a reader of each manifest `kind` needs: DCP's index, or the weights and their config."""


def read_by_loader(kind: str | None, name: str) -> bool:
    """Whether loading a directory of this kind may read the file, so it must be verified.
    Other files (a Finder `.DS_Store`, an NFS `.nfsXXXX`) are never read and are ignored."""
    if kind == "recovery":
        return name in REQUIRED_FILES[kind] or name.endswith(".distcp")
    if kind in REQUIRED_FILES:
        return name in REQUIRED_FILES[kind]
    return True


@dataclass(frozen=True)
class Verification:
    path: Path
    manifest: dict | None
    problem: str | None
    """None when verified; else "FILE: what is wrong" naming the first bad file."""

    @property
    def ok(self) -> bool:
        return self.problem is None


def read_manifest(directory: Path) -> dict:
    """The parsed manifest; raises ValueError with a short reason if it is unusable."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{MANIFEST}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{MANIFEST}: unreadable ({error.__class__.__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{MANIFEST}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{MANIFEST}: format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}")
    if not isinstance(manifest.get("files"), dict) or manifest.get("digest") != "sha256":
        raise ValueError(f"{MANIFEST}: no file list")
    return manifest


def file_problem(name: str, expected: dict, actual: dict | None) -> str | None:
    """Compare one file's recorded and observed {bytes, sha256}; a reason, or None if equal."""
    if actual is None:
        return f"{name}: missing"
    if actual["bytes"] != expected.get("bytes"):
        return f"{name}: size {actual['bytes']} bytes, manifest says {expected.get('bytes')}"
    if actual["sha256"] != expected.get("sha256"):
        return f"{name}: sha256 mismatch (manifest {str(expected.get('sha256'))[:12]}…, file {actual['sha256'][:12]}…)"
    return None


def unlisted_problem(directory: Path, listed: dict, kind: str | None) -> str | None:
    """Every file a loader reads must be covered by the manifest: a required file it does not
    list, or one on disk it does not list, would be used unverified."""
    if not listed:
        return f"{MANIFEST}: lists no files"
    for name in REQUIRED_FILES.get(kind, ()):
        if name not in listed:
            return f"{name}: not listed in {MANIFEST}"
    try:
        on_disk = sorted(entry.name for entry in directory.iterdir() if entry.name != MANIFEST)
    except OSError as error:
        return f"{directory.name}: unreadable ({error.strerror})"
    stray = next((name for name in on_disk if name not in listed and read_by_loader(kind, name)), None)
    return f"{stray}: not listed in {MANIFEST}" if stray else None


def verify_directory(directory: Path) -> Verification:
    try:
        manifest = read_manifest(directory)
    except ValueError as reason:
        return Verification(directory, None, str(reason))
    problem = unlisted_problem(directory, manifest["files"], manifest.get("kind"))
    if problem:
        return Verification(directory, manifest, problem)
    for name, expected in sorted(manifest["files"].items()):
        path = directory / name
        try:
            actual = file_digest(path) if path.is_file() else None
        except OSError as error:
            return Verification(directory, manifest, f"{name}: unreadable ({error.strerror})")
        problem = file_problem(name, expected, actual)
        if problem:
            return Verification(directory, manifest, problem)
    return Verification(directory, manifest, None)
