"""What a rank may do about a peer that went silent: know whether it is the very process on this
host (and end it), and get its own threads out of the process groups' waits (gloo's by their
sockets; NCCL's by aborting its communicator: `waits_of`).

A frozen peer (SIGSTOP, a hung device, a paused VM) holds every collective that needs it: gloo
waits inside C++, where no Python signal handler or exception reaches, and neither
`ProcessGroupGloo.abort()` nor `shutdown()` ends a wait already in progress (measured, torch
2.13). What does end it is the connection: once one of the group's sockets is shut down, every
wait on it raises gloo's "Connection closed" at once, the same error a dead peer gives, so a
silence takes the same way out as a kill (the one line, the record, exit 75), from whatever the
main thread was waiting in (the step's agreement, DDP's backward, a save's barrier, a background
commit).

Ending the frozen worker itself is for the launcher's sake: torchrun stops a worker with SIGTERM
and waits 30 s before its SIGKILL, and a stopped process never handles the SIGTERM. It is done
only where the pid is provably the frozen peer's: the same boot of the same machine, the same
pid namespace, and the same start time, checked through a pidfd so a pid reused in between is
never signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger("trainer")


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces): [0] is the state."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a rank is, as another rank on the same host can prove it (registered in the store)."""

    host: str
    boot: str
    """The kernel's boot id: another boot, or another machine, shares no pid."""
    pid_namespace: str
    """Another pid namespace (another pod on the same node) means another process table."""
    pid: int
    started: int
    """Clock ticks after boot at which the process started: a reused pid has another."""

    @classmethod
    def of_this_process(cls) -> "ProcessIdentity | None":
        try:
            return cls(socket.gethostname(), Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                       os.readlink("/proc/self/ns/pid"), os.getpid(), int(_stat_fields("self")[19]))
        except (OSError, ValueError, IndexError):
            return None  # not Linux: no peer is ever ended from here

    def as_dict(self) -> dict:
        return asdict(self)

    def same_host_as(self, other: "ProcessIdentity") -> bool:
        return (self.boot, self.pid_namespace) == (other.boot, other.pid_namespace)


def end_if_here(peer: ProcessIdentity, here: ProcessIdentity | None) -> bool:
    """SIGKILL `peer` if it is a process of this host's pid namespace whose start time still
    matches (through a pidfd: the check and the signal are about one process); True if sent."""
    if here is None or not here.same_host_as(peer) or peer.pid == here.pid:
        return False
    try:
        handle = os.pidfd_open(peer.pid)
    except (OSError, AttributeError):
        return False  # gone already, or no pidfd (not Linux 5.3+): nothing provable
    try:
        if int(_stat_fields(peer.pid)[19]) != peer.started:
            return False  # the pid now belongs to another process
        signal.pidfd_send_signal(handle, signal.SIGKILL)
        return True
    except (OSError, ValueError, IndexError):
        return False
    finally:
        os.close(handle)


def is_dead_here(peer: ProcessIdentity, here: ProcessIdentity | None) -> bool:
    """Whether `peer`, on this host, has provably ended (its pid is gone, a zombie, or another
    process's): a closed connection then names it at once, without a second reading."""
    if here is None or not here.same_host_as(peer):
        return False
    try:
        fields = _stat_fields(peer.pid)
        return fields[0] in ("Z", "X") or int(fields[19]) != peer.started
    except (OSError, ValueError, IndexError):
        return True


def socket_inodes() -> dict[int, int]:
    """This process's sockets: inode -> one file descriptor holding it."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(fd)
    return found


WILDCARD = ("0.0.0.0", "::", "")


def _host(address: str) -> str:
    return address.removeprefix("::ffff:")  # an IPv4 address seen through an IPv6 socket


def _ends(fd: int) -> tuple[tuple, tuple | None, bool]:
    """(local end, remote end or None, listening) of a socket this process holds."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        try:
            remote = sock.getpeername()
        except OSError:
            remote = None
        return sock.getsockname(), remote, bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _is_tcp(end) -> bool:
    return isinstance(end, tuple) and len(end) > 1


def listeners(store_port: int) -> list[tuple[str, int]]:
    """(host, port) of every TCP socket this process listens on, less the rendezvous store's:
    a gloo group's own listener among them (each rank's peers connect to it)."""
    found = []
    for fd in socket_inodes().values():
        try:
            local, _, listening = _ends(fd)
        except OSError:
            continue
        if listening and _is_tcp(local) and local[1] != store_port:
            found.append((_host(local[0]), local[1]))
    return found


def local_hosts_since(before: dict[int, int]) -> list[str]:
    """The local addresses of the TCP connections opened since `before` (a `socket_inodes()`):
    the interface a group just created talks over."""
    found = []
    for inode, fd in socket_inodes().items():
        try:
            local, remote, listening = _ends(fd) if inode not in before else ((), None, True)
        except OSError:
            continue
        if not listening and remote is not None and _is_tcp(local) and _host(local[0]) not in found:
            found.append(_host(local[0]))
    return found


class GroupSockets:
    """The sockets a process group opened (found as the ones that appeared while it connected,
    or, for a group the script created before the run looked, as the connections to and from
    the ranks' listeners), less the rendezvous store's: cutting them ends every wait on the
    group at once."""

    def __init__(self, store_port: int):
        self.store_port = store_port
        self.inodes: set[int] = set()

    def opened(self, before: dict[int, int]) -> None:
        """The group was created since `before` (a `socket_inodes()`): keep what it opened."""
        for inode, fd in socket_inodes().items():
            if inode not in before and not self._is_store(fd):
                self.inodes.add(inode)

    def adopt(self, ranks_listeners: list[list[tuple[str, int]]]) -> None:
        """A group created before this process looked (`listeners()` of every rank, gathered
        over it): gloo's connections are each accepted on one rank's listener and connected
        from another's socket to it, so a connection with either end at a listener is the group's
        (a peer's listener on another host: its address; one bound to every address: its port)."""
        at = {(host, port) for found in ranks_listeners for host, port in found}
        anywhere = {port for host, port in at if host in WILDCARD}

        def listener(end) -> bool:
            return _is_tcp(end) and (end[1] in anywhere or (_host(end[0]), end[1]) in at)

        for inode, fd in socket_inodes().items():
            try:
                local, remote, listening = _ends(fd)
            except OSError:
                continue
            if not listening and remote is not None and (listener(local) or listener(remote)) \
                    and not self._is_store(fd):
                self.inodes.add(inode)

    def _is_store(self, fd: int) -> bool:
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                ends = [sock.getsockname()]
                try:
                    ends.append(sock.getpeername())
                except OSError:
                    pass
        except OSError:
            return False
        return any(isinstance(end, tuple) and len(end) > 1 and end[1] == self.store_port for end in ends)

    def cut(self) -> int:
        """Shut every connection among them down (both directions; never a listener); how many."""
        cut = 0
        for inode, fd in socket_inodes().items():
            if inode not in self.inodes:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue  # a listener: shutting it down aborts gloo's accepting thread (SIGABRT)
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                continue  # already closed
        return cut


class Communicator(Protocol):
    """A backend whose waits are not sockets (NCCL's communicators): it ends them itself."""

    def abort(self) -> None:
        """End every collective in progress on it, and make every later one fail."""


class CommunicatorAbort:
    """NCCL's own way out of a wait on a silent peer: a collective there is a kernel on the
    device and a CPU thread polling it, no socket to cut, and only the communicator's abort
    (`ncclCommAbort`, through ProcessGroupNCCL's `abort`) ends it before NCCL's watchdog would (by
    SIGABRT, after the group's timeout: no record, no line). The main thread then finds the
    silence's verdict after the collective (`Ranks._collective`) and takes the same way out as on
    gloo. Verified on a GPU only (docs/scale-out.md, On GPUs)."""

    def __init__(self, communicator: Communicator):
        self.communicator = communicator

    def cut(self) -> int:
        try:
            self.communicator.abort()
        except Exception as error:  # noqa: BLE001 - on the watcher's thread: the group's timeout is the fallback
            log.warning("could not abort the process group's communicator: %s", error)
            return 0
        return 1


class EveryGroup:
    """Ends the waits of all of this process's groups at once: the heartbeat's `on_silence`."""

    def __init__(self, *groups):
        self.groups = groups

    def cut(self) -> int:
        return sum(group.cut() for group in self.groups)


def waits_of(backend: str, sockets: GroupSockets, communicator: Communicator) -> EveryGroup:
    """What ends every wait of a run whose training group has `backend`: the gloo groups'
    connections (the background groups are gloo on every backend), and, for any other backend
    (NCCL), its `communicator`'s abort."""
    if backend == "gloo":
        return EveryGroup(sockets)
    return EveryGroup(sockets, CommunicatorAbort(communicator))
