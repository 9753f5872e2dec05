"""A failure costs seconds: no rank waits on a dead or frozen peer, torchrun's agent restarts
the workers in place from tier 0, and nothing a dead process leaves behind refuses its successor.

End to end under real torchrun (gloo on loopback) with real signals:
- a frozen rank (SIGSTOP): the other rank ends within the bound (`--peer-timeout-secs`, the
  fallback, with sync saves; its silence, `--peer-silence-secs`, with async saves: the async
  save's background groups must not hold it either), exit 75, one line naming rank 1 as
  unresponsive, recorded as `interrupted` with the peer. About 10 s each.
- kill -9 of rank 1 under `torchrun --max-restarts 1` (the static rendezvous; the c10d one in
  test_bench.py's restart_bench run): the surviving rank names rank 1 as gone
  (not the model's error), the agent restarts both workers in place, they rejoin the first time,
  restore the newest generation from tier 0 and end bit-identical to the uninterrupted run;
  `report` shows R from the last step to the next first step. About 15 s.
- a trainer with DataLoader workers killed with -9 and restarted at once is not refused (its
  orphaned workers do not hold the lock), while a live second trainer still is (73). About 6 s.
- 3 ranks, kill -9 of rank 1: rank 2 names it and exits 75 first; rank 0, finding the loss after
  rank 2 ended, names rank 1 alone (the survivor marked itself as left). About 8 s.
The auto bound's arithmetic is tested without processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import compare, run_cli, start, wait_for_line
from support.limits import scaled
from support.runs import FINAL_2P, attempts, generation
from support.runs import TWO_PROCESS_EPOCHS as EPOCHS
from support.torchrun import clean_environment, free_port, launch as launch_torchrun, rank_processes
from test_spare import wait_gone
from trainer.config import PeerWaitConfig
from trainer.parallel.ranks import StepPace, _what_happened

BOUND_S = 3


def test_the_peers_bound_follows_the_steps_of_its_kind_with_a_floor_and_torchs_default_before():
    wait = PeerWaitConfig()
    pace = StepPace(wait)
    assert pace.agreed(100.0, saves=False) == wait.first_s == 1800.0  # nothing measured: torch's own default
    assert pace.agreed(100.5, saves=True) == wait.first_s  # no step with a save measured yet
    assert pace.agreed(104.5, saves=False) == wait.floor_s  # 0.5 s steps: 10 x 0.5 s is under the floor
    assert pace.agreed(105.0, saves=True) == 10 * 4.0  # the save step took 4 s
    pace.agreed(110.0, saves=False)  # a slow step with a save (5 s): a second interval of its kind
    assert pace.typical("step") == 0.5 and pace.typical("save") == 5.0
    assert pace.agreed(120.0, saves=False) == wait.floor_s  # a single 10 s step (an outlier) does not set it
    assert StepPace(PeerWaitConfig(timeout_s=7.0)).agreed(0.0, saves=False) == 7.0


@pytest.mark.parametrize("silent,verdict,timed_out,expected", [
    ([1], None, False, "rank 1 is gone: its connection closed while stepping and its heartbeat stopped (the process died"),
    ([0, 2], None, False, "ranks 0, 2 are gone: their connections closed while stepping and their heartbeats stopped "
                          "(the processes died or their nodes went away)"),
    ([0, 2], None, True, "ranks 0, 2 stopped answering: no reply within 9 s while stepping, and their heartbeats stopped"),
    ([0, 2], {"silent_s": 8, "ended": [2]}, False, "ranks 0, 2 stopped answering: their heartbeats were silent for 8 s"),
])
def test_the_lost_peer_line_names_one_rank_or_several_in_grammar(silent, verdict, timed_out, expected):
    """Rank 0 may name the killed rank and one its agent already stopped beside it."""
    line = _what_happened(RuntimeError("closed"), "stepping", silent, verdict, timed_out, 9.0)[1]
    assert line.startswith(expected), line
    assert line.endswith("; ended the process of rank 2 on this host (SIGKILL)") == bool(verdict), line


SURVIVOR_ENDS_FIRST = """
import os, signal, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from trainer import recovery

out = Path(sys.argv[1])
recovery.seed_everything(0)
model = nn.Linear(2, 1)
with recovery.open_run(out / "run") as run:
    (out / f"pid-{run.rank}").write_text(str(os.getpid()))
    pair = dist.new_group([1, 2])  # a collective in which rank 2 finds the loss without rank 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.restore(model, optimizer)
    run.step(torch.tensor(0.0))  # every rank alive
    if run.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if run.rank == 2:  # finds the loss first, names rank 1 and ends by itself (75)
        dist.all_reduce(torch.zeros(1), group=pair)
    survivor = Path(f"/proc/{(out / 'pid-2').read_text()}")  # rank 0 finds the loss once rank 2 ended
    while survivor.exists() and (survivor / "stat").read_text().split(") ")[1][0] != "Z":
        time.sleep(0.05)
    run.step(torch.tensor(0.0))
"""


def test_a_survivor_that_ended_after_naming_the_lost_rank_is_not_named_lost_itself(tmp_path):
    """3 ranks, kill -9 of rank 1: rank 2 finds the loss first, names rank 1 and exits 75;
    rank 0, finding it after rank 2's process ended, names rank 1 alone (it said "ranks 1, 2 are
    gone": rank 2 had not marked itself as left, `process_group`). Forked ranks, no agent.
    Cost: ~1 CPU-s (TEST_CPU_LOG: the ranks forked from the zygote), ~8 s of wall."""
    script = tmp_path / "survivor_ends_first.py"
    script.write_text(SURVIVOR_ENDS_FIRST)
    ranks = rank_processes([str(script), str(tmp_path)], 3, expect=None, timeout=120)
    assert [rank.returncode for rank in ranks] == [75, -signal.SIGKILL, 75], [rank.stderr[-2000:] for rank in ranks]
    for rank in (0, 2):
        lost = [line for line in ranks[rank].stderr.splitlines() if "gone" in line]
        assert len(lost) == 1 and "error: rank 1 is gone: its connection closed" in lost[0], ranks[rank].stderr
    assert attempts(tmp_path / "run")[-1]["peer"]["ranks"] == [1]


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the worker of `rank` among the launcher's children (its environment says)."""
    for child in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under {launcher_pid}")


def launch(tmp_path: Path, run: Path, *args, restarts: int = 0, static: bool = False) -> tuple[subprocess.Popen, Path]:
    """torchrun with 2 processes: `--standalone` (the c10d rendezvous), or `static` (a fixed
    master address and port, as the PyTorchJob launches it)."""
    status = tmp_path / "status"
    rendezvous = ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())] if static \
        else ["--standalone"]
    command = [*rendezvous, "--nproc_per_node", "2", "--max-restarts", str(restarts),
               "-m", "trainer", "--output", str(run), "--threads", "1", "--epochs", str(EPOCHS),
               "--log-every-steps", "1", *map(str, args)]
    return launch_torchrun(command, clean_environment(TRAINER_EXIT_STATUS_FILE=str(status))), status


@pytest.mark.parametrize("mode,found_by", [("sync", "timeout"), ("async", "silence")])
def test_a_frozen_rank_ends_the_other_within_the_bound_naming_it_resumable(mode, found_by, tmp_path):
    """By its silence (`--peer-silence-secs`), or, where that is longer, by the collectives'
    fallback bound (`--peer-timeout-secs`): either way one line naming rank 1, 75."""
    run = tmp_path / "run"
    bounds = ("--peer-timeout-secs", BOUND_S, "--background-timeout-secs", BOUND_S, "--peer-silence-secs", 60) \
        if found_by == "timeout" else ("--peer-silence-secs", BOUND_S)
    process, status = launch(tmp_path, run, "--checkpoint-mode", mode, "--recover-every-steps", 2, *bounds)
    frozen = None
    try:
        wait_for_line(process, "step=6 ")
        frozen = rank_pid(process.pid, 1)
        os.kill(frozen, signal.SIGSTOP)  # a hung device, a silent NIC, a paused VM
        stopped = time.monotonic()
        while not status.exists() and time.monotonic() - stopped < scaled(60):
            time.sleep(0.05)
        waited = time.monotonic() - stopped
        assert status.exists(), "rank 0 still waits for the frozen rank"
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):  # rank 0 ended it already (same host) and the agent reaped it
                os.kill(frozen, signal.SIGKILL)  # else torchrun's agent gives the stopped process 30 s
        out, err = process.communicate(timeout=scaled(60))
    assert int(status.read_text()) == 75, err[-3000:]
    assert waited < BOUND_S + scaled(15), f"rank 0 took {waited:.1f} s for a {BOUND_S} s bound"
    lines = [line for line in err.splitlines() if line.startswith("trainer:")]
    said = "no reply within 3 s" if found_by == "timeout" else "its heartbeat was silent for"
    assert len(lines) == 1 and lines[0].startswith(f"trainer: error: rank 1 stopped answering: {said}"), err[-3000:]
    assert "Traceback" not in err.split("torchrun")[0] and "the model or its loss" not in err
    record = attempts(run)[-1]
    assert (record["status"], record["exit_code"], record["peer"]) == \
        ("interrupted", 75, {"state": "unresponsive", "ranks": [1]})
    # every generation committed before the freeze is in the record (an async commit too)
    on_disk = sorted(path.parent.name for path in generation(run, "").glob("step-*/manifest.json"))
    assert on_disk and [entry["name"] for entry in record["generations_published"]] == on_disk, record


def test_a_rank_killed_under_max_restarts_restarts_in_place_from_tier0_and_ends_exact(tmp_path, baseline_2p):
    """The static rendezvous, as pytorchjob.yaml launches it (bench/restart_bench.py, which the
    suite runs at --quick with its checks, does the same under --standalone's c10d). The
    restarted workers come from the warm spare (trainer/parallel/spare.py; its mechanics without
    torch: tests/test_spare.py)."""
    run, memory = tmp_path / "run", tmp_path / "memory"
    process, status = launch(tmp_path, run, "--resume", "auto", "--recover-every-steps", 4, "--memory-dir", memory,
                             "--memory-every-steps", 1, restarts=1, static=True)
    try:
        spare = int(wait_for_line(process, "warm spare: pid ").split()[3])
        wait_for_line(process, "step=10 ")
        os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
        out, err = process.communicate(timeout=scaled(300))
    finally:
        process.kill()
    assert process.returncode == 0 and int(status.read_text()) == 0, err[-3000:]
    lost = [line for line in err.splitlines() if line.startswith("trainer:")]
    assert lost and lost[0].startswith("trainer: error: rank 1 is gone: its connection closed"), err[-3000:]
    assert "could not join" not in err and "the model or its loss" not in err
    # step 10's tier-0 save of rank 1 may or may not have been written when it died: 9 or 10
    assert re.search(r"restored step-000000(09|10) \(step=(9|10) epoch=1 position=[12]\) from tier 0", out), out[-2000:]
    first, second = attempts(run)
    assert (first["status"], first["peer"]) == ("interrupted", {"state": "lost", "ranks": [1]})
    assert second["restored"]["tier"] == "memory" and second["status"] == "completed"
    # the restarted workers were forked from the warm spare (no imports), which ended with the launch
    assert (first["warm_spare"], second["warm_spare"]) == (False, True)
    assert "warm spare" not in out and wait_gone(spare), "a second spare, or the spare outlived the launch"
    assert compare(generation(baseline_2p, FINAL_2P), generation(run, FINAL_2P)).returncode == 0
    report = run_cli("report", run)
    assert "R " in report.stdout and "from attempt 1's last step to this one's first" in report.stdout, report.stdout
    # the tier-0 generation's samples count too (its ledger entry is in no durable record)
    assert "256 samples: none repeated or skipped" in report.stdout, report.stdout


def test_a_killed_trainer_with_dataloader_workers_restarts_at_once_while_a_live_one_is_refused(tmp_path):
    run = tmp_path / "run"
    first = start(run, "--num-workers", 2, "--epochs", 40)
    try:
        wait_for_line(first, "step=3 ")
        second = run_cli("--output", run, "--num-workers", 2, "--resume", "auto")
        assert second.returncode == 73 and "is in use by another trainer" in second.stderr, second.stderr
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        # its DataLoader workers live on for a few seconds (until their parent check fires)
        restarted = run_cli("--output", run, "--num-workers", 2, "--epochs", 1, "--resume", "auto")
    finally:
        first.kill()
        first.communicate()
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert "restored step-" in restarted.stdout
    records = attempts(run)
    assert [r["status"] for r in records][-1] == "completed"
    assert json.loads((run / ".trainer.storage.lock").read_text() or "{}") == {}  # released: names no holder
