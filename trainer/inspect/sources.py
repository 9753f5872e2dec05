"""The read side of a run directory, whatever its backend: one interface for `list`,
`verify`, `report` and `compare.py`.

`LocalRun` reads a directory on this disk; `ObjectStoreRun` reads the objects of a run in an
object store (read-only: no lease, no writes), with this machine's local tier beside it. The
commands format what either returns the same way (trainer/inspect/listing.py), so a run
prints the same tables, lines and exit codes wherever it lives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.signing import Signing
from trainer.location import InStore, OnDisk


class RunSource(ABC):
    where: str
    """The run directory (or generation) as the user named it."""
    signing: Signing | None = None
    """With a key: unsigned or mis-signed generations do not verify."""

    @abstractmethod
    def describe(self) -> dict:
        """`list`: generations, exports and attempts (66 when this is no run)."""

    @abstractmethod
    def verifications(self) -> list[tuple[str, Verification]]:
        """`verify`: every generation and export re-hashed (or the one this source names)."""

    @abstractmethod
    def report(self):
        """`report`: the recovery report from the attempt records (66 when there are none)."""

    @abstractmethod
    def generation(self, scratch: Path) -> Path:
        """`compare.py`: the generation this source names as a verified local directory (one
        in an object store is downloaded into `scratch`)."""


class LocalRun(RunSource):
    def __init__(self, path: Path, signing: Signing | None = None):
        self.path, self.where, self.signing = path, str(path), signing

    def describe(self) -> dict:
        from trainer.inspect.listing import describe_run, require_run_directory

        require_run_directory(self.path)
        return describe_run(self.path, self.signing)

    def verifications(self) -> list[tuple[str, Verification]]:
        from trainer.inspect.listing import local_verifications

        return local_verifications(self.path, self.signing)

    def report(self):
        from trainer.inspect.listing import run_report

        return run_report(self.path)

    def generation(self, scratch: Path) -> Path:
        return self.path


class ObjectStoreRun(RunSource):
    def __init__(self, location: InStore, signing: Signing | None = None):
        self.location, self.where, self.signing = location, location.store.url, signing

    def describe(self) -> dict:
        from trainer.inspect.object_store import describe_store_run

        return describe_store_run(self.location.store, self.location.local_tier, self.signing)

    def verifications(self) -> list[tuple[str, Verification]]:
        from trainer.inspect.object_store import store_verifications

        return store_verifications(self.location.store, self.signing)

    def report(self):
        from trainer.inspect.object_store import store_report

        return store_report(self.location.store)

    def generation(self, scratch: Path) -> Path:
        from trainer.inspect.object_store import local_generation

        return local_generation(self.location.store, scratch)


def open_source(location: OnDisk | InStore, signing: Signing | None = None) -> RunSource:
    """A run on this disk or in an object store (as `location_argument` parsed it): the one
    place of the read side that asks."""
    match location:
        case InStore():
            return ObjectStoreRun(location, signing)
        case OnDisk(root):
            return LocalRun(root, signing)
