"""Scale-out: real `torchrun --standalone --nproc_per_node 2` runs on gloo resume exactly,
survive kill -9 of one rank mid-save, guard the world size, and report the trainer's own exit
status although torchrun collapses every child failure into 1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import REPO, compare, completed, finish, one_error_line, run_cli, train
from support.limits import scaled, wait_until
from support.runs import FINAL_2P, TWO_PROCESS_EPOCHS, attempts, generation
from support.torchrun import (TORCHRUN, TORCHRUN_CHILD_FAILED, clean_environment, forked_ranks, free_port, launch,
                              trainer_ranks)
from support.torchrun import torchrun as run_torchrun

EPOCHS = TWO_PROCESS_EPOCHS  # 16 steps: enough for mid-run generations, short enough for CI


def torchrun(output: Path, *args, expect: int = 0, env: dict | None = None, tmp: Path) -> subprocess.CompletedProcess:
    """Two processes, `EPOCHS` epochs (support.torchrun's `torchrun`)."""
    return run_torchrun(output, "--epochs", EPOCHS, *args, nproc=2, expect=expect, env=env, tmp=tmp)


def trainer_error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("trainer:")]


def crash(run: Path, point: str, rank: int, *args) -> subprocess.CompletedProcess:
    """A resume during which rank `rank` dies by SIGKILL at crash point `point`; torchrun
    reports the failure (nothing is written for a killed child)."""
    crashed = completed(launch(
        ["--standalone", "--nproc_per_node", "2", "-m", "trainer", "--output", run, "--epochs", EPOCHS, "--threads", 1,
         "--resume", *args], clean_environment(TRAINER_FAULT_POINT=point, TRAINER_FAULT_RANK=str(rank))), 600)
    assert crashed.returncode == TORCHRUN_CHILD_FAILED
    assert f"fault injection: killing at {point}" in crashed.stderr and "exitcode  : -9" in crashed.stderr
    return crashed


def test_two_processes_survive_an_interrupt_and_a_rank_killed_mid_save(tmp_path, baseline_2p):
    """Async and sync saves under torchrun: an async run interrupted, a rank killed at any point
    of a sync or async save (the last committed generation stays the newest), and the async
    resume of the async generation ends bit-identical to the uninterrupted sync run."""
    run = tmp_path / "run"
    interrupted = torchrun(run, "--interrupt-at-step", 11, "--checkpoint-mode", "async", expect=75, tmp=tmp_path)
    assert interrupted.stderr.count("exitcode  : 75") == 2, "every rank must exit 75"
    assert interrupted.stdout.count("step=11 ") == 1, "only rank 0 logs progress"

    def published() -> list[str]:
        return sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("."))

    # Sync: rank 1 dies right after writing its shards of step-00000016 (rank 0 waits at the barrier).
    crash(run, "after-write", 1)
    # Async: rank 1 dies once its host copy is staged, before its write (rank 0's background
    # write loses its peer); then rank 0 dies after every rank wrote and every file was
    # hashed and fsynced, before the manifest (rank 1 waits for rank 0's verdict).
    crash(run, "after-staging", 1, "--checkpoint-mode", "async")
    crash(run, "after-files-fsync", 0, "--checkpoint-mode", "async")
    assert published() == ["step-00000008"]
    assert list((run / "checkpoints").glob(".step-00000016.tmp-*")), "the torn save stays a temporary"
    verified = run_cli("verify", run)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # Three attempts in a row died restoring step-00000008: the crash-loop guard (tested on its
    # own in test_faults.py) would stop a fourth; the operator says to go on.
    resumed = torchrun(run, "--resume", "--checkpoint-mode", "async", "--max-failed-attempts", 0, tmp=tmp_path)
    assert "restored step-00000008 (step=8 epoch=1 position=0)" in resumed.stdout
    assert not list((run / "checkpoints").glob(".step-*.tmp-*")), "stale temporaries are cleaned on start"
    result = compare(generation(baseline_2p, FINAL_2P), generation(run, FINAL_2P))
    assert result.returncode == 0, result.stdout
    assert "rng_by_rank.1.torch" in result.stdout and "data_by_rank.1.position" in result.stdout
    shard_ranks = {p.name.split("_")[2] for p in generation(run, FINAL_2P).glob("__*_*.distcp")}
    assert shard_ranks == {"0", "1"}  # one generation holding both ranks' shards
    manifest = json.loads((generation(run, FINAL_2P) / "manifest.json").read_text())
    assert manifest["timings"]["mode"] == "async" and manifest["timings"]["save_blocked_s"] < manifest["timings"]["write_s"]
    records = attempts(run)  # one record per attempt, written by rank 0 only
    assert [(r["status"], r["exit_code"], r["world_size"]) for r in (records[0], records[-1])] == \
        [("interrupted", 75, 2), ("completed", 0, 2)]
    assert all(r["status"] in ("interrupted", "running") for r in records[1:4])  # a lost peer; "running" if rank 0 was stopped first
    assert records[1]["steps_replayed"] == 3
    assert records[-1]["checkpoint_mode"] == "async"


def test_verify_refuses_a_value_planted_in_a_ranks_shard_with_the_line_every_rank_resumes_with(tmp_path,
                                                                                               baseline_2p):
    """A pickle payload appended to rank 1's own shard as the optimizer's `dampening` (written
    by that rank), the manifest fixed up: `verify` and the 2-process `--resume` refuse it with
    the same line, exit 65, and nothing runs it."""
    from test_untrusted import plant_value, refusal

    run, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(baseline_2p, run)
    key = "optim.param_groups.0.dampening"
    shard = plant_value(generation(run, FINAL_2P), key, marker, in_place=True)
    assert shard.startswith("__1_"), f"{key} is in {shard}: not a shard of rank 1"
    line = refusal(FINAL_2P, shard, f"the value of {key}")
    verified = run_cli("verify", run)
    assert verified.returncode == 65 and one_error_line(verified).endswith(line), verified.stdout + verified.stderr
    resumed = trainer_ranks(run, "--epochs", EPOCHS, "--resume", nproc=2, expect=65)  # its launch is not under test
    assert trainer_error_lines(resumed) and all(error.endswith(line) for error in trainer_error_lines(resumed))
    assert not marker.exists()


def test_async_staging_with_several_ranks_holds_the_values_of_the_moment_it_was_staged(tmp_path):
    """FSDP2 on two ranks: after staging, every rank mutates its parameter shards and optimizer
    state in place before the background write starts; the generation still holds the staged
    values (tests/rank_staging_isolation.py compares it with a sync save of the same state). Its
    ranks forked as a launcher starts them: the launch is not under test."""
    stdouts = forked_ranks(REPO / "tests" / "rank_staging_isolation.py", tmp_path, nproc=2)
    assert "isolated 12 tensors" in "".join(stdouts)


def test_a_disk_full_on_one_rank_fails_every_rank_with_74_and_commits_nothing(tmp_path):
    """Rank 1 alone may write only 1 KiB per file (its shards are larger): its background write
    fails, every rank learns of it at the next save and exits 74, rank 0 prints one line."""
    run, status_file = tmp_path / "run", tmp_path / "status"
    wrapper = tmp_path / "one-rank-limited.sh"
    wrapper.write_text(f'#!/bin/bash\nif [ "$RANK" = 1 ]; then ulimit -f 1; fi\nexec {sys.executable} -m trainer "$@"\n')
    wrapper.chmod(0o755)
    result = completed(launch(["--standalone", "--nproc_per_node", "2", "--no-python", wrapper, "--output", run,
                              "--epochs", EPOCHS, "--threads", 1, "--checkpoint-mode", "async"],
                             clean_environment(TRAINER_EXIT_STATUS_FILE=str(status_file))), 600)
    status = int(status_file.read_text()) if status_file.exists() else None
    assert result.returncode == TORCHRUN_CHILD_FAILED and status == 74, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stderr.count("exitcode  : 74") == 2, "every rank exits 74"
    [line] = trainer_error_lines(result)
    # Python's write says EFBIG; torch's zip writer, when the limit cuts a torch.save short, a short write.
    assert line.startswith("trainer: error: writing generation step-00000008 failed: "), line
    assert "File too large" in line or "a write was cut short" in line, line
    assert "rerun with --resume auto" in line
    assert not [p for p in (run / "checkpoints").iterdir()], "nothing committed, no temporary left"
    record = attempts(run)[-1]
    assert record["status"] == "failed" and record["exit_code"] == 74 and not record["generations_published"]


def test_sigterm_to_torchrun_saves_once_on_every_rank_and_exits_75(tmp_path):
    """SIGTERM reaches the ranks at slightly different moments; they agree on one step, save
    it together and exit 75. Rank 0's clock alone drives the seconds trigger meanwhile (if
    ranks disagreed on a save, one would wait in the save while the other trains: a hang).
    Async saves: the last one is drained and committed on the way out."""
    run, status_file = tmp_path / "run", tmp_path / "status"
    launcher = launch(
        ["--standalone", "--nproc_per_node", "2", "-m", "trainer", "--output", run, "--epochs", "2000",
         "--recover-every-epochs", "0", "--recover-every-secs", "0.5", "--checkpoint-mode", "async"],
        clean_environment(TRAINER_EXIT_STATUS_FILE=str(status_file)))
    try:
        wait_until(lambda: len(list((run / "checkpoints").glob("step-*"))) >= 2 or launcher.poll() is not None,
                   "two time-triggered generations", every=0.2)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = finish(launcher)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == TORCHRUN_CHILD_FAILED and int(status_file.read_text()) == 75, stderr[-3000:]
    record = attempts(run)[-1]
    assert record["status"] == "preempted" and record["reason"].startswith("SIGTERM after step")
    saved = record["generations_published"]
    assert len(saved) >= 3 and saved[-1]["step"] == record["last_step"]
    assert f"preempted by SIGTERM: saved step {record['last_step']} (exit 75)" in stdout
    verified = run_cli("verify", run)
    assert verified.returncode == 0, verified.stdout


def test_world_size_change_is_refused_then_allowed_with_the_override(tmp_path):
    # 1 → 2: a single-process generation, resumed by two processes.
    run = tmp_path / "run"
    train(run, "--epochs", 1)
    refused = torchrun(run, "--resume", expect=65, tmp=tmp_path)
    lines = trainer_error_lines(refused)
    assert len(lines) == 1, "rank 0 alone prints the error every rank shares"
    assert lines[0].startswith("trainer: error: step-00000008 was written in a different environment: world_size 1 → 2")
    assert "--allow-drift world_size" in lines[0]
    assert refused.stderr.count("exitcode  : 65") == 2
    allowed = trainer_ranks(run, "--epochs", EPOCHS, "--resume", "--allow-drift", "world_size",
                            nproc=2)  # the refusal above is torchrun's; this run's launch is not under test
    assert "rank 1: no RNG state stored for rank 1" in allowed.stdout
    change = attempts(run)[-1]["world_size_change"]
    assert (change["from"], change["to"], change["exact"]) == (1, 2, False)

    # 2 → 1: the 2-process generation just written, extended by one process (the same guard
    # refuses it without the override; with it, rank 0's RNG entries restore into `rng`).
    assert "world_size 2 → 1" in one_error_line(train(run, "--resume", "--epochs", 3, expect=65))
    train(run, "--resume", "--epochs", 3, "--allow-drift", "world_size")
    record = attempts(run)[-1]
    assert record["status"] == "completed" and record["world_size_change"]["exact"] is False
    assert record["allowed_drift"] == ["world_size"]
    assert "rng.torch" in compare(generation(run, "step-00000024"), generation(run, "step-00000024")).stdout


def test_fsdp_two_process_interrupt_and_resume_matches_uninterrupted_fsdp(tmp_path):
    """--data-parallel fsdp: each rank writes only its shards (sync or async), an async 2-process resume is exact,
    the export holds whole tensors, and a resume must keep the choice (it is fingerprinted)."""
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    trainer_ranks(baseline, "--epochs", EPOCHS, "--data-parallel", "fsdp", nproc=2)  # the reference
    # Async: each rank stages its own shards (DTensors) and writes them in the background; the
    # resume restores that generation and writes the final one async too.
    # Tier 0 too: each rank saves its own shards alone at step 10 (one node: no replica).
    memory = ("--memory-dir", tmp_path / "shm", "--memory-every-steps", 5)
    trainer_ranks(run, "--epochs", EPOCHS, "--data-parallel", "fsdp", "--interrupt-at-step", 11, "--checkpoint-mode",
                  "async", *memory, nproc=2, expect=75)  # forked as a launcher starts them: the resume is torchrun's
    assert json.loads((generation(run, "step-00000008") / "manifest.json").read_text())["timings"]["mode"] == "async"
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
    resumed = torchrun(run, "--data-parallel", "fsdp", "--resume", "--checkpoint-mode", "async", *memory, tmp=tmp_path)
    assert "restored step-00000010 (step=10 epoch=1 position=2) from tier 0 (memory)" in resumed.stdout
    result = compare(generation(baseline, FINAL_2P), generation(run, FINAL_2P))
    assert result.returncode == 0, result.stdout
    assert json.loads((generation(run, FINAL_2P) / "manifest.json").read_text())["timings"]["mode"] == "async"

    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(generation(run, FINAL_2P))).read_metadata().state_dict_metadata
    for key in ("model.net.0.weight", "optim.state.net.0.weight.momentum_buffer"):
        assert [tuple(chunk.sizes) for chunk in stored[key].chunks] == [(32, 16), (32, 16)], key  # one half per rank

    from safetensors.torch import load_file

    exported = load_file(str(run / "exports" / FINAL_2P / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in exported.items() if name.endswith("weight")} == \
        {"net.0.weight": (64, 16), "net.3.weight": (64, 64), "net.6.weight": (4, 64)}

    refused = trainer_ranks(run, "--resume", "--epochs", 3, nproc=2, expect=65)  # DDP cannot resume it exactly
    assert "config.data_parallel fsdp" in trainer_error_lines(refused)[0]


def test_fsdp_without_torchrun_is_a_one_line_usage_error(tmp_path):
    line = one_error_line(train(tmp_path / "run", "--data-parallel", "fsdp", expect=2))
    assert line.startswith("trainer: error: --data-parallel fsdp shards the model across processes")
    assert not (tmp_path / "run").exists()


def test_pytorchjob_polyaxonfile_is_valid_and_its_launcher_reports_the_trainer_status(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    checked = subprocess.run([str(Path(sys.executable).with_name("polyaxon")), "check", "-f",
                              "polyaxonfiles/pytorchjob.yaml"], cwd=REPO, capture_output=True, text=True,
                             timeout=scaled(600), env={**os.environ, "HOME": str(home)})
    assert checked.returncode == 0 and "Polyaxonfile valid" in checked.stdout, checked.stdout + checked.stderr

    rendered, baked = render_pytorchjob(home, {"workers": 0, "epochs": 1, "interrupt_at_step": 3,
                                               "allow_drift": ["world_size"]},
                                        {"workers": 0, "epochs": 1, "interrupt_at_step": 3,
                                         "allow_drift": ["world_size"], "install_requirements": False})
    master, worker = rendered["master"], rendered["worker"]
    assert master == worker and rendered["replicas"] == [1, 0] and rendered["nProcPerNode"] == 2
    assert "-m trainer --tracked --epochs=1 --interrupt-at-step=3 --resume=auto" in master
    assert "--allow-drift=world_size" in master and "--keep-last" not in master  # unset → not passed
    assert '--nnodes="${PET_NNODES:-$(( 0 + 1 ))}"' in master and "--max-restarts=2" in master

    assert "-r requirements.txt" in master  # the public base image installs them at start

    # Run the rendered launcher as the master pod of the baked image would, without PET_* (the
    # fallback path), in this checkout instead of the image's copy, with a local output
    # directory instead of --tracked.
    baked = baked["master"]
    assert "pip" not in baked  # the baked image holds the requirements (docker/Dockerfile)
    script = baked.replace("--tracked", f"--output {tmp_path / 'run'}").replace("/opt/training-recovery", str(REPO))
    env = clean_environment(RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                            PATH=f"{TORCHRUN.parent}{os.pathsep}{os.environ['PATH']}")
    launched = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=scaled(600),
                              env=env)
    assert launched.returncode == 75, launched.stdout[-2000:] + launched.stderr[-3000:]
    # torchrun restarts the workers in place (restarts_in_place, 2 by default): each round resumes and
    # is interrupted at step 3 again, until the pod fails to Polyaxon's retries with the trainer's 75
    assert [r["status"] for r in attempts(tmp_path / "run")] == ["interrupted"] * 3


RENDER = """
import json, sys
from polyaxon._polyaxonfile import check_polyaxonfile
from polyaxon._polyaxonfile.specs import CompiledOperationSpecification, OperationSpecification

def render(params):
    op = check_polyaxonfile(polyaxonfile="polyaxonfiles/pytorchjob.yaml", params=params, is_cli=False, verbose=False)
    compiled = OperationSpecification.compile_operation(op)
    compiled = CompiledOperationSpecification.apply_params(compiled, params={k: v.to_dict() for k, v in op.params.items()})
    compiled = CompiledOperationSpecification.apply_operation_contexts(compiled)
    context = {"globals": {"run_artifacts_path": "/artifacts/run"}}
    compiled = CompiledOperationSpecification.apply_runtime_contexts(compiled, contexts={"master": context, "worker": context})
    run = compiled.run
    return {"master": run.master.container.args[0], "worker": run.worker.container.args[0],
            "replicas": [run.master.replicas, run.worker.replicas], "nProcPerNode": run.n_proc_per_node}

print(json.dumps([render(params) for params in json.loads(sys.argv[1])]))
"""


def render_pytorchjob(home: Path, *params: dict) -> list[dict]:
    """The container scripts as Polyaxon's own compiler resolves them for each set of params
    (one interpreter for all: Polyaxon's import is most of a render's cost)."""
    result = subprocess.run([sys.executable, "-c", RENDER, json.dumps(params)], cwd=REPO, capture_output=True,
                            text=True, timeout=scaled(600), env={**os.environ, "HOME": str(home)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ pure logic, no processes
EXIT_PROBE = """
import atexit, os, runpy, sys
class Teardown:
    def __del__(self):
        os.write(1, b"interpreter teardown ran\\n")
probe = Teardown()
atexit.register(lambda: os.write(1, b"exit handlers ran\\n"))
sys.argv = ["trainer", "list", sys.argv[1]]
runpy.run_module("trainer", run_name="__main__")
"""


@pytest.mark.parametrize("world_size, teardown", [("1", True), ("2", False)])
def test_one_of_several_processes_skips_the_teardown_but_not_the_exit_handlers(tmp_path, world_size, teardown):
    """A rank of a multi-process launch leaves with os._exit after running the exit handlers
    and flushing its streams, so torch's C++ threads cannot abort it during the interpreter's
    teardown; a single process still exits normally."""
    env = clean_environment(WORLD_SIZE=world_size, RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    result = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(tmp_path / "missing")], cwd=REPO,
                            capture_output=True, text=True, timeout=scaled(300), env=env)
    assert result.returncode == 66, result.stderr
    assert one_error_line(result).startswith("trainer: error: ") and "does not exist" in result.stderr
    assert "exit handlers ran" in result.stdout
    assert ("interpreter teardown ran" in result.stdout) is teardown


def test_launch_environment_reads_the_launcher_variables():
    from trainer.errors import UsageError
    from trainer.parallel.launch import LaunchEnvironment

    assert LaunchEnvironment.from_environ({}) == LaunchEnvironment()
    assert not LaunchEnvironment.from_environ({"WORLD_SIZE": "1", "RANK": "0"}).distributed
    two = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "master", "MASTER_PORT": "29500"}
    assert LaunchEnvironment.from_environ(two) == LaunchEnvironment(rank=1, world_size=2, local_rank=1,
                                                                    master_addr="master", master_port=29500)
    restarted = LaunchEnvironment.from_environ({**two, "TORCHELASTIC_RESTART_COUNT": "2",
                                                "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (restarted.restart, restarted.agent_store) == (2, True)
    for broken, reason in [({**two, "MASTER_ADDR": ""}, "MASTER_ADDR not set"),
                           ({**two, "RANK": "2"}, "not below WORLD_SIZE"),
                           ({**two, "WORLD_SIZE": "two"}, "not an integer")]:
        with pytest.raises(UsageError, match=reason):
            LaunchEnvironment.from_environ(broken)


def test_rank_slices_together_are_exactly_the_global_batch():
    from trainer.data.order import EpochBatchOrder, EpochShape, uneven_split

    whole = list(EpochBatchOrder(EpochShape(128, 16), 1234, epoch=3, start_batch=5))
    slices = [list(EpochBatchOrder(EpochShape(128, 16), 1234, 3, 5, rank, 2)) for rank in (0, 1)]
    assert len(whole) == len(slices[0]) == len(slices[1]) == 3
    for batch, first, second in zip(whole, *slices):
        assert len(first) == len(second) == 8 and sorted(first + second) == sorted(batch)
    assert uneven_split(EpochShape(128, 16), 2) is None
    assert "does not divide evenly across 3 processes" in uneven_split(EpochShape(128, 16), 3)
    assert uneven_split(EpochShape(100, 16), 8) is None, "--last-batch pad weighs the last batch's shares"
    assert "last batch of an epoch: 4" in uneven_split(EpochShape(100, 16, "refuse"), 8)
    assert "larger than the 10 samples" in uneven_split(EpochShape(10, 16, "drop"), 1)
    assert uneven_split(EpochShape(0, 16), 3) is None, "a loop that batches its own data (HF's Trainer) shares nothing"


def test_each_rank_finds_its_own_rng_entry_in_any_layout():
    from trainer.run.state import stored_rng_key, stored_world_size

    single = {"rng.torch": 0, "rng.python.internal": 0}
    two = {f"rng_by_rank.{r}.torch": 0 for r in (0, 1)}
    assert (stored_world_size(single), stored_world_size(two)) == (1, 2)
    assert stored_rng_key(single, 0) == ("rng",) and stored_rng_key(single, 1) is None
    assert stored_rng_key(two, 0) == ("rng_by_rank", "0") and stored_rng_key(two, 1) == ("rng_by_rank", "1")
    assert stored_rng_key(two, 2) is None
