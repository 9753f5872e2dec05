"""Test seams, in one place: switches that exist only so tests can prove crash safety.

The CLI installs them once, from the environment, before any work starts; library code asks
`crash_point(name)` at each point of the publish protocol where a crash is worth proving
survivable, and `skip_rng_restore()` when restoring RNGs. With no seam installed (every
real run, every in-process use of the library) both are no-ops, so product code reads and
behaves the same with the seams off.

This is the one piece of process-wide state in the package, on purpose: threading a test
hook through every constructor on the save path made nine signatures carry it. It is
written once, before training, and only read afterwards.

Environment variables (read by `from_environment`; an unknown value is a usage error, so a
typo cannot silently disable a fault test):
- `TRAINER_FAULT_POINT=NAME` kills this process with SIGKILL at crash point NAME;
- `TRAINER_FAULT_RANK=R` limits that (and a pause, and a raise) to rank R of a multi-process run;
- `TRAINER_PAUSE_POINT=NAME` stops this process (SIGSTOP, once) at crash point NAME, so a test
  can change the world (take the store away) at exactly that point and then SIGCONT it;
- `TRAINER_RAISE_POINT=NAME` raises an I/O error (EIO) at crash point NAME, in whatever thread
  reaches it (a staging or committer thread's failure, rank 0's retention or export failing:
  the other ranks must hear of each);
- `TRAINER_DEBUG_SKIP_RNG_RESTORE=python,numpy` leaves those RNGs unrestored (the test that
  proves each RNG matters);
- `TRAINER_SIGNAL_AT_MICRO_BATCH=N` sends this process SIGTERM right after the backward of
  its N-th micro-batch (a preemption that lands inside a --grad-accum window).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from dataclasses import dataclass, replace
from typing import Mapping

from trainer.errors import UsageError

FAULT_ENV = "TRAINER_FAULT_POINT"
FAULT_RANK_ENV = "TRAINER_FAULT_RANK"
SKIP_RNG_ENV = "TRAINER_DEBUG_SKIP_RNG_RESTORE"
SIGNAL_ENV = "TRAINER_SIGNAL_AT_MICRO_BATCH"
PAUSE_ENV = "TRAINER_PAUSE_POINT"
RAISE_ENV = "TRAINER_RAISE_POINT"

CRASH_POINTS = ("after-staging", "after-write", "before-seal", "after-files-fsync", "after-manifest", "after-rename",
                "store-after-first-object", "store-before-manifest", "store-after-manifest",
                "store-retention-after-uncommit", "before-retention", "before-export", "memory-after-write",
                "after-memory-save")
"""Where a crash can be injected, in publish order: an async save's host copy complete (its
write not started), shards written, every rank's shards written (rank 0, on one disk, before
sealing), every file hashed and
fsynced, manifest written, directory renamed into place; then in a store: one data object
uploaded, every data object uploaded, the manifest committed; retention in a store
between removing a generation's manifest and its data; rank 0's local retention before it
removes a generation; rank 0 before it writes an export; a tier-0 generation's files written, before
its commit (in the background under async saves; `--memory-dir`); a tier-0 generation published and
recorded. An async tier-0 save passes `after-staging`, `after-write` and the commit's points too."""
RNG_KINDS = ("python", "numpy", "torch", "cuda")
"""The global RNGs a snapshot holds (trainer/run/state.py); named here so the CLI can validate
the skip list without importing torch."""


@dataclass(frozen=True)
class Seams:
    crash_at: str | None = None
    """Crash point at which this process kills itself (None: never)."""
    skip_rng: frozenset[str] = frozenset()
    """RNG kinds whose restore is skipped (empty: restore all)."""
    signal_at: int | None = None
    """Micro-batch of this attempt after whose backward this process sends itself SIGTERM."""
    pause_at: str | None = None
    """Crash point at which this process stops itself once (SIGSTOP) until a SIGCONT."""
    raise_at: str | None = None
    """Crash point at which the thread that reaches it raises (None: never)."""

    @classmethod
    def from_environment(cls, env: Mapping[str, str], rank: int) -> "Seams":
        point = _crash_point_named(env, FAULT_ENV)
        fault_rank = env.get(FAULT_RANK_ENV)
        if fault_rank is not None and not fault_rank.isdigit():
            raise UsageError(f"{FAULT_RANK_ENV}={fault_rank!r} is not a rank number")
        pause, raised = _crash_point_named(env, PAUSE_ENV), _crash_point_named(env, RAISE_ENV)
        if fault_rank is not None and int(fault_rank) != rank:
            point = pause = raised = None
        skip = frozenset(filter(None, env.get(SKIP_RNG_ENV, "").split(",")))
        if skip - set(RNG_KINDS):
            raise UsageError(f"{SKIP_RNG_ENV} names unknown RNGs {sorted(skip - set(RNG_KINDS))}; "
                             f"use {', '.join(RNG_KINDS)}")
        signal_at = env.get(SIGNAL_ENV)
        if signal_at is not None and not signal_at.isdigit():
            raise UsageError(f"{SIGNAL_ENV}={signal_at!r} is not a micro-batch number")
        return cls(point, skip, int(signal_at) if signal_at else None, pause, raised)


def _crash_point_named(env: Mapping[str, str], variable: str) -> str | None:
    """The crash point a variable names, or None; a typo is a usage error, never a silent no-op."""
    point = env.get(variable) or None
    if point is not None and point not in CRASH_POINTS:
        raise UsageError(f"{variable}={point!r} is not a crash point; use one of {', '.join(CRASH_POINTS)}")
    return point


_installed: list[Seams] = [Seams()]


def install(seams: Seams) -> None:
    """Called once by the CLI, before any work."""
    _installed[0] = seams


def crash_point(name: str) -> None:
    """Kill this process here (SIGKILL, no clean-up) if a test asked for a crash at `name`;
    stop it here once (SIGSTOP) if a test asked for a pause; raise if it asked for a raise."""
    if _installed[0].pause_at == name:
        _installed[0] = replace(_installed[0], pause_at=None)
        sys.stderr.write(f"trainer: fault injection: pausing at {name}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
    if _installed[0].crash_at == name:
        sys.stderr.write(f"trainer: fault injection: killing at {name}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if _installed[0].raise_at == name:
        raise OSError(errno.EIO, os.strerror(errno.EIO), f"fault injection: raising at {name}")


def micro_batch_done(count: int) -> None:
    """SIGTERM to this process after its `count`-th micro-batch, if a test asked for it."""
    if _installed[0].signal_at == count:
        os.kill(os.getpid(), signal.SIGTERM)


def skip_rng_restore() -> frozenset[str]:
    return _installed[0].skip_rng
