"""Several trainer processes under `torchrun` (always fresh interpreters: a fork cannot be a
launcher's rank), a free port for a rendezvous, and an environment without an outer launcher's
variables. The launcher itself (torchrun's agent) is forked from the worker's zygote where it
can be (`launch`): it is a Python program that imports torch before it does anything (about
2 s of CPU, a third of a 2-process launch) and then starts its ranks as fresh interpreters.
An uninterrupted reference run's ranks may be forked from the zygote too, with the variables a
launcher sets (`forked_ranks`, and `trainer_ranks` for the trainer's own command: no agent,
no fresh interpreters)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from support.cli import REPO, completed, forked, trainer_env, zygote, zygote_environment
from support.limits import scaled

TORCHRUN = Path(sys.executable).with_name("torchrun")
AGENT = ("-m", "torch.distributed.run")
"""What the `torchrun` script runs (its entry point, `torch.distributed.run:main`)."""
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


def launch(args, env: dict, start_new_session: bool = False) -> subprocess.Popen:
    """`torchrun ARGS` as a live process with text pipes. Its agent is forked from the worker's
    zygote (tests/forking.py) unless a fork cannot stand in for the script (TEST_FORK=0, or an
    environment torch reads at import that differs from the zygote's); PYTHONUNBUFFERED alone
    may differ: it sets the agent's own output buffering, and the ranks, fresh interpreters,
    read it from the environment they inherit, `env` as given."""
    args = [*map(str, args)]
    if forked({**env, "PYTHONUNBUFFERED": zygote_environment().get("PYTHONUNBUFFERED", "")}, {}):
        return zygote().spawn([*AGENT, *args], REPO, env, new_session=start_new_session)
    return subprocess.Popen([str(TORCHRUN), *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=start_new_session)


def torchrun(output, *args, nproc: int = 2, expect: int = 0, env: dict | None = None,
             tmp: Path) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC -m trainer --output OUTPUT --threads 1 ARGS`;
    `expect` is the trainer's status (every rank's), read from TRAINER_EXIT_STATUS_FILE;
    torchrun's own status must be 0 for 0 and 1 for anything else."""
    status_file = tmp / f"status-{len(list(tmp.glob('status-*')))}"
    command = ["--standalone", "--nproc_per_node", str(nproc), "-m", "trainer", "--output", str(output),
               "--threads", "1", *map(str, args)]
    result = completed(launch(command, clean_environment(TRAINER_EXIT_STATUS_FILE=str(status_file), **(env or {}))),
                      600)
    trainer_status = int(status_file.read_text()) if status_file.exists() else None
    assert trainer_status == expect, (f"trainer status {trainer_status}, wanted {expect} (torchrun {result.returncode})\n"
                                      f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    assert result.returncode == (0 if expect == 0 else TORCHRUN_CHILD_FAILED), result.stderr[-3000:]
    return result


def rank_environment(rank: int, nproc: int, port: int | str, env: dict | None = None, per_node: int | None = None) -> dict:
    """The trainer's environment for `rank` of `nproc`, as a launcher sets it (rank 0 hosts the
    rendezvous store on `port`), plus `env`: all on this node, or `per_node` ranks on each node
    (`torchrun --nnodes N --nproc_per_node PER_NODE`)."""
    local = per_node or nproc
    return trainer_env(clean_environment(RANK=str(rank), LOCAL_RANK=str(rank % local), WORLD_SIZE=str(nproc),
                                         LOCAL_WORLD_SIZE=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                         **(env or {})))


def forked_ranks(script: Path, *args, nproc: int, preload: str | None = None) -> list[str]:
    """`python SCRIPT ARGS` as `nproc` ranks started the way any launcher may start them (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; rank 0 hosts the rendezvous store), each forked
    from this worker's zygote (tests/forking.py) unless the environment asks for a fresh
    interpreter: a reference run without torchrun's agent and N interpreters' start (about 2 +
    3N CPU-seconds less; `preload`: a library the zygote imports first, tests/forking.py
    PRELOADABLE). Every rank must exit 0; their stdouts, in rank order."""
    return [result.stdout for result in rank_processes([str(script), *map(str, args)], nproc, expect=0,
                                                       preload=preload)]


def trainer_ranks(output, *args, nproc: int, expect: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun`'s command (`-m trainer --output OUTPUT --threads 1 ARGS`) as `forked_ranks`
    runs a script: for a run whose launch is not under test (a reference, or the first part of
    a resume that only needs its generations), at no agent's and no interpreter's cost. Every
    rank must exit `expect`; their outputs joined in rank order (as torchrun passes them on)."""
    argv = ["-m", "trainer", "--output", str(output), "--threads", "1", *map(str, args)]
    results = rank_processes(argv, nproc, expect, env)
    return subprocess.CompletedProcess(["trainer_ranks", *map(str, args)], expect,
                                       "".join(result.stdout for result in results),
                                       "".join(result.stderr for result in results))


def rank_processes(argv: list[str] | list[list[str]], nproc: int, expect: int | None,
                   env: dict | list[dict] | None = None, per_node: int | None = None,
                   timeout: float = 600, preload: str | None = None) -> list[subprocess.CompletedProcess]:
    """`python ARGV` as `nproc` launched ranks (see `forked_ranks`), `env` added to what a launcher
    sets (`per_node` ranks on each node: `rank_environment`); an `argv` and an `env` per rank
    where lists of them are given; each must exit `expect` (None: any status)."""
    port = str(free_port())
    processes = []
    try:
        for rank in range(nproc):
            own = argv[rank] if isinstance(argv[0], list) else argv
            environment = rank_environment(rank, nproc, port, env[rank] if isinstance(env, list) else env, per_node)
            processes.append(zygote().spawn(own, REPO, environment, new_session=False, preload=preload)
                             if forked(environment, {}) else
                             subprocess.Popen([sys.executable, *own], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
        outputs = [process.communicate(timeout=scaled(timeout)) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, (out, err)) in enumerate(zip(processes, outputs)):
        assert expect is None or process.returncode == expect, (f"rank {rank} exited {process.returncode}, wanted {expect}\n"
                                              f"{out[-2000:]}\n{err[-3000:]}")
    return [subprocess.CompletedProcess(process.args, process.returncode, out, err)
            for process, (out, err) in zip(processes, outputs)]
