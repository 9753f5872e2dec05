"""Where a run directory lives: one interface, whatever the backend.

The attempt (trainer/run/) holds one `RunStorage` and never asks which kind it is, the way
torchtitan's checkpointer dispatches its public verbs to a backend's hooks and Orbax picks
one of two commit strategies behind one interface. We have the same pair of strategies:

* `LocalStorage` (storage/local.py): the run directory is on this machine's disk. A
  generation is committed by an atomic rename; a flock keeps a second writer out.
* `TieredObjectStorage` and `DirectObjectStorage` (storage/object/backend.py): the run
  directory is in an object store, where a generation is committed by writing its manifest
  last, and a lease keeps a second writer out. Tiered: published on this machine's local
  tier, then made durable by a background uploader. Direct (several processes that share no
  disk): every rank uploads its own shards and rank 0 commits inside the save.

The verbs, in the order an attempt calls them: `claim` (rank 0: hold the run directory, bring
its history here), `committed` and `restorable` (what can be restored, and a verified local
copy of one), `go_ahead` (the attempt goes on: clean up), `checkpointer` (how a save is
written), `start_uploads`, `after_publish` and `completed` (what happens to what a save
published), `set_aside_later_than` (going back), `push_record`, `drain` and `close`.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.resume import set_aside_later_line
from trainer.checkpoint.section import LocalSection, Published
from trainer.checkpoint.atomic import write_file_durably
from trainer.checkpoint.identity import ADOPT_OPTION, RunIdentity, identity_or_problem
from trainer.checkpoint.signing import Signing
from trainer.errors import CorruptGeneration
from trainer.layout import EXPORTS, GENERATIONS, RUN_IDENTITY, RunDirectory

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Transfer:
    """What one copy between the object store and this machine moved, and how long it took."""

    bytes: int
    seconds: float


NOTHING_MOVED = Transfer(0, 0.0)


@dataclass(frozen=True)
class Durable:
    """A published generation or export that is now committed where it survives this machine."""

    kind: str
    """GENERATIONS or EXPORTS."""
    name: str
    bytes: int
    upload_s: float
    """Seconds the upload itself took."""
    durable_s: float
    """Seconds from the save's start to its commit in the object store."""


@dataclass(frozen=True)
class AfterPublish:
    """What the backend did with one publish, for the attempt to record."""

    durable: tuple[Durable, ...] = ()
    """Publishes that became durable meanwhile (this one, when the backend waits for it)."""
    waited_s: float = 0.0
    """Seconds the loop was held (back-pressure of a slow object store)."""
    removed: tuple[str, ...] = ()
    """Generations the backend's own retention removed from the object store."""


class RunStorage(ABC):
    """A run directory and this machine's copy of it (see the module docstring)."""

    def __init__(self, local: RunDirectory, where: str, signing: Signing | None):
        self.local = local
        """This machine's run directory: the run itself, or the local tier of one in an object store."""
        self.where = where
        """The run directory as the user named it (a path or a URL), for messages."""
        self.signing = signing
        """With a key: what this attempt publishes is signed, what it restores must be."""

    def section(self, kind: str) -> LocalSection:
        """This machine's generations or exports."""
        return LocalSection(self.local.section(kind), self.signing)

    # ----------------------------------------------------------------- claiming (rank 0)
    @abstractmethod
    def claim(self, attempt_id: str, held: contextlib.ExitStack, must_exist: bool) -> None:
        """Hold the run directory for this attempt (until `held` closes) and bring its history
        here. `must_exist`: the operator asked to resume, so a missing local directory is 66."""

    @abstractmethod
    def committed(self) -> list[str]:
        """The committed generations, oldest first: what a resume may choose from."""

    @property
    @abstractmethod
    def generations_where(self) -> str:
        """Where the committed generations are, for messages."""

    @abstractmethod
    def restorable(self, name: str, committed: list[str]) -> tuple[Verification, Transfer]:
        """The committed generation `name`, verified, on this machine (and what fetching it
        moved); a damaged one is refused (65), naming the newest earlier one that verifies."""

    def establish_identity(self, attempt_id: str, adopt_from: tuple[str, ...]) -> RunIdentity:
        """The run's identity (`run.json`): created with the run directory, kept from then on,
        with the runs the operator adopts (`--adopt-from`) added and recorded. A directory
        without one gets a new id: its generations that name a run are then foreign until
        adopted, so removing `run.json` never lets another run's generation in."""
        path = self.local.identity
        data = path.read_bytes() if path.is_file() else None
        found, problem = identity_or_problem(data)
        if problem:
            raise CorruptGeneration(f"{path}: {problem.split(': ', 1)[1]}; restore it from a copy of the run "
                                    f"directory, or remove it and adopt the generations with {ADOPT_OPTION} RUN")
        identity = found or RunIdentity.new()
        if found is None and self.committed():
            log.warning("%s had no %s: this run is now %s (generations that name another run need %s)",
                        self.where, RUN_IDENTITY, identity.run, ADOPT_OPTION)
        for run in adopt_from:
            identity = identity.adopting(run, attempt_id, ADOPT_OPTION)
            log.info("adopting the generations of run %s (%s, recorded in %s)", run, ADOPT_OPTION, RUN_IDENTITY)
        if identity != found:
            self.keep_identity(identity.to_bytes())
        return identity

    def keep_identity(self, data: bytes) -> None:
        """Write `run.json` where the run directory lives."""
        write_file_durably(self.local.identity, data)

    def go_ahead(self) -> None:
        """The choice succeeded and the attempt goes ahead: the backend may now delete what is
        not committed. A refused start (73, 66) therefore deletes nothing."""

    def remove_stale_temporaries(self) -> None:
        """Once the generation to restore verified: temporaries of dead writers go."""
        for kind in (GENERATIONS, EXPORTS):
            section = self.section(kind)
            for name in section.remove_stale_temporaries():
                log.info("removed stale temporary %s/%s", section.root.name, name)

    def tidy_local_sections(self, warn_uncommitted: bool) -> None:
        """Finish what a crash interrupted on this disk; say which copies were never committed."""
        for kind in (GENERATIONS, EXPORTS):
            section = self.section(kind)
            for name in section.recover_interrupted_replacements():
                log.warning("restored %s/%s: a crash interrupted its replacement", section.root.name, name)
            for name in section.uncommitted() if warn_uncommitted else ():
                log.warning("%s has no manifest: an uncommitted copy (kept, never selected)", section.path(name))

    # ----------------------------------------------------------------- every rank
    def join(self, claimed: RunDirectory) -> None:
        """A rank other than 0 learns the run directory rank 0 claimed (under --tracked only
        rank 0 knows the outputs path)."""

    def needs_one_disk(self) -> bool:
        """Every rank must see the run directory rank 0 claimed (a shared disk)."""
        return True

    def local_copy(self, generation: Verification) -> Verification:
        """A rank other than 0: the generation rank 0 verified, as this rank reads it."""
        return generation

    @abstractmethod
    def checkpointer(self, mode: str, attempt_id: str, coordinator: Coordinator, device) -> Checkpointer:
        """How this attempt writes a recovery generation ("sync" or "async")."""

    # ----------------------------------------------------------------- after each publish
    def start_uploads(self, protected: frozenset[str], attempt_folder: Path) -> None:
        """Rank 0, once the attempt's record exists: start making publishes durable."""

    def after_publish(self, kind: str, published: Published, directory: Path) -> AfterPublish:
        """Rank 0: a generation or export was just published on this machine."""
        return AfterPublish()

    def completed(self) -> tuple[Durable, ...]:
        """Publishes that became durable since the last call; raises a background failure."""
        return ()

    def kept_locally(self, kind: str) -> frozenset[str]:
        """What local retention must not delete yet (not durable, or the newest durable one)."""
        return frozenset()

    def set_aside_later_than(self, step: int) -> list[str]:
        """Going back: every later generation and export is set aside (kept, never selected);
        see `set_aside_later_line`."""
        return set_aside_later_line(self.section(GENERATIONS), self.section(EXPORTS), step)

    def push_record(self, folder: Path) -> None:
        """Copy an attempt's record where it survives this machine; never raises."""

    def recorded(self, folder: Path) -> None:
        """The record now says that publishes became durable (`after_publish` returned them)."""

    def durable_note(self, newest_durable: str | None, considered: str | None) -> str | None:
        """The line an attempt ends with about what survives this machine (None: the run
        directory is on this disk, nothing more to say)."""
        return None

    # ----------------------------------------------------------------- the end
    def drain(self) -> tuple[Durable, ...]:
        """Wait until everything published is durable."""
        return ()

    def close(self) -> None:
        """Stop background work (after `drain`, or after a failure)."""
