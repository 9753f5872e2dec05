"""Tier 0: recovery generations in memory, outside the process (`--memory-dir`).

A directory on a memory filesystem (`/dev/shm/…` on a machine, an `emptyDir` with
`medium: Memory` in a pod) holds the newest `--memory-keep` generations, saved every
`--memory-every-steps` steps. It survives a crashed or OOM-killed process and a container
restart in the same pod; it does not survive the loss of the pod or the node, so it never
replaces the durable tiers (the run directory, the object store), which keep their cadence.

Its generations follow the same protocol as the durable ones: the same checkpointer (of the
attempt's mode) and `RenameCommit`, the same `LocalSection` (manifest last with every file's digest, signed with
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
its partner on the next node (`PeerReplication`, storage/memory/replication.py); the claim (trainer/run/claim.py)
offers a generation only when every rank's part can be had, and a rank whose part is missing
or damaged fetches the replica (`fetch`).

The budget (`--memory-tier-max-bytes`, default: what the memory filesystem has free) covers
the K generations and the staging buffers of async saves: two host copies of the state (the
durable saves' and tier 0's); a start that cannot fit is refused in one line (exit 2), and a
save that would not fit is skipped with a warning, never written past the budget. Every save
waits for the tier-0 save before it (one in flight) and prunes to K - 1 before writing, so K are
never exceeded even while one is being written.

`MemoryTier` is the interface; `MemoryDirTier` has a directory behind it, `NoMemoryTier` nothing
(the option is off): the attempt never asks which one it holds. The package, one job a module,
each using only those below it: budget.py (the arithmetic), choice.py (which generations every
rank can restore), parts.py (where the parts lie), replication.py (the peer replica), saves.py
(saving), and this module, which composes them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

import torch

from trainer.checkpoint.checkpointer import build_checkpointer
from trainer.checkpoint.coordination import Coordinator, SingleProcess
from trainer.checkpoint.identity import RunIdentity
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.signing import Signing
from trainer.config import MemoryTierConfig
from trainer.errors import CorruptGeneration
from trainer.layout import generation_step
from trainer.options import AUTO
from trainer.storage.memory.choice import MISSING, Agreement, Holding
from trainer.storage.memory.parts import Place, RankParts, remove_other_world_sizes
from trainer.parallel.silence import local_hosts_since, socket_inodes
from trainer.storage.memory.replication import (NoReplication, Outgoing, PeerReplication, Replication, exchange,
                                                 say_interface)
from trainer.storage.memory.saves import MemoryDirSaves, MemoryCommit, MemorySaves, NoMemorySaves


class MemoryTier(Protocol):
    """Tier 0 as the attempt holds it: at the claim (every rank, at the same point), then the
    saver for the attempt's saves."""

    where: str

    def claim(self, held: contextlib.ExitStack) -> None:
        """Hold this rank's parts for the attempt (a second trainer is refused, 73)."""

    def holding(self) -> Holding:
        """What this rank's parts hold, for rank 0 to choose from."""

    def agreement(self) -> Agreement | None:
        """What every rank must be given alike (None: no tier 0 here)."""

    def bind(self, identity: RunIdentity | None) -> None:
        """Its parts belong to this run from now on."""

    def problem(self, name: str, attempt: str) -> str | None:
        """Why this rank's own part of `name` cannot serve (None: it verifies)."""

    def restorable(self, name: str) -> Verification:
        """This rank's part of `name`, verified."""

    def fetch(self, coordinator: Coordinator, name: str, attempt: str, needing: set[int]) -> str | None:
        """The ranks in `needing` receive their part from their partner; why this rank's still cannot serve."""

    def set_aside_later_than(self, step: int) -> list[str]:
        """Going back: later tier-0 generations are removed."""

    def saver(self, attempt_id: str, coordinator: Coordinator, mode: str, device: torch.device) -> MemorySaves:
        """This attempt's saves, through a checkpointer of `mode` (every rank, at the same point)."""


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

    def saver(self, attempt_id: str, coordinator: Coordinator, mode: str, device: torch.device) -> MemorySaves:
        return NoMemorySaves()


class MemoryDirTier:
    """Tier 0 in `config.directory` (see the module docstring): this rank's own part, and
    under torchrun with several nodes the replica it keeps of its keeper rank's part."""

    def __init__(self, config: MemoryTierConfig, signing: Signing | None, place: Place = Place()):
        self.config, self.place = config, place
        self.parts = RankParts(config.directory, signing, place)
        self.own = self.parts.own
        self.where = str(config.directory) if place.world_size > 1 else self.own.where

    # ----------------------------------------------------------------- restoring (every rank)
    def claim(self, held: contextlib.ExitStack) -> None:
        """Hold this rank's parts for the attempt: a second trainer pointed at them is refused (73)."""
        for part in self.parts.all:
            part.claim(held)

    def holding(self) -> Holding:
        return Holding(self.place.rank, {rank: part.held() for rank, part in self.parts.by_rank.items()})

    def agreement(self) -> Agreement:
        every = self.config.every_steps or AUTO  # None: auto
        return Agreement(every, self.config.keep, self.place.local_world_size)

    def bind(self, identity: RunIdentity | None) -> None:
        """Its parts belong to this run from now on; the first rank of the node also gives back
        this run's parts of another world size (`remove_other_world_sizes`)."""
        if identity is not None:
            for part in self.parts.all:
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
        replica = self.parts.by_rank.get(kept) if kept in needing else None
        if replica is not None and name in replica.section.names():
            with contextlib.suppress(OSError):  # gone meanwhile: its partner hears "nothing"
                outgoing = Outgoing(replica.section.path(name))
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
        return [f"{part.where}/{name}" for part in self.parts.all
                for name in part.remove_where(lambda held: generation_step(held) > step)]

    # ----------------------------------------------------------------- saving
    def saver(self, attempt_id: str, coordinator: Coordinator, mode: str, device: torch.device) -> MemorySaves:
        """Every rank, at the same point (the replica's transfers get a group of their own).
        Each rank writes its own part alone (no collective: a tier-0 save never waits for a
        peer), through the same checkpointer and commit as a durable save."""
        checkpointer = build_checkpointer(mode, MemoryCommit(self.own.section), attempt_id, device, SingleProcess())
        replicas: Replication = NoReplication()
        if self.place.several_nodes:
            before = socket_inodes()
            group = coordinator.background()
            say_interface(local_hosts_since(before), os.environ)
            replicas = PeerReplication(self.own, self.parts.by_rank[self.place.keeps_replica_of], self.place,
                                       self.config.keep, group)
        return MemoryDirSaves(self.parts, self.config, checkpointer, mode == "async", coordinator, replicas)
