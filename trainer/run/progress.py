"""Training progress the way users expect it: a status line on a terminal, sparse log lines
otherwise.

- Not a terminal (a pipe, a file, a cluster's log collector): the greppable line
  `step=N epoch=E loss=L lr=R` (with `rate=`, `eta=`, `newest=` appended once known) for the
  first and last step of an attempt and then every `--log-every-steps` global steps or
  `--log-every-secs` seconds since the previous line, whichever comes first. One line per
  step would flood the log of a long run.
- A terminal: one status line (steps, steps/s, ETA, last loss, newest generation) rewritten
  in place at most `REDRAW_SECS` apart; other log lines clear it first, so they never run
  into it. The first and last step of the attempt are still printed as lines.

When to print is decided by `LinePolicy`, with an injected clock (like trainer/run/cadence.py),
so it is unit-testable without a terminal. Only rank 0 shows progress.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

from trainer.run.cadence import StepPoint, build_policy
from trainer.config import CadenceConfig, ProgressConfig

log = logging.getLogger("trainer")
REDRAW_SECS = 0.1
CLEAR_LINE = "\r\x1b[K"


@dataclass(frozen=True)
class StepInfo:
    step: int
    epoch: int
    loss: float
    lr: float
    newest: str | None
    """The newest generation this attempt can fall back to (published or restored)."""
    rate: float | None
    """Steps per second over this attempt so far (None at its first step)."""
    eta_s: float | None


class LinePolicy:
    """Which steps get a line: the attempt's first and last, and then every N global steps
    or S seconds since the previous line (the cadence triggers, reused)."""

    def __init__(self, config: ProgressConfig, clock: Callable[[], float] = time.monotonic):
        self.triggers = build_policy(CadenceConfig(None, config.every_steps, config.every_s), clock)
        self.started = False

    def due(self, step: int, last: bool) -> bool:
        due = self.triggers.due(StepPoint(step, 0, False)) or last or not self.started
        if due:
            self.started = True
            self.triggers.saved()
        return due


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_line(info: StepInfo) -> str:
    line = f"step={info.step} epoch={info.epoch} loss={info.loss:.4f} lr={info.lr:.5g}"
    if info.rate is not None:
        line += f" rate={info.rate:.3g}/s"
    if info.eta_s is not None:
        line += f" eta={format_duration(info.eta_s)}"
    if info.newest:
        line += f" newest={info.newest}"
    return line


def render_status(info: StepInfo, total: int, width: int) -> str:
    """The terminal status line, cut to `width` columns."""
    share = info.step / total if total else 1.0
    bar = "#" * int(share * 20) + "." * (20 - int(share * 20))
    parts = [f"step {info.step}/{total} [{bar}] {share:.0%}",
             "-" if info.rate is None else f"{info.rate:.3g} steps/s",
             "ETA " + ("-" if info.eta_s is None else format_duration(info.eta_s)),
             f"loss {info.loss:.4f}", f"newest {info.newest or '-'}"]
    return " | ".join(parts)[:max(width - 1, 0)]


class StatusLine:
    """One line at the bottom of a terminal, rewritten in place. Installed as a filter on
    the logging handlers, it clears itself before any log record is written."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.shown = False

    def show(self, text: str) -> None:
        self.stream.write(CLEAR_LINE + text)
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
            self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        self.clear()
        return True


class Progress:
    """The loop calls `step()` after every optimizer step and `close()` once at the end."""

    def __init__(self, config: ProgressConfig, total_steps: int, terminal: TextIO | None = None,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 width: Callable[[], int] = lambda: shutil.get_terminal_size().columns):
        self.total_steps = total_steps
        self.enabled = enabled
        self.clock = clock
        self.width = width
        self.lines = LinePolicy(config, clock)
        self.status = StatusLine(terminal) if terminal is not None and enabled else None
        self.first: tuple[float, int] | None = None
        self.drawn_at = 0.0
        self.handlers: list[logging.Handler] | None = None
        """The logging handlers the status line is attached to (None: not yet)."""

    @classmethod
    def for_stdout(cls, config: ProgressConfig, enabled: bool) -> "Progress":
        """Progress on this process's stdout; the total is known once the dataset is (`begin`)."""
        terminal = sys.stdout if sys.stdout.isatty() else None
        return cls(config, 0, terminal, enabled)

    def begin(self, total_steps: int) -> None:
        """The attempt trains up to `total_steps` (for the ETA and the status bar)."""
        self.total_steps = total_steps

    def info(self, step: int, epoch: int, loss: float, lr: float, newest: str | None) -> StepInfo:
        now = self.clock()
        if self.first is None:
            self.first = (now, step)
        started, first_step = self.first
        rate = (step - first_step) / (now - started) if step > first_step and now > started else None
        eta = (self.total_steps - step) / rate if rate else None
        return StepInfo(step, epoch, loss, lr, newest, rate, eta)

    def step(self, step: int, epoch: int, loss: float, lr: float, newest: str | None, last: bool) -> None:
        """`last`: the attempt stops after this step (final step, interrupt, preemption)."""
        if not self.enabled:
            return
        info = self.info(step, epoch, loss, lr, newest)
        if self.status is None:
            if self.lines.due(step, last):
                log.info("%s", format_line(info))
            return
        first = self.handlers is None
        self._attach()
        if first or last:
            log.info("%s", format_line(info))  # the attempt's first and last step stay in the scrollback
        now = self.clock()
        if not last and (not self.status.shown or now - self.drawn_at >= REDRAW_SECS):
            self.status.show(render_status(info, self.total_steps, self.width()))
            self.drawn_at = now

    def _attach(self) -> None:
        if self.handlers is None:
            self.handlers = list(logging.getLogger().handlers)
            for handler in self.handlers:
                handler.addFilter(self.status)

    def close(self) -> None:
        if self.status is not None:
            self.status.clear()
            for handler in self.handlers or []:
                handler.removeFilter(self.status)
            self.handlers = None
