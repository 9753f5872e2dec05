"""What the training loop tells an outside observer (experiment tracking), and nothing more.

The loop calls these at a few fixed points: once the attempt record exists, after every
optimizer step, after every published generation or export (and, for a run directory in an
object store, once the store holds it), and after retention removed one.
The default does nothing, so an untracked run pays one method call per step and imports
nothing. `trainer.integrations.polyaxon.tracking` implements them for Polyaxon; ending the tracked run (offline:
succeeded / stopped / failed) happens in the CLI, which is the one place that knows the final
exit status of every path, including failures before the loop starts.

Observers must not change training: they receive plain values and return nothing the loop
uses, except `run_identity`, which only goes into the attempt record.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainer.run.records import AttemptRecord

if TYPE_CHECKING:  # the checkpointer imports torch; observers only need the record's fields
    from trainer.checkpoint.checkpointer import Published


class TrainingEvents:
    """The no-op observer; subclasses override what they record."""

    def run_identity(self, previous_attempt: AttemptRecord | None) -> dict | None:
        """The external run this attempt belongs to, for the attempt record's `polyaxon`
        field (None when untracked). `previous_attempt` is the newest earlier record in the
        same output directory, which tells a resumed run from a fresh one."""
        return None

    def attempt_started(self, record: dict) -> None:
        """The attempt record was written: what was restored, and what will be replayed."""

    def step_completed(self, step: int, metrics: dict[str, float]) -> None:
        """Optimizer step `step` (global, counted from the start of training) finished."""

    def published(self, kind: str, path: Path, published: "Published") -> None:
        """A `generation` or `export` was atomically published at `path`."""

    def durable(self, kind: str, name: str) -> None:
        """The `generation` or `export` called `name` is committed in the run's store (a run
        directory in an object store; at once for saves made straight to the store)."""

    def removed(self, kind: str, name: str) -> None:
        """Retention deleted the `generation` or `export` called `name`: it is no longer an artifact."""

    def continue_hint(self) -> str:
        """How the user continues this run after exit 75 (the trainer's option; a tracker's command)."""
        return "rerun with --resume auto"
