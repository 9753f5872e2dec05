"""Typed errors, each bound to one sysexits-style exit code.

Library code raises these with a one-line message saying what happened, where, and how to fix
it; `cli.py` alone turns them into a line on stderr and an exit status.
"""

from __future__ import annotations

import errno
import os


OPTION = "\x1f"
"""Brackets an option named in a message (`option`)."""


def option(flag: str, value: object = None) -> str:
    """An option named in a message, as the user spells it: `str()` of the error says the
    command line's `--flag value`; `trainer.recovery` says `open_run`'s keyword instead
    (`resume='auto'`, trainer/recovery/said.py `spelled`). One message for both users."""
    return f"{OPTION}{flag}{'' if value is None else f' {value}'}{OPTION}"


def as_flags(text: str) -> str:
    """`text` with its options (`option`) as the command line spells them."""
    return text.replace(OPTION, "")


class TrainerError(Exception):
    """Base class: a failure the user or operator can act on (never a traceback)."""

    exit_code = 1

    def __str__(self) -> str:
        return as_flags(super().__str__())


class UsageError(TrainerError):
    """An invalid option or combination of options."""

    exit_code = 2


class ChangedWhileStaged(UsageError):
    """The loop changed a parameter or the optimizer's state in place after an async save and
    before its next optimizer step, while the save's copy of it could still be read (an EMA
    swapped in for evaluation, a hand-made update): that generation would hold a torn state,
    so it is never committed. A usage error (2): change them only in `optimizer.step()`, or
    save with `checkpoint_mode="sync"`."""


class MemoryTierTooSmall(UsageError):
    """Tier 0's K generations and the staging buffers do not fit `--memory-tier-max-bytes`
    (or the memory filesystem): the options ask for what this state cannot have. A usage
    error (2), not 73 or 74: nothing is held by another writer and no I/O failed, retrying
    cannot help, and the fix is an option (raise the budget, lower --memory-keep)."""


class CorruptGeneration(TrainerError):
    """A generation's files do not match its manifest (or the manifest is unreadable)."""

    exit_code = 65


class UntrustedGeneration(TrainerError):
    """A generation holds something loading would have to run code for (a pickled object
    outside DCP's metadata classes, a value that does not load weights-only), or, with a
    signing key, it is unsigned or its signature does not match: refused, nothing deleted."""

    exit_code = 65


class UnloadableState(TrainerError):
    """The training state holds a value that only an unrestricted unpickler could load back
    (a workload's stateful object returning a custom class): refused at the save, not at
    the resume hours later."""

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
    """Another rank of a multi-process run stopped answering (crashed, was killed, lost its
    node, froze) while this one waited for it. Resumable: nothing of this rank's is wrong, and
    the next attempt (torchrun's restart in place, the orchestrator's retry) continues from the
    newest generation. `state` is LOST (its connection closed) or UNRESPONSIVE (no reply within
    the bound); `ranks` the ones whose heartbeat stopped (empty when that cannot be known)."""

    exit_code = 75
    LOST, UNRESPONSIVE = "lost", "unresponsive"

    def __init__(self, message: str, state: str = LOST, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.state, self.ranks = state, ranks


class DecidedOnPrimary(TrainerError):
    """Rank 0 raised (and printed) an error in a decision every rank shares, such as the
    fingerprint guard; the other ranks exit with the same status without repeating the line."""

    reported_by_primary = True

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def is_peer_loss(error: BaseException) -> bool:
    """A collective failed because another rank went away or did not come within the group's
    timeout: gloo reports a closed or reset connection, or a timeout, as a plain RuntimeError
    from its transport; NCCL raises DistError kinds (found by name: this module imports no torch)."""
    if any(kind.__name__ == "DistError" for kind in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and "gloo/transport" in str(error)


EXIT_OK = 0
EXIT_INTERRUPTED = 75


# ----------------------------------------------------------------- storage errors, in one line
_STORAGE_ADVICE = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free space or raise the quota",
                   errno.EFBIG: "raise the file-size limit (ulimit -f)", errno.EACCES: "fix the permissions",
                   errno.EPERM: "fix the permissions", errno.EROFS: "make the filesystem writable"}


def storage_failure(error: OSError, what: str) -> StorageFailure:
    """One line for an I/O error: what failed, where, and what to do about it."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    where = f" ({error.filename})" if getattr(error, "filename", None) else ""
    advice = _STORAGE_ADVICE.get(error.errno, "check the storage")
    return StorageFailure(f"{what} failed: {reason}{where}; {advice}, then rerun with {option('--resume', 'auto')}")


def root_cause(error: BaseException) -> BaseException:
    """DCP wraps each rank's error in a CheckpointException (a BaseException whose str()
    holds tracebacks); dig out the original so it can be reported in one line. The chain may
    loop (an inner error re-raised while its wrapper was being handled has the wrapper as its
    context): the walk stops at the first error it meets again."""
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            error = first[0] if isinstance(first, tuple) else first
            continue
        cause = error.__cause__ or error.__context__
        if isinstance(error, OSError) or not isinstance(cause, BaseException) or id(cause) in seen:
            return error
        error = cause
    return error


SHORT_WRITE = ("inline_container", "unexpected pos")
"""How torch's zip writer (torch.save into a shard file) reports a write the file took only in
part: a full disk or a file-size limit, surfacing as a RuntimeError instead of an OSError."""


def as_storage_failure(error: BaseException, what: str) -> StorageFailure | None:
    """Any OS-level I/O error (disk full, limits, permissions, a stale network mount…) is the
    storage's problem, not a bug: it becomes one line and exit 74. None for anything else."""
    cause = root_cause(error)
    if isinstance(cause, OSError):
        return storage_failure(cause, what)
    if isinstance(cause, RuntimeError) and all(part in str(cause) for part in SHORT_WRITE):
        return StorageFailure(f"{what} failed: a write was cut short (the disk is full or a file-size limit was "
                              f"reached); free space or raise the limit (ulimit -f), then rerun with "
                              f"{option('--resume', 'auto')}")
    return None


def reraise_as_storage_failure(error: BaseException, what: str):
    """Inside an `except`: raise a storage error as one-line StorageFailure (exit 74), and
    anything else unchanged."""
    failure = as_storage_failure(error, what)
    if failure is not None:
        raise failure from None
    raise error
