"""Where a run directory lives: two roles, whatever the backend.

The attempt (trainer/run/) holds one `RunStorage` and never asks which kind it is, the way
torchtitan's checkpointer dispatches its public verbs to a backend's hooks and Orbax picks
one of two commit strategies behind one interface. The interface has two roles, composed:

* the **claim** (`RunStorage`): hold the run directory, say what is committed, hand over a
  verified generation to restore (and each other rank its own copy), go ahead, go back;
* the **durability** (`Durability`, built by `RunStorage.durability()` once the attempt's
  record exists): the `Commit` a checkpointer writes through, and what becomes of each
  publish until it survives this machine (`after_publish`, `completed`, `kept_locally`,
  `drain`, `close`). Rank 0 and the other ranks are given the durability that fits them.

The record of an attempt survives the machine through `RunStorage.records` (a `RecordCopy`).

We have the same pair of commit strategies as Orbax:

* `LocalStorage` (storage/local.py): the run directory is on this machine's disk. A
  generation is committed by an atomic rename; a POSIX record lock keeps a second writer out.
* `ObjectStorage` (storage/object/backend.py): the run directory is in an object store,
  where a generation is committed by writing its manifest last, and a lease keeps a second
  writer out. Its durability is one of two strategies: `Tiered` (one process: published on
  this machine's local tier, then made durable by a background uploader) or `Direct`
  (several processes that share no disk: every rank uploads its own shards and rank 0
  commits, sync or async).

The claim's verbs, in the order an attempt calls them: `claim` (rank 0: hold the run
directory, bring its history here), `committed` and `restorable` (what can be restored, and a
verified local copy of one), `go_ahead` (the run's identity; the attempt goes on: clean up),
`remove_stale_temporaries`, `join` and `local_copy` (every other rank), `durability`, and
`set_aside_later_than` (going back).
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.commit import Commit
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


class RecordCopy(ABC):
    """Where an attempt's record goes to survive this machine."""

    @abstractmethod
    def push(self, folder: Path, step_digests: bool = True) -> None:
        """Copy the attempt's record (and, with `step_digests`, its per-step log); never raises."""

    @abstractmethod
    def note(self, newest_durable: str | None, considered: str | None) -> str | None:
        """The line an attempt ends with about what survives this machine (None: nothing more
        to say than the run directory on this disk)."""


class KeptHere(RecordCopy):
    """The record is where the run directory is: on this disk (or, on a rank other than 0,
    nowhere: only rank 0 keeps records)."""

    def push(self, folder: Path, step_digests: bool = True) -> None:
        return None

    def note(self, newest_durable: str | None, considered: str | None) -> str | None:
        return None


class Durability(ABC):
    """What makes a publish survive this machine, built after the claim for this rank."""

    @abstractmethod
    def commit(self) -> Commit:
        """The commit a checkpointer writes recovery generations through."""

    @abstractmethod
    def after_publish(self, kind: str, published: Published, directory: Path) -> AfterPublish:
        """Rank 0: a generation or export was just published on this machine."""

    @abstractmethod
    def completed(self) -> tuple[Durable, ...]:
        """Publishes that became durable since the last call; raises a background failure."""

    @abstractmethod
    def kept_locally(self, kind: str) -> frozenset[str]:
        """What local retention must not delete yet (not durable, or the newest durable one)."""

    @abstractmethod
    def recorded(self, folder: Path) -> None:
        """The record now says that publishes became durable (`after_publish` returned them)."""

    @abstractmethod
    def drain(self) -> tuple[Durable, ...]:
        """Wait until everything published is durable."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work (after `drain`, or after a failure)."""


class RunStorage(ABC):
    """The claim on a run directory, and this machine's copy of it (see the module docstring)."""

    shares_one_disk: bool = True
    """Every rank must see the run directory rank 0 claimed (else each has its own copy)."""

    def __init__(self, local: RunDirectory, where: str, generations_where: str, signing: Signing | None):
        self.local = local
        """This machine's run directory: the run itself, or the local tier of one in an object store."""
        self.where = where
        """The run directory as the user named it (a path or a URL), for messages."""
        self.generations_where = generations_where
        """Where the committed generations are, for messages."""
        self.signing = signing
        """With a key: what this attempt publishes is signed, what it restores must be."""
        self.records: RecordCopy = KeptHere()
        """Where this attempt's record survives this machine (rank 0's claim may change it)."""

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

    @abstractmethod
    def restorable(self, name: str, committed: list[str], one_pass: bool = False,
                   damaged: str | None = None) -> tuple[Verification, Transfer]:
        """The committed generation `name`, verified, on this machine (and what fetching it
        moved); a damaged one is refused (65), naming the newest earlier one that verifies.
        `one_pass`: a backend may leave the shards' digest to the load (`shards_pending`,
        trainer/checkpoint/onepass.py). `damaged`: the load found this problem in the copy
        returned before; the run directory's disk then refuses it as the separate pass would
        (65, naming the newest earlier one that verifies), an object store's local tier
        downloads it again (one warning) and returns the download."""

    def go_ahead(self, attempt_id: str, adopt_from: tuple[str, ...]) -> RunIdentity:
        """The choice succeeded and the attempt goes ahead: the run's identity is established
        (what the generation must belong to), and a backend may now delete what is not
        committed. A refused start (73, 66) therefore touches nothing."""
        return self._establish_identity(attempt_id, adopt_from)

    def _establish_identity(self, attempt_id: str, adopt_from: tuple[str, ...]) -> RunIdentity:
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
            self._keep_identity(identity.to_bytes())
        return identity

    def _keep_identity(self, data: bytes) -> None:
        """Write `run.json` where the run directory lives."""
        write_file_durably(self.local.identity, data)

    def remove_stale_temporaries(self) -> None:
        """Once the generation to restore verified: temporaries of dead writers go."""
        for kind in (GENERATIONS, EXPORTS):
            section = self.section(kind)
            for name in section.remove_stale_temporaries():
                log.info("removed stale temporary %s/%s", section.root.name, name)

    def _tidy_local_sections(self, warn_uncommitted: bool) -> None:
        """Finish what a crash interrupted on this disk; say which copies were never committed."""
        for kind in (GENERATIONS, EXPORTS):
            section = self.section(kind)
            for name in section.recover_interrupted_replacements():
                log.warning("restored %s/%s: a crash interrupted its replacement", section.root.name, name)
            for name in section.uncommitted() if warn_uncommitted else ():
                log.warning("%s has no manifest: an uncommitted copy (kept, never selected)", section.path(name))

    # ----------------------------------------------------------------- every rank
    @abstractmethod
    def join(self, claimed: RunDirectory) -> None:
        """A rank other than 0 learns the run directory rank 0 claimed (under --tracked only
        rank 0 knows the outputs path)."""

    def local_copy(self, generation: Verification) -> Verification:
        """A rank other than 0: the generation rank 0 verified, as this rank reads it."""
        return generation

    @abstractmethod
    def durability(self, protected: frozenset[str], attempt_folder: Path, primary: bool) -> Durability:
        """This rank's durability, once the attempt's record exists (rank 0 starts making
        publishes durable; `protected`: generations the backend's retention must keep)."""

    # ----------------------------------------------------------------- going back (rank 0)
    def set_aside_later_than(self, step: int) -> list[str]:
        """Going back: every later generation and export is set aside (kept, never selected);
        see `set_aside_later_line`."""
        return set_aside_later_line(self.section(GENERATIONS), self.section(EXPORTS), step)
