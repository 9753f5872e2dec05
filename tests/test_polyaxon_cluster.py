"""What the cluster receives: every polyaxonfile × preset rendered through Polyaxon's own agent
path (`make_and_convert`: compile, resolve, k8s converter), the documented commands parsed by the
CLI's own click commands and preset reader, the image recipe, and the preemption save measured
against the grace Kubernetes gives the pod.
"""

from __future__ import annotations

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

from conftest import REPO, attempts

from test_polyaxon_bundle import POLYAXONFILES, PRESETS, JOB_FILE, check_all, preset_targets, trainer_argv
from trainer.cli import train_parser

PYTORCHJOB = REPO / "polyaxonfiles" / "pytorchjob.yaml"
PRESET = {p.stem: p for p in PRESETS}
PERMANENT = [2, 65, 66, 70, 73]
"""Exits a retry cannot fix: usage, fingerprint/damage, nothing to resume, crash loop, held."""
KUBERNETES_DEFAULT_GRACE_S = 30
"""terminationGracePeriodSeconds when the pod spec does not set it; Polyaxon 2.18's converter
never sets it (no such field in V1Environment, no occurrence in the package)."""
MAIN_CONTAINER = {"polyaxonfile.yaml": "polyaxon-main", "pytorchjob.yaml": "pytorch"}
UUID = "0123abcd" * 4
DOCS = [REPO / "README.md", REPO / "docs" / "polyaxon.md"]


def combinations() -> list[list[Path]]:
    cases = [[f] for f in POLYAXONFILES]
    cases += [[f, p] for p in PRESETS for f in preset_targets(p)]
    cases.append([JOB_FILE, PRESET["gpu"], PRESET["resume"]])
    cases += [[f, PRESET["resume"], PRESET["allow-drift-torch"]] for f in POLYAXONFILES]
    return cases


def convert(files: list[Path], params: dict | None = None) -> dict:
    """The custom resource the agent would create for this submission (owner acme, project tr)."""
    from kubernetes.client import ApiClient
    from polyaxon import settings
    from polyaxon._k8s.executor.executor import Executor
    from polyaxon._schemas.agent import AgentConfig
    from polyaxon.polyaxonfile import check_polyaxonfile

    store = {"name": "store", "kind": "volume_claim", "schema": {"mountPath": "/store", "volumeClaim": "store-pvc"}}
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
        assert container["image"] == f"training-recovery:2.13.0-{'cu128' if gpu else 'cpu'}"
        assert container["workingDir"] == "/opt/training-recovery"
        script = " ".join(container["command"] + container["args"])
        assert "pip" not in script, "attempts must not install packages"
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
    about = {"step-cadence": {"keep_every"}}  # milestones are part of that cadence
    for preset in PRESETS:
        params = set(yaml.safe_load(preset.read_text()).get("params") or {})
        assert not params & (user_choices - about.get(preset.stem, set())), preset.name


# ------------------------------------------------------------------------------- documented commands
def documented_commands() -> list[list[str]]:
    """Every `polyaxon ...` line in a shell block of README.md and docs/polyaxon.md."""
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
            # What `ops resume/restart -f ...` sends: the files merged and read as one preset.
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
    assert len(installs) == 1 and installs[0].startswith("RUN ")
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
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == status, result.stderr
    assert "is not the cu128 build" in result.stderr
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored[ignored.index("*"):ignored.index("*") + 5] == ["*", "!requirements.txt", "!trainer/", "!compare.py",
                                                                  "!examples/"]
    assert "COPY examples/ examples/" in instructions  # the example workloads run in the image too


# ------------------------------------------------------------------------------- preemption
def test_save_on_sigterm_fits_well_inside_the_grace(tmp_path):
    """SIGTERM → generation published → exit 75, timed on a 25 MB model: it must fit well inside
    the trainer's default grace, which must leave the pod's 30 s a margin for the launcher and
    the sidecar."""
    default_grace = train_parser().parse_args([]).preempt_grace_secs
    assert default_grace <= KUBERNETES_DEFAULT_GRACE_S - 10
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "trainer", "--output", str(run), "--epochs", "400",
                                "--hidden-size", "1024", "--layers", "4", "--log-every-steps", "1"],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


# ------------------------------------------------------------------------------- server path
def server_resume(original: dict, files: list[str], recompile: bool) -> list[str]:
    """The trainer argv of a run started with `-P original` and then given `ops resume -f FILES`
    (`--recompile` or not), on the public server's path, rebuilt with the 2.18 client's own
    functions. CLI (`_cli/operations.py` resume/restart): the files are merged and read as one
    preset. Server (haupt 2.16.1 `orchestration/operations/service.py` resume_run/_clone_run →
    init_run): without --recompile the run's original operation is compiled with that content as
    override, but `params = op_spec.params` keeps the *original* params, which the scheduler
    applies; with --recompile the content itself is the operation, params included."""
    from polyaxon._config.spec import ConfigSpec
    from polyaxon._polyaxonfile import read_polyaxonfile
    from polyaxon.polyaxonfile import CompiledOperationSpecification, OperationSpecification, check_polyaxonfile
    from polyaxon.schemas import V1Operation

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        started = check_polyaxonfile(polyaxonfile=[str(JOB_FILE)], params=original, is_cli=False,
                                     strict_params=True, verbose=False)
        content = read_polyaxonfile(ConfigSpec.read_from(files), is_preset=True).to_source_json()
        if recompile:
            op_spec = V1Operation.read(content)
            compiled = OperationSpecification.compile_operation(op_spec)
        else:
            op_spec = V1Operation.read(started.to_json())  # the run's raw_content
            compiled = OperationSpecification.compile_operation(op_spec, override=content,
                                                                use_override_patch_strategy=True)
        params = {name: param.to_dict() for name, param in (op_spec.params or {}).items()}  # run.params
        compiled = CompiledOperationSpecification.apply_params(compiled, params=params, context={})
        compiled = CompiledOperationSpecification.apply_operation_contexts(compiled)
        compiled = CompiledOperationSpecification.apply_runtime_contexts(compiled)
    env = [e if isinstance(e, dict) else e.to_dict() for e in compiled.run.container.env or []]
    return trainer_argv(compiled.run.container.args[0]) + [f"ENV {e['name']}={e['value']}" for e in env]


def test_ops_resume_with_presets_applies_their_runpatch_but_not_their_params(tmp_path):
    """The override form: docs/polyaxon.md says so; if this starts failing, the server path
    changed and the docs must follow."""
    preset = tmp_path / "preset.yaml"
    preset.write_text("version: 1.1\nkind: operation\nparams:\n  resume: latest\nrunPatch:\n  container:\n"
                      "    env:\n      - name: PRESET_SEEN\n        value: 'yes'\n")
    argv = server_resume({"interrupt_at_step": 27}, [str(preset)], recompile=False)
    assert "ENV PRESET_SEEN=yes" in argv
    assert "--resume=auto" in argv and "--interrupt-at-step=27" in argv  # the preset's params: not applied


@pytest.mark.parametrize("presets, expected", [
    (["resume"], {"--resume=latest"}),
    (["from-generation"], {"--from-generation=step-00000016"}),
    (["resume", "allow-drift-torch"], {"--resume=latest", "--allow-drift=torch"}),
])
def test_ops_resume_recompile_with_the_polyaxonfile_applies_the_presets(presets, expected):
    """The recompile form documented for going back and accepting a drift: the whole operation
    is replaced, so the presets' params apply (and the original -P do not: repeat them)."""
    files = [str(JOB_FILE)] + [str(PRESET[name]) for name in presets]
    argv = server_resume({"interrupt_at_step": 27, "keep_last": 5}, files, recompile=True)
    assert expected <= set(argv)
    assert not any(a.startswith(("--interrupt-at-step", "--keep-last=5")) for a in argv)
    assert not ({"--resume=latest", "--resume=auto"} & set(argv) and "--from-generation=step-00000016" in argv)
