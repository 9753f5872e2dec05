"""Recovery in a user's own loop under torchrun (trainer/recovery/, docs/library.md): the example
examples/own_loop_ddp.py, a plain loop whose model the script wraps itself (DDP or FSDP2), run by
real `torchrun` on gloo, a rank killed with kill -9 mid-epoch and restarted in place by
`--max-restarts`, then SIGTERM to torchrun (every rank saves, the status file says 75), then a
fresh launch that resumes: the final generation equal field by field to an uninterrupted run at
the same world size, and the witness's every check passed.

One torchrun launch does the kill and its resume (the agent restarts the workers in place) and
the SIGTERM; the resume after it and the uninterrupted run fork their ranks from the zygote with
the variables a launcher sets (no agent, no fresh interpreters: a launcher changes no bit), the
uninterrupted run one per world size and bits, shared by the cells whose bits are the same.
Two epochs (18 steps): the kill lands in the first, the SIGTERM in the second. Cost (TEST_CPU_LOG,
alone, load 6 to 13): 115 CPU-s for the four cells with torchrun's agent forked from the zygote
(support.torchrun.launch; 139 before), 209 s of wall. Odd world sizes are
where a reduction's order shows, so DDP and FSDP2 run at 3; at 2 both restart from tier 0
(`memory=`), and FSDP2's run ends equal to DDP's uninterrupted one (a mean of two gradients is
the same bits in either order: one baseline).
The DDP cell at 3 reads a stream (`KeyedData` over shards, 6 lanes) and its ledger is checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

from support.cli import REPO, compare, finish, run_cli, wait_for_line, zygote
from support.limits import scaled, wait_until
from support.runs import attempts, generation, made_once
from support.torchrun import clean_environment, forked_ranks, free_port, rank_environment, rank_processes
from support.torchrun import launch as launch_torchrun
from test_peer_failures import rank_pid

EXAMPLE = REPO / "examples" / "own_loop_ddp.py"
FINAL = "step-00000018"
"""2 epochs of 9 global batches (8 of 12 samples and a ragged one of 4, shared unevenly by 3 ranks)."""
EPOCHS = ("--epochs", "2")


def launch(run: Path, nproc: int, *args, restarts: int = 0, status: Path | None = None,
           warm: bool = False) -> subprocess.Popen:
    """`torchrun` (its agent forked from the zygote: support.torchrun.launch) running the example
    (`warm`: through the launch entry, `-m trainer.launch`, and its warm spare)."""
    entry = ["-m", "trainer.launch"] if warm else []
    command = ["--standalone", "--nproc_per_node", nproc, "--max-restarts", restarts, *entry, EXAMPLE, run, *EPOCHS,
               *args]
    env = clean_environment(**({"TRAINER_EXIT_STATUS_FILE": str(status)} if status else {}))
    return launch_torchrun(command, env)


def stop_all(process: subprocess.Popen) -> None:
    """kill -9 torchrun's workers (each in a session of its own), then torchrun."""
    if process.poll() is None:
        for child in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)
        process.kill()


@contextlib.contextmanager
def bounded(process: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """`process`, stopped (workers and all) if it outlives the limit, so a wait for its next
    line ends; and on every way out."""
    watchdog = threading.Timer(scaled(600), stop_all, (process,))
    watchdog.start()
    try:
        yield process
    finally:
        watchdog.cancel()
        stop_all(process)


def baseline(tmp_path_factory, nproc: int, options: list[str]) -> Path:
    """The uninterrupted run of the example at `nproc` ranks with the options that shape its bits,
    made once per session, its ranks forked from the zygote (no torchrun: the bits are the
    same under any launcher). Not tier 0 nor async saves (neither changes a bit), and at 2 ranks
    DDP's run for FSDP2's too (FSDP2's reduce-scatter mean of two gradients is DDP's all-reduce
    mean bit for bit: a sum of two is the same in either order; at 3 they differ)."""
    shaping = resume_options(options)
    if nproc == 2:
        shaping = [option if option != "fsdp" else "ddp" for option in shaping]
    return made_once(tmp_path_factory, "own-loop-" + "".join(shaping).replace("--", "-") + f"-{nproc}p",
                     lambda folder: forked_ranks(EXAMPLE, folder / "run", *EPOCHS, *shaping, nproc=nproc)) / "run"


def resume_options(options: list[str]) -> list[str]:
    """`options` less tier 0, the checkpoint mode and who creates the group: the fresh launch
    restores from the disk (the SIGTERM's generation) and saves sync (the same bytes as async),
    and none of them changes a bit."""
    kept, skip = [], False
    for option in options:
        if not skip and option not in ("--memory-dir", "--checkpoint-mode", "--init-first"):
            kept.append(option)
        skip = not skip and option in ("--memory-dir", "--checkpoint-mode")
    return kept


CELLS = {
    # id: (ranks, the example's options, the resume's own: what only this cell proves)
    "ddp-3-stream": (3, ("--data-parallel", "ddp", "--stream"), ("--init-first",)),  # a stream in 6 lanes (each
    # rank reads 2), its cursor restored; the resume in the script's own group, joined before open_run
    "fsdp-3": (3, ("--data-parallel", "fsdp", "--checkpoint-mode", "async"), ()),  # FSDP2, async saves: each
    # rank stages and writes its own shards, restores its own (the resume saves sync: the same bytes)
    "ddp-2-tier0": (2, ("--data-parallel", "ddp", "--memory-dir", "{memory}", "--init-first"), ()),  # the restart
    # from tier 0, the script's own `init_process_group` before open_run rejoining (trainer/parallel/rendezvous.py)
    "fsdp-2-tier0": (2, ("--data-parallel", "fsdp", "--memory-dir", "{memory}"), ()),  # FSDP2's shards in tier 0
}
"""`--init-first` under `--max-restarts`: torch's own `init_process_group` (2.13, --standalone) reads the
same keys every round in the agent's store, and rejoins only by luck; the library and the launch entry
key `env://` by round (trainer/parallel/rendezvous.py; the race itself: tests/test_rejoin.py)."""
WARM = {"ddp-2-tier0"}
"""The cells launched through `-m trainer.launch` (trainer/launch.py): the restarted workers are the
warm spare's forks, the script run from the top in each."""


@pytest.mark.parametrize("cell", CELLS)
def test_a_killed_rank_restarted_in_place_then_sigterm_resumes_equal_to_an_uninterrupted_run(
        tmp_path, tmp_path_factory, cell):
    nproc, options, resumed_with = CELLS[cell]
    options = [str(option).format(memory=tmp_path / "memory") for option in options]
    reference = baseline(tmp_path_factory, nproc, options)
    run, status = tmp_path / "run", tmp_path / "status"

    with bounded(launch(run, nproc, *options, restarts=1, status=status, warm=cell in WARM)) as process:
        wait_for_line(process, "step=6 ")  # mid-epoch 0: the newest generation is step 4 (or tier 0's)
        # An async save of step 4 may still be in flight on a loaded machine: kill once it committed.
        wait_until(lambda: (generation(run, "step-00000004") / "manifest.json").exists(), "step 4 committed")
        os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
        wait_for_line(process, "from step=")  # the agent restarted every rank in place, and they restored
        wait_for_line(process, "step=10 ")  # in the second epoch
        process.send_signal(signal.SIGTERM)  # torchrun passes it to every rank: all save one step, exit 75
        out, err = finish(process, 600)
    assert process.returncode != 0 and int(status.read_text()) == 75, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("trainer:")]
    # rank 0's line names rank 1; a rank the agent already stopped may be named beside it (known: not the culprit alone)
    named = [re.match(r"trainer: error: ranks? ([\d, ]+) (is|are) gone", line) for line in lines]
    assert any(match and 1 in map(int, match[1].split(", ")) for match in named), err[-3000:]
    assert lines[-1].startswith("trainer: stopped, resumable (exit 75): SIGTERM after step "), err[-3000:]
    first, restarted = attempts(run)
    assert first["status"] == "interrupted" and first["peer"]["state"] == "lost" and 1 in first["peer"]["ranks"], first
    assert restarted["status"] == "preempted" and restarted["world_size"] == nproc
    assert restarted["restored"]["tier"] == ("memory" if "--memory-dir" in options else "disk")
    assert restarted["warm_spare"] == (cell in WARM), restarted  # forked from the spare with every import done
    stopped_at = restarted["last_step"]
    assert generation(run, f"step-{stopped_at:08d}").is_dir()  # every rank's shards of the step reached

    # A fresh start of every rank, forked as a launcher starts them (the launch above is torchrun's):
    err = "".join(rank.stderr for rank in rank_processes(
        [str(EXAMPLE), str(run), *EPOCHS, *resume_options(options), *resumed_with], nproc, expect=0))
    # Said without the script configuring logging, by rank 0 alone:
    said = [line for line in err.splitlines() if line.startswith("restored ")]
    assert len(said) == 1 and said[0].startswith(f"restored step-{stopped_at:08d} (step={stopped_at} "), err[-3000:]
    assert "from the local disk" in said[0]

    compared = compare(generation(reference, FINAL), generation(run, FINAL))
    assert compared.returncode == 0, compared.stdout
    assert f"rng_by_rank.{nproc - 1}.torch" in compared.stdout  # every rank's own state, compared
    if "--stream" in options:  # the stream's cursor (the run's 6 lanes, where each lane's block starts), compared
        assert "stream.run_lanes " in compared.stdout and "stream.blocks " in compared.stdout, compared.stdout
    if "async" not in options:  # the samples of every step, in the uninterrupted run's order (the stream's too)
        assert "ledgers: same samples in the same order since step 0" in compared.stdout, compared.stdout
    report = run_cli("report", run)
    assert "NOT EXACT" not in report.stdout, report.stdout
    # tier 0 every step may leave the kill's resume nothing to replay: "not compared", never "passed"
    assert "exactness witness  every check passed" in report.stdout or \
        "--memory-dir" in options and "matched; not compared: 1 replay" in report.stdout, report.stdout
    assert "samples: none repeated or skipped" in report.stdout, report.stdout
    if "async" not in options:  # a lost peer's attempt may not record its last async generation's samples
        assert "200 samples: none repeated or skipped" in report.stdout, report.stdout
    records = attempts(run)
    assert [r["status"] for r in records] == ["interrupted", "preempted", "completed"]
    assert all(record["restore_check"]["matched"] for record in records[1:])
    replay = records[1]["replay"]  # tier 0 every step may leave none to replay: not compared
    assert replay.get("compared") is False and "--memory-dir" in options or replay["matched"] == replay["of"] > 0
    assert records[2]["replay"]["matched"] == records[2]["replay"]["of"] == 1  # the step after the stop's save


def test_fsdp2_in_one_process_killed_then_preempted_resumes_equal_to_an_uninterrupted_run(tmp_path, tmp_path_factory):
    """The FSDP2 row's 1-process cell: a script that starts its own group of one (as one GPU's
    FSDP2 run does) and shards its model with `fully_shard` over it, started as any launcher
    starts rank 0 of 1 (forked: no agent to test at one rank); kill -9 mid-epoch, resumed;
    SIGTERM (75), resumed; equal to the uninterrupted run, the witness's every check passed.
    Cost: four forked processes, about 8 CPU-s."""
    options = ("--data-parallel", "fsdp", "--init-first")
    reference = made_once(tmp_path_factory, "own-loop-fsdp-1p",
                          lambda folder: forked_ranks(EXAMPLE, folder / "run", *EPOCHS, *options, nproc=1)) / "run"
    run = tmp_path / "run"

    def started() -> subprocess.Popen:
        return zygote().spawn([str(EXAMPLE), str(run), *EPOCHS, *options], REPO,
                              rank_environment(0, 1, free_port()), new_session=False)

    killed = started()
    wait_for_line(killed, "step=6 ")  # mid-epoch 0: the newest generation is step 4's
    killed.kill()
    finish(killed)
    assert killed.returncode == -signal.SIGKILL and (generation(run, "step-00000004") / "manifest.json").exists()

    stopped = started()
    assert wait_for_line(stopped, "from step=").startswith("from step=4 ")
    wait_for_line(stopped, "step=10 ")
    stopped.send_signal(signal.SIGTERM)
    out, err = finish(stopped)
    assert stopped.returncode == 75 and "stopped, resumable (exit 75)" in err, err[-3000:]

    resumed = started()
    out, err = finish(resumed)
    assert resumed.returncode == 0, err[-3000:]
    compared = compare(generation(reference, FINAL), generation(run, FINAL))
    assert compared.returncode == 0, compared.stdout
    assert "ledgers: same samples in the same order since step 0" in compared.stdout, compared.stdout
    report = run_cli("report", run)
    assert "exactness witness  every check passed" in report.stdout and "NOT EXACT" not in report.stdout, report.stdout
    records = attempts(run)
    assert [r["status"] for r in records] == ["running", "preempted", "completed"], records
    assert records[1]["restored"]["name"] == "step-00000004" and records[1]["replay"]["matched"] == records[1]["replay"]["of"] > 0
    assert all(record["restore_check"]["matched"] for record in records[1:])
    manifest = json.loads((generation(run, FINAL) / "manifest.json").read_text())
    assert manifest["fingerprint"]["config"]["data_parallel"] == "fsdp"  # sharded, not taken for a plain model


ACCELERATE_WITHOUT_MODEL = """
import sys
import torch
from accelerate import Accelerator
from trainer import recovery
from trainer.recovery import accelerated

accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
prepared, optimizer = accelerator.prepare(model, optimizer)
with recovery.open_run(sys.argv[1]) as run:
    accelerated.load_state(accelerator, run, model=None if sys.argv[2] == "none" else model)
"""


def test_accelerates_load_state_on_two_processes_without_the_prepared_model_is_one_line_and_exit_2(tmp_path):
    """Issue 57: without `model=` (or with the unwrapped model) Accelerate's ranks trained under
    DDP's own reduction, and a resume was silently not exact at 3 processes. Accelerate keeps
    only the unwrapped model, so the run cannot find the wrapper: refused, naming `model=`.
    Cost: two forked ranks importing accelerate, about 6 CPU-s."""
    script = tmp_path / "accelerate_without_model.py"
    script.write_text(ACCELERATE_WITHOUT_MODEL)
    for given in ("none", "unwrapped"):
        ranks = rank_processes([str(script), str(tmp_path / given), given], 2, expect=2)
        lines = [line for line in ranks[0].stderr.splitlines() if line.startswith("trainer: error:")]
        assert len(lines) == 1 and "accelerated.load_state on 2 processes needs model=" in lines[0], ranks[0].stderr
        assert "Traceback" not in ranks[0].stderr + ranks[1].stderr


SHARED_COPY = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from trainer.checkpoint.snapshot import write_snapshot

dist.init_process_group("gloo")
rank = dist.get_rank()
# the model first: DCP's own planner gives rank 0 its copy, then the next duplicate to the smaller plan (rank 1)
write_snapshot({"model": {"weight": torch.ones(1000)}, "workload": {"best": torch.tensor(float(rank))}},
               Path(sys.argv[1]))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_shared_extra_that_the_ranks_hold_differently_is_stored_as_rank_0s(tmp_path):
    """Issue 57: DCP keeps one copy of an entry every rank saves under one key, from whichever
    rank's plan is smallest; a loop's `extras` (then all shared) came back as rank 1's. The
    shared section is kept from rank 0 (`RankZeroCopies`). Cost: two forked ranks, about 2 CPU-s."""
    import torch
    import torch.distributed.checkpoint as dcp

    script, directory = tmp_path / "shared_copy.py", tmp_path / "snapshot"
    script.write_text(SHARED_COPY)
    directory.mkdir()
    rank_processes([str(script), str(directory)], 2, expect=0)
    loaded = {"model": {"weight": torch.zeros(1000)}, "workload": {"best": torch.tensor(-1.0)}}
    dcp.load(loaded, checkpoint_id=directory, no_dist=True)
    assert loaded["workload"]["best"].item() == 0.0 and loaded["model"]["weight"].sum().item() == 1000
