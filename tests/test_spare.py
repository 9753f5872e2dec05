"""The warm spare (trainer/parallel/spare.py) in a launch in miniature, torch-free
(tests/spare_probe.py: an agent starting workers as torchrun's does): a restarted worker is the
spare's child and its front ends as it ends (status, signal, SIGTERM passed on, a SIGKILLed front
takes its worker along); another argv, an environment read at import that differs, or no spare at
all: the worker runs itself; no spare outlives its agent (it ends, is SIGTERMed, is SIGKILLed).
The trainer's own kill -9 under `torchrun --max-restarts` from the spare is in
tests/test_peer_failures.py. About 1 CPU-s.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from support.cli import REPO
from support.limits import scaled
from trainer.parallel.spare import address

PROBE = Path(__file__).with_name("spare_probe.py")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + scaled(10)
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return gone(pid)


class Agent:
    """The probe's agent: its workers are its children, as torchrun's are."""

    def __init__(self, sockets: Path):
        self.run_id, self.sockets = uuid.uuid4().hex, sockets
        self.process = subprocess.Popen([sys.executable, str(PROBE)], cwd=REPO, text=True, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO),
                                                                      "PROBE_ROLE": "agent"})
        self.spare = None

    def said(self, prefix: str) -> str:
        while True:
            line = self.process.stdout.readline()
            assert line, f"the agent ended before saying {prefix!r}"
            if line.startswith(prefix):
                return line.strip()

    def start(self, restart: int, *argv: str, **env: str) -> int:
        environment = {**os.environ, "PYTHONPATH": str(REPO), "PROBE_ROLE": "worker", "WORLD_SIZE": "2",
                       "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": str(restart),
                       "TORCHELASTIC_RUN_ID": self.run_id, "XDG_RUNTIME_DIR": str(self.sockets), **env}
        self.process.stdin.write(f"start {json.dumps({'argv': list(argv), 'env': environment})}\n")
        self.process.stdin.flush()
        return int(self.said("started ").split()[1])

    def status(self, pid: int) -> int:
        self.process.stdin.write(f"wait {pid}\n")
        self.process.stdin.flush()
        return int(self.said(f"status {pid} ").split()[2])

    def first_round(self) -> int:
        """The first worker forks the spare; its pid."""
        worker = self.start(0)
        self.spare = int(self.said("spare ").split()[1])
        assert self.status(worker) == 0
        return self.spare

    def worker(self) -> dict:
        fields = dict(item.split("=", 1) for item in self.said("worker ").split()[1:])
        return {**fields, "pid": int(fields["pid"])}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=scaled(30))
        if self.spare is not None and not wait_gone(self.spare):
            os.kill(self.spare, signal.SIGKILL)


@pytest.fixture
def agent():
    sockets = Path(tempfile.mkdtemp(prefix="spare-", dir="/tmp"))  # private (0700), and short: a socket's path
    started = Agent(sockets)                                          # is at most 107 bytes; as $XDG_RUNTIME_DIR
    try:
        yield started
    finally:
        started.close()
        shutil.rmtree(sockets)


def test_a_restarted_worker_is_the_spares_child_and_its_front_ends_as_it_ends(agent):
    spare = agent.first_round()
    assert spare > 0 and not gone(spare) and len(list(agent.sockets.iterdir())) == 1

    front = agent.start(1, PROBE_ACTION="exit:7")
    worker = agent.worker()
    assert worker["from_spare"] == "True" and worker["front"] == str(front) and worker["pid"] not in (front, spare)
    assert agent.status(front) == 7

    front = agent.start(1, PROBE_ACTION="exit:-9")  # a worker killed: its front dies of the same signal
    assert agent.worker()["from_spare"] == "True" and agent.status(front) == -signal.SIGKILL

    front = agent.start(1, PROBE_ACTION="wait")  # the agent's SIGTERM reaches the worker
    worker = agent.worker()
    os.kill(front, signal.SIGTERM)
    assert agent.status(front) == 75 and wait_gone(worker["pid"])

    front = agent.start(1, PROBE_ACTION="wait")  # the agent's SIGKILL of a front ends its worker too
    worker = agent.worker()
    os.kill(front, signal.SIGKILL)
    assert agent.status(front) == -signal.SIGKILL
    assert wait_gone(worker["pid"]), "the worker outlived its front"

    agent.process.stdin.close()  # the launch ends: so does the spare, and its socket
    agent.process.wait(timeout=scaled(30))
    assert wait_gone(spare), "the spare outlived its agent"
    assert list(agent.sockets.iterdir()) == []


def test_another_command_or_import_environment_is_refused_and_the_worker_runs_itself(agent):
    agent.first_round()
    for argv, env in ((("another", "run"), {}), ((), {"OMP_NUM_THREADS": "7"}),
                      ((), {"TORCHELASTIC_RUN_ID": "another-launch"})):  # the last: no spare at all
        front = agent.start(1, *argv, PROBE_ACTION="exit:3", **env)
        worker = agent.worker()
        assert (worker["from_spare"], worker["pid"]) == ("False", front), (argv, env)
        assert agent.status(front) == 3


@pytest.mark.parametrize("end", [signal.SIGTERM, signal.SIGKILL])
def test_no_spare_outlives_an_agent_that_is_stopped_or_killed(agent, end):
    spare = agent.first_round()
    os.kill(agent.process.pid, end)
    agent.process.wait(timeout=scaled(30))
    assert wait_gone(spare), f"the spare outlived its agent's {signal.Signals(end).name}"


def test_the_spare_lives_only_in_a_directory_of_this_user_alone(tmp_path):
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir(mode=0o755)
    env = {"TORCHELASTIC_RUN_ID": "r"}
    assert Path(address({**env, "XDG_RUNTIME_DIR": str(private)}, 1)).parent == private
    elsewhere = address({**env, "XDG_RUNTIME_DIR": str(shared)}, 1)
    assert elsewhere is None or Path(elsewhere).parent != shared
    assert address({**env, "XDG_RUNTIME_DIR": str(private)}, 1) != address({**env, "XDG_RUNTIME_DIR": str(private)}, 2)
