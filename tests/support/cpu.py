"""What the suite's 2-core budget is spent on: with TEST_CPU_LOG=FILE, each test's CPU seconds
(this worker's, its finished subprocesses', torchrun's ranks and the zygote's forked children
included) are appended to FILE, whatever else the machine runs at the time. And two savings: the
cyclic collector frozen once collection has imported torch (as the trainer does, trainer/cli.py),
and the checkout's modules compiled once per session (`compile_checkout`)."""

from __future__ import annotations

import gc
import os
import resource

import pytest

from support.cli import REPO, zygote

COMPILED = ("trainer", "examples", "bench", "tests")
"""The checkout's folders of Python that the suite's processes import or run."""


def pytest_sessionstart(session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # once: in the controller, or the only process
        compile_checkout()


def compile_checkout() -> None:
    """Each module of the checkout compiled to its __pycache__ (ignored by git), where it is
    stale or missing. An environment with PYTHONDONTWRITEBYTECODE=1 (this machine's) writes
    none, so every trainer process compiled the 80-odd modules it imports: about 0.2 CPU-s of
    each of the suite's hundreds of processes. Reading a .pyc needs no write: every process,
    forked or fresh, finds them."""
    import compileall

    for folder in COMPILED:
        compileall.compile_dir(REPO / folder, quiet=2)


def pytest_collection_finish(session) -> None:
    """Every test module and what it imports (torch) is loaded: frozen, the cyclic collector
    never scans them again in this long-lived worker."""
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With TEST_CPU_LOG=FILE, append `SECONDS NODEID` for each test to FILE."""
    log = os.environ.get("TEST_CPU_LOG")
    if not log:
        yield
        return
    before = cpu_seconds()
    yield
    with open(log, "a") as file:
        file.write(f"{cpu_seconds() - before:.2f} {item.nodeid}\n")


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked_children = zygote().cpu_seconds if zygote.cache_info().currsize else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked_children
