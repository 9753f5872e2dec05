"""A generation belongs to its run (issue #30): every manifest names the run id its run
directory holds (`run.json`), so a generation copied in from another run is refused (65) even
when one key signs both runs, until an operator adopts it (`--adopt-from RUN`, recorded in
`run.json`); `ops restart --copy` seeding records its adoption the same way. `verify` applies
every check `--resume` applies (name, run, signature, structure), locally and in the object
store, with the same verdict.

Cost: two signed toy runs shared by the module (8 and 6 steps, ~3 s each), a legacy run
(~3 s), a few refused and two completed resumes (~3 s each) and, in the store test, 3 CLI
calls for each of 5 kinds of damage, one more for one of them (about 100 s in all on 2 busy
cores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.checkpoint.digest import of_bytes

from support.cli import one_error_line, run_cli, train
from support.runs import attempts

TOY = ("--workload", "tests/workloads/toy.py:ToyWorkload", "--epochs", 4)
"""2 steps an epoch: generations at steps 2, 4, 6, 8."""
KEY = "5e0d9c8b7a6f4e3d2c1b0a9f8e7d6c5b"


def run_id(run: Path) -> str:
    return json.loads((run / "run.json").read_text())["run"]


def manifest(run: Path, name: str, folder: str = "checkpoints") -> dict:
    return json.loads((run / folder / name / "manifest.json").read_text())


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("key") / "key"
    path.write_text(KEY)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, key) -> tuple[Path, Path]:
    """A: signed, interrupted after step 5 (generations 2, 4). B: another run of the same
    workload under the same key, completed (generations up to 8)."""
    folder = tmp_path_factory.mktemp("runs")
    train(folder / "A", *TOY, "--interrupt-at-step", 5, "--signing-key-file", key, expect=75)
    train(folder / "B", *TOY, "--signing-key-file", key)
    return folder / "A", folder / "B"


def with_foreign(runs, tmp_path: Path) -> Path:
    """A copy of A holding B's step-00000006 (`cp -a B/checkpoints/step-00000006 A/checkpoints/`)."""
    a, b = runs
    run = tmp_path / "A"
    shutil.copytree(a, run)
    shutil.copytree(b / "checkpoints" / "step-00000006", run / "checkpoints" / "step-00000006")
    return run


def test_every_manifest_names_the_run_and_copies_keep_it(runs):
    a, b = runs
    assert run_id(a) != run_id(b)
    assert {manifest(a, name)["run"] for name in ("step-00000002", "step-00000004")} == {run_id(a)}
    assert manifest(b, "step-00000008", "exports")["run"] == run_id(b)


def test_another_runs_generation_is_refused_under_the_same_key_until_adopted(runs, key, tmp_path):
    a, b = runs
    run = with_foreign(runs, tmp_path)
    refused = train(run, *TOY, "--resume", "--signing-key-file", key, expect=65)
    line = one_error_line(refused)
    assert f"step-00000006 is another run's: manifest.json: belongs to run {run_id(b)}, not to this run " \
           f"({run_id(a)})" in line and f"--adopt-from {run_id(b)}" in line
    assert f"--from-generation step-00000004" in line
    verified = run_cli("verify", run, "--signing-key-file", key)
    assert verified.returncode == 65 and f"step-00000006: manifest.json: belongs to run {run_id(b)}" in verified.stdout
    chosen = train(run, *TOY, "--from-generation", "step-00000006", "--signing-key-file", key, expect=65)
    assert f"belongs to run {run_id(b)}" in one_error_line(chosen)

    # Removing run.json lets nothing in: the directory gets a new id, and B's generation stays foreign.
    kept = (run / "run.json").read_bytes()
    (run / "run.json").unlink()
    without = train(run, *TOY, "--resume", "--signing-key-file", key, expect=65)
    assert f"belongs to run {run_id(b)}" in one_error_line(without) and "had no run.json" in without.stdout
    (run / "run.json").write_bytes(kept)

    adopted = train(run, *TOY, "--resume", "--adopt-from", run_id(b), "--signing-key-file", key)
    assert "restored step-00000006" in adopted.stdout
    identity = json.loads((run / "run.json").read_text())
    assert identity["run"] == run_id(a)
    assert identity["adopted"] == [{"run": run_id(b), "attempt": attempts(run)[-1]["id"],
                                    "how": "--adopt-from"}]
    assert manifest(run, "step-00000008")["run"] == run_id(a)  # what it writes from then on is its own
    assert run_cli("verify", run, "--signing-key-file", key).returncode == 0  # the adoption is recorded


def test_a_generation_written_before_run_ids_is_restored_as_the_runs_own(tmp_path):
    """A run directory of an earlier trainer: no run.json, manifests without a run id (unsigned)."""
    run = tmp_path / "legacy"
    train(run, *TOY, "--interrupt-at-step", 3, expect=75)
    (run / "run.json").unlink()
    path = run / "checkpoints" / "step-00000002" / "manifest.json"
    old = json.loads(path.read_text())
    del old["run"]
    path.write_text(json.dumps(old))
    resumed = train(run, *TOY, "--resume")
    assert "restored step-00000002" in resumed.stdout
    assert "step-00000002 names no run (written before run ids): restored as this run's own" in resumed.stdout
    assert manifest(run, "step-00000008")["run"] == run_id(run)


def test_ops_restart_copy_seeding_records_that_it_adopted_the_originals_run(runs, key, tmp_path):
    """The volume store's seeding (copy_seed.py), then the copy's trainer resumes from it."""
    from trainer.integrations.polyaxon.copy_seed import seed_on_volume
    from trainer.integrations.polyaxon.placement import run_directory_in

    a, _ = runs
    original, copy = run_directory_in(tmp_path, "u1"), run_directory_in(tmp_path, "c1")
    shutil.copytree(a, original)
    seeded = seed_on_volume(copy, "u1")
    assert seeded.generation == "step-00000004"
    resumed = train(copy, *TOY, "--resume", "--signing-key-file", key)
    assert "restored step-00000004" in resumed.stdout
    identity = json.loads((copy / "run.json").read_text())
    assert identity["run"] != run_id(a)
    assert identity["adopted"] == [{"run": run_id(a), "attempt": "seeding",
                                    "how": "polyaxon ops restart --copy of run u1"}]


# ----------------------------------------------------------------------------- verify == resume, local == store
def renamed(run: Path, runs) -> str:
    shutil.copytree(run / "checkpoints" / "step-00000004", run / "checkpoints" / "step-00000006")
    return "step-00000006"


def foreign(run: Path, runs) -> str:
    shutil.copytree(runs[1] / "checkpoints" / "step-00000006", run / "checkpoints" / "step-00000006")
    return "step-00000006"


def resigned_elsewhere(run: Path, runs) -> str:
    """A byte of a shard changed and the manifest fixed up: only the signature notices."""
    directory = run / "checkpoints" / "step-00000004"
    shard = max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    path = directory / "manifest.json"
    fixed = json.loads(path.read_text())
    fixed["files"][shard.name] = of_bytes(bytes(data))
    path.write_text(json.dumps(fixed))
    return "step-00000004"


def flipped(run: Path, runs) -> str:
    shard = max((run / "checkpoints" / "step-00000004").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    return "step-00000004"


def unlisted(run: Path, runs) -> str:
    (run / "checkpoints" / "step-00000004" / "__7_0.distcp").write_bytes(b"not listed")
    return "step-00000004"


DAMAGE = {"name": renamed, "run": foreign, "signature": resigned_elsewhere, "structure": flipped,
          "unlisted": unlisted}


def damaged_line(output: str, name: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith("DAMAGED") and f"/{name}: " in line]
    return line.split(f"/{name}: ", 1)[1]


def upload(run: Path, bucket, prefix: str) -> None:
    client = bucket.client()
    files = sorted((p for p in run.rglob("*") if p.is_file()), key=lambda p: p.name == "manifest.json")
    for path in files:  # every manifest last, as a commit would
        client.put_object(Bucket=bucket.name, Key=f"{prefix}/{path.relative_to(run)}", Body=path.read_bytes())


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_verify_and_resume_give_the_same_verdict_locally_and_in_the_store(runs, key, tmp_path, s3_bucket, kind):
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    name = DAMAGE[kind](run, runs)
    upload(run, s3_bucket, kind)
    local = run_cli("verify", run, "--signing-key-file", key)
    stored = run_cli("verify", f"{s3_bucket.url}/{kind}", "--signing-key-file", key, env=s3_bucket.env())
    assert local.returncode == stored.returncode == 65, local.stdout + local.stderr + stored.stdout + stored.stderr
    problem = damaged_line(local.stdout, name)
    assert damaged_line(stored.stdout, name) == problem
    resumed = train(run, *TOY, "--resume", "--signing-key-file", key, expect=65)
    assert problem in one_error_line(resumed)
    if kind != "run":
        return  # restoring from the store shares its check with verify (ObjectSection.trusted); once is enough
    from_store = train(f"{s3_bucket.url}/{kind}", *TOY, "--resume", "--signing-key-file", key, "--local-tier",
                       tmp_path / "tier", env=s3_bucket.env(), expect=65)
    assert problem in one_error_line(from_store)
