"""Where tier 0's generations lie on this node: which rank keeps whose part (`Place`: its own,
and with several nodes the replica of the rank before it, `partner`/`keeper_of`), one rank's
part as a run directory of its own (`MemoryPart`: `run.json`, `checkpoints/`, a lock), this
rank's parts together (`RankParts`: what they hold and may hold), and giving back this run's
parts of another world size (`remove_other_world_sizes`)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.atomic import write_file_durably
from trainer.checkpoint.identity import RunIdentity, identity_or_problem
from trainer.checkpoint.manifest import InvalidManifest, read_manifest
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.signing import Signing
from trainer.errors import OutputLocked
from trainer.layout import GENERATIONS, RunDirectory
from trainer.storage.lock import OutputLock
from trainer.storage.memory.budget import directory_bytes, node_share

log = logging.getLogger("trainer")


def partner(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank on the next node with the same local rank: it keeps this rank's replica. None
    with one node (no other node to survive on)."""
    if local_world_size >= world_size:
        return None
    return (rank + local_world_size) % world_size


def keeper_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank whose replica this rank keeps (the one that has this rank as its partner)."""
    if local_world_size >= world_size:
        return None
    return (rank - local_world_size) % world_size


@dataclass(frozen=True)
class Place:
    """Where this process sits: which tier-0 parts it writes and keeps (`partner`, `keeper_of`)."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    local_rank: int = 0

    @property
    def partner(self) -> int | None:
        return partner(self.rank, self.world_size, self.local_world_size)

    @property
    def keeps_replica_of(self) -> int | None:
        return keeper_of(self.rank, self.world_size, self.local_world_size)

    @property
    def several_nodes(self) -> bool:
        """Each rank has a partner on another node (and keeps a replica of its keeper's part)."""
        return self.local_world_size < self.world_size


def part_directory(directory: Path, rank: int, world_size: int) -> Path:
    """One rank's tier-0 generations: `--memory-dir` itself for one process; `rank-R-of-W`
    in it under torchrun (its own, or the replica it keeps of its keeper's partner). The world
    size is in the name: a part of another world size is never taken for this one's."""
    return directory if world_size == 1 else directory / f"rank-{rank}-of-{world_size}"




PART_NAME = re.compile(r"rank-(\d+)-of-(\d+)")


def other_world_sizes(directory: Path, world_size: int) -> list[Path]:
    """Parts under `directory` of another world size than `world_size`: `rank-R-of-W` folders
    with another W, and (under torchrun) a one-process part in `directory` itself. Never
    restored at this world size (`part_directory`)."""
    found = [entry for entry in sorted(directory.iterdir()) if entry.is_dir() and
             (match := PART_NAME.fullmatch(entry.name)) and int(match.group(2)) != world_size] \
        if directory.is_dir() else []
    root = RunDirectory(directory)
    if world_size > 1 and (root.section(GENERATIONS).is_dir() or root.identity.is_file()):
        found.insert(0, directory)
    return found


def remove_other_world_sizes(directory: Path, world_size: int, run: str) -> None:
    """Give back the memory of parts under `directory` of another world size that belong to
    `run` (a resume at another world size, or an earlier one: they are of a line this attempt
    leaves, and never restored at this one) or to no run (no readable `run.json`: nobody can
    restore them). Each only when its lock is free (no live trainer holds it) and while held;
    another run's is kept (a run we cannot speak for). One line says what was done."""
    removed, kept = [], []
    for path in other_world_sizes(directory, world_size):
        part = MemoryPart(path, None)
        name = "." if path == directory else path.name
        bound = part.bound_to()
        if bound not in (run, None):
            kept.append(f"{name} (run {bound}'s)")
            continue
        try:
            with OutputLock(path):
                if part.bound_to() == bound:  # read again, held: nobody binds it meanwhile
                    part.remove_everything(whole=path != directory)
        except OutputLocked:
            kept.append(f"{name} (held by a live trainer)")
            continue
        removed.append(f"{name} ({'this run' if bound else 'no run'})")
    if removed:
        log.info("tier 0 (%s) held parts of another world size than %d: removed %s%s", directory, world_size,
                 ", ".join(removed), f"; kept {', '.join(kept)}" if kept else "")
    elif kept:
        log.info("tier 0 (%s) holds parts of another world size than %d: kept %s", directory, world_size,
                 ", ".join(kept))



class MemoryPart:
    """One rank's tier-0 generations in one directory (`part_directory`): a run directory of
    its own (`run.json`, `checkpoints/`, a lock), on this node's memory filesystem."""

    def __init__(self, directory: Path, signing: Signing | None):
        self.run = RunDirectory(directory)
        self.section = LocalSection(self.run.section(GENERATIONS), signing)
        self.where = str(self.section.root)

    def claim(self, held: contextlib.ExitStack) -> None:
        """Held for the attempt: a second trainer pointed at it is refused (73)."""
        self.section.root.mkdir(parents=True, exist_ok=True)
        held.enter_context(OutputLock(self.run.root))
        self.section.recover_interrupted_replacements()
        self.section.remove_stale_temporaries()  # held: no other writer is filling one

    def held(self) -> tuple[str | None, dict[str, str]]:
        """(the run it is bound to, {generation: its writing attempt})."""
        generations = {}
        for name in self.section.names():
            try:
                generations[name] = read_manifest(self.section.path(name)).attempt
            except InvalidManifest:
                generations[name] = ""  # damaged: offered, so that verifying it refuses it with its reason
        return self.bound_to(), generations

    def bound_to(self) -> str | None:
        """The run this part holds generations of (its `run.json`), None if none or unreadable."""
        identity, _ = identity_or_problem(self.run.identity.read_bytes() if self.run.identity.is_file() else None)
        return identity.run if identity else None

    def bind(self, identity: RunIdentity) -> None:
        """It belongs to this run from now on: its `run.json` is the run directory's. What
        another run left here is removed (memory, not a durable copy: the lock held since
        `claim` says no live trainer uses it)."""
        if self.bound_to() != identity.run:
            if left := self.section.names():
                log.warning("tier 0 (%s) held generations of run %s (%s): removed, it now belongs to run %s",
                            self.where, self.bound_to(), ", ".join(left), identity.run)
            for name in left:
                self.section.remove(name)
        data = identity.to_bytes()
        if not self.run.identity.is_file() or self.run.identity.read_bytes() != data:
            write_file_durably(self.run.identity, data)

    def remove_everything(self, whole: bool) -> None:
        """Every generation and temporary, and its `run.json`; with `whole`, its directory too
        (the caller holds its lock)."""
        if whole:
            shutil.rmtree(self.run.root, ignore_errors=True)
            return
        shutil.rmtree(self.section.root, ignore_errors=True)
        self.run.identity.unlink(missing_ok=True)

    def remove_where(self, doomed: Callable[[str], bool]) -> list[str]:
        names = [name for name in self.section.names() if doomed(name)]
        for name in names:
            self.section.remove(name)
        return names

    def used_bytes(self) -> int:
        return sum(directory_bytes(self.section.path(name)) for name in self.section.names())


class RankParts:
    """This rank's tier-0 parts in `directory`: its own, and under torchrun with several nodes
    the replica it keeps of its keeper rank's part (`by_rank`: {rank: its part here})."""

    def __init__(self, directory: Path, signing: Signing | None, place: Place):
        self.place = place
        self.own = MemoryPart(part_directory(directory, place.rank, place.world_size), signing)
        self.by_rank = {place.rank: self.own}
        if place.several_nodes:
            kept = place.keeps_replica_of
            self.by_rank[kept] = MemoryPart(part_directory(directory, kept, place.world_size), signing)
        self.all = list(self.by_rank.values())

    def used_bytes(self) -> int:
        return sum(part.used_bytes() for part in self.all)

    def limit_bytes(self, max_bytes: int | None) -> int:
        """`max_bytes` (`--memory-tier-max-bytes`), else what these parts hold plus this rank's
        share of what their filesystem has free (`node_share`: the processes of the node share it)."""
        if max_bytes is not None:
            return max_bytes
        stats = os.statvfs(self.own.section.root)
        return node_share(stats.f_bavail * stats.f_frsize, self.place.local_world_size) + self.used_bytes()

    def share(self) -> str:
        """Where the default budget comes from, as the refusal says it."""
        processes = self.place.local_world_size
        return "the free memory of its filesystem" if processes == 1 else \
            f"1/{processes} of the free memory of its filesystem: {processes} processes on this node share it"
