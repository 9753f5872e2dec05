"""Where this process sits in a launch: the rank variables torchrun (or the Kubeflow training
operator) sets, read without importing torch so the CLI can use them before anything heavy.

A process started without `WORLD_SIZE`, or with `WORLD_SIZE=1`, is a single-process run and
behaves exactly as a plain `python -m trainer` (no process group at all). With a larger world
size, `RANK` and `MASTER_ADDR`/`MASTER_PORT` must be present: torchrun sets them for every
child, and the operator sets them for every pod.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from trainer.errors import UsageError
from trainer.parallel.spare import FRONT_ENV

PRIMARY = 0
"""The rank that holds the output lock, writes manifests, attempt records and exports."""


@dataclass(frozen=True)
class LaunchEnvironment:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    """Index on this node: picks the CUDA device."""
    local_world_size: int = 1
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE; the operator's pods: 1 each): a
    rank's tier-0 replica goes to the same local rank on the next node."""
    master_addr: str = ""
    master_port: int = 0
    """Where the rendezvous store listens (MASTER_ADDR/MASTER_PORT)."""
    restart: int = 0
    """torchrun's TORCHELASTIC_RESTART_COUNT: how many times its agent restarted the workers."""
    agent_store: bool = False
    """torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE), and it outlives a
    restart of the workers: what one round wrote there is still there for the next."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_primary(self) -> bool:
        return self.rank == PRIMARY

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "LaunchEnvironment":
        world_size = _env_int(env, "WORLD_SIZE", 1, minimum=1)
        if world_size == 1:
            return cls()
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing == ["RANK"] and "NODE_RANK" in env:  # what Lightning's launcher sets at fit()
            raise UsageError(f"WORLD_SIZE={world_size} but RANK not set: Lightning's launcher started this "
                             f"process inside fit(), after rank 0 opened the run alone; call "
                             f"trainer.recovery.lightning.launch(trainer) before open_run")
        if missing:
            raise UsageError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; start the "
                             f"trainer with torchrun (it sets RANK, MASTER_ADDR and MASTER_PORT)")
        rank = _env_int(env, "RANK", 0, minimum=0)
        if rank >= world_size:
            raise UsageError(f"RANK={rank} is not below WORLD_SIZE={world_size}; check the launcher's variables")
        local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", 1, minimum=1)
        if world_size % local_world_size:
            raise UsageError(f"LOCAL_WORLD_SIZE={local_world_size} does not divide WORLD_SIZE={world_size}; start "
                             f"the same number of processes on every node")
        return cls(rank, world_size, _env_int(env, "LOCAL_RANK", 0, minimum=0), local_world_size,
                   env["MASTER_ADDR"], _env_int(env, "MASTER_PORT", 0, minimum=0),
                   _env_int(env, "TORCHELASTIC_RESTART_COUNT", 0, minimum=0),
                   env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): the start-up part
    of what a restart costs (interpreter, imports), which no other clock of ours sees. A worker
    the warm spare forked started when the process the agent started did (its front)."""
    try:
        fields = Path(f"/proc/{os.environ.get(FRONT_ENV) or 'self'}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")), 3)
    except (OSError, ValueError, IndexError):
        return None


def rank_of(env: Mapping[str, str]) -> int:
    """This process's rank for labelling output; never fails (0 when unset or malformed)."""
    try:
        return LaunchEnvironment.from_environ(env).rank
    except UsageError:
        return 0


def is_multi_process(env: Mapping[str, str]) -> bool:
    """Whether a launcher started this process as one of several; never fails."""
    try:
        return LaunchEnvironment.from_environ(env).distributed
    except UsageError:
        return False


def local_rank_of(env: Mapping[str, str]) -> int:
    """This process's index on its node; never fails (0 when unset or malformed)."""
    try:
        return _env_int(env, "LOCAL_RANK", 0, minimum=0)
    except UsageError:
        return 0


def _env_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"environment variable {name}={text!r} is not an integer; check the launcher") from None
    if value < minimum:
        raise UsageError(f"environment variable {name}={value} must be at least {minimum}")
    return value


def watch_children(children: Mapping[int, subprocess.Popen], joined: Callable[[], bool],
                   lost: Callable[[str], None], poll_s: float = 0.2) -> threading.Thread:
    """Until `joined()`, watch the ranks (rank: process) a launcher in this process started
    (Lightning's starts them from rank 0): one that ends before every rank joined would leave
    this one waiting the whole join bound for it. `lost(line naming it)` is called at once
    instead. After the join the run's bounded collectives and heartbeats name a lost rank."""

    def watching() -> None:
        while not joined():
            for rank, child in children.items():
                status = child.poll()
                if status is not None:
                    lost(f"rank {rank} (pid {child.pid}) ended with status {status} before every rank joined "
                         f"the run's process group")
                    return
            time.sleep(poll_s)

    thread = threading.Thread(target=watching, name="trainer-children", daemon=True)
    thread.start()
    return thread
