"""Durable, atomic filesystem operations (the only place that calls fsync and rename).

The publish protocol (DESIGN.md §5.3): write into a unique temporary sibling, fsync every
file, write and fsync the manifest last, fsync the directory, rename it to its final name,
fsync the parent. A crash at any instant leaves the old set of directories, or the old set
plus one complete new one. Exports and recovery generations share this one implementation.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
from pathlib import Path

from trainer.errors import RefuseOverwrite, StorageFailure

MANIFEST = "manifest.json"
_CHUNK = 8 << 20
_ADVICE = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free space or raise the quota",
           errno.EFBIG: "raise the file-size limit (ulimit -f)", errno.EACCES: "fix the permissions",
           errno.EPERM: "fix the permissions", errno.EROFS: "make the filesystem writable"}


def storage_failure(error: OSError, what: str) -> StorageFailure:
    """One line for an I/O error: what failed, where, and what to do about it."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    where = f" ({error.filename})" if getattr(error, "filename", None) else ""
    advice = _ADVICE.get(error.errno, "check the storage")
    return StorageFailure(f"{what} failed: {reason}{where}; {advice}, then rerun with --resume auto")


def is_storage_error(error: BaseException) -> bool:
    """Any OS-level I/O error (disk full, limits, permissions, a stale network mount…) is the
    storage's problem, not a bug: it becomes one line and exit 74."""
    return isinstance(error, OSError)


def root_cause(error: BaseException) -> BaseException:
    """DCP wraps each rank's error in a CheckpointException (a BaseException whose str()
    holds tracebacks); dig out the original so it can be reported in one line."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        return root_cause(inner)
    cause = error.__cause__ or error.__context__
    if not isinstance(error, OSError) and isinstance(cause, BaseException):
        return root_cause(cause)
    return error


def reraise_as_storage_failure(error: BaseException, what: str):
    """Inside an `except`: raise a storage error as one-line StorageFailure (exit 74), and
    anything else unchanged."""
    failure = as_storage_failure(error, what)
    if failure is not None:
        raise failure from None
    raise error


def as_storage_failure(error: BaseException, what: str) -> StorageFailure | None:
    cause = root_cause(error)
    return storage_failure(cause, what) if is_storage_error(cause) else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path, sync: bool = False) -> dict:
    """Size and sha256 of a file; with `sync`, also fsync it (just-written files are read
    back from the page cache, so hashing and syncing cost one pass)."""
    digest = hashlib.sha256()
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
    return {"bytes": size, "sha256": digest.hexdigest()}


def write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so readers see the old or the new content, never a mix."""
    temporary = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
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
    path = parent / f".{name}.tmp-{tag}-{secrets.token_hex(3)}"
    path.mkdir(parents=True)
    return path


def seal_directory(temporary: Path, manifest: dict, fault_hook=lambda point: None,
                   known: dict[str, dict] | None = None) -> dict:
    """Write into `temporary` a manifest listing every file's size and sha256, and make it
    all durable. Returns the manifest as written (with `files`).

    `known` holds {bytes, sha256} of files whose writer hashed them while writing and has
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
            files[entry.name] = {"bytes": recorded["bytes"], "sha256": recorded["sha256"]}
        else:
            files[entry.name] = file_digest(entry, sync=True)
    fault_hook("after-files-fsync")
    sealed = {**manifest, "digest": "sha256", "files": files}
    write_file_durably(temporary / MANIFEST, encode_json(sealed))
    fsync_dir(temporary)
    fault_hook("after-manifest")
    return sealed


def publish_directory(temporary: Path, final: Path, manifest: dict, fault_hook=lambda point: None,
                      known: dict[str, dict] | None = None) -> dict:
    """Seal `temporary` and rename it to `final`, which must not exist yet."""
    sealed = seal_directory(temporary, manifest, fault_hook, known)
    rename_into_place(temporary, final, fault_hook)
    return sealed


def rename_into_place(temporary: Path, final: Path, fault_hook=lambda point: None) -> None:
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
        fault_hook("after-rename")
        fsync_dir(final.parent)
        return
    if final.is_symlink() or not final.is_dir():
        raise RefuseOverwrite(f"{final} exists and is not a directory this trainer wrote; move it away, "
                              f"then rerun with --resume auto")
    token = secrets.token_hex(3)
    replacing = final.with_name(f".{final.name}{REPLACING}{token}")
    os.rename(final, replacing)
    os.rename(temporary, final)
    fault_hook("after-rename")
    os.rename(replacing, final.with_name(f".{final.name}{REPLACED}{token}"))
    fsync_dir(final.parent)


REPLACING = ".replacing-"
"""Suffix of a directory being replaced (its name is about to be taken over)."""
REPLACED = ".replaced-"
"""Suffix of a superseded directory kept for inspection; never selected or restored."""


def set_aside(directory: Path) -> Path:
    """Retire a published directory under its `.NAME.replaced-R` name (kept, never selected)."""
    aside = directory.with_name(f".{directory.name}{REPLACED}{secrets.token_hex(3)}")
    os.rename(directory, aside)
    return aside


def finish_interrupted_replacements(root: Path) -> list[str]:
    """After a crash inside `rename_into_place`: a `.NAME.replacing-R` whose NAME is missing
    is put back (the new directory never arrived); one whose NAME exists is retired to
    `.NAME.replaced-R` (the new one did). Returns the names put back."""
    if not root.is_dir():
        return []
    restored, changed = [], False
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(".") or REPLACING not in entry.name:
            continue
        name, token = entry.name[1:].split(REPLACING, 1)
        final = root / name
        if final.exists():
            os.rename(entry, root / f".{name}{REPLACED}{token}")
        else:
            os.rename(entry, final)
            restored.append(name)
        changed = True
    if changed:
        fsync_dir(root)
    return restored


def manifest_digest(directory: Path) -> str:
    """sha256 of the manifest file itself: names exactly which sealed content was used."""
    return hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()
