"""An attempt that failed on the workload's own code: one line naming where the exception came
from (a DataLoader worker, the dataset, the model and its loss, the optimizer step) and what
it was, with a failed exit (1, never 75: retrying a deterministic failure would repeat it).

The place is read from the traceback: the trainer frame nearest the failure says which part of
the workload the trainer was calling, the innermost frame says which line raised. An exception
from a DataLoader worker reaches the trainer re-raised by torch, its traceback folded into the
message; that message is read instead. An exception that passed through none of these is
the trainer's own: it is left as it is (a bug keeps its traceback). The full traceback goes to
the log, for whoever fixes the workload.
"""

from __future__ import annotations

import logging
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import NoReturn

from trainer.errors import PeerFailure, TrainerError, UsageError, option
from trainer.run.records import FAILED, INTERRUPTED
from trainer.data.fetching import KeyedSeeding
from trainer.run.stepping import OptimizerSteps
from trainer.workload.loading import first_line

log = logging.getLogger("trainer")

EXIT_FAILED = 1

CALLS_INTO_THE_WORKLOAD: dict[CodeType, str] = {
    KeyedSeeding.fetched.__code__: "the dataset",
    OptimizerSteps.micro_batch.__code__: "the model or its loss",
    OptimizerSteps.step.__code__: "the optimizer step (optimizer, scheduler or a step hook)",
}
"""The trainer's calls into the workload, by code object (a renamed method fails the import)."""

WORKER_RAISED = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)\.\nOriginal Traceback[^\n]*\n(.*)",
                           re.DOTALL)
FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
WORKER_DIED = re.compile(r"DataLoader worker \(pid.*?\) (exited unexpectedly.*|is killed by signal.*)")


NONDETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation, but you set "
                              r"'torch\.use_deterministic_algorithms\(True\)'")
"""torch's error (checked against torch 2.13.0) for an op without a deterministic kernel on its device."""
NONDETERMINISTIC_ALLOWED = ("--allow-nondeterministic-ops: ops without a deterministic implementation on this device "
                            "ran (torch warned), so a resumed run may differ by rounding; the exactness witness "
                            "reports it")


class NondeterministicOp(UsageError):
    """The workload used an op with no deterministic implementation on this device: exactness
    cannot be promised, so the run ends in one line naming the op and the opt-in (2), never the
    workload's traceback; retrying would repeat it."""


def nondeterministic_op(error: BaseException) -> NondeterministicOp | None:
    """The refusal `error` (or what it was raised from) stands for, if it is torch's."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RuntimeError) and (found := NONDETERMINISTIC.search(str(error))):
            return NondeterministicOp(
                f"{found.group(1)} has no deterministic implementation on this device, so this run cannot promise "
                f"an exact resume; use another op, or accept it with {option('--allow-nondeterministic-ops')} "
                f"(recorded as not promised exact)")
        error = error.__cause__ or error.__context__
    return None


class WorkloadFailure(TrainerError):
    """The workload's code raised (or a DataLoader worker died): the message names where."""

    exit_code = EXIT_FAILED


@dataclass(frozen=True)
class Failure:
    """How an attempt that raised `cause` ends: the error to raise, its exit code and reason."""

    cause: BaseException
    error: BaseException

    @property
    def exit_code(self) -> int:
        return self.error.exit_code if isinstance(self.error, TrainerError) else EXIT_FAILED

    @property
    def reason(self) -> str:
        return str(self.error) if isinstance(self.error, TrainerError) else \
            f"{self.error.__class__.__name__}: {self.error}"

    def record_and_raise(self, recorder) -> NoReturn:
        """Record the attempt `failed` (`interrupted` by a lost peer, with its ranks), then raise."""
        if isinstance(self.error, PeerFailure):
            recorder.peer_failed(self.error.state, self.error.ranks)
            recorder.ended(INTERRUPTED, self.exit_code, self.reason)
        else:
            recorder.ended(FAILED, self.exit_code, self.reason)
        if self.error is self.cause:
            raise self.cause
        raise self.error from self.cause


def attributed(error: BaseException) -> Failure:
    """`error`, or a WorkloadFailure naming where in the workload it came from."""
    if isinstance(error, TrainerError) or not isinstance(error, Exception):
        return Failure(error, error)
    if (refusal := nondeterministic_op(error)) is not None:  # where it was used: in the log, for whoever looks
        log.info("%s", "".join(traceback.format_exception(error)).rstrip())
        return Failure(error, refusal)
    where = from_worker(str(error)) or from_main_process(error)
    if where is None:
        return Failure(error, error)
    log.error("%s", "".join(traceback.format_exception(error)).rstrip())
    return Failure(error, WorkloadFailure(where))


def from_worker(message: str) -> str | None:
    if died := WORKER_DIED.search(message):
        return f"a DataLoader worker died ({died.group(1).rstrip(' .').removeprefix('is ')}): killed from outside, " \
               f"or by the " \
               f"out-of-memory killer; check the workers' memory (--num-workers) and the node's log"
    raised = WORKER_RAISED.search(message)
    if raised is None:
        return None
    kind, worker, rest = raised.groups()
    frames = FRAME_LINE.findall(rest)
    at = f" at {place(frames[-1][0], int(frames[-1][1]), frames[-1][2])}" if frames else ""
    said = next((line for line in reversed(rest.strip().splitlines()) if line.startswith(kind)), kind)
    return f"the dataset raised in DataLoader worker {worker}{at}: {said}"


def from_main_process(error: Exception) -> str | None:
    frames = list(traceback.walk_tb(error.__traceback__))
    part = next((CALLS_INTO_THE_WORKLOAD[frame.f_code] for frame, _ in reversed(frames)
                 if frame.f_code in CALLS_INTO_THE_WORKLOAD), None)
    if part is None:
        return None
    frame, line = frames[-1]
    return f"{part} raised at {place(frame.f_code.co_filename, line, frame.f_code.co_name)}: " \
           f"{error.__class__.__name__}: {first_line(error)}"


def place(filename: str, line: int, function: str) -> str:
    """`path:line in function`, the path relative to the working directory when it is below it."""
    path = Path(filename)
    try:
        path = path.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{path}:{line} in {function}"
