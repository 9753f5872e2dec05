"""`list`, `verify`, `report` and `compare.py` on a run directory in a real S3 server
(SeaweedFS): one small run (interrupted at step 10, resumed to 16) made once for the module;
edits (a deleted manifest, an overwritten object) go to server-side copies of it.

The trainer runs and a few commands run as subprocesses, end to end; the other commands call
`trainer.cli.main` in this process (each subprocess costs seconds of imports on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.cli import REPO, run_cli
from trainer.cli import main

G4, G8, G16 = "step-00000004", "step-00000008", "step-00000016"


@dataclass(frozen=True)
class StoreRun:
    url: str
    bucket: str
    tier: Path
    """This machine's local tier: the default one for the URL under TRAINER_LOCAL_TIER."""
    env: dict


@pytest.fixture(scope="module")
def run(s3_server, tmp_path_factory):
    bucket = s3_server.create_bucket("listing")
    tiers = tmp_path_factory.mktemp("tiers")
    env = {**s3_server.env(), "TRAINER_LOCAL_TIER": str(tiers)}
    url = f"s3://{bucket}/run"
    for args, expected in ((("--interrupt-at-step", 10), 75), (("--resume",), 0)):
        result = run_cli("--output", url, "--epochs", 2, *args, env=env)
        assert result.returncode == expected, result.stderr[-2000:]
    yield StoreRun(url, bucket, tiers / "s3" / bucket / "run", env)
    s3_server.delete_bucket(bucket)


def copy_run(s3_server, run: StoreRun, prefix: str) -> str:
    """A server-side copy of the run under another prefix, to edit without touching `run`."""
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=run.bucket, Prefix="run/")["Contents"]
    for entry in listed:
        client.copy_object(Bucket=run.bucket, Key=prefix + entry["Key"][len("run"):],
                           CopySource={"Bucket": run.bucket, "Key": entry["Key"]})
    return f"s3://{run.bucket}/{prefix}"


@pytest.fixture(scope="module")
def damaged(s3_server, run) -> str:
    """A copy whose newest generation has one object overwritten with other bytes."""
    url = copy_run(s3_server, run, "damaged")
    key = f"damaged/checkpoints/{G16}/__0_0.distcp"
    client = s3_server.client()
    size = client.head_object(Bucket=run.bucket, Key=key)["ContentLength"]
    client.put_object(Bucket=run.bucket, Key=key, Body=b"\x00" * size)
    return url


def in_process(command, monkeypatch, capsys, env: dict):
    """`command(argv)` in this process under `env`: (exit status, stdout, stderr)."""
    def call(*args, **overrides):
        for name, value in {**env, **overrides}.items():
            monkeypatch.setenv(name, value)
        status = command([str(arg) for arg in args])
        out, err = capsys.readouterr()
        return status, out, err
    return call


@pytest.fixture
def cli(monkeypatch, capsys, run):
    """`python -m trainer ARGS`."""
    return in_process(main, monkeypatch, capsys, run.env)


@pytest.fixture
def compare_cli(monkeypatch, capsys, run):
    """`python compare.py ARGS` (the script at the repository root)."""
    spec = importlib.util.spec_from_file_location("compare_script", REPO / "compare.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return in_process(script.main, monkeypatch, capsys, run.env)


def rows(text: str) -> dict[str, list[list[str]]]:
    """Table rows of `list` text by section, split on whitespace."""
    tables, current = {}, None
    for line in text.splitlines():
        if line in ("recovery generations", "exports", "attempts"):
            current = tables.setdefault(line, [])
        elif current is not None and line.startswith(("  step-", "  2")):  # a generation, or an attempt id
            current.append(line.split())
    return tables


def test_list_shows_what_is_durable_and_what_this_machine_holds(run, cli):
    result = run_cli("list", run.url, env=run.env)  # the default local tier, end to end
    assert result.returncode == 0, result.stderr
    assert f"local tier {run.tier}\n" in result.stdout
    table = rows(result.stdout)
    assert [r[:1] + r[4:7] for r in table["recovery generations"]] == \
        [[G8, "committed", "yes", "yes"], [G16, "committed", "yes", "yes"]]
    assert [r[:1] + r[3:6] for r in table["exports"]] == [[G16, "committed", "yes", "yes"]]
    assert [r[1:3] for r in table["attempts"]] == [["interrupted", "75"], ["completed", "0"]]

    status, out, _ = cli("list", run.url, "--json")
    described = json.loads(out)
    local = json.loads(cli("list", run.tier, "--json")[1])
    assert status == 0 and described["store"] == run.url and described["local_tier_found"]
    for section in ("generations", "exports"):
        assert [(r["durable"], r["local"], r["verified"]) for r in described[section]] == \
            [(True, "same", None)] * len(local[section])
        assert [(r["name"], r["bytes"], r["epoch"], r["attempt"], r["save_s"]) for r in described[section]] == \
            [(r["name"], r["bytes"], r["epoch"], r["attempt"], r["save_s"]) for r in local[section]]
    assert [a["id"] for a in described["attempts"]] == [a["id"] for a in local["attempts"]]
    assert json.loads(cli("list", run.tier, "--store", run.url, "--json")[1]) == described

    assert f"local tier of {run.url} (add --store {run.url}" in cli("list", run.tier)[1]
    elsewhere = json.loads(cli("list", run.url, "--local-tier", run.tier.parent / "absent", "--json")[1])
    assert not elsewhere["local_tier_found"]
    assert {r["local"] for r in elsewhere["generations"] + elsewhere["exports"]} == {"absent"}


def test_list_marks_uncommitted_local_only_stale_and_differing_copies(s3_server, run, cli, tmp_path):
    url = copy_run(s3_server, run, "edited")
    client, hidden = s3_server.client(), f".{G8}.replaced-a1b2c3"
    client.delete_object(Bucket=run.bucket, Key=f"edited/checkpoints/{G16}/manifest.json")
    client.copy_object(Bucket=run.bucket, Key=f"edited/checkpoints/{hidden}/manifest.json",
                       CopySource={"Bucket": run.bucket, "Key": f"edited/checkpoints/{G8}/manifest.json"})
    tier = tmp_path / "tier"
    shutil.copytree(run.tier, tier)
    manifest = tier / "checkpoints" / G8 / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=1))  # same content, other bytes
    # an old copy the store's retention removed (older than the store's newest generation, G8)
    shutil.copytree(tier / "checkpoints" / G8, tier / "checkpoints" / G4)

    described = json.loads(cli("list", url, "--local-tier", tier, "--json")[1])
    assert [(r["name"], r["durable"], r["local"]) for r in described["generations"]] == \
        [(G4, False, "stale"), (G8, True, "different"), (G16, False, "only")]
    assert described["generations"][2]["verified"] is True and described["generations"][1]["verified"] is None
    assert (described["generations_uncommitted"], described["generations_replaced"]) == ([G16], [hidden])
    status, text, _ = cli("list", url, "--local-tier", tier)
    assert status == 0
    assert [r[:1] + r[4:7] for r in rows(text)["recovery generations"]] == \
        [[G4, "NO", "no", "stale"], [G8, "committed", "yes", "differs"], [G16, "yes", "no", "only"]]
    assert "  local only: published on this machine, not (yet) in the store" in text
    assert "  local stale: an old copy on this machine that the store no longer holds (its retention removed " \
           "it); never restored: the store is the truth" in text
    assert f"  uncommitted prefix without a manifest (never selected; the next trainer removes it): {G16}" in text
    assert f"  superseded copy kept for inspection (never selected; delete when done): {hidden}" in text


def test_verify_streams_every_object_and_names_the_damage(run, damaged, cli):
    status, out, _ = cli("verify", run.url)
    assert status == 0
    assert out.splitlines() == [f"ok       {run.url}/checkpoints/{G8}", f"ok       {run.url}/checkpoints/{G16}",
                                f"ok       {run.url}/exports/{G16}"]
    status, out, _ = cli("verify", f"{run.url}/exports/{G16}", "--json")
    assert status == 0 and json.loads(out) == [{"path": f"{run.url}/exports/{G16}", "verified": True,
                                                "problem": None}]

    status, out, err = cli("verify", damaged)
    assert status == 65
    assert f"DAMAGED  {damaged}/checkpoints/{G16}: __0_0.distcp" in out
    assert f"ok       {damaged}/checkpoints/{G8}" in out
    assert len(err.splitlines()) == 1
    assert err.startswith(f"trainer: error: 1 of 3 damaged, first {damaged}/checkpoints/{G16}: __0_0.distcp")
    # list trusts the commit (one manifest read each); verify is what re-hashes
    assert rows(cli("list", damaged)[1])["recovery generations"][1][4] == "committed"

    status, _, err = cli("verify", f"{run.url}/checkpoints/step-00000017")
    assert status == 66 and "is not a committed generation or export" in err


def test_report_reads_the_attempt_records_from_the_store(run, cli):
    status, out, _ = cli("report", run.url)
    assert status == 0 and out.startswith(f"recovery report {run.url}\n")
    status, out, _ = cli("report", run.url, "--json")
    report = json.loads(out)
    assert status == 0 and report["output"] == run.url
    assert [row["outcome"] for row in report["rows"]] == ["interrupted", "completed"]
    assert (report["totals"]["useful"], report["totals"]["computed"], report["totals"]["lost"]) == (16, 18, 2)


def test_report_sees_a_live_trainer_by_its_lease(s3_server, run, cli):
    """A `running` record in the store is live while its attempt renews the lease (on any
    host), killed once the lease has not been renewed for its ttl."""
    url, client = copy_run(s3_server, run, "live"), s3_server.client()
    resumed = json.loads(cli("list", url, "--json")[1])["attempts"][1]["id"]
    key = f"live/attempts/{resumed}/attempt.json"
    record = json.loads(client.get_object(Bucket=run.bucket, Key=key)["Body"].read())
    client.put_object(Bucket=run.bucket, Key=key, Body=json.dumps({**record, "status": "running"}).encode())
    for renewed, outcome in ((time.time(), "running"), (time.time() - 3600, "killed")):
        lease = {"attempt": record["id"], "host": "another-host", "pid": 1, "ttl_s": 30.0, "renewals": 3,
                 "renewed_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(renewed))}
        client.put_object(Bucket=run.bucket, Key="live/.trainer.lease", Body=json.dumps(lease).encode())
        status, out, _ = cli("report", url, "--json")
        assert status == 0 and [row["outcome"] for row in json.loads(out)["rows"]] == ["interrupted", outcome]


def test_compare_downloads_store_generations(run, damaged, compare_cli):
    same = run_cli("compare.py", f"{run.url}/checkpoints/{G16}", run.tier / "checkpoints" / G16, env=run.env)
    assert same.returncode == 0 and "all equal" in same.stdout, same.stderr
    status, out, _ = compare_cli(f"{run.url}/checkpoints/{G8}", f"{run.url}/checkpoints/{G16}", "--json")
    assert status == 1 and json.loads(out)["a"] == f"{run.url}/checkpoints/{G8}"
    status, _, err = compare_cli(f"{run.url}/checkpoints/{G16}", f"{damaged}/checkpoints/{G16}")
    assert status == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"compare: error: {damaged}/checkpoints/{G16} cannot be compared: __0_0.distcp")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_bad_store_inputs_are_one_line_with_their_exit_code(run, cli):
    nowhere = f"s3://{run.bucket}/nothing-here"
    cases = [
        (("list", "ftp://bucket/run"), {}, 2, "unknown store scheme ftp://"),
        (("list", "s3://no-such-bucket-0123/run"), {}, 66, "bucket no-such-bucket-0123 does not exist"),
        (("verify", run.url), {"AWS_SECRET_ACCESS_KEY": "wrong"}, 74, "refused"),
        (("list", run.url), {"AWS_ACCESS_KEY_ID": "nobody"}, 74, "check the credentials"),
        (("report", run.url), {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}"}, 74,
         "check the endpoint (AWS_ENDPOINT_URL)"),
        (("list", nowhere), {}, 66, f"nothing under {nowhere}"),
        (("verify", nowhere), {}, 66, f"no committed generations or exports under {nowhere}"),
        (("report", nowhere), {}, 66, f"no attempt records under {nowhere}/attempts"),
        (("list", run.tier, "--local-tier", run.tier), {}, 2, "--local-tier goes with a store URL"),
    ] + [((command, run.url), {"AWS_ENDPOINT_URL": "127.0.0.1:8333"}, 2, "AWS_ENDPOINT_URL=127.0.0.1:8333 has no "
          "scheme; write it as http://127.0.0.1:8333 (https:// for TLS)") for command in ("list", "report", "verify")]
    for args, env, expected, words in cases:
        status, _, err = cli(*args, **env)
        assert (status, len(err.splitlines())) == (expected, 1) and words in err, (args, status, err)


def test_bad_compare_inputs_are_one_line(run, compare_cli):
    for args, env, expected, words in [
        (("ftp://a/b", "s3://x/y"), {}, 2, "unknown store scheme ftp://"),
        ((run.url, run.url), {}, 2, f"{run.url} is a run, not a generation; pass {run.url}/checkpoints/{G16} "
                                    f"(its newest generation)"),
        ((f"{run.url}/checkpoints/{G8}", f"{run.url}/checkpoints/{G16}"),
         {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}"}, 74, "check the endpoint"),
    ]:
        status, _, err = compare_cli(*args, **env)
        assert (status, len(err.splitlines())) == (expected, 1) and words in err, (args, status, err)
