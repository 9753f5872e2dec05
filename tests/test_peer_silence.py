"""A frozen rank is found by its silence: every rank watches the others' heartbeats, and a peer
whose counter stood still for `--peer-silence-secs` is named, ended if it runs on this host, and
the survivors leave whatever they waited in, exit 75, whatever the step time. A slow but living
rank keeps beating and is never named. A restarted round whose peer never comes ends in one line.

End to end under real torchrun (gloo on loopback), real SIGSTOP, steps that sleep (wall time, not
CPU: tests/workloads/slow_steps.py), no assertion on speed (bench/restart_bench.py measures it):
- rank 1 SIGSTOPped after step 2 of 2 s steps, `--max-restarts 1`, tier 0: rank 0 names rank 1,
  ends it, the agent restarts both in place (no 30 s grace for a stopped worker) and the run
  ends bit-identical to an uninterrupted one;
- a step of rank 1 twenty times longer than the others and a save of rank 1 longer than the
  silence bound: the run completes, nobody is named;
- a restarted round (torchrun's restart count 1) whose peer never comes: one line, 75.
- three ranks, rank 1 frozen: ranks 0 and 2 each end 75 with one line naming rank 1.
- `recovery.open_run` in the script's own process group, rank 1 in a pid namespace of its own
  (another pod on the node: never ended from here) frozen: rank 0 cuts the group's connections
  found through the ranks' listeners and ends 75 in one line, with a 30-minute bound.
The pure parts (the robust bound, the ring of watchers, proving a pid is the peer's) are tested
without torchrun. Cost (TEST_CPU_LOG, load average about 12 from other jobs): the frozen rank's
restart 29 s of CPU with its baseline (69 s of wall, plus 35 s for the shared baseline), the
slow rank 11 s (33 s wall), three ranks 12 s (20 s wall), the restarted round 3 s (8 s wall), the
script's own group 4 s counted (rank 1, reaped outside the test, about 3 s more; 41 s wall, load 8).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import REPO, compare, wait_for_line
from support.limits import scaled
from support.runs import attempts, generation, made_once
from support.torchrun import clean_environment, free_port, torchrun, trainer_ranks
from support.torchrun import launch as launch_torchrun
from test_peer_failures import rank_pid
from trainer.config import PeerWaitConfig
from trainer.parallel.heartbeat import Heartbeat
from trainer.parallel.launch import LaunchEnvironment
from trainer.parallel.ranks import StepPace
from trainer.parallel.silence import GroupSockets, ProcessIdentity, end_if_here, is_dead_here

WORKLOAD = ("--workload", f"{REPO}/tests/workloads/slow_steps.py:SlowSteps", "--toy-samples", 24,
            "--batch-size", 4, "--epochs", 1)
FINAL = "step-00000006"
SILENCE_S = 4


@pytest.fixture(scope="module")
def baseline_slow(tmp_path_factory) -> Path:
    """The same workload without its sleeps (they come from the environment, unfingerprinted)."""
    return made_once(tmp_path_factory, "slow-steps-2p",
                     lambda folder: trainer_ranks(folder / "run", *WORKLOAD, nproc=2)) / "run"


def test_the_fallback_bound_ignores_the_first_interval_and_one_outlier():
    wait = PeerWaitConfig()
    pace = StepPace(wait)
    assert pace.agreed(100.0, saves=False) == wait.first_s == 1800.0  # nothing measured: torch's own default
    assert pace.agreed(120.0, saves=False) == 10 * 20.0  # only the first interval (a compile): it stands alone
    assert pace.agreed(124.0, saves=False) == 10 * 4.0  # a second: the first no longer counts
    assert pace.agreed(164.0, saves=False) == 10 * 4.0  # one loaded moment (40 s): the second slowest rules
    assert pace.agreed(169.0, saves=False) == 10 * 5.0  # a slow interval that repeats does count
    assert pace.agreed(169.5, saves=True) == wait.first_s  # no step with a save measured yet
    assert pace.agreed(170.0, saves=False) == 10 * 5.0
    assert StepPace(PeerWaitConfig(timeout_s=7.0)).agreed(0.0, saves=False) == 7.0
    assert (wait.join_bound_s(0), wait.join_bound_s(1)) == (wait.first_s, wait.rejoin_s)


def test_every_rank_is_watched_by_its_predecessors_in_a_ring():
    def watched(rank: int, size: int) -> list[int]:
        return Heartbeat(LaunchEnvironment(rank, size, master_addr="127.0.0.1", master_port=1)).watched()

    assert watched(3, 5) == [4, 0, 1, 2] and watched(0, 2) == [1] and watched(1, 2) == [0]
    assert watched(30, 32) == [31, *range(7)]  # WATCHED of them, not every rank: the store's load stays linear
    assert sorted(rank for watcher in range(32) for rank in watched(watcher, 32)) == sorted(list(range(32)) * 8)


def test_a_pid_is_ended_only_where_it_is_provably_the_peers(tmp_path):
    here = ProcessIdentity.of_this_process()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = int(Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        peer = ProcessIdentity(here.host, here.boot, here.pid_namespace, child.pid, started)
        elsewhere = ProcessIdentity(here.host, "another-boot", here.pid_namespace, child.pid, started)
        reused = ProcessIdentity(here.host, here.boot, here.pid_namespace, child.pid, started + 1)
        assert not end_if_here(elsewhere, here) and not end_if_here(reused, here)  # not provably the peer
        assert not end_if_here(peer, None) and not end_if_here(here, here)  # no identity; never itself
        assert child.poll() is None and not is_dead_here(peer, here)
        assert end_if_here(peer, here)
        assert child.wait(timeout=scaled(30)) == -signal.SIGKILL
        assert is_dead_here(peer, here) and not is_dead_here(elsewhere, here)
    finally:
        child.kill()
        child.wait()


def test_a_groups_connections_are_found_through_the_ranks_listeners_and_nothing_else_is_cut():
    """A group created before the run looked: its connections are the ones accepted on a rank's
    listener or connected to one (here: in this process, both ends), a listener bound to every
    address by its port alone; another connection and the listeners themselves are left alone."""
    opened = []

    def listening(host: str) -> socket.socket:
        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen()
        opened.append(sock)
        return sock

    def connected(to: socket.socket) -> tuple[socket.socket, socket.socket]:
        client = socket.create_connection(("127.0.0.1", to.getsockname()[1]))
        accepted = to.accept()[0]
        opened.extend((client, accepted))
        return client, accepted

    try:
        gloo, anywhere, other = listening("127.0.0.1"), listening("0.0.0.0"), listening("127.0.0.1")
        group = [*connected(gloo), *connected(anywhere)]
        unrelated = connected(other)
        sockets = GroupSockets(store_port=1)
        sockets.adopt([[("127.0.0.1", gloo.getsockname()[1])], [("0.0.0.0", anywhere.getsockname()[1])]])
        assert sockets.inodes == {os.fstat(sock.fileno()).st_ino for sock in group}
        assert sockets.cut() == 4
        assert all(sock.recv(1) == b"" for sock in group)  # shut down: a wait on them ends at once
        unrelated[0].sendall(b"x")
        assert unrelated[1].recv(1) == b"x" and gloo.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        for sock in opened:
            sock.close()


def launch(run: Path, status: Path, *args, env: dict) -> subprocess.Popen:
    command = ["--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "-m", "trainer",
               "--output", str(run), "--threads", "1", "--log-every-steps", "1", *map(str, (*WORKLOAD, *args))]
    return launch_torchrun(command, clean_environment(TRAINER_EXIT_STATUS_FILE=str(status), PYTHONUNBUFFERED="1", **env))


def frozen_at_step_2(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Rank 1 under torchrun `process` frozen by SIGSTOP once rank 0 printed `step=2` (a hung
    device, a silent NIC, a paused VM); the run left to end (killed past the scaled `timeout`);
    rank 1 killed after. Rank 1's pid and torchrun's stderr."""
    frozen = None
    try:
        wait_for_line(process, "step=2 ")
        frozen = rank_pid(process.pid, 1)
        os.kill(frozen, signal.SIGSTOP)
        _, err = process.communicate(timeout=scaled(timeout))
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.kill()
    return frozen, err


def test_a_frozen_rank_with_slow_steps_is_named_by_its_silence_ended_and_the_restart_is_exact(tmp_path, baseline_slow):
    run, status = tmp_path / "run", tmp_path / "status"
    process = launch(run, status, "--resume", "auto", "--memory-dir", tmp_path / "memory", "--memory-every-steps", 1,
                     "--peer-silence-secs", SILENCE_S, env={"SLOW_STEP_SECS": "2"})
    frozen, err = frozen_at_step_2(process, timeout=180)
    assert process.returncode == 0 and int(status.read_text()) == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("trainer:")]
    assert len(lines) == 1 and lines[0].startswith("trainer: error: rank 1 stopped answering: its heartbeat was "
                                                   "silent for "), err[-3000:]
    assert "ended its process on this host (SIGKILL)" in lines[0] and "Traceback" not in err.split("torchrun")[0]
    assert Path(f"/proc/{frozen}").exists() is False or "Z" in Path(f"/proc/{frozen}/stat").read_text().split()[2]
    first, second = attempts(run)
    assert (first["status"], first["exit_code"], first["peer"]) == \
        ("interrupted", 75, {"state": "unresponsive", "ranks": [1]})
    assert second["restored"]["tier"] == "memory" and second["status"] == "completed"
    assert compare(generation(baseline_slow, FINAL), generation(run, FINAL)).returncode == 0


def test_a_slow_step_and_a_long_save_of_a_living_rank_are_never_named_frozen(tmp_path):
    """Rank 1's step 3 sleeps 20 x a step and its first save sleeps past the silence bound: its
    heartbeat goes on, so the run completes and nobody is named."""
    result = torchrun(tmp_path / "run", *WORKLOAD, "--recover-every-steps", 4, "--peer-silence-secs", SILENCE_S,
                      tmp=tmp_path, env={"SLOW_STEP_SECS": "0.25", "SLOW_AT_STEP": "3", "SLOW_EXTRA_SECS": "5",
                                         "SLOW_SAVE_SECS": str(SILENCE_S + 3), "SLOW_RANK": "1"})
    assert not [line for line in result.stderr.splitlines() if line.startswith("trainer:")], result.stderr[-3000:]
    assert attempts(tmp_path / "run")[-1]["status"] == "completed"


def test_a_restarted_round_whose_peer_never_comes_ends_in_one_line(tmp_path):
    """Rank 0 of round 1 of torchrun's restarts, as its agent starts it, and no rank 1."""
    environment = clean_environment(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT=str(free_port()), TORCHELASTIC_RESTART_COUNT="1")
    result = subprocess.run([sys.executable, "-m", "trainer", "--output", str(tmp_path / "run"), "--threads", "1",
                             "--rejoin-timeout-secs", "3"], cwd=REPO, capture_output=True, text=True,
                            timeout=scaled(120), env=environment)
    assert result.returncode == 75, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("trainer: error: round 1 of torchrun's restarts: not every rank "
                                                   "of the 2 joined within 3 s (--rejoin-timeout-secs)"), lines


def test_three_ranks_name_the_same_frozen_rank_and_end_resumable(tmp_path):
    """Rank 1 of three frozen, no restart: the two others (rank 0 watches 1 and 2, rank 2 watches
    0 and 1) end 75, each with one line naming rank 1 alone, and rank 0's record names it."""
    run, status = tmp_path / "run", tmp_path / "status"
    command = ["--standalone", "--nproc_per_node", "3", "-m", "trainer", "--output", str(run),
               "--threads", "1", "--log-every-steps", "1", "--workload", WORKLOAD[1], "--toy-samples", "24",
               "--batch-size", "6", "--epochs", "3", "--peer-silence-secs", str(SILENCE_S)]
    process = launch_torchrun(command, clean_environment(TRAINER_EXIT_STATUS_FILE=str(status), PYTHONUNBUFFERED="1",
                                                         SLOW_STEP_SECS="0.5"))
    frozen, err = frozen_at_step_2(process, timeout=120)
    assert process.returncode == 1 and int(status.read_text()) == 75, err[-3000:]
    lines = sorted(line for line in err.splitlines() if line.startswith("trainer:"))  # one per rank that acts
    assert [line.split(" stopped answering: its heartbeat was silent for ")[0] for line in lines] == \
        ["trainer: error: rank 1", "trainer: rank 2: error: rank 1"], err[-3000:]
    assert "exitcode  : 75" in err, err[-3000:]  # ranks 0 and 2 (rank 1: killed)
    record = attempts(run)[-1]
    assert (record["status"], record["exit_code"], record["peer"]) == \
        ("interrupted", 75, {"state": "unresponsive", "ranks": [1]})


def test_a_frozen_peer_in_the_scripts_own_process_group_is_cut_off_by_its_silence(tmp_path):
    """`recovery.open_run` in a group the script created before it (its sockets opened before the
    run looked): rank 1, in a pid namespace of its own (another pod on the node: not provably a
    process here, so never ended), frozen in step 4 while rank 0 waits in DDP's reduction with a
    30-minute bound. Rank 0 finds the group's connections through the ranks' listeners, cuts
    them when rank 1's heartbeat goes silent, and ends 75 in one line naming rank 1; before,
    it waited out the bound. Cost: two fresh interpreters, about 8 CPU-s."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--user", "--pid", "--fork", "--map-root-user", "true"],
                                         capture_output=True).returncode != 0:
        pytest.skip("no unshare --user --pid here (a pid namespace stands for another host)")
    script, run, port = REPO / "tests" / "workloads" / "own_loop_frozen.py", tmp_path / "run", str(free_port())

    def rank(number: int, *prefix: str) -> subprocess.Popen:
        env = clean_environment(RANK=str(number), LOCAL_RANK=str(number), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=port, SILENCE_S=str(SILENCE_S), PYTHONUNBUFFERED="1")
        return subprocess.Popen([*prefix, sys.executable, str(script), str(run)], cwd=REPO, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    primary = rank(0)
    other = rank(1, unshare, "--user", "--pid", "--fork", "--map-root-user", "--kill-child")
    try:
        wait_for_line(other, "waiting")
        frozen = int(Path(f"/proc/{other.pid}/task/{other.pid}/children").read_text().split()[0])
        os.kill(frozen, signal.SIGSTOP)
        out, err = primary.communicate(timeout=scaled(120))  # the bound is 30 minutes: only the silence ends it
    finally:
        for process in (primary, other):
            process.kill()
            process.wait()
    assert primary.returncode == 75, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("trainer:")]
    assert len(lines) == 1 and lines[0].startswith("trainer: error: rank 1 stopped answering: its heartbeat was "
                                                   "silent for "), err[-3000:]
    assert "ended its process" not in lines[0]  # another pid namespace: not provably the peer, never signalled
    record = attempts(run)[-1]
    assert (record["status"], record["exit_code"], record["peer"]) == \
        ("interrupted", 75, {"state": "unresponsive", "ranks": [1]})
