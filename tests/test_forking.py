"""A child forked from the zygote (tests/forking.py, behind `run_cli` and `start`) behaves as a
fresh interpreter would: tests/forking_probe.py runs both ways, started the same way, and what
each saw and how each ended must be equal. The one known difference is the parent (the zygote,
not pytest's worker), which the trainer never asks about.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from forking import forkable
from support.cli import trainer_env, wait_for_line, zygote, zygote_environment
from support.limits import scaled

PROBE = Path(__file__).with_name("forking_probe.py")


def fresh(argv: list[str], cwd: Path, env: dict, new_session: bool = False) -> subprocess.Popen:
    """The probe as a fresh interpreter, with the stdio a forked child gets (stdin at EOF)."""
    return subprocess.Popen([sys.executable, str(PROBE), *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session)


def forked(argv: list[str], cwd: Path, env: dict, new_session: bool = False) -> subprocess.Popen:
    assert forkable(env, zygote_environment()), "the probe's environment must be one the zygote can fork for"
    return zygote().spawn([str(PROBE), *argv], cwd, env, new_session=new_session)


def ended(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=scaled(60))
    return process.returncode, out, err


def both(*argv: str, cwd: Path, env: dict | None = None, new_session: bool = False) -> list[tuple[int, str, str]]:
    environment = trainer_env(env)
    return [ended(start(list(argv), cwd, environment, new_session)) for start in (fresh, forked)]


@pytest.mark.parametrize("new_session", [False, True], ids=["same-session", "new-session"])
def test_a_forked_child_sees_what_a_fresh_interpreter_sees(tmp_path, new_session):
    """argv, cwd, environment (os.environ and what its own subprocesses inherit), signal
    dispositions and mask, stdio, open fds, flags, session; exit status and output."""
    (fresh_status, fresh_out, fresh_err), (forked_status, forked_out, forked_err) = both(
        "report", "3", cwd=tmp_path, env={"PROBE_MARK": "set for this child only"}, new_session=new_session)
    assert (forked_status, forked_err) == (fresh_status, fresh_err) == (3, "a line on stderr\n")
    seen_fresh, seen_forked = json.loads(fresh_out), json.loads(forked_out)
    random_draws = ("random", "numpy_random")
    assert {k: v for k, v in seen_forked.items() if k not in random_draws} == \
           {k: v for k, v in seen_fresh.items() if k not in random_draws}
    assert seen_forked["env"]["PROBE_MARK"] == "set for this child only" and seen_forked["cwd"] == str(tmp_path)
    assert seen_forked["session_leader"] is new_session


def test_forked_children_draw_unshared_random_numbers(tmp_path):
    """A fresh interpreter seeds `random` and numpy's global generator from the OS; two forks of
    one zygote must not replay one sequence."""
    draws = [json.loads(ended(forked(["report", "0"], tmp_path, trainer_env()))[1]) for _ in range(2)]
    assert draws[0]["random"] != draws[1]["random"]
    assert draws[0]["numpy_random"] != draws[1]["numpy_random"]


@pytest.mark.parametrize("mode", ["raise", "exit-message", "at-exit"])
def test_a_forked_child_ends_as_a_fresh_interpreter_does(tmp_path, mode):
    """An uncaught exception (status 1, its traceback), sys.exit with a message, and the
    interpreter's shutdown (non-daemon threads joined, then atexit handlers)."""
    fresh_end, forked_end = both(mode, cwd=tmp_path)
    assert forked_end == fresh_end
    assert fresh_end[0] == (0 if mode == "at-exit" else 1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_ends_a_forked_child_as_it_ends_a_fresh_one(tmp_path, sig):
    """SIGTERM and SIGKILL kill it (status -N); SIGINT raises KeyboardInterrupt, whose traceback
    is printed before the interpreter ends by SIGINT."""
    endings = []
    for start in (fresh, forked):
        process = start(["wait"], tmp_path, trainer_env())
        wait_for_line(process, "ready")
        process.send_signal(sig)
        status, out, err = ended(process)
        endings.append((status, out, err.splitlines()[-1:]))  # where SIGINT lands in the code varies
    assert endings[1] == endings[0]
    assert endings[0][0] == -sig
