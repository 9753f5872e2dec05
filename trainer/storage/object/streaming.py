"""A generation's shards streamed from the store into the local tier while the one-pass load
reads them (trainer/checkpoint/onepass.py `Arrivals`): restore at the speed of the slowest of
the download, the hash and the load, not of their sum.

A shard up to `RANGED_ABOVE` bytes is one GET, streamed to its file and hashed as it arrives
(`ObjectStore.stream_into`, the download's own path: a failed try resumes where the written
bytes end); a larger one is fetched in parts of `RANGE_BYTES` (ranged GETs, every part of every
shard on one pool, first parts first), each part appended to its file only once every earlier
part of that file has been, so each file is written and hashed front to back, once, from the
bytes as they arrived. How far a file is written is how far the load may read. The last part
of a shard reads to the object's end, so an object longer than the manifest says is counted,
not cut. Every GET goes through the client's bounded retries and timeouts (the run's
`--store-*` settings); a failure after them fails the load (exit 74), a missing or resized
object is that file's problem in the manifest's words (65, `DamagedShard`).
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping

from trainer.checkpoint.atomic import fsync_dir, rename_into_place, write_file_durably
from trainer.checkpoint.digest import algorithm_of, entry as digest_entry, hasher
from trainer.checkpoint.manifest import Verification, deferred
from trainer.checkpoint.onepass import Arrivals
from trainer.errors import StorageFailure, TrainerError, option
from trainer.layout import MANIFEST
from trainer.storage.base import Transfer
from trainer.storage.object.client import ObjectClient, describe
from trainer.storage.object.section import ObjectSection

RANGED_ABOVE = 256 << 20
"""Shards larger than this are fetched in ranged parts, several at once; smaller ones in one
streamed GET each, which costs less client CPU per byte (64 MB read from loopback SeaweedFS:
0.14-0.20 CPU-s in 16 MiB parts, 0.15-0.18 in one streamed GET; docs/checkpoint-modes.md)."""
RANGE_BYTES = 16 << 20
"""Bytes per ranged GET of a large shard: parts small enough to spread one shard over several
connections and to let the load start early, large enough that a GET's overhead stays small."""
PARALLEL_GETS = 8
"""GETs in flight at once, over every shard of the generation."""


def parts_of(size: int) -> list[tuple[int, int | None]]:
    """[start, end) of each ranged GET of an object of `size` bytes; the last one open (None:
    to the object's end)."""
    part = RANGE_BYTES
    starts = list(range(0, max(size, 1), part))
    return [(start, None if index == len(starts) - 1 else start + part) for index, start in enumerate(starts)]


class Assembly:
    """One shard's file, appended part after part in order whatever order the parts arrive in."""

    def __init__(self, path: Path, name: str, parts: int, arrivals: Arrivals, algorithm: str):
        self.name, self.parts, self.arrivals, self.algorithm = name, parts, arrivals, algorithm
        self.file = open(path, "wb", buffering=0)
        self.digest, self.written, self.next = hasher(algorithm), 0, 0
        self.waiting: dict[int, bytes] = {}
        self.lock = threading.Lock()
        self.done = False

    def arrived(self, index: int, data: bytes) -> None:
        with self.lock:
            if self.done:
                return
            self.waiting[index] = data
            while self.next in self.waiting:
                piece = memoryview(self.waiting.pop(self.next))
                self.digest.update(piece)  # the hash and the write release the GIL: shards overlap
                self.written += len(piece)
                while piece:
                    piece = piece[self.file.write(piece):]
                self.next += 1
            self.arrivals.advanced(self.name, self.written)
            if self.next == self.parts:
                self.finish(digest_entry(self.written, self.algorithm, self.digest.hexdigest()))

    def finish(self, digest: dict | None) -> None:
        """Once (the first word wins: a missing object stays missing)."""
        if not self.done:
            self.done = True
            self.file.close()
            self.arrivals.finished(self.name, digest)

    def missing(self) -> None:
        with self.lock:
            self.finish(None)

    def resized(self, size: int) -> None:
        with self.lock:
            self.finish(digest_entry(size, self.algorithm, ""))


def stream_shards(objects: ObjectClient, key_of: Callable[[str], str], files: Mapping[str, Mapping],
                  directory: Path, arrivals: Arrivals, where: str) -> None:
    """Start streaming every file of `files` ({name: manifest entry}) into `directory`; returns
    at once (every file created), the download goes on on a pool of its own and reports to
    `arrivals`."""
    rounds = {name: parts_of(int(entry["bytes"])) if int(entry["bytes"]) > RANGED_ABOVE else [(0, None)]
              for name, entry in files.items()}
    whole = sorted(name for name, parts in rounds.items() if len(parts) == 1)
    assemblies = {name: Assembly(directory / name, name, len(parts), arrivals, algorithm_of(files[name]))
                  for name, parts in rounds.items() if len(parts) > 1}
    for name in whole:
        (directory / name).touch()  # the load's index check finds every shard before its bytes
    pool = ThreadPoolExecutor(PARALLEL_GETS, thread_name_prefix="store-stream")

    def reported(name: str, error: BaseException) -> None:
        """A failure after the client's retries: the load raises it (one line, 74)."""
        arrivals.failed(error if isinstance(error, TrainerError) else
                        StorageFailure(f"{where}: downloading {name} failed: {describe(error)}; earlier "
                                       f"generations are intact; rerun with {option('--resume', 'auto')}"))
        missing(name)

    def missing(name: str) -> None:
        if name in assemblies:
            assemblies[name].missing()
        else:
            arrivals.finished(name, None)

    def stream(name: str) -> None:
        try:
            arrivals.finished(name, objects.stream_into(key_of(name), directory / name,
                                                        lambda written: arrivals.advanced(name, written),
                                                        algorithm_of(files[name])))
        except FileNotFoundError:
            missing(name)
        except BaseException as error:  # noqa: BLE001 - handed to the load
            reported(name, error)

    def get(name: str, index: int, start: int, end: int | None) -> None:
        assembly = assemblies[name]
        try:
            if assembly.done:
                return
            data = objects.read_range(key_of(name), start, end)
            assembly.arrived(index, data)
        except FileNotFoundError:
            missing(name)
        except BaseException as error:  # noqa: BLE001 - handed to the load
            reported(name, error)

    def size_of(name: str) -> int | None:
        """A ranged shard's size in the store (a ranged GET cannot tell a longer object; one
        shorter would fail its last GETs), before any part is asked for."""
        try:
            return objects.size(key_of(name))
        except BaseException as error:  # noqa: BLE001 - handed to the load
            reported(name, error)
            return None

    ranged = sorted(assemblies)
    for name, size in zip(ranged, pool.map(size_of, ranged)):
        if size is None:
            missing(name)
        elif size != int(files[name]["bytes"]):
            assemblies[name].resized(size)
    for name in whole:
        pool.submit(stream, name)
    for index in range(max((len(rounds[name]) for name in ranged), default=0)):
        for name in ranged:  # the first part of every shard first: every file starts loading early
            if index < len(rounds[name]) and not assemblies[name].done:
                pool.submit(get, name, index, *rounds[name][index])
    pool.shutdown(wait=False)


def fetch_streaming(section: ObjectSection, name: str, staging: Path, into: Path) -> tuple[Verification, Transfer]:
    """`section.fetch`, but for the one-pass load: the manifest checked as `fetch` checks it,
    the small files downloaded and verified, then the shards streamed into `staging/name` in
    the background while the caller loads them (`shards_pending`, with their `arrivals`). A
    load that verifies `keep()`s the copy: it is renamed to `into/name`, as `fetch` leaves it;
    otherwise it is removed. The Transfer counts the bytes, and the seconds until the load can
    start (the rest overlaps the load)."""
    started = time.monotonic()
    manifest_data, checked = section.committed_manifest(name, into / name)
    if not checked.ok:
        return checked, Transfer(0, 0.0)
    manifest = checked.manifest
    directory = staging / name
    directory.mkdir(parents=True)
    shards = {file: entry for file, entry in manifest.files.items() if deferred(file)}
    problem = section.download_files(name, sorted(set(manifest.files) - set(shards)), manifest, directory)
    if problem:
        shutil.rmtree(directory, ignore_errors=True)
        return Verification(into / name, manifest, problem), Transfer(0, 0.0)
    write_file_durably(directory / MANIFEST, manifest_data)

    def keep() -> None:
        fsync_dir(directory)
        into.mkdir(parents=True, exist_ok=True)
        rename_into_place(directory, into / name)

    arrivals = Arrivals(shards, keep, lambda: shutil.rmtree(directory, ignore_errors=True))
    stream_shards(section.objects, lambda file: section.key(name, file), shards, directory, arrivals, section.url(name))
    transferred = sum(int(entry["bytes"]) for entry in manifest.files.values())
    return (Verification(directory, manifest, None, shards_pending=True, arrivals=arrivals),
            Transfer(transferred, time.monotonic() - started))
