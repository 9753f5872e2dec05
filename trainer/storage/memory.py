"""Tier 0: recovery generations in memory, outside the process (`--memory-dir`).

A directory on a memory filesystem (`/dev/shm/…` on a machine, an `emptyDir` with
`medium: Memory` in a pod) holds the newest `--memory-keep` generations, saved every
`--memory-every-steps` steps. It survives a crashed or OOM-killed process and a container
restart in the same pod; it does not survive the loss of the pod or the node, so it never
replaces the durable tiers (the run directory, the object store), which keep their cadence.

Its generations follow the same protocol as the durable ones: the same checkpointer (of the
attempt's mode) and `RenameCommit`, the same `LocalSection` (manifest last with every file's sha256, signed with
the backend's key, renamed into place), verified on load and bound to the run (`run.json`,
copied here from the run directory). A restore reads tier 0 first when it holds a generation
newer than the newest durable one that continues the line (`newer_than`); a damaged one is
refused with one warning and the durable tier serves (`restorable`). Going back
(`--from-generation`) sets later tier-0 generations aside too (removed: no superseded copies are
kept in memory).

Under async saves (`--checkpoint-mode async`; `auto` where it runs async, on CUDA) a tier-0 save
is an `AsyncCheckpointer` of its own: the loop pays its staging (a host copy into buffers of its
own, reused from save to save), and the write, the commit (manifest last, signed, renamed) and the
pruning's accounting happen in the background. Its buffers are apart from the durable saves', so
a tier-0 save in flight never holds or touches a durable one; a durable save never waits for it.
It is reported once committed (`completed`, polled after every step; at the latest the next
tier-0 save waits for it), and its failure is a warning, as in sync mode. A kill during its
write leaves a temporary, never selected and removed at the next `claim`. Under sync saves it
writes in the loop (`SyncCheckpointer`).

Under torchrun each rank writes a part of its own (`part_directory`: `rank-R-of-W/` in the
node's `--memory-dir`), alone: no collective, so a tier-0 save never waits for a peer, and a
restore loads each part on its rank alone. With several nodes each rank's part is also kept by
its partner on the next node (`Replication`, storage/peer.py); the claim (trainer/run/claim.py)
offers a generation only when every rank's part can be had, and a rank whose part is missing
or damaged fetches the replica (`fetch`).

The budget (`--memory-tier-max-bytes`, default: what the memory filesystem has free) covers
the K generations and the staging buffers of async saves: two host copies of the state (the
durable saves' and tier 0's); a start that cannot fit is refused in one line (exit 2), and a
save that would not fit is skipped with a warning, never written past the budget. Every save
waits for the tier-0 save before it (one in flight) and prunes to K - 1 before writing, so K are
never exceeded even while one is being written.

`NoMemoryTier` is the same interface with nothing behind it (the option is off): the attempt
never asks which one it holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer import seams
from trainer.checkpoint.atomic import write_file_durably
from trainer.checkpoint.checkpointer import Checkpointer, build_checkpointer
from trainer.checkpoint.commit import Committed, RenameCommit
from trainer.checkpoint.coordination import Coordinator, SingleProcess, raise_if_any_failed
from trainer.checkpoint.identity import RunIdentity, identity_or_problem
from trainer.checkpoint.manifest import GenerationFacts, InvalidManifest, Verification, read_manifest
from trainer.checkpoint.section import LocalSection, Published
from trainer.checkpoint.signing import Signing
from trainer.config import MemoryTierConfig
from trainer.errors import CorruptGeneration, MemoryTierTooSmall, OutputLocked, StorageFailure
from trainer.layout import GENERATIONS, RunDirectory, generation_name, generation_step
from trainer.storage.lock import OutputLock
from trainer.storage.peer import Outgoing, exchange, keeper_of, partner

log = logging.getLogger("trainer")

OVERHEAD_BYTES = 256 * 1024
"""Allowed on top of the state's tensor bytes for a generation's index, manifest and pickled
values, until a saved generation gives its real size."""


@dataclass(frozen=True)
class Budget:
    """What tier 0 needs against what it may use."""

    generation_bytes: int
    keep: int
    staging_bytes: int
    limit_bytes: int
    staging_copies: int = 0
    """Host copies of the state the staging buffers hold (async: the durable saves' and tier 0's)."""
    parts: int = 1
    """Parts kept per generation: this rank's own, and (several nodes) the replica of a peer's."""

    @property
    def needed(self) -> int:
        return self.parts * self.keep * self.generation_bytes + self.staging_bytes

    def line(self) -> str:
        copies = f" ({self.staging_copies} host copies: durable and tier-0 saves stage apart)" \
            if self.staging_copies > 1 else ""
        parts = f"{self.parts} parts (its own and a peer's replica) x " if self.parts > 1 else ""
        return (f"{parts}{self.keep} x {self.generation_bytes} bytes of generations + {self.staging_bytes} bytes of "
                f"staging{copies} = {self.needed} bytes")


def state_bytes(state_dict: dict) -> int:
    """The bytes of every tensor in a (nested) state dict: what a generation of it stores."""
    total = 0
    stack = [state_dict]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif hasattr(value, "untyped_storage") and hasattr(value, "nbytes"):
            total += int(value.nbytes)
    return total


def lazy_optimizer_bytes(optimizers) -> int:
    """Optimizer state not created yet, which `state_bytes` cannot see: most optimizers create
    theirs at the first step (Adam's exp_avg and exp_avg_sq, SGD's momentum buffer). DCP's
    `get_optimizer_state_dict` creates it for the optimizers saved under `optim`; an optimizer
    among the workload's own stateful objects (`stateful()`, saved with its plain `state_dict()`)
    keeps none until it steps. Per parameter without state: `lazy_tensors` of its size."""
    return sum(lazy_tensors(group) * int(parameter.nbytes) for optimizer in optimizers
               for group in optimizer.param_groups for parameter in group["params"] if parameter not in optimizer.state)


def lazy_tensors(group: dict) -> int:
    """Tensors of a parameter's size that an optimizer creates per parameter, from the
    hyperparameters naming the known ones: Adam-like (`betas`: exp_avg and exp_avg_sq, a third
    with `amsgrad`), RMSprop (`alpha`: square_avg, plus momentum and centered buffers), SGD
    (`momentum`: its buffer unless 0); any other: 2, as Adam (conservative for most)."""
    if "betas" in group:
        return 3 if group.get("amsgrad") else 2
    if "alpha" in group:
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    if "momentum" in group:
        return 1 if group["momentum"] else 0
    return 2


def directory_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file()) if path.is_dir() else 0


@dataclass(frozen=True)
class Place:
    """Where this process sits: which tier-0 parts it writes and keeps (storage/peer.py)."""

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


def part_directory(directory: Path, rank: int, world_size: int) -> Path:
    """One rank's tier-0 generations: `--memory-dir` itself for one process; `rank-R-of-W`
    in it under torchrun (its own, or the replica it keeps of its keeper's partner). The world
    size is in the name: a part of another world size is never taken for this one's."""
    return directory if world_size == 1 else directory / f"rank-{rank}-of-{world_size}"


@dataclass(frozen=True)
class Agreement:
    """What every rank's tier 0 must be given alike, checked at the claim (`disagreement`):
    the cadence and the count kept decide the tier-0 save points, and so the replica's rounds
    every rank runs in step; the processes per node decide who is whose partner. A difference
    would leave ranks waiting in those rounds until the background bound."""

    every_steps: int | str
    keep: int
    local_world_size: int


AGREED = (("--memory-every-steps", "every_steps", "give the same on every node"),
          ("--memory-keep", "keep", "give the same on every node"),
          ("processes per node (torchrun --nproc-per-node, LOCAL_WORLD_SIZE)", "local_world_size",
           "start the same number on every node, or drop --memory-dir"))


def disagreement(agreements: list[Agreement | None]) -> str | None:
    """The one line refusing tier-0 settings that differ between ranks (None: they agree).
    `agreements`: every rank's, in rank order (None: no --memory-dir there)."""
    without = [rank for rank, agreement in enumerate(agreements) if agreement is None]
    if len(without) == len(agreements):
        return None  # no tier 0 anywhere
    if without:
        return f"--memory-dir is given to some ranks but not to rank(s) {without}; give it on every node, or on none"
    for option, field_name, fix in AGREED:
        values: dict[object, list[int]] = {}
        for rank, agreement in enumerate(agreements):
            values.setdefault(getattr(agreement, field_name), []).append(rank)
        if len(values) > 1:
            found = ", ".join(f"{value} on {ranks_named(ranks)}" for value, ranks in values.items())
            return f"tier 0: {option} differs between nodes ({found}); {fix}"
    return None


def ranks_named(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-3`, `ranks 0-1, 4-5`: consecutive ranks as ranges (sorted input)."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    named = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)
    return f"rank {named}" if len(ranks) == 1 else f"ranks {named}"


def node_share(free_bytes: int, processes_on_node: int) -> int:
    """One rank's share of what the memory filesystem has free: every process on the node
    writes its parts there, so each may count only its share of it."""
    return free_bytes // max(1, processes_on_node)


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


@dataclass(frozen=True)
class Holding:
    """What one rank's tier 0 holds, for rank 0 to choose from: per rank whose part it keeps
    (its own, and the replica of one other), the run that part is bound to and each
    generation's writing attempt ("" when its manifest does not read)."""

    rank: int
    parts: dict[int, tuple[str | None, dict[str, str]]] = field(default_factory=dict)


MISSING = "not in this node's tier 0"


def available_everywhere(holdings: list[Holding], run: str) -> dict[str, str]:
    """The tier-0 generations of run `run` whose part every rank can have: its own, or a
    replica on another rank; {name: its writing attempt}. Every part must have been written by
    the same attempt: a part of the same step from another line (an attempt that went back, a
    replica that stopped) is never combined with this one's."""
    offered: dict[int, set[tuple[str, str]]] = {}
    for holding in holdings:
        for rank, (bound, generations) in holding.parts.items():
            if bound == run:
                offered.setdefault(rank, set()).update(generations.items())
    if len(holdings) == 0 or any(rank not in offered for rank in range(len(holdings))):
        return {}
    common = set.intersection(*(offered[rank] for rank in range(len(holdings))))
    return dict(sorted(common))


class NoMemoryTier:
    """`--memory-dir` is off: nothing newer to restore, nothing to save."""

    where = "no tier 0"

    def claim(self, held: contextlib.ExitStack) -> None:
        return None

    def holding(self) -> Holding:
        return Holding(0)

    def agreement(self) -> Agreement | None:
        return None

    def bind(self, identity: RunIdentity | None) -> None:
        return None

    def problem(self, name: str, attempt: str) -> str | None:
        raise AssertionError("no tier 0 holds a generation")  # newer_than named none

    def restorable(self, name: str) -> Verification:
        raise AssertionError("no tier 0 holds a generation")

    def fetch(self, coordinator: Coordinator, name: str, attempt: str, needing: set[int]) -> str | None:
        raise AssertionError("no tier 0 holds a generation")

    def set_aside_later_than(self, step: int) -> list[str]:
        return []

    def saver(self, attempt_id: str, coordinator: Coordinator, mode: str, device: torch.device) -> "NoMemorySaves":
        return NoMemorySaves()


class NoMemorySaves:
    """The saves' verbs, as the attempt calls them; each returns the tier-0 generations that
    became published during the call."""

    def fits(self, estimate: Callable[[], int]) -> None:
        return None

    def due(self, step: int) -> bool:
        return False

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        return []

    def completed(self) -> list[Published]:
        return []

    def wait_for_staging(self) -> float:
        return 0.0

    def finalize(self) -> list[Published]:
        return []

    def close_after_failure(self) -> list[Published]:
        return []

    def retire(self, durable: list[str]) -> None:
        return None


def newer_than(holdings: list[Holding], durable: list[str], history: list[dict],
               run: RunIdentity | None) -> dict[str, str]:
    """Tier-0 generations newer than the newest durable one that continue its line: every
    rank's part can be had (`available_everywhere`), bound to this run (`run`, the run
    directory's identity; None: a new run directory), and none was written by an attempt that
    a later attempt went back from (`--from-generation` to an earlier step, perhaps without
    tier 0, so it could not set them aside). {name: the attempt that wrote every part}."""
    if run is None:
        return {}  # nobody's yet: `bind` clears what another run left once this attempt goes ahead
    newest = generation_step(durable[-1]) if durable else -1
    went_back = [(record.get("id", ""), (record.get("restored") or {}).get("step"))
                 for record in history if record.get("explicit_generation")]
    newer = {}
    for name, attempt in available_everywhere(holdings, run.run).items():
        step = generation_step(name)
        if step <= newest:
            continue
        if any(later > attempt and isinstance(back, int) and back < step for later, back in went_back):
            log.info("tier 0 holds %s of an abandoned line (a later attempt went back): not restored", name)
            continue
        newer[name] = attempt
    return newer


class MemoryCommit(RenameCommit):
    """`RenameCommit` with the seam `memory-after-write`: a tier-0 generation's files written,
    its commit not begun (on the committer thread under async saves)."""

    def commit(self, temporary: Path, step: int, describe, digests: dict[str, dict],
               coordinator: Coordinator) -> Committed:
        seams.crash_point("memory-after-write")
        return super().commit(temporary, step, describe, digests, coordinator)


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


class MemoryTier(NoMemoryTier):
    """Tier 0 in `config.directory` (see the module docstring): this rank's own part, and
    under torchrun with several nodes the replica it keeps of its keeper rank's part."""

    def __init__(self, config: MemoryTierConfig, signing: Signing | None, place: Place = Place()):
        self.config, self.place = config, place
        self.own = MemoryPart(part_directory(config.directory, place.rank, place.world_size), signing)
        kept = place.keeps_replica_of
        self.replica = MemoryPart(part_directory(config.directory, kept, place.world_size), signing) \
            if kept is not None else None
        self.parts = [self.own] + ([self.replica] if self.replica else [])
        self.where = str(config.directory) if place.world_size > 1 else self.own.where

    # ----------------------------------------------------------------- restoring (every rank)
    def claim(self, held: contextlib.ExitStack) -> None:
        """Hold this rank's parts for the attempt: a second trainer pointed at them is refused (73)."""
        for part in self.parts:
            part.claim(held)

    def holding(self) -> Holding:
        parts = {self.place.rank: self.own.held()}
        if self.replica is not None:
            parts[self.place.keeps_replica_of] = self.replica.held()
        return Holding(self.place.rank, parts)

    def agreement(self) -> Agreement:
        return Agreement(self.config.every_steps, self.config.keep, self.place.local_world_size)

    def bind(self, identity: RunIdentity | None) -> None:
        """Its parts belong to this run from now on; the first rank of the node also gives back
        this run's parts of another world size (`remove_other_world_sizes`)."""
        if identity is not None:
            for part in self.parts:
                part.bind(identity)
            if self.place.local_rank == 0:
                remove_other_world_sizes(self.config.directory, self.place.world_size, identity.run)

    def problem(self, name: str, attempt: str) -> str | None:
        """Why this rank's own part of `name` cannot serve (None: it verifies: hash, run,
        signature, and it was written by `attempt`, the line's)."""
        if name not in self.own.section.names():
            return MISSING
        verification = self.own.section.verify(name, cached=True)
        if verification.ok and verification.manifest.attempt != attempt:
            return f"written by attempt {verification.manifest.attempt}, not {attempt} (another line)"
        return verification.problem

    def restorable(self, name: str) -> Verification:
        """This rank's part of `name`, verified (`problem` hashed it already: cached)."""
        return self.own.section.verify(name, cached=True)

    def fetch(self, coordinator: Coordinator, name: str, attempt: str, needing: set[int]) -> str | None:
        """Every rank, at the same point: the ranks in `needing` receive their part of `name`
        from the rank that keeps its replica, into their own tier 0; returns why this rank's
        part still cannot serve (None: it verifies now)."""
        place, outgoing = self.place, None
        kept = place.keeps_replica_of
        mine = place.rank in needing
        if kept in needing and self.replica is not None and name in self.replica.section.names():
            with contextlib.suppress(OSError):  # gone meanwhile: its partner hears "nothing"
                outgoing = Outgoing(self.replica.section.path(name))
        try:
            with outgoing or contextlib.nullcontext():
                received = exchange(coordinator.group, kept if kept in needing else None, outgoing,
                                    place.partner if mine else None, self.own.section, wanted=name)
        except CorruptGeneration as error:  # what the partner sent was refused (the stream drained)
            return str(error) if mine else None
        except Exception as error:  # noqa: BLE001 - a peer gone, or what it sent unreadable: this rank's problem
            return f"its replica could not be fetched ({str(error).splitlines()[0] if str(error) else error!r})" \
                if mine else None
        if not mine:
            return None
        if received is None:
            return f"rank {place.partner} keeps no replica of it"
        return self.problem(name, attempt)

    def set_aside_later_than(self, step: int) -> list[str]:
        """Going back: later tier-0 generations belong to the abandoned line. Removed rather
        than kept as superseded copies: memory is the scarce thing here, and the budget counts
        only what can be restored."""
        return [f"{part.where}/{name}" for part in self.parts
                for name in part.remove_where(lambda held: generation_step(held) > step)]

    # ----------------------------------------------------------------- saving
    def saver(self, attempt_id: str, coordinator: Coordinator, mode: str, device: torch.device) -> "MemorySaves":
        """Every rank, at the same point (the replica's transfers get a group of their own).
        Each rank writes its own part alone (no collective: a tier-0 save never waits for a
        peer), through the same checkpointer and commit as a durable save."""
        checkpointer = build_checkpointer(mode, MemoryCommit(self.own.section), attempt_id, device, SingleProcess())
        replicas = Replication(self, coordinator.background()) if self.place.partner is not None else NoReplication()
        return MemorySaves(self, checkpointer, mode == "async", coordinator, replicas)

    def limit_bytes(self) -> int:
        """`--memory-tier-max-bytes`, else what this rank's parts hold plus its share of what
        their filesystem has free (`node_share`: the processes of the node share it)."""
        if self.config.max_bytes is not None:
            return self.config.max_bytes
        stats = os.statvfs(self.own.section.root)
        return node_share(stats.f_bavail * stats.f_frsize, self.place.local_world_size) + self.used_bytes()

    def share(self) -> str:
        """Where the default budget comes from, as the refusal says it."""
        processes = self.place.local_world_size
        return "the free memory of its filesystem" if processes == 1 else \
            f"1/{processes} of the free memory of its filesystem: {processes} processes on this node share it"

    def used_bytes(self) -> int:
        return sum(part.used_bytes() for part in self.parts)


class NoReplication:
    """One node (or no tier 0): no partner to keep a replica."""

    def offer(self, name: str | None) -> None:
        return None

    def published(self, name: str) -> None:
        return None

    def gave_up(self) -> None:
        return None

    def wait(self) -> None:
        return None

    def abandon(self) -> None:
        return None


class Replication(NoReplication):
    """The peer replica (storage/peer.py): at every tier-0 save point, on a thread of its own
    and a gloo group of its own, this rank sends the part it just saved to its partner once it
    is committed (async saves commit in the background: the loop reports it, `published`), and
    keeps the one its keeper sends. Every rank runs the same rounds in the same order (one per
    save point; a skipped or failed save offers nothing), so the ends always meet. A failed
    round is a warning and ends the replication for the attempt (a peer gone)."""

    def __init__(self, tier: MemoryTier, coordinator: Coordinator):
        self.tier, self.coordinator = tier, coordinator
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier0-replica")
        self.committing: dict[str, threading.Event] = {}
        """Parts offered whose commit the loop has not reported yet."""
        self.reported: set[str] = set()
        """Parts whose commit the loop reported before their round was offered (sync saves)."""
        self.broken = False
        self.rounds: list[Future] = []

    def offer(self, name: str | None) -> None:
        """A round for this save point (the loop's thread): `name` once committed, else nothing."""
        committed = None
        if name in self.reported:
            self.reported.discard(name)
        elif name is not None:
            committed = self.committing.setdefault(name, threading.Event())
        self.rounds = [done for done in self.rounds if not done.done()] + \
            [self.thread.submit(self.round, name, committed)]

    def published(self, name: str) -> None:
        if event := self.committing.pop(name, None):
            event.set()
        else:
            self.reported.add(name)

    def gave_up(self) -> None:
        """The save in flight failed: its round offers nothing."""
        for event in self.committing.values():
            event.set()
        self.committing.clear()

    def round(self, name: str | None, committed: threading.Event | None) -> None:
        if committed is not None:
            committed.wait()
        if self.broken:
            return
        tier, place = self.tier, self.tier.place
        try:
            outgoing = Outgoing(tier.own.section.path(name)) if name in tier.own.section.names() else None
        except OSError:
            outgoing = None  # pruned meanwhile: nothing this round
        try:
            with outgoing or contextlib.nullcontext():
                received = exchange(self.coordinator.group, place.partner, outgoing, place.keeps_replica_of,
                                    tier.replica.section)
            if received is not None:
                step = generation_step(received)
                kept = [name for name in tier.replica.section.names() if generation_step(name) <= step]
                tier.replica.remove_where(lambda name: generation_step(name) > step or
                                          name in kept[:max(0, len(kept) - tier.config.keep)])
        except Exception as error:  # noqa: BLE001 - a peer gone or what it sent unreadable: never ends the run
            log.warning("tier 0's replica stopped for this attempt: %s", (str(error) or repr(error)).splitlines()[0])
            self.broken = True

    def wait(self) -> None:
        """Every round offered so far has ended (the attempt ends: every rank calls it, after
        every tier-0 save was committed and reported)."""
        self.gave_up()  # nothing is in flight any more: a part never reported was never committed
        for done in self.rounds:
            done.result()
        self.thread.shutdown(wait=True)

    def abandon(self) -> None:
        self.broken = True
        self.gave_up()
        self.thread.shutdown(wait=False, cancel_futures=True)


class MemorySaves(NoMemorySaves):
    """This attempt's tier-0 saves: cadence, budget, publish, prune."""

    def __init__(self, tier: MemoryTier, checkpointer: Checkpointer, staging: bool, coordinator: Coordinator,
                 replicas: NoReplication):
        self.tier, self.checkpointer, self.staging = tier, checkpointer, staging
        self.coordinator = coordinator
        """Every rank's: a start refused on one rank is refused on all."""
        self.replicas = replicas
        self.failures = 0
        """Tier-0 saves that failed so far (each a warning)."""
        self.generation_bytes = 0
        """The largest tier-0 generation known (estimated, then measured)."""
        self.warned = False

    def budget(self, estimate: int) -> Budget:
        """`estimate`: the bytes a generation of the state stores (its tensors)."""
        self.generation_bytes = max(self.generation_bytes, estimate + OVERHEAD_BYTES + estimate // 50)
        copies = 2 if self.staging else 0  # the durable saves' staging and tier 0's own
        return Budget(self.generation_bytes, self.tier.config.keep, copies * estimate, self.tier.limit_bytes(), copies,
                      len(self.tier.parts))

    def fits(self, estimate: Callable[[], int]) -> None:
        """Before the first step: refuse a start whose tier 0 cannot hold its K generations.
        `estimate()`: the bytes a generation will store, optimizer state not created yet
        included (`TrainingState.estimated_bytes`); called only here, with tier 0 on."""
        budget, refusal = self.budget(estimate()), None
        if budget.needed > budget.limit_bytes:
            rank = f" of rank {self.tier.place.rank}" if self.tier.place.world_size > 1 else ""
            refusal = MemoryTierTooSmall(
                f"tier 0{rank} ({self.tier.own.where}) needs {budget.line()}, over its budget of {budget.limit_bytes} "
                f"bytes (--memory-tier-max-bytes, or {self.tier.share()}); raise it, lower "
                f"--memory-keep (now {budget.keep}), or drop --memory-dir")
        if self.coordinator.distributed:
            raise_if_any_failed(self.coordinator, refusal, "checking tier 0's budget")
        elif refusal is not None:
            raise refusal

    def due(self, step: int) -> bool:
        return step % self.tier.config.every_steps == 0

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        """Wait for the tier-0 save in flight (async), prune to K - 1, then write and publish
        (async: stage, and write in the background) when the new one fits; nothing pruned when
        skipped. Then a replica round (several nodes), skipped or not: every rank runs one here."""
        published, saving = self.written(state_dict, facts)
        self.replicas.offer(generation_name(facts.step) if saving else None)
        return published

    def written(self, state_dict: dict, facts: GenerationFacts) -> tuple[list[Published], bool]:
        """(what was published meanwhile, whether this save was made)."""
        published = self.settled(self.checkpointer.drain, facts.step)
        section, keep, name = self.tier.own.section, self.tier.config.keep, generation_name(facts.step)
        # Those at this step or later are of a line this one replaces (after a refused tier-0
        # generation): removed, never replaced in place (that would keep a superseded copy in memory).
        earlier = [held for held in section.names() if held < name]
        doomed = [held for held in section.names() if held >= name] + earlier[:max(0, len(earlier) - (keep - 1))]
        budget = self.budget(state_bytes(state_dict))
        kept = self.tier.used_bytes() - sum(directory_bytes(section.path(name)) for name in doomed)
        replica = budget.generation_bytes * (len(self.tier.parts) - 1)  # the next one received
        if kept + budget.generation_bytes + replica + budget.staging_bytes > budget.limit_bytes:
            if not self.warned:
                log.warning("tier 0 skipped step %d: %d bytes kept + %d for it + %d of staging would pass its "
                            "budget of %d bytes (the durable tiers keep their cadence)", facts.step, kept,
                            budget.generation_bytes, budget.staging_bytes, budget.limit_bytes)
                self.warned = True
            return published, False
        for name in doomed:
            section.remove(name)
        failures = self.failures
        published += self.settled(lambda: self.checkpointer.save(state_dict, facts), facts.step)
        return published, self.failures == failures  # a save that failed offers nothing to the replica

    def settled(self, call, step: int) -> list[Published]:
        """`call()`'s published tier-0 generations, measured and logged; a storage failure (of
        this save, or of the one before it in the background) is a warning: tier 0 is a
        speed-up, its failure never ends the run."""
        try:
            published = call()
        except StorageFailure as failure:
            log.warning("tier 0 skipped a save (at step %d): %s", step, failure)
            self.failures += 1
            self.replicas.gave_up()
            return []
        for generation in published:
            self.replicas.published(generation.name)
            self.generation_bytes = max(self.generation_bytes, directory_bytes(self.tier.own.section.path(generation.name)))
            log.info("saved %s to tier 0 in %.3fs (the loop held %.3fs)", generation.name, generation.save_s,
                     generation.blocked_s)
        return published

    def completed(self) -> list[Published]:
        return self.settled(self.checkpointer.ready, -1)

    def wait_for_staging(self) -> float:
        try:
            return self.checkpointer.wait_for_staging()
        except StorageFailure as failure:  # with one process its staging failed: raised here
            log.warning("tier 0 skipped a save: %s", failure)
            self.replicas.gave_up()
            return 0.0

    def finalize(self) -> list[Published]:
        published = self.settled(self.checkpointer.finalize, -1)
        self.replicas.wait()
        return published

    def close_after_failure(self) -> list[Published]:
        self.replicas.abandon()  # its peer may be gone: never waited for
        return self.checkpointer.close_after_failure()

    def retire(self, durable: list[str]) -> None:
        """The attempt ends with everything published durable: tier-0 generations no newer than
        the newest durable one can never be restored, so their memory is given back."""
        newest = generation_step(durable[-1]) if durable else -1
        for part in self.tier.parts:
            part.remove_where(lambda name: generation_step(name) <= newest)
