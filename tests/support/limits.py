"""Every wall-clock limit in tests/ goes through `scaled()`: the limits are generous (they catch
a hang, they do not measure speed), and `TEST_TIMEOUT_SCALE` (default 1) multiplies all of
them for a slow or loaded machine. Tests wait for progress (a line, a file, a count of
kills), never for a fixed time.
"""

from __future__ import annotations

import os
import time

import pytest

TIMEOUT_SCALE_ENV = "TEST_TIMEOUT_SCALE"
CLI_TIMEOUT_S = 600
"""One CLI run (a few seconds on an idle machine): only a hang reaches it."""


def timeout_scale(environ=os.environ) -> float:
    text = environ.get(TIMEOUT_SCALE_ENV, "1")
    try:
        scale = float(text)
    except ValueError:
        scale = 0
    if not scale > 0:
        raise pytest.UsageError(f"{TIMEOUT_SCALE_ENV}={text!r}: give a positive number (e.g. 3 on a loaded machine)")
    return scale


TIMEOUT_SCALE = timeout_scale()


def scaled(seconds: float) -> float:
    """A wall-clock limit of the tests, times TEST_TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


def wait_until(condition, what: str, timeout: float = CLI_TIMEOUT_S, every: float = 0.05) -> None:
    """Poll `condition` until it holds; fail naming `what` if the (scaled) limit passes."""
    deadline = time.monotonic() + scaled(timeout)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {scaled(timeout):.0f} s")
        time.sleep(every)
