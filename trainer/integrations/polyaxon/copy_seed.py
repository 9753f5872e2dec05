"""`polyaxon ops restart -uid U --copy`: seed the copy's run directory from U's newest committed
generation, before the copy's trainer looks for one to resume.

Polyaxon's own copy does not help the trainer. Its init step copies U's whole folder of the
artifacts store into the new run's context, and the sidecar uploads that to the new run's
folder whenever it next syncs, unverified, after the trainer started. The trainer's run
directory is not in either folder (placement.py: `<store>/training-recovery/<uuid>`), so
nothing of that copy reaches it or races it; the trainer makes its own copy instead:

- **bucket store**: the newest committed generation of U, copied object by object inside the
  bucket (server-side where the store supports it, through the project's object-store client),
  each object's size checked against U's manifest, the manifest last (the commit marker);
- **volume store**: the generation's files copied into a temporary sibling, fsynced, verified
  against U's manifest (size and sha256), then renamed into place.

U's run directory is only read, never written (no lease, no lock, no cleanup there). Only the
generation is copied: U's attempts and exports stay U's. The seed happens once: a copy that
already holds a committed generation (a retry, or `ops resume` of the copy) is left as it is.
What was copied (`run`, `generation`, `manifest_sha256`) goes into the attempt record's
`polyaxon.copied_from`, and the copy's `run.json` records that it adopted the original run's
id (trainer/checkpoint/identity.py): the copied generation belongs to another run, on purpose.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.atomic import (fsync_dir, manifest_digest, rename_into_place, temporary_sibling,
                                      write_file_durably)
from trainer.checkpoint.identity import RunIdentity, identity_or_problem
from trainer.checkpoint.manifest import verify_directory
from trainer.checkpoint.section import LocalSection
from trainer.errors import CorruptGeneration, UsageError
from trainer.integrations.polyaxon.placement import RUN_DIRECTORIES, RunPlacement, run_directory_in
from trainer.layout import MANIFEST, RUN_IDENTITY, generation_step

log = logging.getLogger("trainer")

CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class CopiedFrom:
    """What a copy's run directory was seeded with."""

    run: str
    generation: str
    manifest_sha256: str

    def to_json(self) -> dict:
        return {"run": self.run, "generation": self.generation, "manifest_sha256": self.manifest_sha256}


def seed_copy(placement: RunPlacement, run_uuid: str, original_uuid: str | None, store_config=None) -> CopiedFrom | None:
    """Seed this copy's run directory (`placement`, of run `run_uuid`) from the original's
    newest committed generation; None when there is nothing to seed or it is already seeded."""
    if not original_uuid:
        raise UsageError(f"run {run_uuid} is an `ops restart --copy`, but Polyaxon does not say of which run; "
                         f"continue the original with `polyaxon ops resume -uid UUID -f presets/resume.yaml`")
    if original_uuid == run_uuid:
        return None
    if placement.kind == "volume":
        return seed_on_volume(placement.location.root, original_uuid)
    if placement.kind == "bucket":
        return seed_in_bucket(placement.location.store_url, run_uuid, original_uuid, store_config)
    return None  # nothing exposed: Polyaxon's init step copied the outputs before the trainer started


def seed_on_volume(own: Path, original_uuid: str) -> CopiedFrom | None:
    original = run_directory_in(own.parent.parent, original_uuid)
    if LocalSection(own / CHECKPOINTS).names():
        return None
    source = LocalSection(original / CHECKPOINTS)
    names = source.names()
    if not names:
        log.warning("copy: run %s has no committed generation in %s; nothing to continue from", original_uuid,
                    original)
        return None
    name = names[-1]
    checked = source.verify(name)
    if not checked.ok:
        raise CorruptGeneration(f"copy: the original's newest generation {original / CHECKPOINTS / name} does not "
                                f"verify ({checked.problem}); copy an earlier one with presets/from-generation.yaml")
    target_root = own / CHECKPOINTS
    temporary = temporary_sibling(target_root, name, "copy")
    for entry in sorted((original / CHECKPOINTS / name).iterdir()):
        if entry.is_file():
            shutil.copyfile(entry, temporary / entry.name)
    for entry in temporary.iterdir():
        with entry.open("rb") as handle:
            os.fsync(handle.fileno())
    fsync_dir(temporary)
    copied = verify_directory(temporary)
    if not copied.ok:
        shutil.rmtree(temporary, ignore_errors=True)
        raise CorruptGeneration(f"copy: {name} copied from run {original_uuid} does not verify ({copied.problem})")
    rename_into_place(temporary, target_root / name)
    identity = adopted_by_copy(read_or_none(own / RUN_IDENTITY), copied.manifest.run, original_uuid)
    if identity is not None:
        write_file_durably(own / RUN_IDENTITY, identity)
    seeded = CopiedFrom(original_uuid, name, manifest_digest(target_root / name))
    log.info("copy: seeded %s from run %s (%s, verified)", target_root / name, original_uuid, name)
    return seeded


def seed_in_bucket(own_url: str, run_uuid: str, original_uuid: str, store_config) -> CopiedFrom | None:
    import hashlib
    import json

    from trainer.checkpoint.manifest import Manifest
    from trainer.config import StoreConfig
    from trainer.storage.location import parse_store_url
    from trainer.storage.object.client import ObjectStore
    from trainer.storage.object.section import ObjectSection

    config = store_config or StoreConfig()
    parent = own_url.rsplit("/", 1)[0]
    if not parent.endswith(RUN_DIRECTORIES):
        raise UsageError(f"copy: {own_url} is not a run directory under {RUN_DIRECTORIES}/ of the artifacts store")
    own = ObjectSection(ObjectStore(parse_store_url(own_url), config), CHECKPOINTS)
    if own.committed():
        return None
    original = ObjectSection(ObjectStore(parse_store_url(f"{parent}/{original_uuid}"), config), CHECKPOINTS)
    names = sorted(original.committed(), key=lambda name: generation_step(name) or -1)
    if not names:
        log.warning("copy: run %s has no committed generation in %s; nothing to continue from", original_uuid,
                    original.objects.url)
        return None
    name = names[-1]
    manifest_data = original.manifest_bytes(name)
    manifest = Manifest.from_json(json.loads(manifest_data))
    files = manifest.files
    both = ObjectStore(parse_store_url(parent), config)  # one location holding both run directories
    for file, entry in sorted(files.items()):
        source = f"{original_uuid}/{CHECKPOINTS}/{name}/{file}"
        target = f"{run_uuid}/{CHECKPOINTS}/{name}/{file}"
        both.copy(source, target)
        size = both.size(target)
        if size != int(entry["bytes"]):
            raise CorruptGeneration(f"copy: {both.url_of(target)} has {size} bytes after the copy, the manifest of "
                                    f"run {original_uuid}'s {name} says {entry['bytes']}")
    identity = adopted_by_copy(both.read(f"{run_uuid}/{RUN_IDENTITY}"), manifest.run, original_uuid)
    if identity is not None:  # before the commit: the copied generation is never foreign to its run
        both.write(f"{run_uuid}/{RUN_IDENTITY}", identity)
    both.write(f"{run_uuid}/{CHECKPOINTS}/{name}/{MANIFEST}", manifest_data)  # the commit marker, last
    log.info("copy: seeded %s from run %s (%s, copied in the store)", own.url(name), original_uuid, name)
    return CopiedFrom(original_uuid, name, hashlib.sha256(manifest_data).hexdigest())


def adopted_by_copy(own_identity: bytes | None, original_run: str | None, original_uuid: str) -> bytes | None:
    """The copy's `run.json` (trainer/checkpoint/identity.py) adopting the original run's id,
    recorded as this seeding; None when the copied generation names no run (written before
    run ids: it is accepted as the copy's own)."""
    if original_run is None:
        return None
    identity, problem = identity_or_problem(own_identity)
    if problem:
        raise CorruptGeneration(f"copy: this run's {RUN_IDENTITY} is {problem.split(': ', 1)[1]}; remove it")
    return (identity or RunIdentity.new()).adopting(original_run, "seeding",
                                                    f"polyaxon ops restart --copy of run {original_uuid}").to_bytes()


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
