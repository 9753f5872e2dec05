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
from trainer.checkpoint.onepass import verified_load
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
    assert f"{shard.name}: sha256 mismatch" in message and "\n" not in message
    assert refused.value.exit_code == 65
    assert verify_directory(generation).problem.startswith(f"{shard.name}: sha256 mismatch")  # the full pass agrees


def test_a_shard_damaged_where_dcp_parses_it_is_still_named_by_its_hash(generation):
    """A byte flipped in a record's header would make DCP's load fail: the hash, not DCP's
    error, names the damage."""
    shard = biggest_shard(generation)
    flip_byte(shard, at=0.0)
    with pytest.raises(CorruptGeneration, match=f"{shard.name}: sha256 mismatch"):
        verified_load(generation, template)


def test_a_corrupted_metadata_is_refused_before_it_is_parsed(generation, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a .metadata that does not match its manifest was parsed")

    monkeypatch.setattr(manifest_module, "metadata_problem", never)
    monkeypatch.setattr(safe_load, "unpickle_metadata", never)
    flip_byte(generation / ".metadata")
    with pytest.raises(CorruptGeneration, match=r"\.metadata: sha256 mismatch") as refused:
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
