"""What the suite's 2-core budget is spent on: with TEST_CPU_LOG=FILE, each test's CPU seconds
(this worker's, its finished subprocesses', torchrun's ranks and the zygote's forked children
included) are appended to FILE, whatever else the machine runs at the time. And the cyclic
collector frozen once collection has imported torch (as the trainer does, trainer/cli.py)."""

from __future__ import annotations

import gc
import os
import resource

import pytest

from support.cli import zygote


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
