"""The bundle's three commands, run for real: the pinned `polyaxon` CLI against Polyaxon's own
server (`haupt sandbox`, one per pytest worker) and the project's local agent, which executes
the queued runs as processes on this machine (trainer/integrations/polyaxon/local_agent.py).

    polyaxon run -f polyaxonfiles/polyaxonfile.yaml -u -P interrupt_at_step=27
    polyaxon ops restart -uid U --copy
    polyaxon ops resume -uid U -f presets/resume.yaml

with the sandbox's artifacts store on a host path and on the SeaweedFS test server (a bucket),
the go-back preset of docs/polyaxon.md (its drift presets: rendered in test_polyaxon_bundle.py), and the final status of a run under
each executor kind (process sidecar, Kubernetes-like, offline in test_tracking.py).

Cost (2 shared cores): about 8 s per sandbox start (one per worker, one more with a bucket store)
and 8-14 s per trained run (the job's start, the install of requirements.txt that finds
everything installed, 64 tiny steps).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.cli import REPO, run_cli
from support.limits import scaled
from support.runs import FINAL
from trainer.integrations.polyaxon import internals
from trainer.integrations.polyaxon.sandbox import Sandbox, haupt_binary, run_uuid_of
from trainer.run.fingerprint import source_digest

# Every test here runs on one pytest worker (`--dist loadgroup`): the servers below start once
# (about 25 s of CPU each), not once per worker that happens to draw one of these tests.
pytestmark = pytest.mark.xdist_group("polyaxon-sandbox")

DONE = {"succeeded", "failed", "stopped"}
RUNS = "training-recovery"
UPLOAD_IGNORE = shutil.ignore_patterns(".git", ".venv*", "outputs*", "__pycache__", ".pytest_cache", "*.pyc")
EDIT = "\n# A template user's edit: the upload, not the image's copy, is what runs.\n"
NO_INSTALL = ("-P", "install_requirements=false")
"""The jobs of every test but the volume store's (which runs the default: requirements.txt
installed at start, a no-op here of about 3 CPU-s a job) start training at once, as on a baked
image (presets/baked-image.yaml)."""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """One Polyaxon server for this module's worker, its artifacts store a host path; stopped
    once the module's tests are done (idle, it still spends about 1 CPU-s a minute: the rest of
    a session's would be about as much as its start)."""
    server = Sandbox(tmp_path_factory.mktemp("plx"), haupt_binary())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bucket_sandbox(tmp_path_factory, s3_server):
    """A second server whose artifacts store is a bucket on the worker's SeaweedFS server."""
    bucket = s3_server.create_bucket()
    store = {"name": "s3-store", "kind": "s3", "schema": {"bucket": f"s3://{bucket}"}}
    server = Sandbox(tmp_path_factory.mktemp("plx-s3"), haupt_binary(), store=store, environment=s3_server.env())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def upload(tmp_path_factory) -> Path:
    """The repository as a template user has it, with an edit to the trainer's code."""
    tree = tmp_path_factory.mktemp("upload") / "training-recovery"
    shutil.copytree(REPO, tree, ignore=UPLOAD_IGNORE, symlinks=True)
    example = tree / "trainer" / "workload" / "example.py"
    example.write_text(example.read_text() + EDIT)
    return tree


class Project:
    """One test's project on a sandbox: its own CLI HOME and its own agent."""

    def __init__(self, sandbox: Sandbox, folder: Path, name: str, **agent):
        self.sandbox, self.folder, self.name = sandbox, folder, name
        self.home = folder / "home"
        assert self.cli("project", "create", "--name", name).returncode == 0
        self.agent = sandbox.agent(folder / "agent", name, **agent)

    def cli(self, *args: str, cwd: Path = REPO):
        return self.sandbox.cli(self.home, *args, cwd=cwd)

    def submit(self, *args: str, cwd: Path = REPO) -> str:
        """A `polyaxon run`/`ops` command that makes or resumes a run; the run's uuid."""
        result = self.cli(*args, cwd=cwd)
        assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return run_uuid_of(result)

    def finish(self, run_uuid: str, expect: str, previous_records: int | None = None) -> dict:
        """Wait until the agent is done with the run and its status is `expect`; the agent's record."""
        status = self.sandbox.wait_for_status(self.name, run_uuid, DONE)
        records = self.wait_for_record(run_uuid, previous_records)
        log = self.agent.log(run_uuid)
        assert status == expect, f"run {run_uuid} is {status}, expected {expect}\n{records[-1]}\n{log[-4000:]}"
        return records[-1]

    def wait_for_record(self, run_uuid: str, previous: int | None) -> list[dict]:
        import time

        deadline = time.monotonic() + scaled(600)
        while time.monotonic() < deadline:
            records = [r for r in self.agent.records() if r.get("run") == run_uuid and "sidecar_copy" not in r]
            if len(records) > (previous or 0):
                return records
            time.sleep(0.3)
        raise TimeoutError(f"the agent recorded nothing for run {run_uuid}")

    def records_of(self, run_uuid: str) -> int:
        return len([r for r in self.agent.records() if r.get("run") == run_uuid and "sidecar_copy" not in r])

    def close(self) -> None:
        self.agent.stop()


@pytest.fixture
def project(sandbox, tmp_path, request):
    made = []

    def make(store_sandbox: Sandbox | None = None, **agent) -> Project:
        name = f"p{len(made)}-{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]}"
        made.append(Project(store_sandbox or sandbox, tmp_path / name, name, **agent))
        return made[-1]

    yield make
    for one in made:
        one.close()


def tree_digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def attempts_in(run_directory: Path) -> list[dict]:
    return [json.loads((f / "attempt.json").read_text()) for f in sorted((run_directory / "attempts").iterdir())]


def same_as_baseline(baseline: Path, final: Path | str, env: dict | None = None) -> None:
    result = run_cli(REPO / "compare.py", baseline / "checkpoints" / FINAL, final, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


# ------------------------------------------------------------------------------- (a) (b) (e): volume store
def test_upload_copy_and_resume_on_a_volume_store_match_the_baseline(project, sandbox, upload, baseline, tmp_path):
    """(a) `run -u` runs the uploaded code and stops at 27 (75 → stopped), `ops resume -f
    presets/resume.yaml` finishes it equal to the baseline; (b) `ops restart --copy` seeds the
    copy from U's newest generation (not from scratch), with a late sidecar sync of the
    copy's context landing beside it, and never writes U's run directory; (d) going back with
    presets/from-generation.yaml. Four trained jobs."""
    plx = project(sidecar_delay_s=4.0)
    store = sandbox.artifacts / RUNS
    u = plx.submit("run", "-p", plx.name, "-f", "polyaxonfiles/polyaxonfile.yaml", "-u",
                   "-P", "interrupt_at_step=27", cwd=upload)
    record = plx.finish(u, "stopped")
    assert record["exit"] == 75 and record["posted"] is None  # the trainer posted `stopped` itself
    (first,) = attempts_in(store / u)
    assert first["fingerprint"]["source"] == source_digest(upload / "trainer") != source_digest(REPO / "trainer")
    assert first["polyaxon"]["run_uuid"] == u and first["polyaxon"]["cloning"] is None
    readable_as_stopped(sandbox, plx.name, u)
    original = tree_digest(store / u)

    # (b) the README's copy command: a new run continuing U's newest generation, step-00000024.
    runs_before = plx.records_of(u)
    c = next(i for i in [plx.submit("ops", "restart", "-p", plx.name, "-uid", u, "--copy")] if i != u)
    plx.finish(c, "stopped")  # the copy takes U's first spec: interrupt_at_step 27 again (docs: note)
    (copied,) = attempts_in(store / c)
    assert copied["restored"]["name"] == "step-00000024", "the copy trained from scratch"
    u_manifest = (store / u / "checkpoints" / "step-00000024" / "manifest.json").read_bytes()
    assert copied["polyaxon"]["copied_from"] == {"run": u, "generation": "step-00000024",
                                                 "manifest_sha256": hashlib.sha256(u_manifest).hexdigest()}
    assert copied["polyaxon"]["cloning"] == "copy" and copied["polyaxon"]["original_uuid"] == u
    # The late sidecar sync put the copy's context (Polyaxon's copy of U's folder) under <store>/<c>/,
    # beside the run directory, which holds only what the copy's trainer wrote.
    assert any(r.get("sidecar_copy") for r in plx.agent.records() if r.get("run") == c)
    assert (sandbox.artifacts / c).is_dir()
    assert sorted(p.name for p in (store / c / "checkpoints").iterdir()) == ["step-00000024"]
    assert tree_digest(store / u) == original, "the copy wrote the original's run directory"
    assert plx.records_of(u) == runs_before
    readable_as_copy(sandbox, plx.name, c, u, "step-00000024", copied["polyaxon"]["copied_from"]["manifest_sha256"])

    # (The copy continuing to the baseline with presets/resume.yaml: the bucket-store test.)

    # (a) the original, resumed in place: the baseline too, its edit still the source.
    assert plx.submit("ops", "resume", "-p", plx.name, "-uid", u, "-f", "presets/resume.yaml") == u
    plx.finish(u, "succeeded", previous_records=runs_before)
    resumed = attempts_in(store / u)[-1]
    assert resumed["restored"]["name"] == "step-00000024" and resumed["polyaxon"]["cloning"] == "resume"
    assert "--interrupt-at-step=27" not in resumed["argv"]  # the preset's params applied, no --recompile
    same_as_baseline(baseline, store / u / "checkpoints" / FINAL)
    readable_as_resumed(sandbox, plx.name, u)

    # (d) go back: a copy of presets/from-generation.yaml naming a generation retention kept.
    back = tmp_path / "from-generation.yaml"
    back.write_text((REPO / "presets" / "from-generation.yaml").read_text().replace("step-00000016", "step-00000048"))
    plx.submit("ops", "resume", "-p", plx.name, "-uid", u, "-f", "polyaxonfiles/polyaxonfile.yaml", "-f", str(back),
               "--recompile", cwd=upload)
    plx.finish(u, "succeeded", previous_records=runs_before + 1)
    assert attempts_in(store / u)[-1]["restored"]["name"] == "step-00000048"
    same_as_baseline(baseline, store / u / "checkpoints" / FINAL)

    # (d) a drift refused, then accepted with presets/allow-drift-torch.yaml: rendered by
    # test_polyaxon_bundle.py (the trainer's side: test_fingerprint_and_attempts.py); a status the trainer posts on
    # an exit that is not 75: test_statuses_under_a_process_sidecar_are_the_trainers.


# ------------------------------------------------------------------------------- (c): a bucket store
def test_upload_copy_and_resume_with_a_bucket_artifacts_store(project, bucket_sandbox, baseline, s3_server):
    """(c) The same commands with the sandbox's artifacts store in a bucket: generations go
    straight to `s3://BUCKET/training-recovery/<uuid>` (local tier, uploads, lease), and the
    copy is seeded by a copy inside the bucket."""
    plx = project(bucket_sandbox, sidecar_delay_s=4.0)
    bucket = bucket_sandbox.store["schema"]["bucket"]
    env = s3_server.env()
    u = plx.submit("run", "-p", plx.name, "-f", "polyaxonfiles/polyaxonfile.yaml", "-u", "-P", "interrupt_at_step=27",
                   *NO_INSTALL)
    plx.finish(u, "stopped")
    client = s3_server.client()
    name = bucket.removeprefix("s3://")

    def objects(prefix: str) -> dict[str, str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=name, Prefix=prefix)
        return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}

    original = objects(f"{RUNS}/{u}/")
    assert f"{RUNS}/{u}/checkpoints/step-00000024/manifest.json" in original
    c = plx.submit("ops", "restart", "-p", plx.name, "-uid", u, "--copy")
    plx.finish(c, "stopped")
    copied = objects(f"{RUNS}/{c}/")
    assert f"{RUNS}/{c}/checkpoints/step-00000024/manifest.json" in copied
    assert objects(f"{RUNS}/{u}/") == original, "the copy wrote the original's run directory"
    assert plx.submit("ops", "resume", "-p", plx.name, "-uid", c, "-f", "presets/resume.yaml") == c
    plx.finish(c, "succeeded", previous_records=1)
    same_as_baseline(baseline, f"{bucket}/{RUNS}/{c}/checkpoints/{FINAL}", env)
    (seeded, resumed) = attempts_in_bucket(client, name, f"{RUNS}/{c}/attempts/")
    assert seeded["polyaxon"]["copied_from"]["generation"] == "step-00000024"
    assert resumed["polyaxon"]["copied_from"] is None and resumed["restored"]["name"] == "step-00000024"
    assert objects(f"{RUNS}/{u}/") == original
    # (U resumed in place to the baseline: the volume-store test; the store path is the same code.)


# ------------------------------------------------------------------------------- your own script
def test_your_own_script_run_copied_and_resumed_by_the_bundle_matches_its_baseline(project, sandbox, upload, tmp_path):
    """presets/own-script.yaml: the bundle runs examples/own_loop.py (a plain loop calling
    trainer.recovery) with the job's run directory and recovery options: `run -u` stops at 13
    (75 → stopped, the epoch-1 generation kept), `ops restart --copy` seeds the copy from it,
    `ops resume -f presets/resume.yaml` finishes the original equal to the script run alone.
    Three trained jobs of 36 tiny steps."""
    baseline = tmp_path / "baseline"
    assert run_cli(REPO / "examples" / "own_loop.py", baseline, "--epochs", "3").returncode == 0
    plx = project()
    store = sandbox.artifacts / RUNS
    own = ("-f", "polyaxonfiles/polyaxonfile.yaml", "-f", "presets/own-script.yaml")
    u = plx.submit("run", "-p", plx.name, *own, "-u", "-P", "interrupt_at_step=13", "-P", "script_args=--epochs 3",
                   *NO_INSTALL, cwd=upload)
    record = plx.finish(u, "stopped")
    assert record["exit"] == 75
    (first,) = attempts_in(store / u)
    assert first["polyaxon"]["run_uuid"] == u and first["last_step"] == 13
    assert first["argv"][0].endswith("own_loop.py")  # the script ran, not the trainer's loop
    assert sorted(p.name for p in (store / u / "checkpoints").iterdir())[-1] == "step-00000012"

    c = next(i for i in [plx.submit("ops", "restart", "-p", plx.name, "-uid", u, "--copy")] if i != u)
    plx.finish(c, "stopped")  # the copy takes U's first params: interrupt_at_step 13 again
    (copied,) = attempts_in(store / c)
    assert copied["restored"]["name"] == "step-00000012" and copied["polyaxon"]["copied_from"]["run"] == u

    runs_before = plx.records_of(u)
    assert plx.submit("ops", "resume", "-p", plx.name, "-uid", u, "-f", "presets/resume.yaml") == u
    plx.finish(u, "succeeded", previous_records=runs_before)
    resumed = attempts_in(store / u)[-1]
    assert resumed["restored"]["name"] == "step-00000012" and resumed["status"] == "completed"
    result = run_cli(REPO / "compare.py", baseline / "checkpoints" / "step-00000036",
                     store / u / "checkpoints" / "step-00000036")
    assert result.returncode == 0, result.stdout[-3000:]


# What a Polyaxon user sees of recovery on the run's page (name, status message, outputs, images,
# lineage), read from the server's API and the run's events in the artifacts store.
def timeline_images(sandbox: Sandbox, run_uuid: str, name: str = "recovery-timeline") -> list[str]:
    events = sandbox.artifacts / run_uuid / "events" / "image" / f"{name}.plx"
    return [json.loads(line.split("|", 2)[2])["path"] for line in events.read_text().splitlines()[1:]]


def conditions(sandbox: Sandbox, project: str, run_uuid: str) -> list[dict]:
    return sandbox.get(f"/api/v1/default/{project}/runs/{run_uuid}/statuses")["status_conditions"]


def readable_as_stopped(sandbox: Sandbox, project: str, u: str) -> None:
    run = sandbox.run(project, u)
    assert run["name"] == "original-1-attempt", run["name"]
    assert "interrupt_at_step=27" in run["outputs"]["first_params"], run["outputs"]
    assert (run["outputs"]["goodput_steps_pct"], run["outputs"]["newest_generation"]) == (88.9, "step-00000024")
    message = conditions(sandbox, project, u)[-1]["message"]
    assert "resumable from newest generation step-00000024" in message, message
    assert f"polyaxon ops resume -uid {u} -f presets/resume.yaml" in message, message
    assert timeline_images(sandbox, u) == [f"assets/image/recovery-timeline_{step}.png" for step in (0, 27)]


def readable_as_copy(sandbox: Sandbox, project: str, c: str, u: str, seed: str, digest: str) -> None:
    run = sandbox.run(project, c)
    assert run["name"] == f"copy-of-{u}-1-attempt", run["name"]
    assert (run["outputs"]["copied_from"], run["outputs"]["newest_generation"]) == (f"run {u} {seed}", seed)
    reference = sandbox.lineage(project, c)[f"generation-{seed}"]
    assert reference["summary"]["hash"] == digest and reference["summary"]["copied_from"] == u
    # the original's picture, copied with its events, is not overwritten by the copy's own
    assert timeline_images(sandbox, c) == [f"assets/image/recovery-timeline_{step}.png" for step in (0, 27)]
    assert timeline_images(sandbox, c, "recovery-timeline-of-this-copy") == \
        [f"assets/image/recovery-timeline-of-this-copy_{step}.png" for step in (0, 27)]


def readable_as_resumed(sandbox: Sandbox, project: str, u: str) -> None:
    run = sandbox.run(project, u)
    assert run["name"] == "resumed-2-attempts" and conditions(sandbox, project, u)[-1]["type"] == "succeeded"
    assert "interrupt_at_step=27" in run["outputs"]["first_params"], run["outputs"]  # after `ops resume` too
    assert run["outputs"]["goodput_steps_pct"] == round(100 * 64 / 67, 1)
    images = timeline_images(sandbox, u)
    assert images == [f"assets/image/recovery-timeline_{step}.png" for step in (0, 27, 0, 64)]
    lineage = sandbox.lineage(project, u)
    # The run's page opens its image widget on the lowest step the lineage summarises (issue #43:
    # it showed attempt 1's picture): step 0, which holds the whole run's timeline.
    assert lineage["recovery-timeline"]["summary"]["step"]["min"] == 0, lineage["recovery-timeline"]
    shown, whole, first = ((sandbox.artifacts / u / image).read_bytes() for image in (images[0], images[3], images[1]))
    assert shown == whole != first
    kept = {f"generation-{g.name}" for g in (sandbox.artifacts / RUNS / u / "checkpoints").glob("step-*")}
    # every creation and every deletion went through (retried on the spurious 405): one reference
    # per kept generation, none to a deleted one.
    assert {name for name in lineage if name.startswith("generation-")} == kept, (sorted(lineage), kept)


def attempts_in_bucket(client, bucket: str, prefix: str) -> list[dict]:
    keys = sorted(o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                  for o in page.get("Contents", []) if o["Key"].endswith("/attempt.json"))
    return [json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read()) for key in keys]


# ------------------------------------------------------------------------------- (e) (f): statuses
def test_statuses_under_a_kubernetes_like_executor_are_the_agents(project, upload):
    """No process sidecar (a Kubernetes pod): the trainer posts nothing, the run is still
    `running` when the process exits, and the agent's status follows the exit code (75 stopped,
    2 failed). (f) a pytorchjob is not executable by a process agent: it fails, saying so."""
    plx = project(executor="k8s")
    short = ["-P", "epochs=1", "-P", "interrupt_at_step=3", *NO_INSTALL]
    u = plx.submit("run", "-p", plx.name, "-f", "polyaxonfiles/polyaxonfile.yaml", "-u", *short, cwd=upload)
    usage = plx.submit("run", "-p", plx.name, "-f", "polyaxonfiles/polyaxonfile.yaml", "-u",
                       "-P", "data_parallel=fsdp", *NO_INSTALL, cwd=upload)
    job = plx.submit("run", "-p", plx.name, "-f", "polyaxonfiles/pytorchjob.yaml", "-u", cwd=upload)
    stopped = plx.finish(u, "stopped")
    assert stopped["exit"] == 75 and stopped["status_at_exit"] == "running" and stopped["posted"] == "stopped"
    failed = plx.finish(usage, "failed")
    assert failed["exit"] == 2 and failed["status_at_exit"] == "running" and failed["posted"] == "failed"
    pytorchjob = plx.finish(job, "failed")
    assert "pytorchjob" in pytorchjob["error"] and "not supported" in pytorchjob["error"]


def test_statuses_under_a_process_sidecar_are_the_trainers(project, upload):
    """With POLYAXON_HAS_PROCESS_SIDECAR (docker and process executors) traceml would log
    `succeeded` at exit whatever the code; the trainer posts the status its exit means. An
    exit before tracking starts (2: a refused option) is the agent's to record."""
    plx = project()
    nothing = plx.submit("run", "-p", plx.name, "-f", "polyaxonfiles/polyaxonfile.yaml", "-u",
                         "-P", "resume=latest", *NO_INSTALL, cwd=upload)
    usage = plx.submit("run", "-p", plx.name, "-f", "polyaxonfiles/polyaxonfile.yaml", "-u",
                       "-P", "data_parallel=fsdp", *NO_INSTALL, cwd=upload)
    record = plx.finish(nothing, "failed")
    assert record["exit"] == 66 and record["status_at_exit"] == "failed" and record["posted"] is None
    record = plx.finish(usage, "failed")
    assert record["exit"] == 2 and record["posted"] == "failed"


def test_a_run_whose_approval_met_the_spurious_405_is_approved_again(project, upload):
    """`run -u` creates the run, uploads, then approves it: a spurious 405 on that last call
    (seen once in CI) left the run pending upload forever. `Sandbox.cli` approves it again with
    `ops approve`; here the run is left unapproved on purpose and the client's report of the 405
    is handed to that path."""
    plx = project()
    created = plx.cli("run", "-p", plx.name, "-f", "polyaxonfiles/polyaxonfile.yaml", "-u", "--approved=false",
                      "-P", "data_parallel=fsdp", *NO_INSTALL, cwd=upload)
    run_uuid = run_uuid_of(created)
    assert plx.sandbox.run(plx.name, run_uuid)["pending"] == "approval"
    report = (f"Could not approve run `{run_uuid}`.\nHTTP request: POST \n"
              f"/api/v1/default/{plx.name}/runs/{run_uuid}/approve\nReason: Method Not Allowed\nStatus: 405.")
    refused = subprocess.CompletedProcess(created.args, 1, created.stdout, report)
    approved = plx.sandbox.approve_after_upload(plx.home, refused, upload, 120)
    assert approved.returncode == 0 and run_uuid_of(approved) == run_uuid, approved.stdout + approved.stderr
    record = plx.finish(run_uuid, "failed")  # approved, so the agent ran it: a usage error, exit 2
    assert record["exit"] == 2


# ------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("private", internals.PRIVATE_NAMES, ids=lambda p: f"{p.module}.{p.name}")
def test_polyaxon_internal_resolves(private):
    assert private.resolve() is not None


def test_a_moved_polyaxon_internal_fails_with_one_line_naming_it():
    from trainer.compat import PrivateApiMoved

    moved = internals.PolyaxonName("polyaxon._local_process.executor", "NoSuchExecutor", "polyaxon", "2.18.0", "a test")
    with pytest.raises(PrivateApiMoved) as raised:
        moved.resolve()
    message = str(raised.value)
    assert "NoSuchExecutor is gone" in message and "internals.py" in message and "\n" not in message


def test_a_client_that_resolved_another_run_is_refused():
    from trainer.errors import UsageError
    from trainer.integrations.polyaxon.tracked_run import require_identity

    instance = "default.p.runs." + "a" * 32
    require_identity(instance, SimpleNamespace(owner="default", project="p", run_uuid="a" * 32))
    with pytest.raises(UsageError) as raised:  # a CLI cache in ~/.polyaxon naming the original run
        require_identity(instance, SimpleNamespace(owner="default", project="p", run_uuid="b" * 32))
    assert "\n" not in str(raised.value) and "~/.polyaxon" in str(raised.value)


def test_only_a_405_that_never_reached_a_view_is_retried():
    from trainer.integrations.polyaxon.local_agent import status_of_exit
    from trainer.integrations.polyaxon.retries import call, one_line, spurious_405

    django = SimpleNamespace(status=405, body="<h1>Method Not Allowed</h1>")
    view = SimpleNamespace(status=405, body='{"detail": "Method \\"PUT\\" not allowed."}')
    assert spurious_405(django) and not spurious_405(view) and not spurious_405(SimpleNamespace(status=500))
    answers = iter([django, django, "ok"])

    def flaky():
        answer = next(answers)
        if isinstance(answer, SimpleNamespace):
            raise type("ApiException", (Exception,), {"status": answer.status, "body": answer.body})()
        return answer

    assert call(flaky) == "ok"
    # the client's ApiException prints its headers and body; a warning takes one line of it
    api = type("ApiException", (Exception,), {"status": 405, "reason": "Method Not Allowed"})
    assert one_line(api("(405)\nReason: Method Not Allowed\nHTTP response headers: ...")) == "HTTP 405 Method Not Allowed"
    assert one_line(OSError("disk\nfull")) == "OSError: disk"
    assert [status_of_exit(code) for code in (0, 75, 2, 65, 74, 1)] == \
        ["succeeded", "stopped", "failed", "failed", "failed", "failed"]


def test_a_retried_calls_client_noise_is_dropped_on_its_thread_only(caplog):
    """The client logs eight lines for every failed try before raising; a retried 405 that then
    succeeds shows none of them. The client's background threads still log theirs."""
    import logging
    import threading

    from trainer.integrations.polyaxon.retries import CLIENT_LOGGER, call

    client_log = logging.getLogger(CLIENT_LOGGER)
    tries = iter([405, 405, "ok"])

    def flaky():
        answer = next(tries)
        background = threading.Thread(target=client_log.error, args=("from the client's event thread",))
        background.start()
        background.join()
        client_log.error("API Client failed at the function `flaky`")
        if answer == 405:
            raise type("ApiException", (Exception,), {"status": 405, "body": "<h1>Method Not Allowed</h1>"})()
        return answer

    with caplog.at_level(logging.ERROR, logger=CLIENT_LOGGER):
        assert call(flaky) == "ok"
        client_log.error("after the call")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["from the client's event thread"] * 3 + ["after the call"], messages
