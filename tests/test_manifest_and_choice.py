"""Pure recovery logic, without a subprocess: manifest validation and verification, and which
generation a new process picks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.errors import CorruptGeneration, NothingToResume, RefuseOverwrite
from trainer.checkpoint.atomic import file_digest
from trainer.checkpoint.digest import CURRENT
from trainer.checkpoint.manifest import (GenerationFacts, InvalidManifest, Manifest, Verification, read_manifest,
                                       verify_directory)
from trainer.checkpoint.resume import choose_candidate, require_verified

FACTS = GenerationFacts(step=24, epoch=3, position=0, fingerprint={"world_size": 1}, allowed_drift=("config",),
                        cadence={"recover": {}, "export": {}}, created_utc="2026-12-01T00:00:00+00:00")


INDEX = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81."
"""A `.metadata` that passes the allowlist check (an empty DCP Metadata), without torch."""


def sealed(directory: Path, kind: str = "recovery", files: dict | None = None, algorithm: str = CURRENT) -> Manifest:
    """A directory whose files are listed, with their real digests, in its manifest."""
    directory.mkdir()
    names = files or ({".metadata": INDEX, "__0_0.distcp": b"shard"} if kind == "recovery"
                      else {"model.safetensors": b"weights", "config.json": b"{}"})
    for name, data in names.items():
        (directory / name).write_bytes(data)
    listed = {name: file_digest(directory / name, algorithm=algorithm) for name in names}
    manifest = (Manifest.for_generation(FACTS, "attempt-1", {"mode": "sync", "write_s": 0.1234567}, listed)
                if kind == "recovery" else Manifest.for_export(24, 3, "attempt-1", listed))
    (directory / "manifest.json").write_text(json.dumps(manifest.to_json()))
    return manifest


# ----------------------------------------------------------------------------- manifest
def test_manifest_round_trips_with_every_field_a_reader_uses(tmp_path):
    written = sealed(tmp_path / "step-00000024")
    data = json.loads((tmp_path / "step-00000024" / "manifest.json").read_text())
    assert set(data) == {"format", "format_version", "kind", "name", "step", "epoch", "attempt", "digest", "files",
                         "position", "fingerprint", "allowed_drift", "cadence", "created_utc", "timings"}
    assert data["timings"] == {"mode": "sync", "write_s": 0.123457}  # rounded to microseconds
    assert read_manifest(tmp_path / "step-00000024") == Manifest.from_json(data) == Manifest.from_json(
        written.to_json())
    assert read_manifest(tmp_path / "step-00000024").facts == FACTS


def test_export_manifest_has_no_generation_fields(tmp_path):
    sealed(tmp_path / "step-00000024", kind="export")
    data = json.loads((tmp_path / "step-00000024" / "manifest.json").read_text())
    assert set(data) == {"format", "format_version", "kind", "name", "step", "epoch", "attempt", "digest", "files"}
    assert read_manifest(tmp_path / "step-00000024").facts is None


@pytest.mark.parametrize("change, reason", [
    (lambda d: d.update(format="other"), "not a training-recovery manifest"),
    (lambda d: d.update(format_version=4), "format_version 4 is not one this trainer reads"),
    (lambda d: d.update(format_version=2), "no file list"),  # format 2 digests with sha256 only
    (lambda d: d.update(signature={"algorithm": "hmac-md5", "hmac": "0" * 32}), "signature algorithm 'hmac-md5'"),
    (lambda d: d.update(signature={"algorithm": "hmac-sha256", "hmac": "xyz"}), "signature hmac is not 64 hex"),
    (lambda d: d.pop("files"), "no file list"),
    (lambda d: d.update(digest="md5"), "no file list"),
    (lambda d: d["files"].update({"x": {"bytes": "3"}}), "the entry for x is not {bytes, blake3}"),
    (lambda d: d["files"].update({"x": {"bytes": 3, "sha256": "0" * 64}}), "the entry for x is not {bytes, blake3}"),
    (lambda d: d.update(kind="weights"), "unknown kind 'weights'"),
    (lambda d: d.update(step="24"), "step is missing or not a int"),
    (lambda d: d.update(step=True), "step is missing or not a int"),
    (lambda d: d.pop("fingerprint"), "fingerprint is missing or not a dict"),
])
def test_a_malformed_manifest_is_refused_with_its_reason(tmp_path, change, reason):
    data = sealed(tmp_path / "g").to_json()
    change(data)
    with pytest.raises(InvalidManifest, match="manifest.json: " + reason.replace("{", r"\{").replace("}", r"\}")):
        Manifest.from_json(data)


def test_verification_names_the_first_problem(tmp_path):
    directory = tmp_path / "g"
    sealed(directory)
    assert verify_directory(directory).ok
    (directory / ".DS_Store").write_bytes(b"finder")  # never read by a loader: ignored
    assert verify_directory(directory).ok
    (directory / "__0_1.distcp").write_bytes(b"stray")
    assert verify_directory(directory).problem == "__0_1.distcp: not listed in manifest.json"
    (directory / "__0_1.distcp").unlink()
    (directory / "__0_0.distcp").write_bytes(b"shark")
    assert verify_directory(directory).problem.startswith("__0_0.distcp: blake3 mismatch")
    (directory / "__0_0.distcp").write_bytes(b"shard!")
    assert verify_directory(directory).problem == "__0_0.distcp: size 6 bytes, manifest says 5"
    (directory / "__0_0.distcp").unlink()
    assert verify_directory(directory).problem == "__0_0.distcp: missing"
    (directory / "manifest.json").unlink()
    assert verify_directory(directory).problem == "manifest.json: missing"


def test_a_directory_digested_with_sha256_is_verified_with_sha256(tmp_path):
    """Generations written before BLAKE3 (format 2) list sha256: each file is hashed with the
    algorithm its manifest names, digests a writer took with another one are not trusted for
    it (read again), and one manifest never mixes algorithms."""
    directory = tmp_path / "g"
    manifest = sealed(directory, algorithm="sha256")
    (directory / "manifest.json").write_text(json.dumps({**manifest.to_json(), "format_version": 2}))
    assert read_manifest(directory).digest == "sha256" and verify_directory(directory).ok
    blake3_digests = {name: file_digest(directory / name) for name in manifest.files}
    assert verify_directory(directory, digests=blake3_digests).ok  # a peer's transfer: read again, sha256
    (directory / "__0_0.distcp").write_bytes(b"shark")
    assert verify_directory(directory).problem.startswith("__0_0.distcp: sha256 mismatch")
    assert verify_directory(directory, digests=blake3_digests).problem.startswith("__0_0.distcp: sha256 mismatch")
    with pytest.raises(ValueError, match="blake3 and sha256"):
        Manifest.for_generation(FACTS, "a", {}, {"a": {"bytes": 1, "sha256": "0"}, "b": {"bytes": 1, "blake3": "0"}})


def test_a_manifest_must_list_what_its_kind_requires(tmp_path):
    sealed(tmp_path / "g", files={"__0_0.distcp": b"shard"})
    assert verify_directory(tmp_path / "g").problem == ".metadata: not listed in manifest.json"
    sealed(tmp_path / "e", kind="export", files={"model.safetensors": b"w"})
    assert verify_directory(tmp_path / "e").problem == "config.json: not listed in manifest.json"


# ----------------------------------------------------------------------------- choice
NAMES = ["step-00000008", "step-00000016", "step-00000024"]


def test_choose_the_newest_or_the_named_generation():
    assert choose_candidate(NAMES, "latest", None, "out") == "step-00000024"
    assert choose_candidate(NAMES, "auto", None, "out") == "step-00000024"
    assert choose_candidate(NAMES, None, "step-00000008", "out") == "step-00000008"
    assert choose_candidate([], "auto", None, "out") is None
    assert choose_candidate([], None, None, "out") is None


@pytest.mark.parametrize("names, resume, named, error, words", [
    (NAMES, None, None, RefuseOverwrite, "already holds generations (newest step-00000024)"),
    ([], "latest", None, NothingToResume, "no generation in out"),
    (NAMES, None, "step-00000032", NothingToResume, "step-00000032 does not exist in out"),
])
def test_choice_refusals(names, resume, named, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        choose_candidate(names, resume, named, "out")


def test_a_damaged_candidate_names_the_newest_earlier_one_that_verifies():
    def verify(name):
        return Verification(Path(name), None, None if name == "step-00000008" else f"{name}: bad")

    with pytest.raises(CorruptGeneration, match="--from-generation step-00000008"):
        require_verified(verify("step-00000024"), NAMES[:2], verify)
    with pytest.raises(CorruptGeneration, match="no earlier generation verifies"):
        require_verified(verify("step-00000024"), [], verify)
    require_verified(verify("step-00000008"), [], verify)  # verified: no error


def test_a_format_1_manifest_still_reads_and_a_signature_covers_every_field(tmp_path):
    """Generations written before safe loading (format_version 1) read as before; a signature
    is over the manifest's canonical bytes, so changing any field (a file's digest included)
    breaks it, and an unsigned manifest is refused with a key unless adopted."""
    from trainer.checkpoint.signing import Signing, encode_signed

    data = sealed(tmp_path / "g").to_json()
    old = sealed(tmp_path / "old", algorithm="sha256").to_json()
    assert Manifest.from_json({**old, "format_version": 1}).step == 24
    signing = Signing(b"k" * 16)
    signed = Manifest.from_json(json.loads(encode_signed(data, signing)))
    assert signing.problem(signed.signature, signed.canonical) is None
    assert "not match" in Signing(b"o" * 16).problem(signed.signature, signed.canonical)
    changed = json.loads(encode_signed(data, signing))
    changed["files"][".metadata"]["blake3"] = "0" * 64
    tampered = Manifest.from_json(changed)
    assert "not match" in signing.problem(tampered.signature, tampered.canonical)
    unsigned = Manifest.from_json(data)
    assert "--allow-unsigned" in signing.problem(unsigned.signature, unsigned.canonical)
    assert Signing(b"k" * 16, allow_unsigned=True).problem(unsigned.signature, unsigned.canonical) is None
    assert "k" * 16 not in repr(signing)
