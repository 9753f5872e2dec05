"""A verified load that reads the disk once: the shards are hashed while DCP loads them.

The separate verification (trainer/checkpoint/manifest.py `verify_directory`) reads every
file from the disk to hash it, then the load reads it again (from the page cache when it
still fits). Here the small files that are parsed (`manifest.json`, `.metadata`) are still
verified before anything parses them (the caller's `verify_directory(..., shards=False)`),
and only the tensor shards (`*.distcp`) are hashed at the same time as DCP loads them, by
`HASH_THREADS` threads of their own, each shard front to back, every byte once, in order.
Whichever of the two reads a page first reads it from the disk; the other finds it in the
page cache. A shard whose size or digest differs from the manifest's raises the same
one-line CorruptGeneration the separate pass gives ("NAME: FILE: blake3 mismatch …"), once
the load is done: the template then holds bytes of the damaged file, so a caller that falls
back to another source loads the whole template again from it.

Measured (bench/checkpoint_bench.py, docs/checkpoint-modes.md): this is faster than the
separate pass. Hashing inside DCP's reader (reading each item's range into memory, hashing
it, and deserializing from there) was measured too and was slower than the separate pass:
on this VM the copies it adds hold the GIL, so the reader threads stop overlapping; it was
not kept. As with the separate pass, the hash and the load are two reads of the file, so
a writer that changes a shard between them is not detected (the manifest detects
corruption; the signature, docs/security.md, covers what was published).

A restore from an object store streams into the same load (`Arrivals`): the download hashes
each shard as its bytes arrive and writes them to the local tier, and the load reads every
item as soon as its bytes are written, so the download, the hash and the load overlap and no
file is read twice. The state is handed nothing until every shard's hash matched.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

from trainer.checkpoint.atomic import file_digest
from trainer.checkpoint.digest import algorithm_of
from trainer.checkpoint.manifest import RECOVERY, Verification, deferred, file_problem, verify_directory
from trainer.checkpoint.restore import Restorable, Restored, restored_by
from trainer.checkpoint.snapshot import flat_template, load_snapshot, stored_entries
from trainer.errors import CorruptGeneration, UntrustedGeneration

class DamagedShard(CorruptGeneration):
    """A shard the one-pass load found damaged (65); `problem` is "FILE: what is wrong", as
    `verify_directory` words it, so a caller can refuse it as the separate pass would."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


class Arrivals:
    """Shards being written into a directory while the one-pass load reads it (a store's
    streamed download, trainer/storage/object/streaming.py). The writer says how far each
    shard has arrived, front to back, and its {bytes, digest} hashed as it was written; the
    load waits for the bytes each item needs and takes those digests instead of reading the
    files again. Every wait ends: the writer reports each shard finished (its digest, or None
    for a missing object) or the download failed (raised in the load). `keep()` after a
    verified load publishes the copy, `discard()` throws it away (the writer's callbacks)."""

    def __init__(self, files: Iterable[str], keep: Callable[[], None], discard: Callable[[], None]):
        self._arrived = {name: 0 for name in files}
        self._digests: dict[str, dict | None] = {}
        self._failure: BaseException | None = None
        self._condition = threading.Condition()
        self.keep, self.discard = keep, discard

    # ----------------------------------------------------------------- the writer's side
    def advanced(self, name: str, arrived: int) -> None:
        with self._condition:
            self._arrived[name] = arrived
            self._condition.notify_all()

    def finished(self, name: str, digest: dict | None) -> None:
        with self._condition:
            self._digests[name] = digest
            self._condition.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._condition:
            self._failure = self._failure or error
            self._condition.notify_all()

    # ----------------------------------------------------------------- the load's side
    def wait(self, name: str, end: int) -> None:
        """Until bytes [0, end) of `name` are written, or it is finished (short: the load
        fails, and its digest says why); raises the download's failure."""
        with self._condition:
            while self._failure is None and name not in self._digests and self._arrived.get(name, 0) < end:
                self._condition.wait()
            if self._failure is not None:
                raise self._failure

    def digest(self, name: str) -> dict | None:
        """{bytes, digest} of `name` as it was written (None: missing), once it is complete."""
        with self._condition:
            while self._failure is None and name not in self._digests:
                self._condition.wait()
            if self._failure is not None:
                raise self._failure
            return self._digests[name]


HASH_THREADS = 2
"""Shards hashed at once beside the load (2 measured best on 2 cores: one leaves the disk
idle between reads, more only compete with DCP's reader threads)."""


def verified_load(directory: Path, make_template: Callable[[dict], dict]) -> tuple[Verification, dict]:
    """Verify and load `directory` with one read of the disk: its manifest and `.metadata`
    verified (and the index checked against the allowlist) before either is parsed, then
    `make_template(stored entries)` filled by `load_verified`. CorruptGeneration (exit 65)
    in one line naming the file, whichever step finds the damage."""
    verification = verify_directory(Path(directory), shards=False)
    if not verification.ok:
        refusal = UntrustedGeneration if verification.untrusted else CorruptGeneration
        raise refusal(f"generation {verification.name} does not verify: {verification.problem}; restore an "
                      f"earlier generation with --from-generation")
    template = make_template(stored_entries(directory))
    load_verified(template, directory, verification.manifest.files)
    return replace(verification, shards_pending=False), template


def load_verified(template: dict, directory: Path, files: Mapping[str, Mapping], arrivals: Arrivals | None = None) \
        -> None:
    """`load_snapshot` of a directory whose `verify_directory(directory, shards=False)`
    passed (`files`: its manifest's), every listed shard hashed while it loads; raises
    CorruptGeneration naming the first shard that does not match (before any error of the
    load itself, which a damaged shard may also cause). `arrivals`: the shards are still
    being written, hashed by their writer (`Arrivals`)."""
    directory = Path(directory)
    shards = sorted(name for name in files if deferred(name))
    if arrivals is not None:  # hashed as they arrive: nothing to read twice
        failed = loading_failure(lambda: load_snapshot(template, directory, arrivals=arrivals))
        found = {name: arrivals.digest(name) for name in shards}
    else:
        with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(shards)))) as pool:
            digests = pool.map(lambda name: observed(directory / name, algorithm_of(files[name])), shards)
            failed = loading_failure(lambda: load_snapshot(template, directory))
            found = dict(zip(shards, digests))
    problem = next(filter(None, (file_problem(name, files[name], found[name]) for name in shards)), None)
    if problem:
        raise DamagedShard(f"{directory.name}: {problem}; restore an earlier generation with --from-generation",
                           problem)
    if failed is not None:
        raise failed


def loading_failure(load: Callable[[], None]) -> BaseException | None:
    """What `load()` raised that a damaged shard can cause (the hash then says which)."""
    try:
        load()
    except (CorruptGeneration, UntrustedGeneration, OSError) as error:
        return error
    return None


def judged_by_loading(generation: Verification, directory: Path | None = None) -> Verification:
    """`generation`, whose structure, name, run and signature verified (its shards hashed, or
    `shards_pending`), judged as a restore judges it: every stored value (tensor records and
    non-tensor values alike, including entries a restore leaves unread, such as another rank's
    RNG) loaded through the safe loader into a template of the stored shapes, then dropped; the
    shards hashed while they load when still pending. The problem is the restore's own line
    (a planted pickle: "step-…/__0_0.distcp: the value of KEY needs posix.system, …").
    `directory`: where the files are, when not at `generation.path` (a store's download)."""
    if not generation.ok or generation.manifest.kind != RECOVERY:
        return generation
    directory = Path(directory or generation.path)
    try:
        template = flat_template(stored_entries(directory))
        if generation.shards_pending:
            load_verified(template, directory, generation.manifest.files)
        else:
            load_snapshot(template, directory)
    except DamagedShard as damaged:
        return replace(generation, problem=damaged.problem, shards_pending=False)
    except (CorruptGeneration, UntrustedGeneration) as refusal:
        return replace(generation, problem=str(refusal), untrusted=isinstance(refusal, UntrustedGeneration),
                       shards_pending=False)
    except OSError as error:
        return replace(generation, problem=f"{directory.name}: unreadable ({error.strerror})", shards_pending=False)
    return replace(generation, shards_pending=False)


def restore_verified(generation: Verification, state: Restorable) -> Restored:
    """`restore()` of a generation whose shards are still to be hashed (`shards_pending`,
    verified by `verify_directory(..., shards=False)`): the same template, checks and
    hand-over, the shards hashed while they load. A damaged shard raises DamagedShard before
    the state is handed anything (the template, which may share the live tensors, then holds
    damaged bytes: a caller that goes on restores the whole state from another source)."""
    if not generation.shards_pending:
        raise AssertionError(f"{generation.name} is verified already: restore it with restore()")
    files, arrivals = generation.manifest.files, generation.arrivals
    try:
        restored = restored_by(replace(generation, shards_pending=False, arrivals=None), state,
                               lambda template, directory: load_verified(template, directory, files, arrivals))
    except BaseException:
        if arrivals is not None:
            arrivals.discard()
        raise
    if arrivals is not None:
        arrivals.keep()  # a streamed download, verified: it becomes the local tier's copy
    return restored


def observed(path: Path, algorithm: str) -> dict | None:
    """A shard's size and digest as read now (None: missing, or unreadable)."""
    try:
        return file_digest(path, algorithm=algorithm) if path.is_file() else None
    except OSError:
        return None
