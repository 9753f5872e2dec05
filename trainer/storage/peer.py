"""Moving a tier-0 generation between two ranks on different nodes (the peer replica).

Tier 0 survives a crashed process but not a lost node. So each rank sends every tier-0
generation it commits to its partner, the rank with the same local rank on the next node
(`partner`), which keeps it in its own tier 0; a replacement node's ranks fetch theirs back
from the same partners. With one node there is no partner, and nothing is sent.

Every transfer is point to point on a gloo group of its own (never the training group, whose
backend may be NCCL): each side posts its send and its receive at once (`isend`/`irecv`), so a
ring of sends never waits on itself. A transfer has three messages: the header's length, the
header (the generation's name and its files' names and sizes, or none), then the files' bytes
as one buffer. The receiver checks every file against the generation's own manifest before
renaming the copy into place (`receive_into`); the signature and the run are checked where a
restore verifies it, as for any generation.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.atomic import fsync_dir, rename_into_place, temporary_sibling
from trainer.checkpoint.manifest import verify_directory
from trainer.checkpoint.section import LocalSection
from trainer.errors import CorruptGeneration
from trainer.layout import generation_step


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
class Parcel:
    """A committed generation's files, as sent: `files` are (name, bytes) in a fixed order."""

    name: str
    files: tuple[tuple[str, bytes], ...]

    @classmethod
    def of(cls, directory: Path) -> "Parcel":
        return cls(directory.name, tuple((entry.name, entry.read_bytes()) for entry in sorted(directory.iterdir())
                                         if entry.is_file()))

    @property
    def bytes(self) -> int:
        return sum(len(data) for _, data in self.files)


def exchange(group, send_to: int | None, parcel: Parcel | None, receive_from: int | None) -> Parcel | None:
    """Send `parcel` (None: "nothing this time") to `send_to` while receiving from
    `receive_from`; returns what was received (None when nothing was sent). Both ends must
    call it at the same point, each naming the other. A peer that died fails it (a reset
    connection, or the group's timeout)."""
    header = json.dumps(None if parcel is None else
                        {"name": parcel.name, "files": [[name, len(data)] for name, data in parcel.files]}).encode()
    lengths = _swap(group, send_to, torch.tensor([len(header)], dtype=torch.int64),
                    receive_from, torch.zeros(1, dtype=torch.int64))
    received = _swap(group, send_to, torch.frombuffer(bytearray(header), dtype=torch.uint8),
                     receive_from, torch.empty(int(lengths[0]) if lengths is not None else 0, dtype=torch.uint8))
    described = json.loads(received.numpy().tobytes()) if received is not None else None
    payload = torch.frombuffer(bytearray(b"".join(data for _, data in parcel.files)), dtype=torch.uint8) \
        if parcel is not None and parcel.bytes else None
    incoming = sum(size for _, size in described["files"]) if described else 0
    body = _swap(group, send_to if payload is not None else None, payload,
                 receive_from if incoming else None, torch.empty(incoming, dtype=torch.uint8))
    if not described:
        return None
    data, files, offset = body.numpy().tobytes() if body is not None else b"", [], 0
    for name, size in described["files"]:
        files.append((name, data[offset:offset + size]))
        offset += size
    return Parcel(described["name"], tuple(files))


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


def receive_into(section: LocalSection, parcel: Parcel) -> None:
    """Write `parcel` as a committed generation of `section`: into a temporary sibling, every
    file checked against the parcel's own manifest, then renamed into place (replacing an older
    copy of the same name: memory keeps no superseded copies). CorruptGeneration if it does not
    verify (nothing is left then); a name that is not a generation's is never written."""
    if generation_step(parcel.name) is None or "/" in parcel.name:
        raise CorruptGeneration(f"a peer sent a generation named {parcel.name!r}; not kept")
    for name, _ in parcel.files:
        if "/" in name or "\0" in name or name in ("", ".", ".."):
            raise CorruptGeneration(f"a peer sent {parcel.name} with a file named {name!r}; not kept")
    section.root.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(section.root, parcel.name, "peer")
    for name, data in parcel.files:
        (temporary / name).write_bytes(data)
    fsync_dir(temporary)
    checked = verify_directory(temporary)
    if not checked.ok:
        shutil.rmtree(temporary, ignore_errors=True)
        raise CorruptGeneration(f"{parcel.name} received from a peer does not verify ({checked.problem})")
    if section.path(parcel.name).is_dir():
        section.remove(parcel.name)
    rename_into_place(temporary, section.path(parcel.name))
