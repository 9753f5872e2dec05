"""The commit protocol for sealed directories in an object store, where there is no rename.

A generation (or export) `SECTION/step-%08d/` is *committed* iff its `manifest.json` object
exists. Data objects go first, in parallel; the manifest, byte-identical to the local one
(it lists every file with its size and digest), goes last and is the commit marker. A prefix
without a manifest is an *uncommitted* leftover (a killed writer, a sidecar, an interrupted
`aws s3 sync`): never selected, never damage, listed, and removed by the next lease holder.
Removal is the reverse: the manifest first (uncommitted from that instant), then the data.

Restore streams every listed object through the digest into a local directory, so a committed
generation is used only if every byte matches its manifest.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

from trainer import seams
from trainer.checkpoint.content import check_content
from trainer.checkpoint.digest import algorithm_of
from trainer.checkpoint.atomic import fsync_dir, rename_into_place, temporary_sibling, write_file_durably
from trainer.checkpoint.manifest import (RECOVERY, InvalidManifest, Manifest, Verification, file_problem,
                                        index_verification, oversized_index, unlisted_problem)
from trainer.checkpoint.identity import adopted, identity_or_problem, trusted
from trainer.checkpoint.signing import Signing
from trainer.errors import CorruptGeneration
from trainer.storage.base import Transfer
from trainer.storage.object.client import ObjectClient
from trainer.layout import MANIFEST, REPLACED, RUN_IDENTITY, SNAPSHOT_INDEX, generation_step, hidden_name

PARALLEL_OBJECTS = 8
"""Objects uploaded or downloaded at once (each large one is also multipart)."""


@dataclass(frozen=True)
class SectionScan:
    committed: list[str]
    """Names with a manifest, oldest first."""
    uncommitted: list[str]
    """`step-%08d` prefixes without a manifest."""
    set_aside: list[str]
    """Hidden `.step-…replaced-…` copies: superseded, kept for inspection."""


def digest_of(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


class ObjectSection:
    """Sealed directories of one section (`checkpoints` or `exports`) of a run in a store."""

    def __init__(self, objects: ObjectClient, section: str, signing: Signing | None = None):
        self.objects = objects
        self.section = section
        self.signing = signing
        """With a key: a manifest must be authentic before anything it lists is downloaded."""

    def key(self, name: str, file: str | None = None) -> str:
        return f"{self.section}/{name}" + (f"/{file}" if file else "")

    def url(self, name: str) -> str:
        return self.objects.url_of(self.key(name))

    # ----------------------------------------------------------------- what is there
    def scan(self) -> SectionScan:
        grouped: dict[str, set[str]] = {}
        for key in self.objects.list(self.section):
            parts = key.split("/")
            if len(parts) >= 3:
                grouped.setdefault(parts[1], set()).add("/".join(parts[2:]))
        names = sorted(grouped)
        published = [name for name in names if generation_step(name) is not None]
        return SectionScan([name for name in published if MANIFEST in grouped[name]],
                           [name for name in published if MANIFEST not in grouped[name]],
                           [name for name in names if name.startswith(".") and REPLACED in name])

    def committed(self) -> list[str]:
        return self.scan().committed

    def manifest_bytes(self, name: str) -> bytes | None:
        return self.objects.read(self.key(name, MANIFEST))

    def manifest_digest(self, name: str) -> str | None:
        data = self.manifest_bytes(name)
        return digest_of(data) if data is not None else None

    # ----------------------------------------------------------------- commit
    def commit(self, name: str, directory: Path, fence: Callable[[], None]) -> Transfer:
        """Upload a published local directory and commit it: data, then the manifest.
        `fence()` raises if this process may no longer write (its lease was taken over); it
        runs before every object and right before the commit. A name already committed with
        the same files is left as it is (an export replayed after a resume)."""
        started = time.monotonic()
        manifest_data = (directory / MANIFEST).read_bytes()
        files = dict(Manifest.from_json(json.loads(manifest_data)).files)
        existing = self.manifest_bytes(name)
        if existing is not None and _files_of(existing) == files:
            return Transfer(0, time.monotonic() - started)
        fence()
        self.clear(name, keep=set(files))
        self.upload_files(name, directory, sorted(files), fence)
        self.commit_manifest(name, manifest_data, files, fence)
        return Transfer(sum(int(entry["bytes"]) for entry in files.values()), time.monotonic() - started)

    def copy_committed(self, name: str, source: ObjectSection,
                       before_commit: Callable[[Manifest], None] = lambda manifest: None) -> str:
        """Copy `source`'s committed `name` (another run prefix of the same store) here by this
        section's commit: every data object copied inside the store (server-side where it can),
        `before_commit(manifest)`, then the commit (sizes checked, the manifest last). Returns
        the sha256 of the manifest; CorruptGeneration when `source` has no readable manifest."""
        manifest_data = source.manifest_bytes(name)
        try:
            manifest = Manifest.from_json(json.loads(manifest_data or b"null"))
        except (InvalidManifest, ValueError) as reason:
            raise CorruptGeneration(f"{source.url(name)}: {MANIFEST} {reason}") from None
        files = dict(manifest.files)
        for file in sorted(files):
            self.objects.copy_from(source.objects, source.key(name, file), self.key(name, file))
        before_commit(manifest)
        self.commit_manifest(name, manifest_data, files, fence=lambda: None)  # seeding holds no lease
        return digest_of(manifest_data)

    def clear(self, name: str, keep: set[str] = frozenset()) -> None:
        """Before writing `name`: uncommit what is committed there (another line's
        generation under the same name) and delete leftovers, except objects named `keep`
        (they are overwritten anyway)."""
        self.objects.delete([self.key(name, MANIFEST)] if self.manifest_bytes(name) is not None else [])
        self.objects.delete([key for key in self.objects.list(self.key(name))
                             if key.split("/", 2)[2] not in keep])

    def upload_files(self, name: str, directory: Path, files: list[str], fence: Callable[[], None]) -> None:
        """The data objects, in parallel; `fence()` before each."""
        if not files:
            return

        def upload(index_file):
            index, file = index_file
            fence()
            self.objects.upload(directory / file, self.key(name, file))
            if index == 0:
                seams.crash_point("store-after-first-object")
        with ThreadPoolExecutor(min(PARALLEL_OBJECTS, len(files)), thread_name_prefix="upload") as pool:
            list(pool.map(upload, enumerate(files)))

    def commit_manifest(self, name: str, manifest_data: bytes, files: dict, fence: Callable[[], None],
                        writers: Mapping[str, int] = {}) -> None:
        """The commit: check the store holds exactly the listed bytes (every object streamed
        through the digest: checkpoint/content.py says why not ETags), then write the manifest.
        From this instant the generation exists. `writers`: the rank that wrote each file."""
        seams.crash_point("store-before-manifest")
        check_content(files, self.held(name, files), self.url(name), writers, name)
        fence()
        self.objects.write(self.key(name, MANIFEST), manifest_data)
        seams.crash_point("store-after-manifest")

    def held(self, name: str, files: Mapping[str, Mapping]) -> dict[str, dict | None]:
        """{file: {bytes, digest}} of what the store holds under `name` (None: missing), each
        hashed with the algorithm of its entry in `files`, read in parallel."""
        if not files:
            return {}
        names = sorted(files)
        with ThreadPoolExecutor(min(PARALLEL_OBJECTS, len(names)), thread_name_prefix="check") as pool:
            return dict(zip(names, pool.map(
                lambda file: self.objects.digest(self.key(name, file), algorithm_of(files[file])), names)))

    # ----------------------------------------------------------------- restore and verify
    def fetch(self, name: str, parent: Path) -> tuple[Verification, Transfer]:
        """Download a committed directory into `parent/name`, verifying every object while it
        streams; it is renamed into place only if everything matched. A damaged generation
        leaves nothing behind locally and comes back as a failed Verification.

        The data files are not fsynced (the manifest, written last, and the rename are): the
        download is a cache of what the store holds durably, and every later use verifies it
        again first. Within this process the page cache is what the load reads (nothing is
        lost without a crash of the machine). After a crash of the machine the copy may hold a
        manifest over torn data: `RemoteRun.reconcile` keeps it only if its manifest is the
        committed one, and `RemoteRun.restorable` hashes every shard before the state is used
        (one process: while it loads; a damaged one is downloaded again), as `local_copy`
        does for every other rank; a compare's download is used at once. An fsync per file
        cost a 256 MB fetch about 0.1 s of its 0.55-0.75 s here."""
        started = time.monotonic()
        manifest_data, checked = self.committed_manifest(name, parent / name)
        if not checked.ok:
            return checked, Transfer(0, 0.0)
        manifest = checked.manifest
        parent.mkdir(parents=True, exist_ok=True)
        temporary = temporary_sibling(parent, name, "fetch")
        problem = self.download_files(name, sorted(manifest.files), manifest, temporary)
        if problem:
            shutil.rmtree(temporary, ignore_errors=True)
            return Verification(parent / name, manifest, problem), Transfer(0, 0.0)
        write_file_durably(temporary / MANIFEST, manifest_data)
        fsync_dir(temporary)
        rename_into_place(temporary, parent / name)
        transferred = sum(int(entry["bytes"]) for entry in manifest.files.values())
        return Verification(parent / name, manifest, None), Transfer(transferred, time.monotonic() - started)

    def committed_manifest(self, name: str, where: Path) -> tuple[bytes | None, Verification]:
        """The committed manifest of `name` (its bytes) and whether it may be downloaded: parsed,
        its name, run and signature trusted, no unlisted object under the prefix."""
        manifest_data = self.manifest_bytes(name)
        if manifest_data is None:
            return None, Verification(where, None, f"{MANIFEST}: missing (not committed)")
        try:
            manifest = Manifest.from_json(json.loads(manifest_data))
        except (InvalidManifest, ValueError) as reason:
            return None, Verification(where, None, str(reason))
        return manifest_data, self.trusted(Verification(where, manifest, self._structure_problem(name, manifest)),
                                           name)

    def download_files(self, name: str, files: list[str], manifest: Manifest, directory: Path) -> str | None:
        """Download `files` of `name` into `directory`, in parallel, each hashed as it streams;
        the first problem (in name order, naming the store), or None."""
        if not files:
            return None
        with ThreadPoolExecutor(min(PARALLEL_OBJECTS, len(files)), thread_name_prefix="download") as pool:
            actual = dict(zip(files, pool.map(lambda file: self._download_or_none(name, file, directory,
                                                                                  manifest.digest), files)))
        problem = next((p for file in files if (p := file_problem(file, manifest.files[file], actual[file]))), None)
        return f"{problem} (in {self.url(name)})" if problem else None

    def _download_or_none(self, name: str, file: str, directory: Path, algorithm: str) -> dict | None:
        """One GET (no lookup first), hashed with `algorithm`: a missing object is None."""
        try:
            return self.objects.download(self.key(name, file), directory / file, algorithm)
        except FileNotFoundError:
            return None

    def verify(self, name: str, into: Path | None = None) -> Verification:
        """Stream every listed object through its digest, keeping nothing (fallbacks), or keeping
        a copy in the folder `into` (`verify`, which then loads every value from it)."""
        where = Path(self.url(name))
        data = self.manifest_bytes(name)
        if data is None:
            return Verification(where, None, f"{MANIFEST}: missing (not committed)")
        try:
            manifest = Manifest.from_json(json.loads(data))
        except (InvalidManifest, ValueError) as reason:
            return Verification(where, None, str(reason))
        problem = self.trusted(Verification(where, manifest, self._structure_problem(name, manifest)), name).problem
        for file in sorted(manifest.files):
            if problem:
                break
            observed = self._download_or_none(name, file, into, manifest.digest) if into else \
                self.objects.digest(self.key(name, file), manifest.digest)
            problem = file_problem(file, manifest.files[file], observed)
        if not problem and manifest.kind == RECOVERY:
            return index_verification(where, manifest, lambda: self.objects.read(self.key(name, SNAPSHOT_INDEX)) or b"")
        return Verification(where, manifest, problem)

    def _structure_problem(self, name: str, manifest: Manifest) -> str | None:
        """What a local directory's verification finds before hashing: a file a loader would
        read that the manifest does not list (here: an object under the prefix), an index
        larger than any DCP index."""
        on_store = [key.rsplit("/", 1)[-1] for key in self.objects.list(self.key(name))]
        return unlisted_problem(manifest, [file for file in on_store if file != MANIFEST]) or oversized_index(manifest)

    def trusted(self, verification: Verification, name: str) -> Verification:
        """The same check of name, run and signature as a local directory's (identity.py)."""
        return trusted(verification, name, *identity_or_problem(self.identity_bytes()), self.signing)

    def identity_bytes(self) -> bytes | None:
        """The run's `run.json` object, None without one."""
        return self.objects.read(RUN_IDENTITY)

    def adopt(self, run: str, attempt: str, how: str) -> None:
        """Record in the run's `run.json` that it continues from `run`'s generations (identity.py)."""
        self.objects.write(RUN_IDENTITY, adopted(self.identity_bytes(), run, attempt, how))

    def owned(self, manifest: Manifest) -> Manifest:
        """`manifest`, naming the run this store prefix belongs to (as it is committed)."""
        identity, _ = identity_or_problem(self.identity_bytes())
        return replace(manifest, run=identity.run) if identity else manifest

    # ----------------------------------------------------------------- removal
    def remove(self, name: str) -> None:
        """Retention: uncommit (manifest first), then delete the data."""
        self.objects.delete([self.key(name, MANIFEST)])
        seams.crash_point("store-retention-after-uncommit")
        self.discard(name)

    def discard(self, name: str) -> None:
        """Delete every object under an uncommitted prefix."""
        self.objects.delete(self.objects.list(self.key(name)))

    def set_aside(self, name: str) -> str:
        """Going back to an earlier generation abandons this one: copy it to a hidden
        `.NAME.replaced-TOKEN` prefix (data, then manifest: the copy is committed under a name
        never selected), then remove it. Returns the hidden name."""
        hidden = hidden_name(name, REPLACED, secrets.token_hex(3))
        keys = self.objects.list(self.key(name))
        for key in sorted(keys, key=lambda k: k.endswith("/" + MANIFEST)):
            self.objects.copy(key, self.key(hidden, key.split("/", 2)[2]))
        self.remove(name)
        return hidden


def _files_of(manifest_data: bytes) -> dict | None:
    try:
        return dict(Manifest.from_json(json.loads(manifest_data)).files)
    except (InvalidManifest, ValueError):
        return None
