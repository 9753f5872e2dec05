"""Several trainer processes under `torchrun` (always fresh interpreters: a fork cannot be a
launcher's rank), a free port for a rendezvous, and an environment without an outer launcher's
variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from support.cli import REPO
from support.limits import scaled

TORCHRUN = Path(sys.executable).with_name("torchrun")
TORCHRUN_CHILD_FAILED = 1
"""What torchrun itself exits with when any child exits non-zero, 75 included (measured)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def clean_environment(**extra: str) -> dict:
    """Our environment without launcher variables from an outer launcher."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PET_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def torchrun(output, *args, nproc: int = 2, expect: int = 0, env: dict | None = None,
             tmp: Path) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC -m trainer --output OUTPUT --threads 1 ARGS`;
    `expect` is the trainer's status (every rank's), read from TRAINER_EXIT_STATUS_FILE;
    torchrun's own status must be 0 for 0 and 1 for anything else."""
    status_file = tmp / f"status-{len(list(tmp.glob('status-*')))}"
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), "-m", "trainer",
               "--output", str(output), "--threads", "1", *map(str, args)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=scaled(600),
                            env=clean_environment(TRAINER_EXIT_STATUS_FILE=str(status_file), **(env or {})))
    trainer_status = int(status_file.read_text()) if status_file.exists() else None
    assert trainer_status == expect, (f"trainer status {trainer_status}, wanted {expect} (torchrun {result.returncode})\n"
                                      f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    assert result.returncode == (0 if expect == 0 else TORCHRUN_CHILD_FAILED), result.stderr[-3000:]
    return result
