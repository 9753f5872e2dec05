"""The Polyaxon bundle: every polyaxonfile and preset combination is what the real `polyaxon`
CLI accepts, renders to a trainer command line our parser accepts, and uploads only code.
What the agent renders for the cluster (k8s converter) is in test_polyaxon_cluster.py.

`polyaxon check` runs offline with HOME in a temporary directory (no CLI config, no server).
Each CLI start costs about a second, so the checks run a few at a time in parallel.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import yaml

from support.cli import REPO
from support.polyaxon import FLAG, JOB_FILE, POLYAXONFILES, PRESETS, check_all, preset_targets, trainer_argv

from trainer.cli import train_parser
from trainer.flags import GIVEN_SETTINGS

NOT_INPUTS = {"--output", "--tracked", "--help", "--local-tier",  # set by the bundle itself (TRAINER_LOCAL_TIER), not by the user
              "--signing-key-file"}  # the bundle's mount of the Secret named by the input signing_key_secret


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("polyaxon-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYAXON_")}
    return {**env, "HOME": str(home), "POLYAXON_NO_OP": "false"}


def inputs_of(polyaxonfile: Path) -> dict[str, dict]:
    return {io["name"]: io for io in yaml.safe_load(polyaxonfile.read_text()).get("inputs", [])}


def render(files: list[Path], params: dict | None = None):
    """Compile like the agent does (params, then operation contexts, then runtime contexts for a
    single-container job) with Polyaxon's own compiler; returns the compiled operation."""
    from polyaxon.polyaxonfile import CompiledOperationSpecification, OperationSpecification, check_polyaxonfile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydantic serializer warnings from inside polyaxon
        operation = check_polyaxonfile(polyaxonfile=[str(f) for f in files], params=params, is_cli=False,
                                       strict_params=True, verbose=False)
        compiled, op_params = OperationSpecification.compile_operation_with_params(operation)
        contexts = {"globals": {"run_artifacts_path": "/plx-context/artifacts/0123abcd"}}
        compiled = CompiledOperationSpecification.apply_params(compiled, params=op_params, context=contexts)
        compiled = CompiledOperationSpecification.apply_operation_contexts(compiled, contexts=contexts)
        if compiled.is_distributed_run:  # runtime contexts are per replica
            contexts = {"master": contexts, "worker": contexts}
        return CompiledOperationSpecification.apply_runtime_contexts(compiled, contexts=contexts)


def container_scripts(compiled) -> list[str]:
    """Every command/args string of every container of the compiled run (job or replicas)."""
    run = compiled.run.to_dict()
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "image" in node and ("command" in node or "args" in node):
                found.append(" ".join(node.get("command", []) + node.get("args", [])))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(run)
    return found


# ---------------------------------------------------------------------------------- polyaxon check
def test_every_polyaxonfile_and_preset_combination_passes_strict_check(cli_env):
    assert JOB_FILE in POLYAXONFILES and (REPO / "presets" / "resume.yaml") in PRESETS
    assert preset_targets(REPO / "presets" / "resume.yaml") == POLYAXONFILES
    cases = [([f], ()) for f in POLYAXONFILES]
    cases += [([f, p], ()) for p in PRESETS for f in preset_targets(p) if f.exists()]
    # Preset on preset, as a GPU run is resumed: polyaxonfile + gpu + resume.
    cases.append(([JOB_FILE, REPO / "presets" / "gpu.yaml", REPO / "presets" / "resume.yaml"], ()))
    for (files, _), result in zip(cases, check_all(cli_env, cases)):
        names = " + ".join(f.relative_to(REPO).as_posix() for f in files)
        assert result.returncode == 0 and "Polyaxonfile valid" in result.stdout, \
            f"{names}:\n{result.stdout}\n{result.stderr}"


def test_invalid_params_and_presets_are_rejected(cli_env, tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("version: 1.1\nkind: operation\nparams:\n  resum: latest\n")
    cases = {  # through the real CLI: what a user sees
        "bad type": (([JOB_FILE], ("epochs=eight",)), "Cannot convert value `eight`"),
        "not an option": (([JOB_FILE], ("checkpoint_mode=eventually",)), "must be one of the values"),
        "no null from -P": (([JOB_FILE], ("resume=null",)), "Value `null` must be one of the values"),
        "unknown param": (([JOB_FILE], ("epochz=3",)), "undeclared param `epochz`"),
        "unknown param in a preset": (([JOB_FILE, typo], ()), "undeclared param `resum`"),
    }
    results = check_all(cli_env, [case for case, _ in cases.values()])
    for (name, (_, expected)), result in zip(cases.items(), results):
        output = " ".join((result.stdout + result.stderr).split())
        assert result.returncode != 0, f"{name} was accepted:\n{output}"
        assert expected in output, f"{name}: {output}"


@pytest.mark.parametrize("param, value", [("epochs", 0), ("dropout", 1.0), ("allow_drift", ["gpu"]),
                                          ("from_generation", "latest"), ("keep_last", 0)])
def test_values_the_trainer_would_refuse_are_refused_at_submission(param, value):
    """Same validation as the CLI check above, in-process (Polyaxon's `check_polyaxonfile`)."""
    with pytest.raises(Exception, match="Polyaxonfile is not valid"):
        render([JOB_FILE], {param: value})


def test_every_preset_says_which_polyaxonfiles_it_combines_with():
    for preset in PRESETS:
        head = preset.read_text().splitlines()[0]
        assert head.startswith("# Combines with: "), f"{preset.name}: first line is {head!r}"
        assert JOB_FILE in preset_targets(preset)


# ---------------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("polyaxonfile", POLYAXONFILES, ids=lambda p: p.name)
def test_rendered_container_runs_the_tracked_trainer_with_options_our_parser_accepts(polyaxonfile):
    compiled = render([polyaxonfile], {"interrupt_at_step": 27})
    scripts = [s for s in container_scripts(compiled) if "-m trainer" in s]
    assert scripts, f"no container of {polyaxonfile.name} runs `python -m trainer`"
    declared = inputs_of(polyaxonfile)
    for script in scripts:
        argv = trainer_argv(script)
        assert "--tracked" in argv and not any(a.startswith("--output") for a in argv)
        assert "-r requirements.txt" in script  # the public base image: the pinned requirements at start
        args = train_parser().parse_args(argv)  # every rendered flag is a real trainer option
        if "interrupt_at_step" in declared:
            assert args.interrupt_at_step == 27
        if "resume" in declared:
            assert args.resume == declared["resume"]["value"]
    assert compiled.termination.max_retries >= 1 and compiled.termination.timeout
    assert compiled.plugins.auto_resume and compiled.plugins.collect_artifacts


def test_tier0_auto_cadence_reaches_the_trainer_and_a_number_stays_a_number():
    for given, wanted in (({"memory_every_steps": "auto", "memory_auto_min_secs": 0.5}, ("auto", 0.5)), ({}, (10, 1.0))):
        compiled = render([JOB_FILE], {"memory_dir": "/dev/shm/run", **given})
        argv = trainer_argv(next(s for s in container_scripts(compiled) if "-m trainer" in s))
        args = train_parser().parse_args(argv)
        assert (args.memory_every_steps, args.memory_auto_min_secs) == wanted, argv


def test_job_renders_defaults_unset_options_and_presets_as_documented(tmp_path):
    compiled = render([JOB_FILE])
    container = compiled.run.container
    assert container.working_dir is None  # the script enters the upload, else the image's code
    assert compiled.run.environment.restart_policy == "Never"
    assert re.fullmatch(r"[a-z0-9.-]+:[0-9][0-9a-z.-]+", container.image), "the image must be pinned to a version"
    (script,) = container_scripts(compiled)
    argv = trainer_argv(script)
    assert "--resume=auto" in argv  # what maxRetries needs: a retry resumes, the first attempt starts
    assert not any(a.startswith(("--interrupt-at-step", "--recover-every-steps", "--from-generation",
                                 "--allow-drift", "--export-dtype", "--amp")) for a in argv), argv

    first = REPO / "presets" / "resume.yaml"
    interrupted = render([JOB_FILE], {"interrupt_at_step": 27, "amp": True, "allow_drift": ["torch", "numpy"]})
    argv = trainer_argv(container_scripts(interrupted)[0])
    assert {"--interrupt-at-step=27", "--amp", "--allow-drift=torch", "--allow-drift=numpy"} <= set(argv)

    # `ops resume -f presets/resume.yaml` on a run started with interrupt_at_step=27.
    started = tmp_path / "first-run.yaml"
    started.write_text("version: 1.1\nkind: operation\nparams:\n  interrupt_at_step: 27\n")
    resumed = trainer_argv(container_scripts(render([JOB_FILE, started, first]))[0])
    assert "--resume=latest" in resumed and not any(a.startswith("--interrupt-at-step") for a in resumed)

    gpu = render([JOB_FILE, REPO / "presets" / "gpu.yaml"])
    argv = trainer_argv(container_scripts(gpu)[0])
    assert {"--checkpoint-mode=async", "--device=cuda"} <= set(argv)
    assert gpu.run.container.resources["limits"]["nvidia.com/gpu"] == 1

    cadence = trainer_argv(container_scripts(render([JOB_FILE, REPO / "presets" / "step-cadence.yaml"]))[0])
    assert {"--recover-every-steps=4", "--keep-every=32"} <= set(cadence)

    # docs/polyaxon.md's go-back and drift forms on that run (run live with a server until the
    # suite's CPU budget moved them here; the trainer's side: test_resume.py, test_faults.py).
    back = trainer_argv(container_scripts(render([JOB_FILE, started, REPO / "presets" / "from-generation.yaml"]))[0])
    assert "--from-generation=step-00000016" in back and not any(
        a.startswith(("--resume", "--interrupt-at-step")) for a in back), back
    drift = tmp_path / "seed.yaml"
    drift.write_text("version: 1.1\nkind: operation\nparams:\n  dropout: 0.2\n  epochs: 9\n")
    refused = trainer_argv(container_scripts(render([JOB_FILE, started, first, drift]))[0])
    assert {"--resume=latest", "--dropout=0.2", "--epochs=9"} <= set(refused)
    assert not any(a.startswith("--allow-drift") for a in refused), refused
    allowed = trainer_argv(container_scripts(render([JOB_FILE, started, first, drift,
                                                     REPO / "presets" / "allow-drift-torch.yaml"]))[0])
    assert {"--resume=latest", "--dropout=0.2", "--allow-drift=torch"} <= set(allowed)


def test_job_inputs_cover_every_trainer_option_with_its_default():
    """Drift guard: a new trainer option needs an input, and input defaults are the CLI's."""
    parser = train_parser()
    workload_options = {option for group in parser._action_groups if group.title.startswith("options of the workload")
                        for action in group._group_actions for option in action.option_strings}
    assert workload_options, "the example workload declares its options in its own group"
    declared = inputs_of(JOB_FILE)
    by_flag = {}
    for name, io in declared.items():
        assert io.get("description"), f"input {name} has no description"
        flag = FLAG.match(io.get("argFormat", "")) or re.search(r"(--[a-z0-9-]+)=", io.get("argFormat", ""))
        by_flag[flag.group(1) if flag else f"--{name.replace('_', '-')}"] = io
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or flag in NOT_INPUTS:
            continue
        assert flag in by_flag, f"trainer option {flag} has no input in {JOB_FILE.name}"
        io = by_flag[flag]
        if action.choices:
            options = set(io["validation"]["options"])
            assert set(action.choices) <= options, f"{flag}: options {options} miss {action.choices}"
        if flag == "--resume":
            continue  # the bundle's default is `auto` (retries resume), the CLI's is no resume
        default = None if action.default == [] else action.default
        if flag in workload_options:  # null: the workload's own default, and nothing for another workload
            assert io["value"] is None, f"{flag}: the example workload's option must default to null"
            continue
        if action.dest in GIVEN_SETTINGS:  # null: unset, a DataLoader or a resumed generation gives it
            assert io["value"] is None, (f"{flag}: must default to null (unset), or it overrides a workload's "
                                         f"DataLoader or a resumed generation's reduction")
            continue
        assert io["value"] == default, f"{flag}: input default {io['value']!r}, trainer default {default!r}"


def test_polyaxonignore_keeps_uploads_to_code(tmp_path, monkeypatch):
    from polyaxon._managers.ignore import IgnoreConfigManager

    (tmp_path / ".polyaxonignore").write_text((REPO / ".polyaxonignore").read_text())
    for name in (".venv/lib/site.py", "outputs/recovery/checkpoints/x", "outputs-bench/y", ".git/config",
                 "trainer/__pycache__/cli.cpython-311.pyc", ".pytest_cache/v", "trainer/cli.py",
                 "requirements.txt", "polyaxonfiles/polyaxonfile.yaml", "presets/resume.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    monkeypatch.chdir(tmp_path)
    uploaded = sorted(p.removeprefix("./") for p in IgnoreConfigManager.get_unignored_filepaths("."))
    assert uploaded == [".polyaxonignore", "polyaxonfiles/polyaxonfile.yaml", "presets/resume.yaml",
                        "requirements.txt", "trainer/cli.py"]


def test_a_plug_in_workload_and_its_own_options_reach_the_trainer_from_the_polyaxonfile():
    """`-P workload=… -P workload_args=…` renders to arguments the trainer's two-phase parser
    accepts, and the example workload's options (null) are not handed to another workload."""
    from trainer.cli import chosen_workload, workload_parser

    compiled = render([JOB_FILE], {"workload": "examples/char_gpt.py:CharGPT", "workload_args": "--gpt-block-size 32",
                                   "grad_accum": 2})
    argv = [arg for arg in trainer_argv(container_scripts(compiled)[0]) if arg != "--tracked"]
    assert {"--workload=examples/char_gpt.py:CharGPT", "--grad-accum=2", "--gpt-block-size", "32"} <= set(argv)
    assert not any(arg.startswith(("--samples", "--hidden-size", "--lr=")) for arg in argv)
    parser, _ = workload_parser(chosen_workload(argv))
    parsed = parser.parse_args(argv + ["--output", "unused"])
    assert (parsed.gpt_block_size, parsed.grad_accum) == (32, 2)


def test_the_signing_key_is_off_by_default_and_mounted_from_a_secret_when_named():
    """Input signing_key_secret: unset, no key option and the trainer signs nothing; set, the
    Secret is mounted read-only and the trainer reads the key from the file (never argv)."""
    plain = render([JOB_FILE])
    assert not any(a.startswith("--signing-key-file") for a in trainer_argv(container_scripts(plain)[0]))
    signed = render([JOB_FILE], {"signing_key_secret": "run-signing"})
    argv = trainer_argv(container_scripts(signed)[0])
    assert "--signing-key-file=/signing/signing.key" in argv
    assert train_parser().parse_args(argv).signing_key_file == Path("/signing/signing.key")
    volume = next(v for v in signed.run.to_dict()["volumes"] if v["name"] == "signing-key")
    assert volume["secret"]["secretName"] == "run-signing" and volume["secret"]["optional"] is True
    mount = next(m for m in signed.run.to_dict()["container"]["volumeMounts"] if m["name"] == "signing-key")
    assert mount["mountPath"] == "/signing" and mount["readOnly"] is True
    adopting = trainer_argv(container_scripts(render([JOB_FILE], {"signing_key_secret": "run-signing",
                                                                  "allow_unsigned": True}))[0])
    assert train_parser().parse_args(adopting).allow_unsigned
    # The multi-node job: the same Secret in every replica (master and workers share the spec).
    job = REPO / "polyaxonfiles" / "pytorchjob.yaml"
    replicas = container_scripts(render([job], {"signing_key_secret": "run-signing", "workers": 1}))
    assert len(replicas) == 2 and all("--signing-key-file=/signing/signing.key" in s for s in replicas)
    assert not any("--signing-key-file" in s for s in container_scripts(render([job], {"workers": 1})))
