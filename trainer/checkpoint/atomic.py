"""Durable, atomic filesystem operations: every rename and directory fsync of the publish
protocol (the DCP writer fsyncs the shards it writes itself, recovery/writer.py).

The publish protocol: write into a unique temporary sibling, fsync every file, write and
fsync the manifest last, fsync the directory, rename it to its final name, fsync the parent.
A crash at any instant leaves the old set of directories, or the old set plus one complete
new one (docs/generations.md, "What survives what"). Exports and recovery generations share this one
implementation.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from trainer import seams
from trainer.checkpoint.digest import CURRENT, entry as digest_entry, hasher
from trainer.errors import RefuseOverwrite
from trainer.layout import (MANIFEST, REPLACED, REPLACING, file_temporary, hidden_name, split_hidden,
                             temporary_name)

_CHUNK = 8 << 20


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path, sync: bool = False, algorithm: str = CURRENT) -> dict:
    """Size and digest of a file ({bytes, ALGORITHM}); with `sync`, also fsync it (just-written
    files are read back from the page cache, so hashing and syncing cost one pass)."""
    digest = hasher(algorithm)
    size = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return digest_entry(size, algorithm, digest.hexdigest())


def write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so readers see the old or the new content, never a mix."""
    temporary = file_temporary(path)
    try:
        write_file_durably(temporary, data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def encode_json(value: dict) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def atomic_write_json(path: Path, value: dict) -> None:
    atomic_write_bytes(path, encode_json(value))


def temporary_sibling(parent: Path, name: str, tag: str) -> Path:
    """A fresh hidden directory next to where `name` will be published (`.NAME.tmp-TAG-RAND`)."""
    path = parent / temporary_name(name, tag)
    path.mkdir(parents=True)
    return path


def seal_directory(temporary: Path, describe, known: dict[str, dict] | None = None, encode=encode_json):
    """Write into `temporary` a manifest listing every file's size and digest, and make it
    all durable. `describe(files)` makes the manifest (a `Manifest`) from the file list,
    `encode(json)` its bytes (signed, with a key); returns it as written.

    `known` holds {bytes, digest} of files whose writer hashed them while writing and has
    already fsynced them; they are not read back (only their size is re-checked). Every
    other file is hashed and fsynced here.
    """
    files = {}
    known = known or {}
    for entry in sorted(temporary.iterdir()):
        if not entry.is_file() or entry.name == MANIFEST:
            continue
        recorded = known.get(entry.name)
        if recorded is not None and entry.stat().st_size == recorded["bytes"]:
            files[entry.name] = dict(recorded)
        else:
            files[entry.name] = file_digest(entry, sync=True)
    seams.crash_point("after-files-fsync")
    sealed = describe(files)
    data = encode(sealed.to_json())
    write_file_durably(temporary / MANIFEST, data)
    fsync_dir(temporary)
    seams.crash_point("after-manifest")
    return type(sealed).from_json(json.loads(data))


def rename_into_place(temporary: Path, final: Path) -> None:
    """Rename a sealed `temporary` to `final` and make the rename durable.

    If `final` already exists (an export replayed after a resume that came out different,
    for instance), it is replaced in three renames: the old directory to
    `.NAME.replacing-R`, the new one to `final`, the old one on to `.NAME.replaced-R`, a
    superseded copy kept for inspection. A crash after the first rename leaves a
    `.replacing-` copy that `finish_interrupted_replacements` puts back or retires, so the
    name is never lost; a `.replaced-` copy is final and never selected again.
    """
    if not final.exists() and not final.is_symlink():
        os.rename(temporary, final)
        seams.crash_point("after-rename")
        fsync_dir(final.parent)
        return
    if final.is_symlink() or not final.is_dir():
        raise RefuseOverwrite(f"{final} exists and is not a directory this trainer wrote; move it away, "
                              f"then rerun with --resume auto")
    replacing = final.with_name(hidden_name(final.name, REPLACING))
    _, token = split_hidden(replacing.name, REPLACING)
    os.rename(final, replacing)
    os.rename(temporary, final)
    seams.crash_point("after-rename")
    os.rename(replacing, final.with_name(hidden_name(final.name, REPLACED, token)))
    fsync_dir(final.parent)


def rename_aside(directory: Path, suffix: str) -> Path:
    """Rename a directory to a hidden `.NAME<suffix>R` sibling (never taken for a published
    one); the caller makes the rename durable with `fsync_dir` once it has done all it renames."""
    aside = directory.with_name(hidden_name(directory.name, suffix))
    os.rename(directory, aside)
    return aside


def set_aside(directory: Path) -> Path:
    """Retire a published directory under its `.NAME.replaced-R` name (kept, never selected)."""
    return rename_aside(directory, REPLACED)


def finish_interrupted_replacements(root: Path) -> list[str]:
    """After a crash inside `rename_into_place`: a `.NAME.replacing-R` whose NAME is missing
    is put back (the new directory never arrived); one whose NAME exists is retired to
    `.NAME.replaced-R` (the new one did). Returns the names put back."""
    if not root.is_dir():
        return []
    restored, changed = [], False
    for entry in sorted(root.iterdir()):
        parts = split_hidden(entry.name, REPLACING)
        if parts is None:
            continue
        name, token = parts
        final = root / name
        if final.exists():
            os.rename(entry, root / hidden_name(name, REPLACED, token))
        else:
            os.rename(entry, final)
            restored.append(name)
        changed = True
    if changed:
        fsync_dir(root)
    return restored


def manifest_digest(directory: Path) -> str:
    """sha256 of the manifest file itself: names exactly which sealed content was used (the
    attempt record's `manifest_sha256`; a few kB, not a file digest of the manifest's)."""
    return hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()
