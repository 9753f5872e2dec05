"""What the cluster receives: every polyaxonfile × preset rendered through Polyaxon's own agent
path (`make_and_convert`: compile, resolve, k8s converter), the documented commands parsed by the
CLI's own click commands and preset reader, the image recipe, and the preemption save measured
against the grace Kubernetes gives the pod.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from support.cli import REPO, run_cli, start
from support.limits import scaled
from support.polyaxon import JOB_FILE, POLYAXONFILES, PRESETS, check_all, preset_targets, trainer_argv
from support.runs import attempts
from trainer.cli import train_parser
from trainer.errors import UsageError
from trainer.location import InStore, OnDisk, parse_store_url

PYTORCHJOB = REPO / "polyaxonfiles" / "pytorchjob.yaml"
PRESET = {p.stem: p for p in PRESETS}
PERMANENT = [2, 65, 66, 70, 73]
"""Exits a retry cannot fix: usage, fingerprint/damage, nothing to resume, crash loop, held."""
KUBERNETES_DEFAULT_GRACE_S = 30
"""terminationGracePeriodSeconds when the pod spec does not set it; Polyaxon 2.18's converter
never sets it (no such field in V1Environment, no occurrence in the package)."""
MAIN_CONTAINER = {"polyaxonfile.yaml": "polyaxon-main", "pytorchjob.yaml": "pytorch"}
UUID = "0123abcd" * 4
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VOLUME_CLAIM_STORE = {"name": "store", "kind": "volume_claim",
                      "schema": {"mountPath": "/store", "volumeClaim": "store-pvc"}}
S3_STORE = {"name": "plx-s3", "kind": "s3", "schema": {"bucket": "s3://plx-artifacts"},
            "secret": {"name": "aws-creds", "items": ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]}}
HOST_PATH_STORE = {"name": "plx-host", "kind": "host_path",
                   "schema": {"mountPath": "/plx-store", "hostPath": "/mnt/plx-store"}}


def combinations() -> list[list[Path]]:
    cases = [[f] for f in POLYAXONFILES]
    cases += [[f, p] for p in PRESETS for f in preset_targets(p)]
    cases.append([JOB_FILE, PRESET["gpu"], PRESET["resume"]])
    cases += [[f, PRESET["resume"], PRESET["allow-drift-torch"]] for f in POLYAXONFILES]
    return cases


def convert(files: list[Path], params: dict | None = None, store: dict = VOLUME_CLAIM_STORE) -> dict:
    """The custom resource the agent would create for this submission (owner acme, project tr),
    with `store` as the agent's artifacts store."""
    from kubernetes.client import ApiClient
    from polyaxon import settings
    from polyaxon._k8s.executor.executor import Executor
    from polyaxon._schemas.agent import AgentConfig
    from polyaxon.polyaxonfile import check_polyaxonfile

    previous = settings.AGENT_CONFIG
    settings.AGENT_CONFIG = AgentConfig.read({"namespace": "polyaxon", "artifactsStore": store})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            operation = check_polyaxonfile(polyaxonfile=[str(f) for f in files], params=params, is_cli=False,
                                           strict_params=True, verbose=False)
            resource = Executor.make_and_convert(owner_name="acme", project_name="tr", run_uuid=UUID,
                                                 run_name="train", content=operation.to_json())
        return ApiClient().sanitize_for_serialization(resource)
    finally:
        settings.AGENT_CONFIG = previous


def pod_specs(resource: dict) -> list[dict]:
    if "batchJobSpec" in resource:
        return [resource["batchJobSpec"]["template"]["spec"]]
    replicas = resource["pytorchJobSpec"]["replicaSpecs"]
    assert all(r["restartPolicy"] == "Never" for r in replicas.values())
    return [r["template"]["spec"] for r in replicas.values()]


def assert_runs_the_upload_else_the_image(script: str, installs: bool, torch_build: str = "cpu") -> None:
    """`-u` runs the upload: the script enters the run's uploads when they exist, else the baked
    image's code, else stops with exit 2; then installs requirements.txt (or not), then trains."""
    chosen = re.search(r'if \[ -d "(?P<run>/plx-context/artifacts/[0-9a-f]+)/uploads" \]; then cd "(?P=run)/uploads";?\s*'
                       r'elif \[ -d /opt/training-recovery \]; then cd /opt/training-recovery;?\s*else .*?exit 2;? ?fi', script)
    assert chosen, script[:600]
    install = f'--extra-index-url "https://download.pytorch.org/whl/{torch_build}" -r requirements.txt'
    assert (install in script) == installs and ("pip" in script) == installs
    if installs:
        assert chosen.end() < script.index(install) < script.index("-m trainer")


# ------------------------------------------------------------------------------- converter
@pytest.mark.parametrize("files", combinations(), ids=lambda fs: "+".join(f.stem for f in fs))
def test_every_combination_renders_the_job_the_cluster_needs(files):
    resource = convert(files, {"workers": 1} if files[0] == PYTORCHJOB else None)
    main = MAIN_CONTAINER[files[0].name]
    termination = resource["termination"]
    assert termination["backoffLimit"] == 3 and termination["activeDeadlineSeconds"] == 86400
    assert termination["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": main, "operator": "In", "values": PERMANENT}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Count", "onExitCodes": {"containerName": main, "operator": "NotIn", "values": PERMANENT}},
    ]
    gpu = PRESET["gpu"] in files
    for spec in pod_specs(resource):
        assert spec["restartPolicy"] == "Never"  # what podFailurePolicy requires
        assert "terminationGracePeriodSeconds" not in spec  # so Kubernetes' default 30 s applies
        containers = {c["name"]: c for c in spec["containers"]}
        assert main in containers, f"podFailurePolicy names {main}, the pod has {sorted(containers)}"
        container = containers[main]
        baked = PRESET["baked-image"] in files
        assert container["image"] == ("training-recovery:2.13.0-cpu" if baked else "python:3.11.7-slim-bookworm")
        assert "workingDir" not in container  # the script picks the code folder
        script = " ".join(container["command"] + container["args"])
        assert_runs_the_upload_else_the_image(script, installs=not baked, torch_build="cu128" if gpu else "cpu")
        args = train_parser().parse_args(trainer_argv(script))
        assert args.tracked and args.preempt_grace_secs <= KUBERNETES_DEFAULT_GRACE_S - 10
        if PRESET["from-generation"] in files:
            assert args.from_generation == "step-00000016" and args.resume is None
        elif PRESET["resume"] in files:
            assert args.resume == "latest" and args.interrupt_at_step is None
        else:
            assert args.resume == "auto"
        if PRESET["allow-drift-torch"] in files:
            assert args.allow_drift == ["torch"]
        if gpu:
            assert args.device == "cuda" and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        # autoResume: the init container copies the run's stored outputs back before the trainer starts.
        init = {c["name"]: c for c in spec["initContainers"]}["polyaxon-init-artifacts-default"]
        assert f"cp -R /store/{UUID}/* /plx-context/artifacts/{UUID}" in init["args"][0]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["store"]["persistentVolumeClaim"]["claimName"] == "store-pvc"
        assert "artifacts-context" in volumes
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["artifacts-context"] == "/plx-context/artifacts"


def test_pytorchjob_replicas_and_outputs_are_declared():
    resource = convert([PYTORCHJOB], {"workers": 2})
    replicas = resource["pytorchJobSpec"]["replicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for polyaxonfile in POLYAXONFILES:
        outputs = {o["name"]: o["type"] for o in yaml.safe_load(polyaxonfile.read_text())["outputs"]}
        assert outputs == {"newest_generation": "str", "export_path": "str", "final_loss": "float"}


# ------------------------------------------------------------------------------- the artifacts store
STORES = {"s3": S3_STORE, "host-path": HOST_PATH_STORE}
SYNCED_CONTEXT = Path("/plx-context/artifacts")


def main_containers(resource: dict, polyaxonfile: Path) -> list[tuple[dict, dict]]:
    """(pod spec, trainer container) of the job, or of every PyTorchJob replica."""
    found = []
    for spec in pod_specs(resource):
        (container,) = [c for c in spec["containers"] if c["name"] == MAIN_CONTAINER[polyaxonfile.name]]
        found.append((spec, container))
    return found


def container_environ(container: dict, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the container starts with: literal values, and each secretKeyRef filled
    from `secrets` (as the kubelet would from the Secret); fieldRefs are left out."""
    environ = {}
    for entry in container["env"]:
        if "value" in entry:
            environ[entry["name"]] = entry["value"] or ""
        elif "secretKeyRef" in (entry.get("valueFrom") or {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            environ[entry["name"]] = (secrets or {}).get(ref["key"], f"{ref['name']}:{ref['key']}")
    return environ


def world_size(polyaxonfile: Path, workers: int) -> int:
    return (workers + 1) * yaml.safe_load(polyaxonfile.read_text())["run"]["nProcPerNode"] \
        if polyaxonfile == PYTORCHJOB else 1


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("polyaxonfile", POLYAXONFILES, ids=lambda p: p.name)
def test_every_replica_reaches_the_artifacts_store_and_finds_the_same_run_directory(polyaxonfile, store):
    """mountArtifactsStore, rendered by the agent's converter: the trainer's container of the job
    and of every PyTorchJob replica gets the store's connection, its credentials (S3) or its mount
    (host path), and a local tier outside the sidecar-synced context; the trainer's resolution,
    given exactly that environment, finds the run's outputs in the store on every pod."""
    from trainer.integrations.polyaxon.placement import place_run, under

    workers = 2
    connection = STORES[store]
    resource = convert([polyaxonfile], {"workers": workers} if polyaxonfile == PYTORCHJOB else None, connection)
    replicas = main_containers(resource, polyaxonfile)
    assert len(replicas) == (2 if polyaxonfile == PYTORCHJOB else 1)  # Master and Worker specs
    for spec, container in replicas:
        env = {e["name"]: e for e in container["env"]}
        catalog = json.loads(env["POLYAXON_CONNECTIONS_CATALOG"]["value"])
        assert [c["name"] for c in catalog["connections"]] == [connection["name"]]
        assert catalog["connections"][0]["kind"] == connection["kind"]
        assert env["POLYAXON_ARTIFACTS_STORE_NAME"]["value"] == connection["name"]
        assert env["POLYAXON_RUN_INSTANCE"]["value"] == f"acme.tr.runs.{UUID}"
        assert env["TRAINER_LOCAL_TIER"]["value"] == "/local-tier"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert mounts["local-tier"] == "/local-tier" and volumes["local-tier"] == {"name": "local-tier",
                                                                                    "emptyDir": {}}
        assert mounts["artifacts-context"] == str(SYNCED_CONTEXT)
        assert not under(Path(mounts["local-tier"]), SYNCED_CONTEXT)
        if store == "s3":
            for key in connection["secret"]["items"]:
                assert env[key]["valueFrom"] == {"secretKeyRef": {"key": key, "name": "aws-creds"}}
            assert set(mounts) == {"local-tier", "artifacts-context", "shm", "signing-key"}  # the key: optional
        else:
            assert mounts["plx-host"] == "/plx-store"
            assert volumes["plx-host"]["hostPath"] == {"path": "/mnt/plx-store"}

        placement = place_run(container_environ(container), None, world_size(polyaxonfile, workers))
        if store == "s3":
            assert str(placement.location) == f"s3://plx-artifacts/training-recovery/{UUID}"
            assert placement.location.local_tier == Path("/local-tier") / UUID
            assert placement.environment == {}  # the credentials are environment variables already
        else:
            assert placement.location == OnDisk(Path("/plx-store") / "training-recovery" / UUID)  # no local tier
        assert placement.connection == connection["name"] and placement.warning is None


def test_a_secret_mounted_as_files_reaches_s3fs_as_environment_variables(tmp_path):
    """A connection whose secret is mounted (`secret.mountPath`) gives the container files, not
    variables: the trainer exports the AWS_* ones that are not set already."""
    from trainer.integrations.polyaxon.placement import place_run

    folder = tmp_path / "aws-creds"
    store = {**S3_STORE, "schema": {"bucket": "s3://plx-artifacts/team"},
             "secret": {"name": "aws-creds", "mountPath": str(folder)}}
    (_, container), = main_containers(convert([JOB_FILE], store=store), JOB_FILE)
    assert str(folder) in [m["mountPath"] for m in container["volumeMounts"]]  # the secret's files
    assert not any(e["name"].startswith("AWS_") for e in container["env"])
    folder.mkdir()
    for name, value in (("AWS_ACCESS_KEY_ID", "id\n"), ("AWS_SECRET_ACCESS_KEY", "secret"),
                        ("AWS_ENDPOINT_URL", "http://minio:9000"), ("README", "not a variable")):
        (folder / name).write_text(value)
    environ = {**container_environ(container), "AWS_ENDPOINT_URL": "http://set-already:9000"}
    placement = place_run(environ)
    assert str(placement.location) == f"s3://plx-artifacts/team/training-recovery/{UUID}"
    assert placement.environment == {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"}


def test_without_the_store_exposed_a_managed_run_warns_once_and_keeps_the_outputs_path(tmp_path, monkeypatch,
                                                                                        caplog):
    """A polyaxonfile without mountArtifactsStore: the container gets only the store's name, so
    the trainer keeps today's outputs path and says, in one warning line, what that costs."""
    from trainer.cli import tracked_placement
    from trainer.parallel.launch import LaunchEnvironment

    doc = yaml.safe_load(JOB_FILE.read_text())
    del doc["plugins"]["mountArtifactsStore"]
    plain = tmp_path / "polyaxonfile.yaml"
    plain.write_text(yaml.safe_dump(doc, sort_keys=False))
    (_, container), = main_containers(convert([plain], store=S3_STORE), JOB_FILE)
    environ = container_environ(container)
    assert "POLYAXON_CONNECTIONS_CATALOG" not in environ and "AWS_ACCESS_KEY_ID" not in environ
    assert environ["POLYAXON_ARTIFACTS_STORE_NAME"] == "plx-s3" and environ["POLYAXON_IS_MANAGED"] == "true"
    for name in [n for n in os.environ if n.startswith(("POLYAXON_", "TRAINER_"))]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = train_parser().parse_args(["--tracked"])
    with caplog.at_level(logging.WARNING, logger="trainer"):
        placement = tracked_placement(args, LaunchEnvironment.from_environ(os.environ), UUID)
    assert placement.location is None and placement.kind == "outputs"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "only as durable as the sidecar's next sync" in warning and "mountArtifactsStore: true" in warning
    # The store options need a store: refused with one line (exit 2), not silently ignored.
    with pytest.raises(UsageError, match="--max-pending-uploads applies only to a run directory in a store"):
        tracked_placement(train_parser().parse_args(["--tracked", "--max-pending-uploads", "9"]),
                          LaunchEnvironment.from_environ(os.environ), UUID)


def offline_store_env(root: Path, run_uuid: str, connection: dict, **extra: str) -> dict:
    """An offline tracked run (POLYAXON_IS_OFFLINE) whose environment carries a connection
    catalog, as mountArtifactsStore gives a managed container."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POLYAXON_", "TRAINER_", "AWS_"))}
    env.update(HOME=str(root / "home"), POLYAXON_IS_OFFLINE="true", POLYAXON_OFFLINE_ROOT=str(root / "offline"),
               POLYAXON_TRACKING_FLUSH_DELAY="0", POLYAXON_RUN_INSTANCE=f"local.tr.runs.{run_uuid}",
               POLYAXON_ARTIFACTS_STORE_NAME=connection["name"],
               POLYAXON_CONNECTIONS_CATALOG=json.dumps({"connections": [connection]}), **extra)
    return env


def test_a_local_tier_the_sidecar_would_upload_is_refused(tmp_path):
    from trainer.integrations.polyaxon.placement import place_run

    run_uuid = "feedbeef" * 4
    env = offline_store_env(tmp_path, run_uuid, S3_STORE, TRAINER_LOCAL_TIER="/plx-context/artifacts/tier")
    with pytest.raises(UsageError, match="TRAINER_LOCAL_TIER=/plx-context/artifacts/tier: the local tier "):
        place_run(env)
    with pytest.raises(UsageError, match="--local-tier: the local tier /plx-context/artifacts/x is under"):
        place_run({**env, "TRAINER_LOCAL_TIER": "/local-tier"}, local_tier=Path("/plx-context/artifacts/x"))


def test_a_tracked_run_writes_its_generations_straight_into_the_s3_artifacts_store(tmp_path, s3_bucket):
    """End to end through the CLI against a real S3 server, offline, with an S3 connection in the
    catalog and the AWS_* variables a mounted secret gives: every generation is committed under
    `<bucket>/training-recovery/<uuid>/checkpoints/`, the local tier sits where TRAINER_LOCAL_TIER says,
    and the lineage points at the store's copy, not at the local tier."""
    run_uuid = "5eed0000" * 4
    connection = {**S3_STORE, "schema": {"bucket": s3_bucket.url}}
    tier = tmp_path / "local-tier"
    env = {**offline_store_env(tmp_path, run_uuid, connection, TRAINER_LOCAL_TIER=str(tier)), **s3_bucket.env()}
    result = run_cli("--tracked", "--epochs", "2", "--samples", "32", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    url = f"{s3_bucket.url}/training-recovery/{run_uuid}"
    assert f"tracking: generations go straight to {url} (artifacts store plx-s3; local tier {tier / run_uuid})" \
        in result.stdout
    prefix = f"training-recovery/{run_uuid}"
    keys = s3_bucket.keys(f"{prefix}/")
    for name in ("step-00000002", "step-00000004"):
        assert f"{prefix}/checkpoints/{name}/manifest.json" in keys
    assert f"{prefix}/exports/step-00000004/manifest.json" in keys
    assert any(k.startswith(f"{prefix}/attempts/") and k.endswith("attempt.json") for k in keys)
    assert not s3_bucket.keys(f"{run_uuid}/outputs/checkpoints/")  # nothing where Polyaxon's copies write
    record = attempts(tier / run_uuid)[0]
    assert record["durable"]["generations_published"] == "step-00000004" and record["polyaxon"]["run_uuid"] == run_uuid
    folder = tmp_path / "offline" / "runs" / run_uuid
    assert not (folder / "outputs" / "checkpoints").exists()
    # The reference names the store URL (in its summary); Polyaxon's own path is what follows the
    # run uuid in it: the path inside the run directory.
    lineage = {a["name"]: a for a in json.loads((folder / "lineages.plx.json").read_text())}
    for name, path in (("generation", "checkpoints"), ("export", "exports")):
        reference = lineage[f"{name}-step-00000004"]
        assert reference["path"] == f"{path}/step-00000004"
        assert reference["summary"]["path"] == f"{url}/{path}/step-00000004"
    outputs = json.loads((folder / "run.plx.json").read_text())["outputs"]
    assert (outputs["newest_generation"], outputs["export_path"]) == ("step-00000004", "exports/step-00000004")


def test_lineage_of_a_bucket_store_run_names_the_store_once_the_store_holds_it(tmp_path):
    """Published on the local tier is not durable: the reference and the pipeline outputs
    follow the commit in the store, and name the store URL, never the local tier."""
    from trainer.integrations.polyaxon.placement import RunPlacement
    from trainer.checkpoint.section import Published
    from trainer.integrations.polyaxon.tracking import PolyaxonEvents

    class Run:  # what PolyaxonEvents uses of polyaxon.tracking.Run
        run_uuid = UUID

        def __init__(self):
            self.references, self.outputs = [], {}

        def get_outputs_path(self):
            return str(tmp_path / "plx-outputs")

        def log_artifact_ref(self, path, **kwargs):
            self.references.append((kwargs["name"], path))

        def log_model_ref(self, path, **kwargs):
            self.references.append((kwargs["name"], path))

        def log_outputs(self, async_req: bool = True, **outputs):  # the client's signature
            assert not async_req  # one PATCH at a time (tracking.PolyaxonEvents.log_outputs)
            self.outputs.update(outputs)

    run, tier, url = Run(), tmp_path / "tier", f"s3://plx-artifacts/{UUID}/outputs"
    events = PolyaxonEvents(run, "managed", None)
    events.place(RunPlacement(InStore(parse_store_url(url), tier), kind="bucket", connection="plx-s3"))
    generation = Published("step-00000008", 8, "ab" * 32, 0.1, 0.1)
    events.published("generation", tier / "checkpoints" / "step-00000008", generation)
    events.published("export", tier / "exports" / "step-00000008", generation)
    assert run.references == [] and run.outputs == {}
    events.durable("generation", "step-00000008")
    events.durable("export", "step-00000008")
    assert run.references == [("generation-step-00000008", f"{url}/checkpoints/step-00000008"),
                              ("export-step-00000008", f"{url}/exports/step-00000008")]
    assert run.outputs == {"newest_generation": "step-00000008", "export_path": "exports/step-00000008"}
    # Removed before the store held it: never referenced, nothing to delete.
    events.published("generation", tier / "checkpoints" / "step-00000016", generation)
    events.removed("generation", "step-00000016")
    events.durable("generation", "step-00000016")
    assert len(run.references) == 2

    # A volume store: the run directory is the store's own folder, referenced when published.
    run, folder = Run(), tmp_path / "plx-store" / UUID / "outputs"
    events = PolyaxonEvents(run, "managed", None)
    events.place(RunPlacement(OnDisk(folder), kind="volume", connection="plx-host"))
    assert events.run_directory == folder
    events.published("generation", folder / "checkpoints" / "step-00000008", generation)
    assert run.references == [("generation-step-00000008", str(folder / "checkpoints" / "step-00000008"))]
    assert run.outputs == {"newest_generation": "step-00000008"}


# ------------------------------------------------------------------------------- precedence
def test_presets_are_applied_after_params_and_set_only_what_they_are_about():
    """The documented rule, measured: a preset beats a -P of the same name, so presets here do
    not set what a user is expected to choose (retention, workload)."""
    from test_polyaxon_bundle import container_scripts, render

    cadence = [JOB_FILE, PRESET["step-cadence"]]
    argv = trainer_argv(container_scripts(render(cadence, {"keep_last": 5}))[0])
    assert "--keep-last=5" in argv  # not set by the preset: the user's -P applies
    argv = trainer_argv(container_scripts(render(cadence, {"recover_every_steps": 8}))[0])
    assert "--recover-every-steps=4" in argv  # set by the preset: the preset wins (documented)
    user_choices = {"keep_last", "keep_every", "keep_exports", "epochs", "samples", "batch_size", "lr", "seed",
                    "image", "workers", "preempt_grace_secs"}
    about = {"step-cadence": {"keep_every"},  # milestones are part of that cadence
             "baked-image": {"image"}}  # the preset is the image (copied, with the user's registry)
    for preset in PRESETS:
        params = set(yaml.safe_load(preset.read_text()).get("params") or {})
        assert not params & (user_choices - about.get(preset.stem, set())), preset.name


# ------------------------------------------------------------------------------- documented commands
def documented_commands() -> list[list[str]]:
    """Every `polyaxon ...` line in a shell block of README.md and the pages of docs/."""
    commands = []
    for doc in DOCS:
        blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", doc.read_text(), re.DOTALL)
        for line in "\n".join(blocks).splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("polyaxon "):
                commands.append(shlex.split(line.replace("$RUN_UUID", "0123abcd")))
    return commands


def parse_with_the_cli(argv: list[str]):
    """Parse argv with the polyaxon CLI's own click commands (options, types, -f paths must
    exist), without running them: what the CLI would reject raises click.UsageError."""
    import click
    from polyaxon.cli import cli

    command, rest, name = cli, argv[1:], "polyaxon"
    ctx = click.Context(cli, info_name=name)
    while isinstance(command, click.Group):
        name, rest = rest[0], rest[1:]
        command = command.get_command(ctx, name)
        assert command is not None, f"no such command: {' '.join(argv)}"
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=name, parent=ctx)
    return command.make_context(name, rest, parent=ctx)


def test_documented_polyaxon_commands_are_accepted_by_the_cli(tmp_path, monkeypatch):
    from polyaxon._config.spec import ConfigSpec
    from polyaxon._polyaxonfile import read_polyaxonfile

    monkeypatch.chdir(REPO)
    commands = documented_commands()
    kinds = {" ".join(c[1:3]) if c[1] == "ops" else c[1] for c in commands}
    assert {"run", "check", "ops resume", "ops restart"} <= kinds, kinds
    checks = []
    for argv in commands:
        ctx = parse_with_the_cli(argv)
        files = list(ctx.params.get("polyaxonfile") or ())
        if argv[1] == "ops":
            # What `ops resume/restart -f ...` sends: the files merged and read as one preset
            # (none for a plain `ops restart`: the run's own operation, unchanged).
            if files:
                read_polyaxonfile(ConfigSpec.read_from(files), is_preset=True)
            if ctx.params["recompile"]:  # the files are the whole operation: a polyaxonfile and presets
                assert Path(files[0]).parent.name == "polyaxonfiles", argv
                checks.append(([REPO / f for f in files], ()))
                continue
            targets = [f for f in POLYAXONFILES if all(Path(f) in preset_targets(REPO / p) for p in files)]
            assert targets, f"{argv}: no polyaxonfile takes these presets"
            checks += [([t] + [REPO / p for p in files], ()) for t in targets]
        elif files:
            params = tuple(p for p in ctx.params.get("params") or ())
            checks.append(([REPO / f for f in files], params))
    checks = list({(tuple(files), params): (files, params) for files, params in checks}.values())
    for (files, params), result in zip(checks, check_all({**os.environ, "HOME": str(tmp_path)}, checks)):
        assert result.returncode == 0 and "Polyaxonfile valid" in result.stdout, \
            f"{[str(f) for f in files]} {params}:\n{result.stdout}\n{result.stderr}"


def test_the_cli_rejects_what_the_old_readme_advised():
    import click

    for command in ("resume", "restart"):  # no -P: only preset files reach them
        with pytest.raises(click.UsageError, match="No such option .-P"):
            parse_with_the_cli(["polyaxon", "ops", command, "-uid", "x", "-P", "resume=latest"])


# ------------------------------------------------------------------------------- image
def test_dockerfile_installs_exactly_the_requirements_and_the_code():
    text = (REPO / "docker" / "Dockerfile").read_text()
    instructions = [line for line in re.sub(r"\\\n", " ", text).splitlines() if line and not line.startswith("#")]
    installs = [i for i in instructions if "pip install" in i]
    assert len(installs) == 2 and all(install.startswith("RUN ") for install in installs)
    # then the project itself, its dependencies being the pins above: nothing else is resolved
    project = shlex.split(installs[1].split("&&")[0])
    assert project[project.index("install") + 1:] == ["--root-user-action=ignore", "--no-deps", "."]
    assert instructions.index("COPY pyproject.toml README.md ./") < instructions.index(installs[1])
    assert instructions.index("COPY trainer/ trainer/") < instructions.index(installs[1])
    words = shlex.split(installs[0].split("&&")[0])
    assert words[words.index("install") + 1:] == ["--root-user-action=ignore", "--extra-index-url",
                                                   "https://download.pytorch.org/whl/${TORCH_BUILD}",
                                                   "-r", "requirements.txt"]
    assert "FROM python:3.11.7-slim-bookworm" in instructions
    assert "COPY requirements.txt ./" in instructions and "COPY trainer/ trainer/" in instructions
    assert "WORKDIR /opt/training-recovery" in instructions
    for polyaxonfile in POLYAXONFILES:
        torch_build = {io["name"]: io for io in yaml.safe_load(polyaxonfile.read_text())["inputs"]}["torch_build"]
        options = torch_build.get("options") or torch_build["validation"]["options"]
        assert options == ["cpu", "cu128"] and torch_build["value"] == "cpu"
    # The build's guard, run against this venv's torch (the CPU build): passes for cpu, stops cu128.
    guard = shlex.split(installs[0].split("&&")[1])
    assert guard[:2] == ["python", "-c"]
    import torch

    assert torch.version.cuda is None, "this check expects the CPU build of torch in the test venv"
    for build, status in (("cpu", 0), ("cu128", 1)):
        result = subprocess.run([sys.executable, "-c", guard[2]], env={**os.environ, "TORCH_BUILD": build},
                                capture_output=True, text=True, timeout=scaled(300))
        assert result.returncode == status, result.stderr
    assert "is not the cu128 build" in result.stderr
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored[ignored.index("*"):ignored.index("*") + 7] == ["*", "!requirements.txt", "!trainer/", "!compare.py",
                                                                  "!examples/", "!pyproject.toml", "!README.md"]
    assert "COPY examples/ examples/" in instructions  # the example workloads run in the image too


# ------------------------------------------------------------------------------- preemption
def test_save_on_sigterm_fits_well_inside_the_grace(tmp_path):
    """SIGTERM → generation published → exit 75, timed on a 25 MB model: it must fit well inside
    the trainer's default grace, which must leave the pod's 30 s a margin for the launcher and
    the sidecar."""
    default_grace = train_parser().parse_args([]).preempt_grace_secs
    assert default_grace <= KUBERNETES_DEFAULT_GRACE_S - 10
    run = tmp_path / "run"
    process = start(run, "--epochs", 400, "--hidden-size", 1024, "--layers", 4)
    try:
        for line in process.stdout:
            if line.startswith("step=3 "):
                break
        else:
            pytest.fail("the trainer ended before logging step 3")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=KUBERNETES_DEFAULT_GRACE_S)
        elapsed = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    record = attempts(run)[-1]
    assert process.returncode == 75 and record["status"] == "preempted", err
    saved = record["generations_published"][-1]
    assert saved["step"] == record["last_step"]
    print(f"SIGTERM to exit 75 with step {saved['step']} saved: {elapsed:.2f} s (grace {default_grace:g} s)")
    # 1.7–2.6 s measured on the shared 2-core VM; the bound leaves room for a loaded machine.
    assert elapsed < 0.75 * default_grace, f"save on SIGTERM took {elapsed:.1f} s of a {default_grace:g} s grace"
