"""Reading and verifying sealed directories (recovery generations and exports).

A directory is *verified* when its manifest parses, has a known format, lists every file in
the directory (and the files its kind requires), and every file it lists exists with the
recorded size and sha256. Verification never modifies anything.
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


def unlisted_problem(directory: Path, listed: dict, required: tuple[str, ...]) -> str | None:
    """Every file must be covered by the manifest: a required file it does not list, or a
    file on disk it does not list, means part of the content would be used unverified."""
    if not listed:
        return f"{MANIFEST}: lists no files"
    for name in required:
        if name not in listed:
            return f"{name}: not listed in {MANIFEST}"
    try:
        on_disk = sorted(entry.name for entry in directory.iterdir() if entry.name != MANIFEST)
    except OSError as error:
        return f"{directory.name}: unreadable ({error.strerror})"
    stray = next((name for name in on_disk if name not in listed), None)
    return f"{stray}: not listed in {MANIFEST}" if stray else None


def verify_directory(directory: Path) -> Verification:
    try:
        manifest = read_manifest(directory)
    except ValueError as reason:
        return Verification(directory, None, str(reason))
    problem = unlisted_problem(directory, manifest["files"], REQUIRED_FILES.get(manifest.get("kind"), ()))
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
