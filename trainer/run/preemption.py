"""Preemption: SIGTERM/SIGINT ask the loop to stop at the next step boundary.

The first signal only sets a flag: the loop finishes the optimizer step in progress, writes a
recovery generation and exits 75 (one further step when the signal lands after a step's
stop check, while its line is printed or its save written). DataLoader workers ignore the
signal, whenever it reaches them. A grace timer exits 75 without publishing if that takes
longer than the orchestrator's grace period allows (an unpublished temporary is never
selected, so nothing is half-published). A second signal exits 75 at once, equally safely.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

from trainer.errors import EXIT_INTERRUPTED

HANDLED = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    def __init__(self, grace_secs: float):
        self.grace_secs = grace_secs
        self.signal_name: str | None = None
        self._previous: dict = {}
        self._timer: threading.Timer | None = None
        self._pid = os.getpid()
        self.last_words: Callable[[str], None] | None = None
        """Set once the attempt record exists: records `preempted` before a hard exit, so the
        record never stays `running` (which would count towards a crash loop)."""

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def stop_cause(self) -> str:
        """What stopped the ranks after an agreed stop: this rank's signal, or, where this rank
        caught none, another rank's (the stop is agreed across ranks: saving.py's `agree`)."""
        return self.signal_name or "a signal to another rank"

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # A DataLoader worker, forked with this handler, signalled with its process group
            # before its worker_init_fn ignores stop signals: the main process decides.
            return
        name = signal.Signals(signum).name
        if self.requested:
            self._exit_now(f"second {name}: exited at once without publishing")
        self.signal_name = name
        self._timer = threading.Timer(self.grace_secs, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self) -> None:
        self._exit_now(f"preemption grace of {self.grace_secs:g}s ran out before the save finished (writing, "
                       f"publishing or, with a store, uploading): exited; the newest complete generation stands")

    def _exit_now(self, reason: str) -> None:
        sys.stderr.write(f"trainer: {reason} (exit 75)\n")
        sys.stderr.flush()
        if self.last_words is not None:
            try:
                self.last_words(reason)
            except Exception:  # noqa: BLE001 - exiting promptly matters more than the record
                pass
        os._exit(EXIT_INTERRUPTED)

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def decided(self) -> None:
        """The attempt is ending on an error: from now on a stop signal has nothing to stop,
        and must not turn the failure into 75 (a resumable exit would retry it forever)."""
        if self._timer is not None:
            self._timer.cancel()
        self._previous.clear()  # not even the start-up handler, which exits 75, comes back
        ignore_late_stop_requests()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.decided()
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def stop_handlers() -> dict:
    """The SIGTERM/SIGINT handlers in place now (only the main thread sets any), to put back."""
    return {sig: signal.getsignal(sig) for sig in HANDLED} if threading.current_thread() is threading.main_thread() \
        else {}


def restore_stop_handlers(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def ignore_late_stop_requests() -> None:
    """Once the attempt's outcome is decided and recorded, a SIGTERM/SIGINT has nothing left
    to stop: ignore it, so it cannot turn a recorded outcome into a different exit status."""
    if threading.current_thread() is threading.main_thread():
        for sig in HANDLED:
            signal.signal(sig, signal.SIG_IGN)
