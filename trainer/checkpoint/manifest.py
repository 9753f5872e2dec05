"""The manifest of a sealed directory (a recovery generation or an export), and verification.

`manifest.json` is written last into a directory: it lists every file with its size and
digest (BLAKE3; sha256 in generations written before format 3, trainer/checkpoint/digest.py)
and describes what the directory holds. `Manifest` is its one in-memory form: built
here for both kinds (`for_generation`, `for_export`), written with `to_json`, read back
with `from_json`, which validates every field readers rely on.

A directory is *verified* when its manifest parses, lists every file a loader of its kind
reads (and the files that kind requires), every file it lists exists with the recorded
size and digest, and a recovery generation's `.metadata` names nothing outside DCP's
metadata classes (trainer/checkpoint/allowlist.py: a planted pickle is refused here, before
any loader sees it). Verification never modifies anything.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from trainer.checkpoint.allowlist import MAX_METADATA_BYTES, metadata_problem
from trainer.checkpoint.atomic import file_digest
from trainer.checkpoint.digest import ALGORITHMS, CURRENT, SHA256, algorithm_of
from trainer.checkpoint.signing import SIGNATURE, canonical_bytes, signature_problem
from trainer.layout import (EXPORT_CONFIG, EXPORT_WEIGHTS, MANIFEST, SNAPSHOT_INDEX, SNAPSHOT_SHARD_SUFFIX,
                             generation_name)

FORMAT = "training-recovery"
FORMAT_VERSION = 3
"""3: every file's entry is `{bytes, ALGORITHM}` with the manifest's `digest` naming the
algorithm (BLAKE3 for new directories). 2: written by a trainer that loads without
unpickling (the writer refuses a value that needs more than `torch.load(weights_only=True)`),
possibly signed, sha256 only. Version 1 generations hold the same stock DCP files; they load
through the same safe path (docs/security.md, "Format versions")."""
READABLE_VERSIONS = (1, 2, 3)
DIGESTS_OF_VERSION = {1: (SHA256,), 2: (SHA256,), 3: ALGORITHMS}
"""The digest algorithms a manifest of each format version may name."""
RECOVERY, EXPORT = "recovery", "export"
REQUIRED_FILES = {RECOVERY: (SNAPSHOT_INDEX,), EXPORT: (EXPORT_WEIGHTS, EXPORT_CONFIG)}
"""What a reader of each kind needs: DCP's index, or the weights and their config."""


class InvalidManifest(ValueError):
    """The manifest cannot be used; the message is "manifest.json: why"."""


@dataclass(frozen=True)
class GenerationFacts:
    """What the loop knows about the training state being saved: the descriptive part of a
    recovery generation's manifest."""

    step: int
    epoch: int
    position: int
    """Batches done in the current epoch."""
    fingerprint: dict
    allowed_drift: tuple[str, ...]
    cadence: dict
    """Cadence policy state carried across processes ({"recover": …, "export": …})."""
    created_utc: str
    state_digest: dict = field(default_factory=dict)
    """{rank: {section: digest}} of the live state this generation saved (trainer/run/witness.py):
    a restore digests what it loaded and compares. Empty in generations written before it."""
    ledger: dict = field(default_factory=dict)
    """The sample ledger since the generation before it (trainer/data/ledger.py). Empty in
    generations written before it."""
    digest_later: Callable[[dict], dict] | None = field(default=None, compare=False, repr=False)
    """`state_digest` still to be computed from the state dict saved (`resolved`): the
    checkpointer does it where it costs the loop least, the async one from its staged copy on
    its committer thread (one process; several gather theirs in the loop)."""

    def resolved(self, saved: dict) -> "GenerationFacts":
        """These facts with `state_digest` computed from `saved` (the state dict, or its staged copy)."""
        if self.digest_later is None:
            return self
        return replace(self, state_digest=self.digest_later(saved), digest_later=None)


@dataclass(frozen=True)
class Manifest:
    kind: str
    name: str
    step: int
    epoch: int
    attempt: str
    files: Mapping[str, Mapping[str, object]]
    """File name -> {"bytes": int, DIGEST: hex}, DIGEST being `digest`."""
    facts: GenerationFacts | None = None
    """Recovery generations only."""
    timings: Mapping[str, object] = field(default_factory=dict)
    """Recovery generations only: how the save went (mode, write_s, …)."""
    signature: Mapping[str, str] | None = None
    """{"algorithm", "hmac"} as read from a signed manifest (trainer/checkpoint/signing.py)."""
    run: str | None = None
    """The run it belongs to (trainer/checkpoint/identity.py); None: written before run ids."""
    canonical: bytes = field(default=b"", compare=False, repr=False)
    """As read: the bytes a signature covers (the manifest without its signature)."""
    digest: str = CURRENT
    """The algorithm of every file's digest (trainer/checkpoint/digest.py): whoever checks a
    file hashes it with this one."""

    @classmethod
    def for_generation(cls, facts: GenerationFacts, attempt: str, timings: dict, files: dict) -> "Manifest":
        return cls(RECOVERY, generation_name(facts.step), facts.step, facts.epoch, attempt, files, facts,
                   {key: round(value, 6) if isinstance(value, float) else value for key, value in timings.items()},
                   digest=digest_of_files(files))

    @classmethod
    def for_export(cls, step: int, epoch: int, attempt: str, files: dict) -> "Manifest":
        return cls(EXPORT, generation_name(step), step, epoch, attempt, files, digest=digest_of_files(files))

    @property
    def fingerprint(self) -> dict:
        return self.facts.fingerprint if self.facts else {}

    @property
    def cadence(self) -> dict:
        return self.facts.cadence if self.facts else {}

    def to_json(self) -> dict:
        data = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": self.kind, "name": self.name,
                "step": self.step, "epoch": self.epoch, "attempt": self.attempt, "digest": self.digest,
                "files": {name: dict(entry) for name, entry in self.files.items()}}
        if self.run is not None:
            data["run"] = self.run
        if self.facts is not None:
            facts = self.facts
            data.update(position=facts.position, fingerprint=facts.fingerprint,
                        allowed_drift=list(facts.allowed_drift), cadence=facts.cadence,
                        created_utc=facts.created_utc, timings=dict(self.timings))
            if facts.state_digest:
                data["state_digest"] = facts.state_digest
            if facts.ledger:
                data["ledger"] = facts.ledger
        return data

    @classmethod
    def from_json(cls, data) -> "Manifest":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InvalidManifest(f"{MANIFEST}: not a {FORMAT} manifest")
        if data.get("format_version") not in READABLE_VERSIONS:
            raise InvalidManifest(f"{MANIFEST}: format_version {data.get('format_version')!r} is not one this "
                                  f"trainer reads ({', '.join(map(str, READABLE_VERSIONS))}); use the trainer "
                                  f"version that wrote it")
        if SIGNATURE in data and (problem := signature_problem(data[SIGNATURE])):
            raise InvalidManifest(f"{MANIFEST}: {problem}")
        files, digest = data.get("files"), data.get("digest")
        if not isinstance(files, dict) or digest not in DIGESTS_OF_VERSION[data["format_version"]]:
            raise InvalidManifest(f"{MANIFEST}: no file list")
        for name, entry in files.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                    and isinstance(entry.get(digest), str)):
                raise InvalidManifest(f"{MANIFEST}: the entry for {name} is not {{bytes, {digest}}}")
        kind = data.get("kind")
        if kind not in REQUIRED_FILES:
            raise InvalidManifest(f"{MANIFEST}: unknown kind {kind!r}")
        _require(data, {"name": str, "step": int, "epoch": int, "attempt": str})
        if "run" in data:
            _require(data, {"run": str})
        facts = None
        if kind == RECOVERY:
            _require(data, {"position": int, "fingerprint": dict, "allowed_drift": list, "cadence": dict,
                            "created_utc": str, "timings": dict})
            if not isinstance(data.get("state_digest", {}), dict):
                raise InvalidManifest(f"{MANIFEST}: state_digest is not a mapping")
            if not isinstance(data.get("ledger", {}), dict):
                raise InvalidManifest(f"{MANIFEST}: ledger is not a mapping")
            facts = GenerationFacts(data["step"], data["epoch"], data["position"], data["fingerprint"],
                                    tuple(data["allowed_drift"]), data["cadence"], data["created_utc"],
                                    data.get("state_digest", {}), data.get("ledger", {}))
        return cls(kind, data["name"], data["step"], data["epoch"], data["attempt"], files, facts,
                   data.get("timings", {}), data.get(SIGNATURE), data.get("run"), canonical_bytes(data), digest)


def digest_of_files(files: Mapping[str, Mapping]) -> str:
    """The one algorithm every entry of `files` was digested with (the current one for none)."""
    found = {algorithm_of(entry) for entry in files.values()}
    if len(found) > 1:
        raise ValueError(f"files digested with {' and '.join(sorted(found))} in one manifest")
    return found.pop() if found else CURRENT


def _require(data: dict, types: dict[str, type]) -> None:
    for name, kind in types.items():
        value = data.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidManifest(f"{MANIFEST}: {name} is missing or not a {kind.__name__}")


def read_manifest(directory: Path) -> Manifest:
    """The parsed manifest; raises InvalidManifest with a short reason if it is unusable."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise InvalidManifest(f"{MANIFEST}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidManifest(f"{MANIFEST}: unreadable ({error.__class__.__name__})") from None
    return Manifest.from_json(data)


@dataclass(frozen=True)
class Verification:
    path: Path
    manifest: Manifest | None
    problem: str | None
    """None when verified; else "FILE: what is wrong" naming the first bad file."""
    untrusted: bool = False
    """The problem is content that loading would have to run code for (not damage)."""
    shards_pending: bool = False
    """Only the parsed files were hashed (`verify_directory(..., shards=False)`): the shards'
    digest is still to be checked by the load (trainer/checkpoint/onepass.py)."""
    arrivals: object | None = field(default=None, compare=False, repr=False)
    """With `shards_pending`: the shards are still being written (a store's streamed download,
    trainer/checkpoint/onepass.py `Arrivals`); the load waits for them and takes their hashes."""

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def name(self) -> str:
        return self.path.name


def read_by_loader(kind: str, name: str) -> bool:
    """Whether loading a directory of this kind may read the file, so it must be verified.
    Other files (a Finder `.DS_Store`, an NFS `.nfsXXXX`) are never read and are ignored."""
    if kind == RECOVERY:
        return name in REQUIRED_FILES[kind] or name.endswith(SNAPSHOT_SHARD_SUFFIX)
    return name in REQUIRED_FILES[kind]


def file_problem(name: str, expected: Mapping, actual: dict | None) -> str | None:
    """Compare one file's recorded and observed {bytes, digest} (observed with the recorded
    entry's algorithm); a reason, or None if equal."""
    if actual is None:
        return f"{name}: missing"
    if actual["bytes"] != expected["bytes"]:
        return f"{name}: size {actual['bytes']} bytes, manifest says {expected['bytes']}"
    algorithm = algorithm_of(expected)
    if actual.get(algorithm) != expected[algorithm]:
        return (f"{name}: {algorithm} mismatch (manifest {expected[algorithm][:12]}…, "
                f"file {str(actual.get(algorithm, '?'))[:12]}…)")
    return None


def unlisted_problem(manifest: Manifest, on_disk: list[str]) -> str | None:
    """Every file a loader reads must be covered by the manifest: a required file it does not
    list, or one on disk it does not list, would be used unverified."""
    if not manifest.files:
        return f"{MANIFEST}: lists no files"
    for name in REQUIRED_FILES[manifest.kind]:
        if name not in manifest.files:
            return f"{name}: not listed in {MANIFEST}"
    stray = next((name for name in on_disk if name not in manifest.files and read_by_loader(manifest.kind, name)),
                 None)
    return f"{stray}: not listed in {MANIFEST}" if stray else None


def verify_directory(directory: Path, shards: bool = True, digests: Mapping[str, dict] | None = None) -> Verification:
    """Verify `directory` against its manifest. With `shards=False` the tensor shards
    (`*.distcp`) are checked for presence and size only: their digest is left to the load that
    reads them (trainer/checkpoint/onepass.py), which must then be the only reader. `digests`:
    every file's {bytes, digest} as its writer hashed it while writing (a peer's transfer,
    trainer/storage/memory/replication.py), taken instead of reading the files again; a file it
    lacks is missing, one it holds with another algorithm than the manifest's is read again."""
    try:
        manifest = read_manifest(directory)
    except InvalidManifest as reason:
        return Verification(directory, None, str(reason))
    try:
        on_disk = sorted(entry.name for entry in directory.iterdir() if entry.name != MANIFEST)
    except OSError as error:
        return Verification(directory, manifest, f"{directory.name}: unreadable ({error.strerror})")
    problem = unlisted_problem(manifest, on_disk) or oversized_index(manifest)
    if problem:
        return Verification(directory, manifest, problem)
    def problem_of(entry: tuple[str, Mapping]) -> str | None:
        name, expected = entry
        path = directory / name
        known = digests.get(name) if digests is not None else None
        if digests is not None and (known is None or manifest.digest in known):
            return file_problem(name, expected, known)
        # Not hashed on the way, or with another algorithm than this (older) manifest's: read it.
        try:
            hashed = path.is_file() and (shards or not deferred(name))
            actual = file_digest(path, algorithm=manifest.digest) if hashed else sized(path, expected)
        except OSError as error:
            return f"{name}: unreadable ({error.strerror})"
        return file_problem(name, expected, actual)

    # The files are hashed in parallel (the hash releases the GIL: one core per file, as the
    # writer wrote them); the first problem in name order is the one reported.
    entries = sorted(manifest.files.items())
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(entries))), thread_name_prefix="verify") as pool:
        problem = next((found for found in pool.map(problem_of, entries) if found), None)
    if problem:
        return Verification(directory, manifest, problem)
    if manifest.kind == RECOVERY:
        checked = index_verification(directory, manifest, (directory / SNAPSHOT_INDEX).read_bytes)
        return replace(checked, shards_pending=not shards) if checked.ok else checked
    return Verification(directory, manifest, None)


HASH_THREADS = min(8, os.cpu_count() or 1)
"""Files of one generation hashed at once by `verify_directory`."""


def deferred(name: str) -> bool:
    """A file whose digest a one-pass load checks while reading it: a tensor shard."""
    return name.endswith(SNAPSHOT_SHARD_SUFFIX)


def sized(path: Path, expected: Mapping) -> dict | None:
    """A shard whose hash is deferred: its size observed, its digest taken as the manifest's
    until the load has read it."""
    if not path.is_file():
        return None
    return {**expected, "bytes": path.stat().st_size}


def oversized_index(manifest: Manifest) -> str | None:
    """A `.metadata` the manifest says is larger than any DCP index is refused before any
    byte of it is read or hashed."""
    size = manifest.files.get(SNAPSHOT_INDEX, {}).get("bytes", 0) if manifest.kind == RECOVERY else 0
    return f"{SNAPSHOT_INDEX}: {size} bytes, more than any DCP index ({MAX_METADATA_BYTES} at most)" \
        if size > MAX_METADATA_BYTES else None


def index_verification(where: Path, manifest: Manifest, read_index) -> Verification:
    """A recovery generation whose files match its manifest verifies if its `.metadata`
    unpickles against the allowlist (trainer/checkpoint/allowlist.py). `read_index()` returns
    the file's bytes; its size is the manifest's, already checked."""
    if problem := oversized_index(manifest):
        return Verification(where, manifest, problem)
    found = metadata_problem(read_index())
    if found is None:
        return Verification(where, manifest, None)
    return Verification(where, manifest, f"{SNAPSHOT_INDEX}: {found[0]}", untrusted=found[1])
