"""What the recovery layer needs from the processes of a run, and nothing more.

A multi-process save is one DCP checkpoint written by every rank into a temporary directory
that rank 0 created; rank 0 alone seals and publishes it. The checkpointer only needs a way
to let the primary decide and tell everyone, and a barrier. `trainer.parallel.ranks.Ranks`
satisfies this protocol under torchrun; `SingleProcess` is the trivial case, so the recovery
package never imports the process-group code above it.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

T = TypeVar("T")


class Coordinator(Protocol):
    is_primary: bool
    """This process seals, publishes and records."""
    distributed: bool
    """Several processes take part in each save."""

    def decide_on_primary(self, decide: Callable[[], T], what: str) -> T:
        """Run `decide` on the primary only; every process gets its result (or its error)."""

    def barrier(self, what: str) -> None:
        """Return once every process got here."""

    def gather(self, value: T, what: str) -> list[T]:
        """Every process's `value`, in rank order, on every process."""


class SingleProcess:
    """One process: it is the primary, decisions are local calls, barriers are no-ops."""

    is_primary = True
    distributed = False

    def decide_on_primary(self, decide: Callable[[], T], what: str) -> T:
        return decide()

    def barrier(self, what: str) -> None:
        return None

    def gather(self, value: T, what: str) -> list[T]:
        return [value]
