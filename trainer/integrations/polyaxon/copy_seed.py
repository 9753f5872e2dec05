"""`polyaxon ops restart -uid U --copy`: seed the copy's run directory from U's newest committed
generation, before the copy's trainer looks for one to resume.

Polyaxon's own copy does not help the trainer. Its init step copies U's whole folder of the
artifacts store into the new run's context, and the sidecar uploads that to the new run's
folder whenever it next syncs, unverified, after the trainer started. The trainer's run
directory is not in either folder (placement.py: `<store>/training-recovery/<uuid>`), so
nothing of that copy reaches it or races it; the trainer makes its own copy instead:

- **bucket store**: the newest committed generation of U, copied object by object inside the
  bucket (server-side where the store supports it), then committed as every generation in a
  store is: each object checked against U's manifest, the manifest last;
- **volume store**: the generation's files copied into a temporary sibling, fsynced, verified
  against U's manifest (size and digest), then renamed into place.

Both are `copy_committed` of the section that owns the commit (trainer/checkpoint/section.py,
trainer/storage/object/section.py): this module chooses what to copy, never how.

U's run directory is only read, never written (no lease, no lock, no cleanup there). Only the
generation is copied: U's attempts and exports stay U's. The seed happens once: a copy that
already holds a committed generation (a retry, or `ops resume` of the copy) is left as it is.
What was copied (`run`, `generation`, `manifest_sha256`) goes into the attempt record's
`polyaxon.copied_from`, and the copy's `run.json` records that it adopted the original run's
id (trainer/checkpoint/identity.py): the copied generation belongs to another run, on purpose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from trainer.config import StoreConfig
from trainer.errors import CorruptGeneration, UsageError
from trainer.integrations.polyaxon.placement import RUN_DIRECTORIES, RunPlacement
from trainer.layout import GENERATIONS, SECTIONS
from trainer.location import InStore, OnDisk, StoreLocation
from trainer.storage.opening import generations_of

log = logging.getLogger("trainer")


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
    if original_uuid == run_uuid or placement.location is None:
        return None  # nothing exposed: Polyaxon's init step copied the outputs before the trainer started
    return seed(placement.location, original_uuid, store_config)


def seed_on_volume(own: Path, original_uuid: str) -> CopiedFrom | None:
    return seed(OnDisk(own), original_uuid)


def seed(own: OnDisk | InStore, original_uuid: str, store_config=None) -> CopiedFrom | None:
    """Copy the newest committed generation of `original_uuid`'s run directory (beside `own`)
    into `own`, adopting that run in `own`'s run.json before the commit."""
    original = sibling_run(own, original_uuid)
    target, source = (generations_of(where, store_config or StoreConfig()) for where in (own, original))
    if target.committed():
        return None
    names = source.committed()
    if not names:
        log.warning("copy: run %s has no committed generation in %s; nothing to continue from", original_uuid,
                    original)
        return None
    name = names[-1]

    def adopt(manifest) -> None:  # before the commit: the copied generation is never foreign to its run
        if manifest.run is not None:  # None: written before run ids, accepted as the copy's own
            target.adopt(manifest.run, "seeding", f"polyaxon ops restart --copy of run {original_uuid}")
    try:
        digest = target.copy_committed(name, source, before_commit=adopt)
    except CorruptGeneration as error:
        raise CorruptGeneration(f"copy: the original's newest generation: {error}; copy an earlier one with "
                                f"presets/from-generation.yaml") from None
    log.info("copy: seeded %s/%s/%s from run %s (%s, verified)", own, SECTIONS[GENERATIONS], name, original_uuid,
             name)
    return CopiedFrom(original_uuid, name, digest)


def sibling_run(own: OnDisk | InStore, run_uuid: str) -> OnDisk | InStore:
    """The run directory of `run_uuid` beside `own`, under the artifacts store's RUN_DIRECTORIES."""
    match own:
        case OnDisk(root):
            return OnDisk(root.parent / run_uuid)
        case InStore(store):
            parent, _, _ = store.prefix.rpartition("/")
            if not parent.endswith(RUN_DIRECTORIES):
                raise UsageError(f"copy: {store.url} is not a run directory under {RUN_DIRECTORIES}/ of the "
                                 f"artifacts store")
            sibling = StoreLocation(store.scheme, store.bucket, f"{parent}/{run_uuid}")
            return InStore(sibling, sibling.default_local_tier())
