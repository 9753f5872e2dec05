"""Loading a generation runs no code from it, and signed generations refuse every tampering.

Each attack is a pickle payload that, if anything unpickled it, would create a marker file:
planted in `.metadata`, in a `.distcp` BYTE_IO item (an optimizer hyperparameter), in a
workload's stateful extra (the toy's counter, a tensor) and in a model tensor's record, with the manifest fixed up (anyone who can
write the run directory can do that). `test_the_payloads_are_live` proves that stock DCP
loading does run them; every other test proves no read path of ours does, and that each
refusal is exit 65 and one line. One trained run (session fixture) serves every case; each
case tampers a copy of it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.digest import of_bytes

from support.cli import REPO, compare, one_error_line, run_cli, train
from support.runs import attempts

TOY = ("--workload", "tests/workloads/toy.py:ToyWorkload", "--epochs", 4)
"""2 steps an epoch: generations at steps 4, 6, 8 are kept."""
FINAL = "step-00000008"
EARLIER = "step-00000006"
LONGER = ("--epochs", 6)
LONGER_FINAL = "step-00000012"


def generation(output: Path, name: str = FINAL) -> Path:
    return output / "checkpoints" / name


class Payload:
    """Runs `touch MARKER` when unpickled by anything that resolves `os.system`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def fix_manifest(directory: Path) -> None:
    """What an attacker does after changing files: re-list every file with its real digest."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {entry.name: of_bytes(entry.read_bytes())
                         for entry in sorted(directory.iterdir()) if entry.name != "manifest.json"}
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def plant_in_metadata(directory: Path, marker: Path) -> None:
    """`.metadata` becomes (payload, the real metadata)."""
    real = pickle.loads((directory / ".metadata").read_bytes())  # our own untampered file
    (directory / ".metadata").write_bytes(pickle.dumps((Payload(marker), real)))
    fix_manifest(directory)


def plant_value(directory: Path, key: str, marker: Path, legacy: bool = False, in_place: bool = False) -> str:
    """The stored value of `key` (a BYTE_IO item or a tensor record) becomes a torch.save'd
    payload (zip format, or torch's `legacy` one) in a shard of its own, or appended to the
    shard that holds it (`in_place`: a rank's own shard), and `.metadata` points at it.
    Returns the shard's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = pickle.loads((directory / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == key)
    blob = io.BytesIO()
    torch.save({"lr": Payload(marker)}, blob, _use_new_zipfile_serialization=not legacy)
    shard = metadata.storage_data[index].relative_path if in_place else "__9_0.distcp"
    before = (directory / shard).read_bytes() if in_place else b""
    (directory / shard).write_bytes(before + blob.getvalue())
    metadata.storage_data[index] = _StorageInfo(shard, len(before), len(blob.getvalue()))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    fix_manifest(directory)
    return shard


def refusal(name: str, shard: str, what: str) -> str:
    """The one line `--resume` and `verify` both give for a planted value (`what`: "the value
    of KEY" for a non-tensor value, "a tensor record")."""
    return (f"{name}/{shard}: {what} needs posix.system, which is never unpickled (it could run "
            f"code); it was damaged or tampered with; restore an earlier generation with --from-generation, or "
            f"start a new --output")


PLANTS = {
    "metadata": lambda d, m: plant_in_metadata(d, m),
    "byte-io": lambda d, m: plant_value(d, "optim.param_groups.0.lr", m),
    "byte-io-legacy": lambda d, m: plant_value(d, "optim.param_groups.0.lr", m, legacy=True),
    "workload-extra": lambda d, m: plant_value(d, "workload.counter.steps", m),
    "tensor-record": lambda d, m: plant_value(d, "model.0.weight", m),
}


LR = "the value of optim.param_groups.0.lr"
REFUSED = {"byte-io": LR, "byte-io-legacy": LR, "workload-extra": "a tensor record", "tensor-record": "a tensor record"}
"""What the refusal of each planted value names (PLANTS; the toy's counter is a tensor)."""


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A toy run (with a workload stateful extra), two generations; never modified."""
    output = tmp_path_factory.mktemp("untrusted") / "run"
    train(output, *TOY)
    return output


def tampered_copy(trained: Path, tmp_path: Path, kind: str, name: str = FINAL) -> tuple[Path, Path]:
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(trained, run)
    PLANTS[kind](generation(run, name), marker)
    return run, marker


def files_of(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and "attempts" not in p.parts)


# ----------------------------------------------------------------------------- the payloads are real
def test_the_payloads_are_live(trained, tmp_path):
    """Stock DCP loading (plain pickle for `.metadata`, `weights_only=False` for values) runs
    each payload: so a missing marker elsewhere means our reader refused it. ~1 s."""
    for kind in ("metadata", "byte-io"):
        run, marker = tampered_copy(trained, tmp_path / kind, kind)
        reader = dcp.FileSystemReader(str(generation(run)))
        try:
            metadata = reader.read_metadata()
            template = {"optim": {"param_groups": [{"lr": None}]}}
            if kind == "byte-io":
                dcp.load(template, storage_reader=reader, no_dist=True)
        except Exception:  # noqa: BLE001 - what the payload leaves behind does not matter here
            metadata = None
        assert marker.exists(), f"stock loading did not run the {kind} payload: the test would prove nothing"
        del metadata


def test_stock_dcp_reads_a_generation(trained, tmp_path):
    """The format stays stock DCP: `dcp_to_torch_save` of stock torch reads every entry, equal
    to what our safe loader reads. ~1 s."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from trainer.checkpoint.snapshot import load_flat

    dcp_to_torch_save(str(generation(trained, FINAL)), str(tmp_path / "state.pt"))
    stock = torch.load(tmp_path / "state.pt", weights_only=True)  # plain values only: weights-only is enough
    ours = load_flat(generation(trained, FINAL))
    assert ours["workload.counter.steps"] == stock["workload"]["counter"]["steps"] == 8
    assert stock["model"] and all(torch.equal(ours[f"model.{key}"], value) for key, value in stock["model"].items())


# ----------------------------------------------------------------------------- no read path runs them
@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_resume_refuses_a_planted_payload(trained, tmp_path, kind):
    """Resume verifies and loads through the allowlist: 65, one line naming the file, nothing
    deleted, no marker. ~3 s each."""
    run, marker = tampered_copy(trained, tmp_path, kind)
    before = files_of(run)
    result = train(run, *TOY, *LONGER, "--resume", expect=65)
    line = one_error_line(result)
    assert not marker.exists()
    assert files_of(run) == before
    if kind == "metadata":
        assert f"{FINAL} is damaged: .metadata: names posix.system" in line
        assert f"--from-generation {EARLIER}" in line
    else:
        assert line.endswith(refusal(FINAL, "__9_0.distcp", REFUSED[kind])), line
    assert attempts(run)[-1]["status"] == "refused" and attempts(run)[-1]["exit_code"] == 65


@pytest.mark.parametrize("kind", ["metadata", "byte-io", "byte-io-legacy", "workload-extra"])
def test_compare_verify_list_report_run_no_planted_payload(trained, tmp_path, kind):
    """compare.py refuses (65); verify refuses (65) with the line --resume gives
    (test_resume_refuses_a_planted_payload), every value loaded through the safe loader; list
    marks the generation NO; report reads only JSON. ~5 s each."""
    run, marker = tampered_copy(trained, tmp_path, kind)
    compared = compare(generation(trained), generation(run))
    assert compared.returncode == 65 and "posix.system" in one_error_line(compared)
    verified = run_cli("verify", run)
    listed = run_cli("list", run, "--json")
    reported = run_cli("report", run)
    assert not marker.exists()
    assert verified.returncode == 65, verified.stdout + verified.stderr
    if kind == "metadata":
        assert "names posix.system" in verified.stdout
        assert f"{FINAL}: .metadata: names posix.system" in one_error_line(verified)
    else:
        assert f"{FINAL}: {refusal(FINAL, '__9_0.distcp', REFUSED[kind])}" in one_error_line(verified)
    assert listed.returncode == 0, listed.stderr
    verdicts = {row["name"]: row["verified"] for row in json.loads(listed.stdout)["generations"]}
    assert verdicts == {"step-00000004": True, EARLIER: True, FINAL: False}
    assert reported.returncode == 0, reported.stderr


@pytest.mark.parametrize("kind, content, reason", [
    ("truncated", lambda real: real[: len(real) // 2], "not a readable DCP index"),
    ("unknown protocol", lambda real: b"\x80\xff" + real[2:], "not a readable DCP index"),
    ("declared 2**62 bytes", lambda real: b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"x.",
     "not a readable DCP index"),
    ("nesting bomb", lambda real: b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b".", "holds a list"),
])
def test_a_malformed_metadata_is_one_line_and_65(trained, tmp_path, kind, content, reason):
    """verify uses the same check resume does (no torch import: 0.3 s each)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    index = generation(run) / ".metadata"
    index.write_bytes(content(index.read_bytes()))
    fix_manifest(generation(run))
    result = run_cli("verify", generation(run))
    assert result.returncode == 65 and reason in one_error_line(result)
    assert index.exists()


def test_a_huge_metadata_is_refused_before_it_is_read(trained, tmp_path):
    """The manifest's size of `.metadata` is checked before any byte is hashed (a sparse 300
    MB file; reading it would take seconds). Resume says the same. ~3 s."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    index = generation(run) / ".metadata"
    with open(index, "r+b") as handle:
        handle.truncate(300 << 20)
    manifest = json.loads((generation(run) / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": 300 << 20, "blake3": "0" * 64}
    (generation(run) / "manifest.json").write_text(json.dumps(manifest))
    verified = run_cli("verify", generation(run))
    assert verified.returncode == 65 and "more than any DCP index" in one_error_line(verified)
    resumed = train(run, *TOY, *LONGER, "--resume", expect=65)
    assert "more than any DCP index" in one_error_line(resumed) and index.stat().st_size == 300 << 20


def test_an_unknown_signature_algorithm_is_refused_without_a_key(trained, tmp_path):
    """A reader that cannot check a signature does not pretend to: 65, one line. ~0.3 s."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    path = generation(run) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["signature"] = {"algorithm": "hmac-md5", "hmac": "0" * 32}
    path.write_text(json.dumps(manifest))
    result = run_cli("verify", generation(run))
    assert result.returncode == 65
    assert "signature algorithm 'hmac-md5' is unknown" in one_error_line(result)


# ----------------------------------------------------------------------------- signing
KEY = "8f1c2b7d9e0a4f6b3c5d7e9f1a2b4c6d"
OTHER_KEY = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("keys")
    (folder / "key").write_text(KEY + "\n")  # a Secret's file often ends in a newline
    (folder / "other").write_text(OTHER_KEY)
    return {"key": folder / "key", "other": folder / "other"}


@pytest.fixture(scope="session")
def signed(tmp_path_factory, keys) -> tuple[Path, list]:
    """A signed toy run interrupted at step 7 and resumed, the key named by the environment
    the second time; returns the run and both processes. ~7 s."""
    output = tmp_path_factory.mktemp("signed") / "run"
    first = train(output, *TOY, "--interrupt-at-step", 7, "--signing-key-file", keys["key"], expect=75)
    second = train(output, *TOY, "--resume", env={"TRAINER_SIGNING_KEY_FILE": str(keys["key"])})
    return output, [first, second]


def test_a_signed_run_resumes_exactly_and_never_shows_its_key(signed, trained):
    run, processes = signed
    assert compare(generation(trained), generation(run)).returncode == 0
    for folder in ("checkpoints", "exports"):
        manifest = json.loads((run / folder / FINAL / "manifest.json").read_text())
        assert manifest["signature"]["algorithm"] == "hmac-sha256" and manifest["format_version"] == 3
    seen = "".join(p.stdout + p.stderr for p in processes)
    seen += "".join(p.read_text() for p in run.rglob("*") if p.is_file() and p.suffix in (".json", ".txt"))
    assert KEY not in seen and KEY.encode() not in b"".join(p.read_bytes() for p in run.rglob("*") if p.is_file())
    assert all(record["allow_unsigned"] is False for record in attempts(run))


def test_a_changed_tensor_byte_with_the_manifest_fixed_is_refused(signed, keys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(signed[0], run)
    shard = max(generation(run).glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    fix_manifest(generation(run))
    before = files_of(run)
    result = train(run, *TOY, *LONGER, "--resume", "--signing-key-file", keys["key"], expect=65)
    assert "signature does not match the signing key" in one_error_line(result)
    assert f"--from-generation {EARLIER}" in one_error_line(result) and files_of(run) == before
    verified = run_cli("verify", run, "--signing-key-file", keys["key"])
    assert verified.returncode == 65 and f"{FINAL}: manifest.json: the signature does not match" in verified.stdout


def test_a_generation_signed_with_another_key_is_refused(signed, keys, tmp_path):
    """A generation from another run (another key) copied in: 65 at resume and at verify."""
    run = tmp_path / "run"
    shutil.copytree(signed[0], run)
    result = train(run, *TOY, *LONGER, "--resume", "--signing-key-file", keys["other"], expect=65)
    assert "signature does not match the signing key" in one_error_line(result)
    verified = run_cli("list", run, "--signing-key-file", keys["other"])
    assert verified.returncode == 0 and verified.stdout.count(" NO ") >= 2


def test_an_unsigned_run_is_refused_with_a_key_until_adopted(trained, keys, tmp_path):
    """With a key, an unsigned generation is refused with the way to adopt it; --allow-unsigned
    adopts it (recorded), and what the run writes from then on is signed. ~7 s."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    refused = train(run, *TOY, *LONGER, "--resume", "--signing-key-file", keys["key"], expect=65)
    assert "not signed" in one_error_line(refused) and "--allow-unsigned" in one_error_line(refused)
    train(run, *TOY, *LONGER, "--resume", "--allow-unsigned", "--signing-key-file", keys["key"])
    assert attempts(run)[-1]["allow_unsigned"] is True and attempts(run)[-1]["status"] == "completed"
    assert "signature" in json.loads((generation(run, LONGER_FINAL) / "manifest.json").read_text())
    verified = run_cli("verify", generation(run, LONGER_FINAL), "--signing-key-file", keys["key"])
    assert verified.returncode == 0, verified.stdout


def test_signing_options_are_checked_before_any_work(trained, keys, tmp_path):
    missing = train(tmp_path / "fresh", *TOY, "--signing-key-file", tmp_path / "nope", expect=66)
    assert "signing key file" in one_error_line(missing) and not (tmp_path / "fresh").exists()
    short = tmp_path / "short"
    short.write_text("abc")
    too_short = train(tmp_path / "fresh", *TOY, "--signing-key-file", short, expect=2)
    assert "at least 16" in one_error_line(too_short) and "abc" not in too_short.stderr
    alone = train(tmp_path / "fresh", *TOY, "--allow-unsigned", expect=2)
    assert "--allow-unsigned goes with a signing key" in one_error_line(alone)


# ----------------------------------------------------------------------------- the same from a store
def test_store_read_paths_run_no_planted_payload(s3_bucket, keys, tmp_path):
    """In the bucket: the newest generation gets a BYTE_IO payload, the one before a `.metadata`
    payload, manifests fixed up. Restore on a fresh machine (download, then load), going back
    to the earlier one, verify, compare, list and report by URL: none runs a payload; the
    refusals are 65, verify's with resume's line. With a key, the unsigned generation is refused before it is downloaded.
    One store run shared by every assertion. ~35 s."""
    url, env, marker = f"{s3_bucket.url}/run", s3_bucket.env(), tmp_path / "MARKER"
    train(url, *TOY, "--local-tier", tmp_path / "tier-a", env=env)
    client = s3_bucket.client()
    for name, kind in ((FINAL, "byte-io"), (EARLIER, "metadata")):
        local, prefix = tmp_path / "copy" / name, f"run/checkpoints/{name}/"
        local.mkdir(parents=True)
        for key in s3_bucket.keys(prefix):
            (local / key[len(prefix):]).write_bytes(client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
        PLANTS[kind](local, marker)
        for file in sorted(local.iterdir(), key=lambda p: p.name == "manifest.json"):  # the manifest last
            client.put_object(Bucket=s3_bucket.name, Key=prefix + file.name, Body=file.read_bytes())
    stored = s3_bucket.keys("run/checkpoints/")

    newest = train(url, *TOY, *LONGER, "--resume", "--local-tier", tmp_path / "tier-b", env=env, expect=65)
    assert one_error_line(newest).endswith(refusal(FINAL, "__9_0.distcp", REFUSED["byte-io"]))
    earlier = train(url, *TOY, "--from-generation", EARLIER, "--local-tier", tmp_path / "tier-c", env=env,
                    expect=65)
    assert ".metadata names posix.system" in one_error_line(earlier)
    verified = run_cli("verify", url, env=env)
    assert verified.returncode == 65 and f"{EARLIER}: .metadata: names posix.system" in verified.stdout
    assert f"{FINAL}: {refusal(FINAL, '__9_0.distcp', REFUSED['byte-io'])}" in verified.stdout  # same as resume
    for name in (FINAL, EARLIER):
        compared = run_cli(REPO / "compare.py", generation(tmp_path / "tier-a", name), f"{url}/checkpoints/{name}",
                           env=env)
        assert compared.returncode == 65 and "posix.system" in one_error_line(compared)
    assert run_cli("list", url, env=env).returncode == 0
    assert run_cli("report", url, env=env).returncode == 0
    unsigned = train(url, *TOY, *LONGER, "--resume", "--signing-key-file", keys["key"], "--local-tier",
                     tmp_path / "tier-d", env=env, expect=65)
    assert "not signed" in one_error_line(unsigned) and not (tmp_path / "tier-d" / "checkpoints" / FINAL).exists()
    assert not marker.exists()
    assert s3_bucket.keys("run/checkpoints/") == stored  # nothing deleted


# ----------------------------------------------------------------------------- the writer
class OwnClass:
    """A workload's own class, as a careless `state_dict()` might return it."""


def test_the_writer_refuses_a_value_only_code_could_load(tmp_path):
    """Refused at the save (65, naming the key and the class), not at the resume hours later;
    plain values and tensors are written. In process, ~0.1 s."""
    from trainer.checkpoint.snapshot import write_snapshot
    from trainer.errors import UnloadableState

    written = write_snapshot({"w": torch.ones(2), "lr": 0.1, "betas": (0.9, 0.99), "name": "x"}, tmp_path / "ok")
    assert written
    with pytest.raises(UnloadableState, match=r"test_untrusted.OwnClass at workload.extra.state"):
        write_snapshot({"w": torch.ones(2), "workload": {"extra": {"state": OwnClass()}}}, tmp_path / "refused")
