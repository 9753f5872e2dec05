"""What the recovery layer needs from the processes of a run, and nothing more.

A multi-process save is one DCP checkpoint written by every rank; a commit strategy
(checkpoint/commit.py) turns it into a generation. The checkpointer only needs a way to let
the primary decide and tell everyone, a barrier and a gather, and, for saves written in the
background, a second coordinator on a process group of its own (`background()`): collectives
of two threads on one group can interleave differently on different ranks and deadlock, so
background work never touches the group the training loop uses. `trainer.parallel.ranks.Ranks`
satisfies this protocol under torchrun; `SingleProcess` is the trivial case, so the recovery
package never imports the process-group code above it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar

from trainer.errors import DecidedOnPrimary, PeerFailure, TrainerError, as_storage_failure, is_peer_loss, root_cause

T = TypeVar("T")


class Coordinator(Protocol):
    rank: int
    is_primary: bool
    """This process seals, publishes and records."""
    distributed: bool
    """Several processes take part in each save."""
    group: Any
    """The torch.distributed process group its collectives run on (None: the default one, or none)."""

    def decide_on_primary(self, decide: Callable[[], T], what: str) -> T:
        """Run `decide` on the primary only; every process gets its result (or its error)."""

    def barrier(self, what: str) -> None:
        """Return once every process got here."""

    def gather(self, value: T, what: str) -> list[T]:
        """Every process's `value`, in rank order, on every process."""

    def background(self) -> "Coordinator":
        """A coordinator on a new CPU (gloo) group for one background thread: every process
        must call this at the same point, as with any collective. Its collectives wait for a
        peer a bounded time (`--background-timeout-secs`), then fail."""

    def saved_in(self, seconds: float) -> None:
        """A save this (background) coordinator took part in lasted `seconds`: its collectives'
        bound follows the slowest save measured."""


class SingleProcess:
    """One process: it is the primary, decisions are local calls, barriers are no-ops."""

    rank = 0
    is_primary = True
    distributed = False
    group = None

    def decide_on_primary(self, decide: Callable[[], T], what: str) -> T:
        return decide()

    def barrier(self, what: str) -> None:
        return None

    def gather(self, value: T, what: str) -> list[T]:
        return [value]

    def background(self) -> "SingleProcess":
        return self

    def saved_in(self, seconds: float) -> None:
        return None


def failure_summary(error: BaseException, what: str) -> tuple[str, int, bool]:
    """A failure as (one line, exit status, already shared), to tell the other ranks. Already
    shared: the rank learnt it from another rank (its decision, or its absence from a
    collective), so it names no failure of its own."""
    if isinstance(error, TrainerError):
        return str(error), error.exit_code, isinstance(error, (DecidedOnPrimary, PeerFailure))
    storage = as_storage_failure(error, what)
    if storage is not None:
        return str(storage), storage.exit_code, False
    cause = root_cause(error)
    if is_peer_loss(cause):  # a background collective another rank never entered: its own error says why
        return f"{what} failed: another rank did not take part within the bound ({_first_line(cause)})", 1, True
    return f"{what} failed: {cause.__class__.__name__}: {_first_line(cause)}", 1, False


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [error.__class__.__name__])[0][:300]


def raise_if_any_failed(coordinator: Coordinator, failure: BaseException | None, what: str) -> None:
    """Every rank says whether its part of `what` failed; if any rank's did, every rank
    raises, so no rank goes on alone and none waits for one that stopped. Rank 0 prints one
    line naming the first rank whose own part failed; every rank exits with that status."""
    reports = coordinator.gather(None if failure is None else failure_summary(failure, what), what)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    rank, (message, exit_code, shared) = next((entry for entry in failed if not entry[1][2]), failed[0])
    if rank == coordinator.rank == 0 and failure is not None:
        raise failure
    raise DecidedOnPrimary(message if rank == 0 or shared else f"rank {rank}: {message}", exit_code)
