"""The real CLI (`python -m trainer`, `python compare.py`) in a subprocess on temporary
directories: a finished run, a live trainer and its progress lines. Each process is forked from
this worker's zygote (tests/forking.py) unless it needs a fresh interpreter (`forked`).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from forking import Zygote, forkable
from support.limits import CLI_TIMEOUT_S, scaled

REPO = Path(__file__).resolve().parents[2]
TRAINER = (sys.executable, "-m", "trainer")
FORK_ENV = "TEST_FORK"


def trainer_env(env: dict | None = None) -> dict:
    """The environment of a trainer subprocess: ours, the repository importable, unbuffered
    output (a test reads progress lines as they come), then `env`."""
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}


def run_cli(*args, env: dict | None = None, timeout: float = CLI_TIMEOUT_S, preload: str | None = None,
            **options) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` (or `python SCRIPT.py ...` when args start with a script);
    `options` go to subprocess.run (preexec_fn, ...); `preload`: a library the zygote imports
    before it forks (tests/forking.py PRELOADABLE: `transformers` for the HF example)."""
    argv = [*map(str, args)] if str(args[0]).endswith(".py") else ["-m", "trainer", *map(str, args)]
    environment = trainer_env(env)
    if not forked(environment, options):
        return subprocess.run([sys.executable, *argv], cwd=REPO, env=environment, capture_output=True, text=True,
                              timeout=scaled(timeout), **options)
    with zygote().spawn(argv, REPO, environment, new_session=False, preload=preload) as process:
        return completed(process, timeout)


def completed(process: subprocess.Popen, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """A started process's output once it exited (killed past the scaled `timeout`)."""
    try:
        out, err = process.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def start(output, *args, env: dict | None = None, command: tuple = TRAINER,
          fresh: bool = False, **options) -> subprocess.Popen:
    """The trainer (or `command`, e.g. torchrun ... -m trainer) on `output` as a live process
    with a progress line per step, arriving unbuffered; `options` go to Popen
    (start_new_session, ...). `fresh`: a fresh interpreter, never a fork of the zygote (a test
    of start-up itself)."""
    rest = ["--output", str(output), "--log-every-steps", "1", *map(str, args)]
    environment = trainer_env(env)
    if not fresh and tuple(command) == TRAINER and forked(environment, {**options, "start_new_session": False}):
        return zygote().spawn(["-m", "trainer", *rest], REPO, environment,
                              new_session=options.get("start_new_session", False))
    return subprocess.Popen([*map(str, command), *rest], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **options)


def forked(environment: dict, options: dict) -> bool:
    """Whether a trainer or compare.py run is forked from the worker's zygote (tests/forking.py)
    rather than started as a fresh interpreter: unless TEST_FORK=0, a `preexec_fn` (or another
    Popen option) is asked for, or the environment differs in what torch reads at import."""
    return (os.environ.get(FORK_ENV, "1") != "0" and not any(options.values())
            and forkable(environment, zygote_environment()))


def zygote_environment() -> dict:
    return trainer_env()


@functools.cache
def zygote() -> Zygote:
    """This worker's zygote, started on first use; it ends with the worker."""
    return Zygote(sys.executable, REPO, zygote_environment())


def wait_for_line(process: subprocess.Popen, prefix: str) -> str:
    """Read the process's stdout up to the first line starting with `prefix` (progress, not
    time: the line comes when the trainer gets there, however slow the machine)."""
    for line in process.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"process ended before printing {prefix!r}: {process.stderr.read()}")


def finish(process: subprocess.Popen, timeout: float = CLI_TIMEOUT_S) -> tuple[str, str]:
    """The rest of a live process's output once it exited (killed if it hangs past the limit)."""
    try:
        return process.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def train(output: Path, *args, expect: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    result = run_cli("--output", output, *args, env=env)
    assert result.returncode == expect, f"exit {result.returncode}, wanted {expect}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def compare(a: Path, b: Path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(REPO / "compare.py", a, b, *args, env=env)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The stderr of a failed run must be exactly one line, with no traceback."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return lines[0]
