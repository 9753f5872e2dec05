"""The run directory in an object store, end to end against a real S3 server (SeaweedFS):
tiered saves, restore on a fresh machine, kill -9 at every step of the commit protocol, the
store going away mid-save, the lease, and the one-line refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import compare, finish, one_error_line, run_cli, start, train, wait_for_line
from support.limits import scaled
from support.runs import FINAL, SHORT, SHORT_FINAL, attempts, generation
from support.s3 import committed, keys, store_env
from s3server import SeaweedServer



@pytest.fixture
def bucket(s3_bucket) -> str:
    return s3_bucket.name


def same_as(baseline: Path, run: Path, name: str = SHORT_FINAL) -> bool:
    return compare(generation(baseline, name), generation(run, name)).returncode == 0


def test_interrupted_store_run_resumes_on_a_fresh_machine_exactly(s3_server, bucket, tmp_path, baseline):
    """Generations are published on the local tier and made durable in the store; a new
    machine (an empty local tier) restores from the store, verified while downloading."""
    env, url = store_env(s3_server), f"s3://{bucket}/run"
    first = train(url, "--local-tier", tmp_path / "node-a", "--interrupt-at-step", 27, expect=75, env=env)
    assert "durable in s3://" in first.stdout and "step-00000024" in first.stdout.splitlines()[-1]
    assert committed(s3_server, bucket) == ["step-00000008", "step-00000016", "step-00000024"]
    # The store's manifest is the local one, byte for byte: the commit marker names the content.
    local_manifest = (tmp_path / "node-a/checkpoints/step-00000024/manifest.json").read_bytes()
    stored = s3_server.client().get_object(Bucket=bucket, Key="run/checkpoints/step-00000024/manifest.json")
    assert stored["Body"].read() == local_manifest
    interrupted = attempts(tmp_path / "node-a")[-1]
    assert interrupted["durable"]["generations_published"] == "step-00000024"
    assert all(entry["durable_s"] >= entry["save_s"] for entry in interrupted["generations_published"])

    resumed = train(url, "--local-tier", tmp_path / "node-b", "--resume", env=env)
    assert "restored step-00000024" in resumed.stdout
    record = attempts(tmp_path / "node-b")[-1]  # node-b pulled node-a's record from the store
    assert [a["status"] for a in attempts(tmp_path / "node-b")] == ["interrupted", "completed"]
    assert record["costs"]["download_s"] > 0 and record["downloaded_bytes"] > 0
    assert record["steps_replayed"] == 3
    assert compare(generation(baseline), generation(tmp_path / "node-b")).returncode == 0
    # The attempt records are in the store too.
    assert len([k for k in keys(s3_server, bucket, "run/attempts/") if k.endswith("attempt.json")]) == 2
    # Exports are committed the same way, and load with safetensors once downloaded.
    from safetensors.torch import load_file
    export = tmp_path / "export.safetensors"
    export.write_bytes(s3_server.client().get_object(
        Bucket=bucket, Key=f"run/exports/{FINAL}/model.safetensors")["Body"].read())
    assert load_file(str(export)).keys() == load_file(str(tmp_path / "node-b/exports" / FINAL /
                                                           "model.safetensors")).keys()


def test_a_local_copy_is_used_only_when_it_is_the_committed_one(s3_server, bucket, tmp_path):
    env, url, tier = store_env(s3_server), f"s3://{bucket}/run", tmp_path / "tier"
    train(url, "--local-tier", tier, "--epochs", 2, "--interrupt-at-step", 12, expect=75, env=env)
    train(url, "--local-tier", tier, "--epochs", 3, "--resume", "--interrupt-at-step", 20,
          expect=75, env=env)
    assert attempts(tier)[-1]["costs"].get("download_s") is None  # same manifest: no download
    assert attempts(tier)[-1]["restored"]["shards_verified"] == "while loading"  # one process: one pass
    # A local copy the store does not hold (never made durable) is dropped, never restored.
    forged = tier / "checkpoints" / "step-00000032"
    os.rename(tier / "checkpoints" / "step-00000016", forged)
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest.update(name="step-00000032", step=32)
    (forged / "manifest.json").write_text(json.dumps(manifest))
    again = train(url, "--local-tier", tier, "--epochs", 3, "--resume", env=env)
    assert "dropped the local copy of checkpoints/step-00000032" in again.stdout
    assert "restored step-00000016" in again.stdout
    assert "download" in json.dumps(attempts(tier)[-1]["costs"])


# ----------------------------------------------------------------- kill -9 in the commit protocol
STORE_CRASHES = [
    # (crash point, extra options, what the start after the crash must say, committed after the crash)
    ("store-after-first-object", (), None, []),
    ("store-before-manifest", (), "step-00000008 has no manifest.json", []),
    ("store-after-manifest", (), "step-00000008 has no manifest.json", ["step-00000008"]),
    # keep-last 1: step-00000016 stays (the restored step-00000008 is protected) until step-00000024 lands.
    ("store-retention-after-uncommit", ("--keep-last", 1), "restored step-00000008",
     ["step-00000008", "step-00000024"]),
]


def test_kill_9_anywhere_in_a_store_commit_then_resume_is_exact(s3_server, bucket, tmp_path, short_baseline):
    """One run killed at each point of the store commit protocol in turn, each start resuming
    what the previous one left: only committed generations are ever restored, the uncommitted
    leftover is deleted, the dead holder's lease is taken over at once (same host, process
    gone), and the run ends equal to the uninterrupted one."""
    env, url, tier = store_env(s3_server), f"s3://{bucket}/run", tmp_path / "tier"
    for point, extra, said, after in STORE_CRASHES:
        killed = run_cli("--output", url, "--local-tier", tier, *SHORT, *extra, "--resume", "auto",
                         env={**env, "TRAINER_FAULT_POINT": point})
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
        assert said is None or said in killed.stdout, (point, killed.stdout[-2000:])
        assert committed(s3_server, bucket) == after, point
    resumed = train(url, "--local-tier", tier, *SHORT, "--keep-last", 1, "--resume", "auto", env=env)
    assert "restored step-00000024" in resumed.stdout and "took over the lease" in resumed.stdout
    assert "step-00000016 has no manifest.json" in resumed.stdout  # the rest of the cut-short removal
    assert same_as(short_baseline, tier)
    prefixes = {key.split("/")[2] for key in keys(s3_server, bucket, "run/checkpoints/")}
    assert prefixes == set(committed(s3_server, bucket)) == {"step-00000008", SHORT_FINAL}


def test_uncommitted_is_never_selected_and_a_damaged_commit_is_refused(s3_server, bucket, tmp_path):
    """A newer prefix without its manifest (what an interrupted `aws s3 sync` leaves) is never
    selected nor damage; a committed generation whose object was altered is refused (65)."""
    env, url = store_env(s3_server), f"s3://{bucket}/run"
    train(url, "--local-tier", tmp_path / "a", "--epochs", 2, expect=0, env=env)
    client = s3_server.client()
    for key in keys(s3_server, bucket, "run/checkpoints/step-00000016/"):
        if not key.endswith("manifest.json"):
            client.copy_object(Bucket=bucket, Key=key.replace("step-00000016", "step-00000040"),
                               CopySource={"Bucket": bucket, "Key": key})
    shard = next(k for k in keys(s3_server, bucket, "run/checkpoints/step-00000016/") if k.endswith(".distcp"))
    body = client.get_object(Bucket=bucket, Key=shard)["Body"].read()
    client.put_object(Bucket=bucket, Key=shard, Body=body[:-1] + bytes([body[-1] ^ 1]))
    refused = run_cli("--output", url, "--local-tier", tmp_path / "b", "--epochs", 3, "--resume", env=env)
    assert "step-00000040 has no manifest.json" in refused.stdout  # a warning, not the refusal
    assert refused.returncode == 65
    line = one_error_line(refused)
    assert "step-00000016 is damaged" in line and "blake3 mismatch" in line
    assert "--from-generation step-00000008" in line
    assert not (tmp_path / "b" / "checkpoints" / "step-00000016").exists()  # nothing unverified kept


def test_a_fetch_refuses_a_flipped_byte_past_the_first_handover_and_a_missing_object(s3_bucket, monkeypatch,
                                                                                       tmp_path):
    """`ObjectSection.fetch` hashes every object as it streams, on the threads the chunks are
    handed to (client.py `stream_object`, CHUNK bytes at a time): a 20 MB shard downloads whole and
    exact, one flipped byte in its second handover is refused with the digest line and leaves
    nothing behind, and a deleted object (one GET, no lookup first) is refused as missing."""
    import torch

    from trainer.checkpoint.checkpointer import SyncCheckpointer
    from trainer.checkpoint.commit import RenameCommit
    from trainer.checkpoint.identity import RunIdentity
    from trainer.checkpoint.manifest import GenerationFacts
    from trainer.checkpoint.section import LocalSection
    from trainer.layout import MANIFEST, RUN_IDENTITY, RunDirectory
    from trainer.location import parse_store_url
    from trainer.storage.object.client import CHUNK, open_objects
    from trainer.storage.object.section import ObjectSection

    s3_bucket.use_env(monkeypatch)
    run = RunDirectory(tmp_path / "tier")
    run.checkpoints.mkdir(parents=True)
    (run.root / RUN_IDENTITY).write_bytes(RunIdentity.new().to_bytes())
    local = LocalSection(run.checkpoints)
    facts = GenerationFacts(4, 0, 4, {"source": "s"}, (), {}, "2026-12-01T00:00:00Z")
    SyncCheckpointer(RenameCommit(local), "attempt").save({"w": torch.arange(5 << 20, dtype=torch.float32)}, facts)
    (name,) = local.committed()
    shard = max((path for path in local.path(name).iterdir() if path.name != MANIFEST), key=lambda p: p.stat().st_size)
    assert shard.stat().st_size > 2 * CHUNK
    objects = open_objects(parse_store_url(f"{s3_bucket.url}/run"))
    objects.write(RUN_IDENTITY, (run.root / RUN_IDENTITY).read_bytes())
    section = ObjectSection(objects, "checkpoints")
    section.commit(name, local.path(name), fence=lambda: None)

    fetched, transfer = section.fetch(name, tmp_path / "clean")
    assert fetched.ok, fetched.problem
    assert (tmp_path / "clean" / name / shard.name).read_bytes() == shard.read_bytes()
    assert transfer.bytes >= shard.stat().st_size

    body = bytearray(shard.read_bytes())
    body[CHUNK + CHUNK // 2] ^= 1  # in the second batch handed over, not the first
    objects.write(section.key(name, shard.name), bytes(body))
    damaged, _ = section.fetch(name, tmp_path / "damaged")
    assert not damaged.ok and f"{shard.name}: blake3 mismatch" in damaged.problem
    assert not (tmp_path / "damaged" / name).exists() and list((tmp_path / "damaged").iterdir()) == []

    objects.delete([section.key(name, shard.name)])
    missing, _ = section.fetch(name, tmp_path / "missing")
    assert not missing.ok and shard.name in missing.problem and "missing" in missing.problem
    assert not (tmp_path / "missing" / name).exists()


# ----------------------------------------------------------------- the store going away
def stopped(process: subprocess.Popen, timeout: float = 600) -> bool:
    """Whether the process stopped itself (SIGSTOP: state T), waiting up to `timeout` (scaled)."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline and process.poll() is None:
        if Path(f"/proc/{process.pid}/stat").read_text().split(") ", 1)[1].startswith("T"):
            return True
        time.sleep(0.05)
    return False


def test_store_stopped_mid_save_fails_within_the_bound_then_resumes_exactly(tmp_path, short_baseline):
    """The server goes away in the middle of a save (the trainer pauses itself right before the
    manifest of step-00000016, the server is killed, the trainer continues): bounded retries,
    then one line and 74; nothing committed is lost; once the server is back, the resume is exact."""
    server = SeaweedServer(tmp_path / "server")
    server.start()
    try:
        bucket = server.create_bucket()
        env, url, tier = server.env(), f"s3://{bucket}/run", tmp_path / "tier"
        train(url, "--local-tier", tier, "--epochs", 1, env=env)  # step-00000008 committed
        args = ("--local-tier", tier, *SHORT, "--resume", "--store-retries", 2, "--store-backoff-secs", 0.2,
                "--store-timeout-secs", 2)
        process = start(url, *args, env={**env, "TRAINER_PAUSE_POINT": "store-before-manifest"})
        try:
            assert stopped(process), "the trainer never reached its pause point"
            server.kill()
            gone = time.monotonic()
        finally:
            process.send_signal(signal.SIGCONT)
        out, err = finish(process)
        failed_after = time.monotonic() - gone
        assert process.returncode == 74, err[-2000:]
        line = [l for l in err.splitlines() if l.startswith("trainer: error:")]
        assert len(line) == 1 and url in line[0] and "after 3 tries" in line[0]
        assert "Traceback" not in err
        assert failed_after < scaled(60)  # bounded: 3 tries of at most 2 x 2 s, 0.6 s of backoff, plus the rest
        server.start()
        assert committed(server, bucket)[0] == "step-00000008"  # the earlier generation intact
        train(url, "--local-tier", tier, *SHORT, "--resume", env=env)
        assert same_as(short_baseline, tier)
    finally:
        server.stop()


# ----------------------------------------------------------------- single writer
def test_a_second_trainer_on_the_same_prefix_is_refused_naming_the_holder(s3_server, bucket, tmp_path):
    env, url = store_env(s3_server), f"s3://{bucket}/run"
    first = start(url, "--local-tier", tmp_path / "a", "--epochs", 400, env=env)  # outlasts the second start, however slow
    try:
        wait_for_line(first, "step=")
        second = run_cli("--output", url, "--local-tier", tmp_path / "b", "--resume", "auto",
                         "--lease-wait-secs", 0, env=env)
        assert second.returncode == 73
        line = one_error_line(second)
        assert f"s3://{bucket}/run is in use by another trainer" in line and f"pid {first.pid}" in line
        assert first.poll() is None  # untouched
    finally:
        first.send_signal(signal.SIGTERM)
        _, said = finish(first)
    assert first.returncode == 75
    # Preempted: the step reached is saved and made durable before exit, and the 75 line says so.
    stopped = [line for line in said.splitlines() if line.startswith("trainer: stopped, resumable (exit 75)")]
    assert len(stopped) == 1 and f"newest durable in s3://{bucket}/run: step-" in stopped[0]
    durable = stopped[0].split(f"s3://{bucket}/run: ")[1].split(";")[0]
    assert durable in committed(s3_server, bucket) and durable == committed(s3_server, bucket)[-1]


# ----------------------------------------------------------------- bad input, before any training
def test_wrong_credentials_missing_bucket_and_unreachable_endpoint_are_one_line(s3_server, bucket, tmp_path):
    cases = {
        "wrong credentials": (f"s3://{bucket}/run", {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, 74,
                              "check the credentials"),
        "missing bucket": ("s3://no-such-bucket-here/run", {}, 66, "bucket no-such-bucket-here does not exist"),
        "no such host": (f"s3://{bucket}/run", {"AWS_ENDPOINT_URL": "http://no-such-host.invalid:9000"}, 74,
                         "check the endpoint"),
        "unreachable endpoint": (f"s3://{bucket}/run", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, 74,
                                 "check the endpoint"),
    }
    for name, (url, override, code, said) in cases.items():
        result = run_cli("--output", url, "--local-tier", tmp_path / name.replace(" ", "-"), "--store-retries", 1,
                         "--store-backoff-secs", 0.1, env={**s3_server.env(), **override})
        assert result.returncode == code, (name, result.stderr[-1500:])
        line = one_error_line(result)
        assert said in line, (name, line)
        assert "step=" not in result.stdout  # before any training
        assert not (tmp_path / name.replace(" ", "-") / "attempts").exists()


def test_unknown_scheme_and_store_options_without_a_store_are_usage_errors(tmp_path):
    unknown = run_cli("--output", "ftp://host/run")
    assert unknown.returncode == 2 and "unknown store scheme ftp://" in one_error_line(unknown)
    schemeless = run_cli("--output", "s3://my-bucket/run", "--local-tier", tmp_path / "tier",
                         env={"AWS_ENDPOINT_URL": "127.0.0.1:8333"})  # `export` pasted without its http://
    assert schemeless.returncode == 2 and one_error_line(schemeless).endswith(
        "AWS_ENDPOINT_URL=127.0.0.1:8333 has no scheme; write it as http://127.0.0.1:8333 (https:// for TLS)")
    stray = run_cli("--output", tmp_path / "run", "--local-tier", tmp_path / "tier")
    assert stray.returncode == 2 and "--local-tier applies only to a run directory in a store; pass --output s3://BUCKET/PREFIX, or drop it" in \
        one_error_line(stray)


def test_a_damaged_shard_of_the_local_copy_is_downloaded_again_by_the_load(s3_server, bucket, tmp_path):
    """One process restores the local tier's copy in one pass (its shards hashed while they
    load): a flipped byte in one makes the load warn once, download the committed generation
    again and restore the whole state from the download, as the claim's separate pass did;
    the record says the store served it and the restore check matches. ~6 s."""
    env, url, tier = store_env(s3_server), f"s3://{bucket}/run", tmp_path / "tier"
    train(url, "--local-tier", tier, "--epochs", 2, "--interrupt-at-step", 12, expect=75, env=env)
    newest = committed(s3_server, bucket)[-1]
    shard = max((tier / "checkpoints" / newest).glob("*.distcp"), key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    again = train(url, "--local-tier", tier, "--epochs", 2, "--resume", env=env)
    output = again.stdout + again.stderr
    warned = [line for line in output.splitlines() if "downloading it again" in line]
    assert len(warned) == 1 and newest in warned[0] and f"{shard.name}: blake3 mismatch" in warned[0], output
    assert f"restored {newest}" in again.stdout and "not exact" not in output
    record = attempts(tier)[-1]
    assert (record["status"], record["restored"]["name"], record["restored"]["tier"]) == ("completed", newest, "store")
    assert record["restored"]["shards_verified"] == "before loading"  # the download was hashed as it streamed
    assert record["downloaded_bytes"] > 0 and record["costs"]["download_s"] > 0
    assert record["restore_check"] == {"matched": True}
