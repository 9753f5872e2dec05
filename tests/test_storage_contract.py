"""The promises of the storage sections, run once against every implementation: a run
directory on this disk (`LocalSection`) and in an object store (`ObjectSection`, over the
in-memory client of tests/memory_objects.py and over the real SeaweedFS server). Tiny real
generations (one 4-float tensor): well under a second each, plus the server's start once."""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch

from memory_objects import MemoryObjects
from trainer.checkpoint.checkpointer import SyncCheckpointer, build_checkpointer
from trainer.checkpoint.commit import RenameCommit
from trainer.checkpoint.identity import RunIdentity
from trainer.checkpoint.manifest import GenerationFacts
from trainer.checkpoint.section import LocalSection, Published
from trainer.config import RetentionConfig, StoreConfig
from trainer.errors import CorruptGeneration
from trainer.layout import GENERATIONS, MANIFEST, RUN_IDENTITY, RunDirectory
from trainer.storage.local import LocalStorage
from trainer.integrations.polyaxon.copy_seed import seed
from trainer.location import InStore, parse_store_url
from trainer.storage.object.client import open_objects
from trainer.storage.object.backend import open_object_storage
from trainer.storage.object.section import ObjectSection


def published_locally(root, step: int = 4) -> LocalSection:
    """A run directory at `root` with one committed generation, `step-0000000{step}`."""
    run = RunDirectory(root)
    run.checkpoints.mkdir(parents=True)
    (root / RUN_IDENTITY).write_bytes(RunIdentity.new().to_bytes())  # its manifests name their run
    section = LocalSection(run.checkpoints)
    facts = GenerationFacts(step, 0, step, {"source": "s"}, (), {}, "2026-12-01T00:00:00Z")
    SyncCheckpointer(RenameCommit(section), "attempt").save({"w": torch.full((4,), float(step))}, facts)
    return section


class OnDisk:
    def __init__(self, tmp_path, request):
        self.tmp_path = tmp_path

    def section(self, label: str):
        return LocalSection(RunDirectory(self.tmp_path / label).checkpoints)

    def with_generation(self, label: str):
        return published_locally(self.tmp_path / label)

    def leftovers(self, section) -> list:
        return section.temporaries() + section.uncommitted()

    def identity(self, section) -> bytes | None:
        return section.identity_bytes()

    def manifest(self, section, name: str) -> bytes:
        return (section.path(name) / MANIFEST).read_bytes()


class InMemoryObjects:
    def __init__(self, tmp_path, request):
        self.tmp_path = tmp_path

    def section(self, label: str):
        return ObjectSection(MemoryObjects(f"s3://bucket/{label}"), "checkpoints")

    def with_generation(self, label: str):
        local = published_locally(self.tmp_path / f"{label}-tier")
        section = self.section(label)
        for name in local.names():
            section.commit(name, local.path(name), fence=lambda: None)
        return section

    def leftovers(self, section) -> list:
        return section.scan().uncommitted

    def identity(self, section) -> bytes | None:
        return section.identity_bytes()

    def manifest(self, section, name: str) -> bytes:
        return section.manifest_bytes(name)


class SeaweedFS(InMemoryObjects):
    """Run directories as prefixes of one fresh bucket on the real server."""

    def __init__(self, tmp_path, request):
        super().__init__(tmp_path, request)
        self.bucket = request.getfixturevalue("s3_bucket")
        self.bucket.use_env(request.getfixturevalue("monkeypatch"))

    def section(self, label: str):
        return ObjectSection(open_objects(parse_store_url(f"{self.bucket.url}/runs/{label}")), "checkpoints")


KINDS = {"local disk": OnDisk, "in-memory object client": InMemoryObjects, "SeaweedFS": SeaweedFS}


@pytest.fixture(params=list(KINDS))
def kind(request, tmp_path):
    return KINDS[request.param](tmp_path, request)


def test_copy_committed_commits_the_copy_by_the_sections_own_protocol(kind):
    """Nothing is committed before `before_commit` ran (the copy's run.json adopts the original
    first), the copy verifies, and its manifest is byte for byte the original's."""
    source, target = kind.with_generation("original"), kind.section("copy")
    (name,) = source.committed()
    seen_before_commit = []

    def before_commit(manifest):
        seen_before_commit.append((list(target.committed()), manifest.step))
        target.adopt(manifest.run, "seeding", "a test")

    digest = target.copy_committed(name, source, before_commit)
    assert seen_before_commit == [([], 4)]
    assert target.committed() == [name] and target.verify(name).ok
    assert kind.manifest(target, name) == kind.manifest(source, name)
    assert digest == hashlib.sha256(kind.manifest(target, name)).hexdigest()
    assert b"seeding" in kind.identity(target) and not kind.leftovers(target)


def test_copy_committed_refuses_a_damaged_original_and_leaves_nothing(tmp_path):
    source, target = published_locally(tmp_path / "original"), LocalSection(tmp_path / "copy" / "checkpoints")
    (name,) = source.committed()
    shard = next(path for path in source.path(name).iterdir() if path.name != MANIFEST)
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    with pytest.raises(CorruptGeneration, match="does not verify"):
        target.copy_committed(name, source)
    assert target.committed() == [] and target.temporaries() == []
    assert not (tmp_path / "copy" / RUN_IDENTITY).exists()


# ----------------------------------------------------------------------------- the two roles
class LocalRun:
    uploads = False
    """Durable when published: nothing becomes durable afterwards."""

    def __init__(self, tmp_path, request):
        self.tmp_path = tmp_path

    def open(self, label: str):
        return LocalStorage(RunDirectory(self.tmp_path / label))


class StoreRun:
    """A run in a SeaweedFS bucket with its local tier; `processes` picks tiered or direct."""

    uploads = True

    def __init__(self, tmp_path, request, processes: int):
        self.tmp_path, self.processes = tmp_path, processes
        self.bucket = request.getfixturevalue("s3_bucket")
        self.bucket.use_env(request.getfixturevalue("monkeypatch"))

    def open(self, label: str):
        return open_object_storage(parse_store_url(f"{self.bucket.url}/{label}"),
                                   RunDirectory(self.tmp_path / f"{label}-tier"), StoreConfig(),
                                   RetentionConfig(keep_last=None), self.processes, None)


RUNS = {"local disk": LocalRun, "SeaweedFS tiered": lambda tmp_path, request: StoreRun(tmp_path, request, 1),
        "SeaweedFS direct": lambda tmp_path, request: StoreRun(tmp_path, request, 2)}


@pytest.fixture(params=list(RUNS))
def run_kind(request, tmp_path):
    return RUNS[request.param](tmp_path, request)


def saved(durability, step: int) -> Published:
    facts = GenerationFacts(step, 0, step, {"source": "s"}, (), {}, "2026-12-01T00:00:00Z")
    checkpointer = build_checkpointer("sync", durability.commit(), "a1", torch.device("cpu"))
    (published,) = checkpointer.save({"w": torch.full((4,), float(step))}, facts)
    return published


def test_every_verb_of_the_claim_and_the_durability_keeps_its_promise(run_kind):
    """Claim, go ahead, save through the durability's commit until durable, restore it, go
    back: the same promises whichever backend holds the run directory."""
    storage = run_kind.open("run")
    with contextlib.ExitStack() as held:
        storage.claim("a1", held, must_exist=False)
        assert storage.committed() == []
        identity = storage.go_ahead("a1", ())
        assert storage.local.identity.read_bytes() == identity.to_bytes()
        durability = storage.durability(frozenset(), storage.local.attempt_folder("a1"), primary=True)
        durable = []
        for step in (4, 8):
            published = saved(durability, step)
            after = durability.after_publish(GENERATIONS, published, storage.section(GENERATIONS).path(published.name))
            durable += [done.name for done in after.durable + durability.drain()]
        assert storage.committed() == ["step-00000004", "step-00000008"]
        assert durable == (["step-00000004", "step-00000008"] if run_kind.uploads else [])
        assert durability.kept_locally(GENERATIONS) <= {"step-00000008"}  # nothing pending once drained
        generation, _ = storage.restorable("step-00000008", storage.committed())
        assert generation.ok and generation.manifest.step == 8
        assert storage.local_copy(generation).manifest == generation.manifest
        assert "checkpoints/step-00000008" in storage.set_aside_later_than(4)
        assert storage.committed() == ["step-00000004"]
        storage.remove_stale_temporaries()
        durability.close()
    assert not list(storage.local.checkpoints.glob(".step-*.tmp-*"))


def test_ops_restart_copy_seeds_a_bucket_run_beside_the_original(s3_bucket, monkeypatch, tmp_path):
    """copy_seed.py in a bucket store: the original's newest generation, committed in the
    copy's prefix with the manifest last, and the copy's run.json adopting the original's run."""
    s3_bucket.use_env(monkeypatch)
    original = ObjectSection(open_objects(parse_store_url(f"{s3_bucket.url}/training-recovery/u1")), "checkpoints")
    local = published_locally(tmp_path / "u1-tier")
    original.commit("step-00000004", local.path("step-00000004"), fence=lambda: None)
    copy = parse_store_url(f"{s3_bucket.url}/training-recovery/c1")
    seeded = seed(InStore(copy, tmp_path / "c1-tier"), "u1")
    assert (seeded.run, seeded.generation) == ("u1", "step-00000004")
    target = ObjectSection(open_objects(copy), "checkpoints")
    assert target.committed() == ["step-00000004"] and target.verify("step-00000004").ok
    assert seeded.manifest_sha256 == target.manifest_digest("step-00000004")
    assert b"polyaxon ops restart --copy of run u1" in target.identity_bytes()
    assert seed(InStore(copy, tmp_path / "c1-tier"), "u1") is None  # seeded once
