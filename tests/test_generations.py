"""Generations on disk: temporaries are never selected, damage is detected and named."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from trainer.checkpoint.resume import verify_candidate
from trainer.checkpoint.section import LocalSection
from trainer.errors import CorruptGeneration

from support.cli import compare, one_error_line, run_cli, train
from support.runs import attempts, generation


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run interrupted at step 27: generations 8, 16, 24 exist."""
    run = tmp_path_factory.mktemp("interrupted") / "run"
    train(run, "--interrupt-at-step", 27, expect=75)
    return run


def fresh_copy(interrupted, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(interrupted, copy)
    return copy


def test_leftover_temporary_is_never_selected_and_is_cleaned(tmp_path, interrupted, baseline):
    run = fresh_copy(interrupted, tmp_path)
    # A crashed attempt's half-written generation, newer than every published one.
    stale = run / "checkpoints" / ".step-00000032.tmp-20260101T000000Z-abc123-ffffff"
    shutil.copytree(generation(run, "step-00000024"), stale)
    # A retention delete cut short: renamed aside first, so it is never mistaken for a generation.
    deleting = run / "checkpoints" / ".step-00000008.deleting-abc123"
    os.rename(generation(run, "step-00000008"), deleting)
    (deleting / "__0_0.distcp").unlink()
    foreign = run / "checkpoints" / "notes-from-operator"
    foreign.mkdir()
    resumed = train(run, "--resume")
    assert "restored step-00000024" in resumed.stdout
    assert "removed stale temporary" in resumed.stdout
    assert not stale.exists() and not deleting.exists() and foreign.exists()  # ours cleaned, theirs untouched
    assert compare(generation(baseline), generation(run)).returncode == 0


def test_a_copy_without_its_manifest_is_uncommitted_not_damage(tmp_path, interrupted, baseline):
    """An interrupted `aws s3 sync` or sidecar copy leaves a generation directory without its
    manifest (written last): never selected, never a reason for 65, listed and kept."""
    run = fresh_copy(interrupted, tmp_path)
    cut_short = generation(run, "step-00000032")
    shutil.copytree(generation(run, "step-00000024"), cut_short)
    (cut_short / "manifest.json").unlink()
    listed = run_cli("list", run)
    assert "uncommitted copy without a manifest (never selected, kept): step-00000032" in listed.stdout
    assert "step-00000032  " not in listed.stdout  # not a row of the table
    resumed = train(run, "--resume", "--interrupt-at-step", 30, expect=75)
    assert "restored step-00000024" in resumed.stdout
    assert "step-00000032 has no manifest: an uncommitted copy (kept, never selected)" in resumed.stdout
    assert cut_short.is_dir() and not (cut_short / "manifest.json").exists()
    train(run, "--resume")  # publishes its own step-00000032 over the copy
    assert compare(generation(baseline), generation(run)).returncode == 0
    assert len(list((run / "checkpoints").glob(".step-00000032.replaced-*"))) == 1


def damage_flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def damage_remove(path):
    path.unlink()


def damage_add(path):
    path.write_bytes(b"data nobody hashed")


def damage_unlist(path):
    """Drop the file from its manifest's list (the file itself stays, unverified)."""
    manifest_path = path.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"][path.name]
    manifest_path.write_text(json.dumps(manifest))


DAMAGE = {
    "flipped byte": ("__0_0.distcp", damage_flip, "blake3 mismatch"),
    "unlisted extra file": ("__0_9.distcp", damage_add, "not listed in manifest.json"),
    "file dropped from the manifest": (".metadata", damage_unlist, "not listed in manifest.json"),
    "truncated file": ("__0_0.distcp", damage_truncate, "size"),
    "missing file": (".metadata", damage_remove, "missing"),
    "damaged manifest": ("manifest.json", damage_truncate, "manifest.json: unreadable"),
}


def test_files_no_loader_reads_are_ignored(tmp_path, interrupted):
    run = fresh_copy(interrupted, tmp_path)
    (generation(run, "step-00000024") / ".DS_Store").write_bytes(b"Finder was here")
    assert run_cli("verify", run).returncode == 0


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_generation_exits_65_naming_file_and_fallback(tmp_path, interrupted, kind):
    run = fresh_copy(interrupted, tmp_path)
    name, damage, reason = DAMAGE[kind]
    damage(generation(run, "step-00000024") / name)
    before = sorted(os.listdir(run / "checkpoints"))
    result = run_cli("--output", run, "--resume")
    assert result.returncode == 65
    line = one_error_line(result)
    assert "step-00000024" in line and name in line and reason in line
    assert "--from-generation step-00000016" in line
    assert sorted(os.listdir(run / "checkpoints")) == before  # nothing deleted
    refused = attempts(run)[-1]
    assert (refused["status"], refused["exit_code"]) == ("refused", 65)
    assert refused["considered_generation"] == "step-00000024"
    assert name in refused["reason"]
    verify = run_cli("verify", run)
    assert verify.returncode == 65
    assert f"DAMAGED  {generation(run, 'step-00000024')}: {name}" in verify.stdout
    assert verify.stdout.count("\nok ") + verify.stdout.startswith("ok ") == 2


def test_operator_resumes_from_the_suggested_generation(tmp_path, interrupted, baseline):
    run = fresh_copy(interrupted, tmp_path)
    damage_flip(generation(run, "step-00000024") / "__0_0.distcp")
    train(run, "--from-generation", "step-00000016")
    assert compare(generation(baseline), generation(run)).returncode == 0
    # The damaged copy was kept aside for inspection, never deleted.
    assert len(list((run / "checkpoints").glob(".step-00000024.replaced-*"))) == 1


def test_verify_accepts_a_good_run_and_a_single_generation(interrupted):
    result = run_cli("verify", interrupted)
    assert result.returncode == 0 and result.stdout.count("ok ") == 3
    single = run_cli("verify", generation(interrupted, "step-00000016"), "--json")
    assert single.returncode == 0 and json.loads(single.stdout)[0]["verified"] is True
    missing = run_cli("verify", interrupted / "nope")
    assert missing.returncode == 66


def test_manifest_records_what_it_promises(interrupted):
    manifest = json.loads((generation(interrupted, "step-00000024") / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and manifest["kind"] == "recovery" and manifest["digest"] == "blake3"
    assert (manifest["step"], manifest["epoch"], manifest["position"]) == (24, 3, 0)
    assert ".metadata" in manifest["files"] and all(
        name == ".metadata" or (name.startswith("__0_") and name.endswith(".distcp")) for name in manifest["files"])
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (generation(interrupted, "step-00000024") / name).stat().st_size
        assert set(entry) == {"bytes", "blake3"} and len(entry["blake3"]) == 64
    assert manifest["attempt"] == attempts(interrupted)[0]["id"]
    assert manifest["fingerprint"]["world_size"] == 1 and "write_s" in manifest["timings"]


def test_a_copied_or_renamed_generation_is_damage_not_a_newer_one(tmp_path, interrupted):
    """A generation copied to a later name would be restored as the newest, and every later
    resume would replay from its real step: its manifest must describe the name it is under."""
    run = fresh_copy(interrupted, tmp_path)
    shutil.copytree(generation(run, "step-00000024"), generation(run, "step-00000099"))
    refused = train(run, "--resume", expect=65)
    line = one_error_line(refused)
    assert "step-00000099 is damaged: manifest.json: describes step-00000024 (step 24)" in line
    assert "--from-generation step-00000024" in line
    # Renamed with a manifest edited to match: the snapshot itself still holds step 24.
    shutil.rmtree(generation(run, "step-00000099"))
    manifest_path = generation(run, "step-00000024") / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.update(name="step-00000099", step=99)
    manifest_path.write_text(json.dumps(manifest))
    generation(run, "step-00000024").rename(generation(run, "step-00000099"))
    refused = train(run, "--resume", expect=65)
    assert "step-00000099 holds step 24, but its manifest says 99" in one_error_line(refused)


def test_a_flipped_shard_byte_is_refused_by_the_one_pass_load_as_before(tmp_path, interrupted):
    """One rank on the local disk: the claim leaves the shards' digest to the load, which
    hashes them as it reads them (trainer/checkpoint/onepass.py). A byte flipped in a
    `.distcp` of the newest generation is refused exactly as the separate pass refuses it
    (the same line, 65, the same advice), but by the load: the attempt's record had started
    (it holds the fingerprint a refusal in the claim never reaches). The suggested resume
    then records that its shards were verified while loading. ~4 s."""
    run = fresh_copy(interrupted, tmp_path)
    shard = max(generation(run, "step-00000024").glob("*.distcp"), key=lambda path: path.stat().st_size)
    damage_flip(shard)
    with pytest.raises(CorruptGeneration) as two_pass:  # today's separate pass, for the expected line
        verify_candidate(LocalSection(run / "checkpoints"), "step-00000024")
    result = run_cli("--output", run, "--resume")
    assert result.returncode == 65
    assert one_error_line(result).endswith(str(two_pass.value))
    assert shard.name in str(two_pass.value) and "--from-generation step-00000016" in str(two_pass.value)
    refused = attempts(run)[-1]
    assert (refused["status"], refused["considered_generation"], refused["restored"]) == ("refused", "step-00000024",
                                                                                          None)
    assert "fingerprint" in refused, "refused in the claim: the shards were hashed before the load"
    train(run, "--from-generation", "step-00000016")
    resumed = attempts(run)[-1]
    assert resumed["restored"]["name"] == "step-00000016"
    assert resumed["restored"]["shards_verified"] == "while loading"


def as_written_before_blake3(directory):
    """Rewrite a generation's manifest as format 2 wrote it: every file's sha256, unsigned,
    the same JSON layout (what a generation of a trainer before BLAKE3 holds)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(format_version=2, digest="sha256",
                    files={name: {"bytes": entry["bytes"], "sha256": hashlib.sha256((directory / name).read_bytes())
                                  .hexdigest()} for name, entry in manifest["files"].items()})
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def test_generations_digested_with_sha256_verify_resume_and_refuse_a_flipped_byte(tmp_path, interrupted, baseline):
    """Generations written before BLAKE3 (format 2, sha256) still verify and load; a byte
    flipped in one is refused (65) by its sha256, and the run resumes from an older sha256
    generation to the same end as the uninterrupted run, its new generations in BLAKE3. ~5 s."""
    run = fresh_copy(interrupted, tmp_path)
    for name in ("step-00000008", "step-00000016", "step-00000024"):
        as_written_before_blake3(generation(run, name))
    verified = run_cli("verify", run)
    assert verified.returncode == 0 and verified.stdout.count("ok ") == 3, verified.stdout
    shard = max(generation(run, "step-00000024").glob("*.distcp"), key=lambda path: path.stat().st_size)
    damage_flip(shard)
    verified = run_cli("verify", run)
    assert verified.returncode == 65 and f"{shard.name}: sha256 mismatch" in verified.stdout, verified.stdout
    refused = run_cli("--output", run, "--resume")
    line = one_error_line(refused)
    assert refused.returncode == 65 and f"{shard.name}: sha256 mismatch" in line, line
    assert "--from-generation step-00000016" in line
    train(run, "--from-generation", "step-00000016")
    assert attempts(run)[-1]["restored"]["name"] == "step-00000016"
    assert compare(generation(baseline), generation(run)).returncode == 0
    newest = json.loads((generation(run) / "manifest.json").read_text())
    older = json.loads((generation(run, "step-00000016") / "manifest.json").read_text())
    assert (newest["digest"], newest["format_version"], older["digest"]) == ("blake3", 3, "sha256")
