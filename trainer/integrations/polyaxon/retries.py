"""The sandbox's spurious 405, told apart from a real one and retried: shared by the local
agent's calls and the tracked trainer's lineage deletions."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

SPURIOUS_405_RETRIES = 5
CLIENT_LOGGER = "polyaxon.cli"
"""Where Polyaxon's client logs a failed call: the function, its file, the whole client config,
the request and the reason, eight lines each time, before raising."""


def spurious_405(error: Exception) -> bool:
    """The sandbox (haupt 2.18, one uvicorn worker) answers about 2% of requests with a Django
    `405 Method Not Allowed` that never reached a view: the same request succeeds when repeated.
    A 405 from a view (Django REST framework) has a JSON `detail`; that one is real, never retried."""
    if getattr(error, "status", None) != 405:
        return False
    body = getattr(error, "body", None) or ""
    try:
        return "detail" not in json.loads(body)
    except (ValueError, TypeError):
        return True


def call(function, *args, **kwargs):
    """A client call, retried only on the sandbox's spurious 405 (`spurious_405`). The client's
    own report of each failed try is left out: a retried 405 that then succeeds is no error, and
    the caller reports a final failure in one line (`one_line`)."""
    for attempt in range(SPURIOUS_405_RETRIES):
        try:
            with client_quiet_on_this_thread():
                return function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - only the spurious 405 is retried
            if not spurious_405(error) or attempt == SPURIOUS_405_RETRIES - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


@contextlib.contextmanager
def client_quiet_on_this_thread():
    """Drop the client's error records made by this thread while inside; other threads' (the
    client's own background logging) still show."""
    caller = threading.get_ident()
    quiet = logging.Filter()
    quiet.filter = lambda record: record.thread != caller
    logger = logging.getLogger(CLIENT_LOGGER)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def one_line(error: Exception) -> str:
    """A client error in one line: an ApiException's str() holds the HTTP headers and body."""
    status = getattr(error, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(error, 'reason', '') or ''}".strip()
    text = str(error).strip().splitlines()
    return f"{error.__class__.__name__}: {text[0] if text else ''}"
