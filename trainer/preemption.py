"""Preemption: SIGTERM/SIGINT ask the loop to stop at the next step boundary.

The first signal only sets a flag: the loop finishes the current optimizer step, writes a
recovery generation and exits 75. A grace timer exits 75 without publishing if that takes
longer than the orchestrator's grace period allows (an unpublished temporary is never
selected, so nothing is half-published). A second signal exits 75 at once, equally safely.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from trainer.errors import EXIT_INTERRUPTED

HANDLED = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    def __init__(self, grace_secs: float):
        self.grace_secs = grace_secs
        self.signal_name: str | None = None
        self._previous: dict = {}
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            sys.stderr.write(f"trainer: second {name} while saving: exiting now without publishing (exit 75)\n")
            os._exit(EXIT_INTERRUPTED)
        self.signal_name = name
        self._timer = threading.Timer(self.grace_secs, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self) -> None:
        sys.stderr.write(f"trainer: preemption grace of {self.grace_secs:g}s ran out before the save "
                         f"finished: exiting without publishing (exit 75)\n")
        os._exit(EXIT_INTERRUPTED)

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
