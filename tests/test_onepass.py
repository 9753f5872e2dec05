"""The verified load that reads the disk once (trainer/checkpoint/onepass.py): the parsed
files are verified before they are parsed, each shard is hashed while DCP loads it, and a
damaged shard is refused in one line naming it. Real DCP, a tiny state, no subprocess
(about 1 s for the file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import manifest as manifest_module
from trainer.checkpoint import safe_load
from trainer.checkpoint.atomic import file_digest
from trainer.checkpoint.manifest import GenerationFacts, Manifest, verify_directory
from trainer.checkpoint.onepass import DamagedShard, verified_load
from trainer.checkpoint.snapshot import write_snapshot
from trainer.errors import CorruptGeneration

FACTS = GenerationFacts(step=8, epoch=0, position=8, fingerprint={"world_size": 1}, allowed_drift=(),
                        cadence={"recover": {}, "export": {}}, created_utc="2026-12-03T00:00:00+00:00")


def state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"model": {"weight": torch.randn(256, 64, generator=generator), "bias": torch.randn(64, generator=generator)},
            "step": 8}


def template(stored: dict) -> dict:
    return {"model": {"weight": torch.zeros(256, 64), "bias": torch.zeros(64)}, "step": 0}


@pytest.fixture
def generation(tmp_path) -> Path:
    directory = tmp_path / "step-00000008"
    directory.mkdir()
    write_snapshot(state(), directory)
    listed = {entry.name: file_digest(entry) for entry in sorted(directory.iterdir())}
    manifest = Manifest.for_generation(FACTS, "attempt-1", {"mode": "sync"}, listed)
    (directory / "manifest.json").write_text(json.dumps(manifest.to_json()))
    return directory


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def biggest_shard(directory: Path) -> Path:
    return max(directory.glob("*.distcp"), key=lambda path: path.stat().st_size)


def test_a_generation_loads_verified(generation):
    verification, loaded = verified_load(generation, template)
    assert verification.ok and not verification.shards_pending
    assert torch.equal(loaded["model"]["weight"], state()["model"]["weight"]) and loaded["step"] == 8


def test_a_flipped_shard_byte_is_refused_in_one_line_naming_the_file(generation):
    shard = biggest_shard(generation)
    flip_byte(shard)
    assert verify_directory(generation, shards=False).shards_pending  # only the parsed files were hashed
    with pytest.raises(CorruptGeneration) as refused:
        verified_load(generation, template)
    message = str(refused.value)
    assert f"{shard.name}: blake3 mismatch" in message and "\n" not in message
    assert refused.value.exit_code == 65
    assert verify_directory(generation).problem.startswith(f"{shard.name}: blake3 mismatch")  # the full pass agrees


def test_a_shard_damaged_where_dcp_parses_it_is_still_named_by_its_hash(generation):
    """A byte flipped in a record's header would make DCP's load fail: the hash, not DCP's
    error, names the damage."""
    shard = biggest_shard(generation)
    flip_byte(shard, at=0.0)
    with pytest.raises(CorruptGeneration, match=f"{shard.name}: blake3 mismatch"):
        verified_load(generation, template)


def test_a_corrupted_metadata_is_refused_before_it_is_parsed(generation, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a .metadata that does not match its manifest was parsed")

    monkeypatch.setattr(manifest_module, "metadata_problem", never)
    monkeypatch.setattr(safe_load, "unpickle_metadata", never)
    flip_byte(generation / ".metadata")
    with pytest.raises(CorruptGeneration, match=r"\.metadata: blake3 mismatch") as refused:
        verified_load(generation, lambda stored: never())
    assert refused.value.exit_code == 65 and "\n" not in str(refused.value)


def test_a_truncated_shard_is_refused_before_anything_is_loaded(generation):
    shard = biggest_shard(generation)
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CorruptGeneration, match=f"{shard.name}: size"):
        verified_load(generation, lambda stored: pytest.fail("loaded a generation whose shard is short"))


def test_a_verification_without_its_shards_cannot_reach_the_plain_restore(generation):
    """Only the one-read load may take a verification whose shards were not hashed."""
    from trainer.checkpoint.restore import restore

    partial = verify_directory(generation, shards=False)
    assert partial.ok and partial.shards_pending
    with pytest.raises(AssertionError, match="verified without its shards"):
        restore(partial, object())


# ----------------------------------------------------------------- streamed from a store
@pytest.fixture
def in_store(tmp_path, monkeypatch):
    """A generation committed in an in-memory store, its shards over 8 KiB fetched in 4 KiB ranges."""
    from memory_objects import MemoryObjects

    from trainer.checkpoint.checkpointer import SyncCheckpointer
    from trainer.checkpoint.commit import RenameCommit
    from trainer.checkpoint.identity import RunIdentity
    from trainer.checkpoint.section import LocalSection
    from trainer.layout import RUN_IDENTITY, RunDirectory
    from trainer.storage.object import streaming
    from trainer.storage.object.section import ObjectSection

    monkeypatch.setattr(streaming, "RANGE_BYTES", 4096)
    monkeypatch.setattr(streaming, "RANGED_ABOVE", 8192)  # the weights' shard in ranges, the others whole
    run = RunDirectory(tmp_path / "writer")
    run.checkpoints.mkdir(parents=True)
    (run.root / RUN_IDENTITY).write_bytes(RunIdentity.new().to_bytes())
    local = LocalSection(run.checkpoints)
    SyncCheckpointer(RenameCommit(local), "attempt-1").save(state(), FACTS)
    (name,) = local.committed()
    objects = MemoryObjects()
    objects.write(RUN_IDENTITY, (run.root / RUN_IDENTITY).read_bytes())
    section = ObjectSection(objects, "checkpoints")
    section.commit(name, local.path(name), fence=lambda: None)
    return section, local.path(name), tmp_path


def streamed(section, name: str, base: Path) -> tuple:
    """A streamed fetch of `name` into `base`, loaded: (verification, the loaded template, error)."""
    from trainer.checkpoint.onepass import load_verified
    from trainer.checkpoint.snapshot import flat_template, stored_entries
    from trainer.storage.object.streaming import fetch_streaming

    (base / "staging").mkdir(parents=True)
    fetched, _ = fetch_streaming(section, name, base / "staging", base / "checkpoints")
    assert fetched.ok and fetched.shards_pending and fetched.arrivals is not None, fetched.problem
    loaded = flat_template(stored_entries(fetched.path))
    try:
        load_verified(loaded, fetched.path, fetched.manifest.files, fetched.arrivals)
    except CorruptGeneration as error:
        fetched.arrivals.discard()
        return fetched, loaded, error
    fetched.arrivals.keep()
    return fetched, loaded, None


def test_a_store_generation_streams_into_the_load_in_ranges_and_a_damaged_or_resized_shard_is_refused(in_store):
    """The shards of a generation in a store are fetched in ranges, several at once, appended in
    order, hashed as they arrive and loaded as their bytes land: the copy kept is the stored
    one and the values are the saved ones. A byte flipped in one range of a shard, or a shard
    longer than its manifest says, is refused naming the file, and nothing is kept. ~1 s."""
    section, written, base = in_store
    name, shard = written.name, biggest_shard(written)
    fetched, loaded, error = streamed(section, name, base / "clean")
    assert error is None
    assert torch.equal(loaded["model.weight"], state()["model"]["weight"]) and loaded["step"] == 8
    assert (base / "clean" / "checkpoints" / name / shard.name).read_bytes() == shard.read_bytes()
    ranged = [start for key, start, _ in section.objects.ranges_read if key.endswith(shard.name)]
    assert len(ranged) == -(-shard.stat().st_size // 4096) > 4 and sorted(ranged) == list(range(0, len(ranged) * 4096, 4096))

    body = bytearray(shard.read_bytes())
    body[2 * 4096 + 100] ^= 0x01  # in the third range
    section.objects.write(section.key(name, shard.name), bytes(body))
    _, _, error = streamed(section, name, base / "damaged")
    assert isinstance(error, DamagedShard) and error.problem.startswith(f"{shard.name}: blake3 mismatch"), error
    assert not (base / "damaged" / "checkpoints" / name).exists() and not (base / "damaged" / "staging" / name).exists()

    section.objects.write(section.key(name, shard.name), shard.read_bytes() + b"\0")
    _, _, error = streamed(section, name, base / "longer")
    assert isinstance(error, DamagedShard)
    assert error.problem == f"{shard.name}: size {shard.stat().st_size + 1} bytes, manifest says {shard.stat().st_size}"
