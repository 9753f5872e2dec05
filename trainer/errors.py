"""Typed errors, each bound to one sysexits-style exit code.

Library code raises these with a one-line message saying what happened, where, and how to fix
it; `cli.py` alone turns them into a line on stderr and an exit status.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base class: a failure the user or operator can act on (never a traceback)."""

    exit_code = 1


class UsageError(TrainerError):
    """An invalid option or combination of options."""

    exit_code = 2


class CorruptGeneration(TrainerError):
    """A generation's files do not match its manifest (or the manifest is unreadable)."""

    exit_code = 65


class FingerprintMismatch(TrainerError):
    """The environment or configuration differs from the one that wrote the generation."""

    exit_code = 65


class NothingToResume(TrainerError):
    """`--resume` was asked for but there is no generation (or not the one named)."""

    exit_code = 66


class RefuseOverwrite(TrainerError):
    """Generations exist and the run was not told to resume: nothing is touched."""

    exit_code = 73


class OutputLocked(TrainerError):
    """Another live trainer holds the output directory."""

    exit_code = 73


class StorageFailure(TrainerError):
    """Writing to the output failed (disk full, file-size limit, permission denied)."""

    exit_code = 74


class CrashLoop(TrainerError):
    """The same generation was restored by several attempts in a row that all died before
    publishing a newer one. Not 75: retrying again would only burn the allocation."""

    exit_code = 70


class TrackingUnavailable(UsageError):
    """`--tracked` was asked for but Polyaxon tracking cannot start: refuse rather than
    train half-tracked (outputs in one place, status and metrics nowhere)."""


class PeerFailure(TrainerError):
    """Another rank of a multi-process run stopped (crashed, was killed, lost its node) while
    this one waited for it; that rank's own error, if it printed one, says why."""

    exit_code = 1


class DecidedOnPrimary(TrainerError):
    """Rank 0 raised (and printed) an error in a decision every rank shares, such as the
    fingerprint guard; the other ranks exit with the same status without repeating the line."""

    reported_by_primary = True

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


EXIT_OK = 0
EXIT_INTERRUPTED = 75
