"""Progress: when a line is printed (fake clock), the terminal status line, and the real CLI
under a pseudo-terminal and through a pipe."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import select
import subprocess
import sys

import pytest

from support.cli import REPO, one_error_line, run_cli
from support.limits import CLI_TIMEOUT_S, scaled

from trainer.config import ProgressConfig
from trainer.run.progress import CLEAR_LINE, Progress, StepInfo, render_status


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def printed_steps(caplog) -> list[int]:
    return [int(re.match(r"step=(\d+) ", r.getMessage()).group(1)) for r in caplog.records
            if r.getMessage().startswith("step=")]


def test_lines_every_n_global_steps_plus_first_and_last(caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    clock = Clock()
    progress = Progress(ProgressConfig(every_steps=10, every_s=3600), total_steps=64, clock=clock)
    for step in range(25, 38):  # a resumed attempt: 25..37, interrupted after 37
        clock.now += 0.5
        progress.step(step, 3, 1.0, 0.01, "step-00000024", last=step == 37)
    assert printed_steps(caplog) == [25, 30, 37]
    line = caplog.records[1].getMessage()
    assert line.startswith("step=30 epoch=3 loss=1.0000 lr=0.01 ")
    assert " rate=2/s eta=0:00:17 newest=step-00000024" in line  # 5 steps in 2.5 s; 34 steps left


def test_slow_steps_get_a_line_every_s_seconds(caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    clock = Clock()
    progress = Progress(ProgressConfig(every_steps=1000, every_s=5), total_steps=100, clock=clock)
    for step in range(1, 13):
        clock.now += 2.0
        progress.step(step, 0, 1.0, 0.01, None, last=False)
    assert printed_steps(caplog) == [1, 4, 7, 10]  # the first, then 6 s (>= 5) after each line


def test_only_rank_0_shows_progress(caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    terminal = io.StringIO()
    progress = Progress(ProgressConfig(), total_steps=10, terminal=terminal, enabled=False)
    progress.step(1, 0, 1.0, 0.01, None, last=True)
    assert printed_steps(caplog) == [] and terminal.getvalue() == ""


def test_terminal_status_line_is_redrawn_in_place_and_cleared_for_log_lines():
    clock, terminal, logged = Clock(), io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(logged)
    root.addHandler(handler)
    old_level = logging.getLogger("trainer").level
    logging.getLogger("trainer").setLevel(logging.INFO)
    try:
        progress = Progress(ProgressConfig(every_steps=1), total_steps=20, terminal=terminal, clock=clock,
                            width=lambda: 200)
        for step in range(1, 11):
            clock.now += 0.0625  # two steps per redraw interval
            progress.step(step, 0, 1.0, 0.01, None, last=False)
        shown = terminal.getvalue()
        assert shown.count(CLEAR_LINE) == 5  # drawn at steps 1, 3, 5, 7, 9
        assert "step 9/20 [#########...........] 45% | 16 steps/s | ETA 0:00:01 | loss 1.0000" in shown
        assert "\n" not in shown
        logging.getLogger("trainer").info("published generation step-00000010")
        assert terminal.getvalue().endswith(CLEAR_LINE)  # cleared before the record was written
        progress.step(11, 0, 1.0, 0.01, "step-00000010", last=False)  # redrawn at once after a log line
        assert terminal.getvalue().endswith("newest step-00000010")
        progress.step(12, 0, 1.0, 0.01, "step-00000010", last=True)
        progress.close()
        assert terminal.getvalue().endswith(CLEAR_LINE)
        assert [line.split()[0] for line in logged.getvalue().splitlines()] == \
            ["step=1", "published", "step=12"]  # per-step lines only for the first and last step
        assert progress.status not in handler.filters
    finally:
        root.removeHandler(handler)
        logging.getLogger("trainer").setLevel(old_level)


def test_status_is_cut_to_the_terminal_width():
    info = StepInfo(step=5, epoch=0, loss=2.5, lr=0.1, newest=None, rate=None, eta_s=None)
    assert render_status(info, 10, 200) == "step 5/10 [##########..........] 50% | - | ETA - | loss 2.5000 | newest -"
    assert len(render_status(info, 10, 30)) == 29


def test_progress_options_are_validated_in_one_line(tmp_path):
    for option, value in (("--log-every-steps", 0), ("--log-every-secs", 0), ("--log-every-steps", "x")):
        result = run_cli("--output", tmp_path / "run", option, value)
        assert result.returncode == 2 and option in one_error_line(result)
    assert not (tmp_path / "run").exists()


def read_all(fd: int, process: subprocess.Popen) -> bytes:
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], scaled(CLI_TIMEOUT_S))
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait(timeout=scaled(CLI_TIMEOUT_S))
    return b"".join(chunks)


@pytest.mark.parametrize("terminal", [True, False])
def test_the_cli_shows_a_status_line_on_a_terminal_and_lines_through_a_pipe(tmp_path, terminal):
    command = [sys.executable, "-m", "trainer", "--output", str(tmp_path / "run"), "--epochs", 3]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "160"}
    if terminal:
        parent, child = pty.openpty()
        process = subprocess.Popen(list(map(str, command)), cwd=REPO, env=env, stdout=child, stderr=child)
        os.close(child)
        out = read_all(parent, process).decode()
        os.close(parent)
    else:
        result = subprocess.run(list(map(str, command)), cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=scaled(CLI_TIMEOUT_S))
        process, out = result, result.stdout
    assert process.returncode == 0, out
    steps = re.findall(r"^step=(\d+) ", out.replace("\r\n", "\n").replace(CLEAR_LINE, "\n"), re.MULTILINE)
    if terminal:
        assert steps == ["1", "24"]  # the status line carries the rest
        assert CLEAR_LINE in out and "steps/s | ETA" in out
        assert "published generation step-00000024" in out
    else:
        assert steps == ["1", "10", "20", "24"]
        assert "\x1b" not in out and "\r" not in out
