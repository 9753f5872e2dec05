"""The peer replica: moving a tier-0 generation between two ranks on different nodes, and the
rounds that do it at every tier-0 save point (`Replication`: `PeerReplication` with several
nodes, `NoReplication` with one).

Tier 0 survives a crashed process but not a lost node. So each rank sends every tier-0
generation it commits to its partner, the rank with the same local rank on the next node
(`partner`, storage/memory/parts.py), which keeps it in its own tier 0; a replacement node's ranks fetch theirs back
from the same partners. With one node there is no partner, and nothing is sent.

Every transfer is point to point on a gloo group of its own (never the training group, whose
backend may be NCCL): each side posts its send and its receive at once (`isend`/`irecv`), so a
ring of sends never waits on itself. A transfer is a header (its length, then the generation's
name and its files' names and sizes, or none), then the files' bytes, file by file in chunks of
at most `CHUNK_BYTES`: each end holds one chunk buffer per direction, never the part, so a 16 GB
part moves with 16 MB of host memory at each end (32 MB where a rank sends and receives at once)
instead of three copies of it (48 GB). The sender reads
every file through a handle opened before the header goes (`Outgoing`: a part pruned meanwhile
is still read whole). The receiver writes each chunk into a temporary sibling as it arrives and
hashes it on the way (`Incoming`); the generation is renamed into place only when every file
matches its own manifest, and a name that is not a generation's is never written. A problem
found on the way is reported at the end, once the stream is drained, so the two ends never
disagree on how many messages are left. The signature and the run are checked where a restore
verifies it, as for any generation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.checkpoint.atomic import fsync_dir, rename_into_place, temporary_sibling
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.digest import CURRENT, entry as digest_entry, hasher, of_bytes
from trainer.checkpoint.manifest import verify_directory
from trainer.checkpoint.section import LocalSection
from trainer.errors import CorruptGeneration
from trainer.layout import generation_step
from trainer.storage.memory.parts import MemoryPart, Place

log = logging.getLogger("trainer")


CHUNK_BYTES = 16 << 20
"""The most bytes sent or received as one message: a transfer's host memory at each end is one
buffer of this size per direction, whatever the part's size. Large enough that gloo's cost per
message is nothing beside the bytes (32 messages for 512 MB)."""


@dataclass(frozen=True)
class Parcel:
    """What is sent ahead of a generation's bytes: its name and its files (name, bytes), in a
    fixed order."""

    name: str
    files: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)

    def header(self) -> dict:
        return {"name": self.name, "files": [[name, size] for name, size in self.files]}

    @classmethod
    def from_header(cls, data) -> "Parcel":
        """What a peer described; CorruptGeneration when it is not a header at all."""
        try:
            files = tuple((str(name), int(size)) for name, size in data["files"])
            if not isinstance(data["name"], str) or any(size < 0 for _, size in files):
                raise ValueError("a negative size")
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptGeneration(f"a peer sent an unreadable description of a generation ({error})") from None
        return cls(data["name"], files)

    def chunks(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """(file index, bytes) of every message after the header, in order: each file in
        chunks of at most `chunk_bytes` (an empty file: none). Both ends derive it from the
        header, so they agree on every message."""
        return [(index, min(chunk_bytes, size - offset)) for index, (_, size) in enumerate(self.files)
                for offset in range(0, size, chunk_bytes)]


class Outgoing:
    """A committed generation's files, opened for sending. Every file is opened at once, before
    the header is sent: the loop may prune the generation while it is sent (a tier-0 save prunes
    on the loop's thread), and an unlinked file stays readable while it is open."""

    def __init__(self, directory: Path):
        self.handles: list = []
        try:
            for entry in sorted(directory.iterdir()):
                if entry.is_file():
                    self.handles.append((entry.name, entry.open("rb")))
        except BaseException:
            self.close()
            raise
        self.parcel = Parcel(directory.name, tuple((name, os.fstat(handle.fileno()).st_size)
                                                   for name, handle in self.handles))

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
        """(file index, its next bytes) in the order of `Parcel.chunks`, each read into one
        buffer reused from chunk to chunk (valid until the next is read). A file that reads
        short is padded with zeros: the receiver's digest refuses it, and the stream keeps the
        length the header promised."""
        plan = self.parcel.chunks(chunk_bytes)
        buffer = memoryview(bytearray(max((size for _, size in plan), default=0)))
        for index, size in plan:
            view = buffer[:size]
            filled = 0
            while filled < size and (read := self.handles[index][1].readinto(view[filled:])):
                filled += read
            view[filled:] = bytes(size - filled)
            yield index, view

    def close(self) -> None:
        for _, handle in self.handles:
            handle.close()

    def __enter__(self) -> "Outgoing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Incoming:
    """A generation received into `section`: written into a temporary sibling file by file as
    its chunks arrive (`take`), each hashed on the way; `keep` renames it into place once every
    file matches the generation's own manifest (replacing an older copy of the same name:
    memory keeps no superseded copies). A problem found on the way (a name that is not a
    generation's or a file's, another generation than `wanted`, a failed write) writes nothing
    more and is raised by `keep`, after the caller drained the stream."""

    def __init__(self, section: LocalSection, parcel: Parcel, wanted: str | None = None):
        self.section, self.parcel = section, parcel
        self.problem = name_problem(parcel, wanted)
        self.temporary: Path | None = None
        self.digests: dict[str, dict] = {}
        self.current: tuple[int, object, object] | None = None
        """(file index, open file, its digest so far: the current algorithm, which the sender's
        manifest names too unless it is an older generation's, read again by `verify_directory`)."""
        if self.problem is None:
            try:
                section.root.mkdir(parents=True, exist_ok=True)
                self.temporary = temporary_sibling(section.root, parcel.name, "peer")
            except OSError as error:
                self.problem = f"{parcel.name} received from a peer could not be written ({error.strerror or error})"

    def take(self, index: int, data: memoryview) -> None:
        if self.problem is not None:
            return
        try:
            if self.current is None or self.current[0] != index:
                self.finish_file()
                self.current = (index, (self.temporary / self.parcel.files[index][0]).open("wb"), hasher())
            self.current[1].write(data)
            self.current[2].update(data)
        except OSError as error:
            self.problem = f"{self.parcel.name} received from a peer could not be written ({error.strerror or error})"

    def finish_file(self) -> None:
        if self.current is not None:
            index, handle, digest = self.current
            handle.close()
            self.digests[self.parcel.files[index][0]] = digest_entry(self.parcel.files[index][1], CURRENT,
                                                                     digest.hexdigest())
            self.current = None

    def keep(self) -> str:
        """The name received, renamed into place; CorruptGeneration when it does not verify or
        could not be written (nothing is left then)."""
        try:
            if self.problem is None:
                self.finish_file()
                for name, size in self.parcel.files:
                    if name not in self.digests and size == 0:  # an empty file sends no chunk
                        (self.temporary / name).touch()
                        self.digests[name] = of_bytes(b"")
                fsync_dir(self.temporary)
                checked = verify_directory(self.temporary, digests=self.digests)
                if not checked.ok:
                    self.problem = f"{self.parcel.name} received from a peer does not verify ({checked.problem})"
        except OSError as error:
            self.problem = f"{self.parcel.name} received from a peer could not be written ({error.strerror or error})"
        if self.problem is not None:
            self.discard()
            raise CorruptGeneration(self.problem)
        name = self.parcel.name
        if self.section.path(name).is_dir():
            self.section.remove(name)
        rename_into_place(self.temporary, self.section.path(name))
        self.section.remember_verified(name, checked)
        return name

    def discard(self) -> None:
        if self.current is not None:
            self.current[1].close()
            self.current = None
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)


def name_problem(parcel: Parcel, wanted: str | None) -> str | None:
    """Why a parcel is refused by its names alone (None: its names may be written)."""
    if generation_step(parcel.name) is None or "/" in parcel.name:
        return f"a peer sent a generation named {parcel.name!r}; not kept"
    if wanted is not None and parcel.name != wanted:
        return f"a peer sent {parcel.name} when {wanted} was asked for; not kept"
    names = [name for name, _ in parcel.files]
    for name in names:
        if "/" in name or "\0" in name or name in ("", ".", ".."):
            return f"a peer sent {parcel.name} with a file named {name!r}; not kept"
    if len(set(names)) != len(names):
        return f"a peer sent {parcel.name} naming a file twice; not kept"
    return None


def exchange(group, send_to: int | None, outgoing: Outgoing | None, receive_from: int | None,
             section: LocalSection | None, wanted: str | None = None, chunk_bytes: int = CHUNK_BYTES) -> str | None:
    """Send `outgoing` (None: "nothing this time") to `send_to` while receiving from
    `receive_from` into `section` (`Incoming`: verified, then renamed into place); returns the
    name received (None when the peer sent nothing). Both ends must call it at the same point,
    each naming the other. CorruptGeneration when what arrived is refused (the stream drained
    first); a peer that died fails it (a reset connection, or the group's timeout)."""
    header = json.dumps(None if outgoing is None else outgoing.parcel.header()).encode()
    lengths = _swap(group, send_to, torch.tensor([len(header)], dtype=torch.int64),
                    receive_from, torch.zeros(1, dtype=torch.int64))
    received = _swap(group, send_to, torch.frombuffer(bytearray(header), dtype=torch.uint8),
                     receive_from, torch.empty(int(lengths[0]) if lengths is not None else 0, dtype=torch.uint8))
    described = json.loads(received.numpy().tobytes()) if received is not None else None
    parcel = Parcel.from_header(described) if described is not None else None
    sending = outgoing.chunks(chunk_bytes) if outgoing is not None and send_to is not None else iter(())
    plan = parcel.chunks(chunk_bytes) if parcel is not None else []
    buffer = torch.empty(max((size for _, size in plan), default=0), dtype=torch.uint8)
    incoming = Incoming(section, parcel, wanted) if parcel is not None else None
    try:
        for chunk, (index, size) in zip_longest(sending, plan, fillvalue=(None, 0)):
            outgoing_chunk = torch.frombuffer(chunk[1], dtype=torch.uint8) if chunk[0] is not None else None
            arrived = _swap(group, send_to if outgoing_chunk is not None else None, outgoing_chunk,
                            receive_from if index is not None else None, buffer[:size])
            if index is not None:
                incoming.take(index, memoryview(arrived.numpy()))
    except BaseException:
        if incoming is not None:
            incoming.discard()
        raise
    return incoming.keep() if incoming is not None else None


def _swap(group, send_to: int | None, outgoing, receive_from: int | None, incoming):
    """One message each way at once; the received tensor (None if nothing was received)."""
    works = []
    if send_to is not None and outgoing is not None and outgoing.numel():
        works.append(dist.isend(outgoing, dst=send_to, group=group))
    if receive_from is not None and incoming.numel():
        works.append(dist.irecv(incoming, src=receive_from, group=group))
    for work in works:
        work.wait()
    return incoming if receive_from is not None and incoming.numel() else None


class Replication(Protocol):
    """The replica's rounds, as a tier-0 save calls them (the loop's thread)."""

    def offer(self, name: str | None) -> None:
        """A round for this save point: `name` once committed, else nothing."""

    def published(self, name: str) -> None:
        """`name` was committed (reported by the loop)."""

    def gave_up(self) -> None:
        """The save in flight failed: its round offers nothing."""

    def wait(self) -> None:
        """Every round offered so far has ended (the attempt ends)."""

    def abandon(self) -> None:
        """After a failure: the peer may be gone, never waited for."""


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


INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
"""Read by torch's gloo when a group is created (checked against torch 2.13.0): the network
interface(s) its connections use, comma-separated; without it, the address the hostname resolves
to, often not the fast fabric."""


def say_interface(hosts: list[str], env) -> str:
    """The one line naming the address the replica's transfers use, and how it was chosen (logged)."""
    chosen = env.get(INTERFACE_ENV)
    line = (f"tier 0's replica goes over gloo from {', '.join(hosts) or 'an address not found'} "
            + (f"({INTERFACE_ENV}={chosen})" if chosen else
               f"(the address this host's name resolves to; set {INTERFACE_ENV} to choose the interface)"))
    log.info("%s", line)
    return line


class Rounds:
    """The order of the replica's rounds, and which of them still carry a part (pure: the bound).

    Every rank runs every round (the two ends of a transfer must meet), but a round that has not
    begun when a newer one with a part is offered sends nothing of its own (a header saying so,
    milliseconds): the newer part supersedes it. So however slow the link, at most two parts are
    owed at any time (the one moving and the newest offered), the replica lags by at most those,
    and the attempt's end (`wait`) waits for at most them, never for a backlog of every save. (A
    newer save that then fails leaves the replica at the part before the superseded one.)"""

    def __init__(self):
        self.offered = 0
        self.newest_with_part = -1

    def offer(self, carries_part: bool) -> int:
        """A new round (its number); `carries_part`: it has a part to send."""
        number = self.offered
        self.offered += 1
        if carries_part:
            self.newest_with_part = number
        return number

    def sends(self, number: int) -> bool:
        """Whether round `number`, beginning now, still sends its part (no newer one offered)."""
        return number >= self.newest_with_part


class PeerReplication:
    """The peer replica (`exchange`): at every tier-0 save point, on a thread of its own
    and a gloo group of its own, this rank sends the part it just saved to its partner once it
    is committed (async saves commit in the background: the loop reports it, `published`), and
    keeps the one its keeper sends. Every rank runs the same rounds in the same order (one per
    save point; a skipped or failed save offers nothing), so the ends always meet; a round
    superseded before it began sends nothing (`Rounds`: the backlog is bounded). A failed
    round is a warning and ends the replication for the attempt (a peer gone)."""

    def __init__(self, own: MemoryPart, replica: MemoryPart, place: Place, keep: int, coordinator: Coordinator):
        """`own`: this rank's part, sent; `replica`: its keeper's, received; `keep`: the K kept."""
        self.own, self.replica, self.place, self.keep, self.coordinator = own, replica, place, keep, coordinator
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier0-replica")
        self.committing: dict[str, threading.Event] = {}
        """Parts offered whose commit the loop has not reported yet."""
        self.reported: set[str] = set()
        """Parts whose commit the loop reported before their round was offered (sync saves)."""
        self.broken = False
        self.rounds: list[Future] = []
        self.order = Rounds()

    def offer(self, name: str | None) -> None:
        """A round for this save point (the loop's thread): `name` once committed, else nothing."""
        committed = None
        if name in self.reported:
            self.reported.discard(name)
        elif name is not None:
            committed = self.committing.setdefault(name, threading.Event())
        number = self.order.offer(name is not None)
        self.rounds = [done for done in self.rounds if not done.done()] + \
            [self.thread.submit(self._round, name, committed, number)]

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

    def _round(self, name: str | None, committed: threading.Event | None, number: int) -> None:
        if not self.order.sends(number):
            name = None  # superseded by a newer part: this round only meets the partner's
        elif committed is not None:
            committed.wait()
        if self.broken:
            return
        place = self.place
        try:
            outgoing = Outgoing(self.own.section.path(name)) if name in self.own.section.names() else None
        except OSError:
            outgoing = None  # pruned meanwhile: nothing this round
        try:
            with outgoing or contextlib.nullcontext():
                received = exchange(self.coordinator.group, place.partner, outgoing, place.keeps_replica_of,
                                    self.replica.section)
            if received is not None:
                step = generation_step(received)
                kept = [name for name in self.replica.section.names() if generation_step(name) <= step]
                self.replica.remove_where(lambda name: generation_step(name) > step or
                                          name in kept[:max(0, len(kept) - self.keep)])
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


