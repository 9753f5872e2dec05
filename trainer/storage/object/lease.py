"""Single writer on a store: a lease object that expires unless its holder renews it.

`flock` cannot protect a prefix shared by pods, and a dead pod never releases anything, so
the lock on a store is a lease: `.trainer.lease` names its holder (attempt, host, pid, ttl)
and is taken with a conditional create (S3 `If-None-Match: *`). A heartbeat thread renews it
every third of its ttl with `If-Match` on the ETag it last wrote. A new trainer that finds
it held watches it: a holder on this host whose process is gone is taken over at once;
otherwise, when the ETag has not changed for a whole ttl (measured on the watcher's own
clock, so clocks need not agree), the lease has expired and is taken over with `If-Match`.

Fencing: every commit first checks (`fence()`) that the lease is still ours, reading the
object itself, so a zombie writer (a paused or partitioned pod of an earlier attempt) whose
lease was taken over cannot commit over the newer attempt's line: its next commit is refused
(73) and it exits. What remains is the window of one request between that check and the
write; docs/object-store.md says so.

Releasing does not delete the object: it is overwritten with a released record (a
tombstone), which a new trainer takes at once. Were it deleted, a zombie that wakes after its
successor ended would find no lease, take it again, and commit its own line over the
successor's; a tombstone is another writer's record, so the zombie's fence refuses.

A tombstone can still be deleted (an operator, a lifecycle rule). So every acquisition also
takes a fencing token: `.trainer.lease-token` holds a counter that only grows, incremented
with a conditional write by each new holder. A fence that finds the lease *missing* takes it
again only while the counter still holds its own token (nobody acquired since); a larger
counter means a successor came, and a missing counter means it cannot tell: both are refused
(73). A zombie therefore never commits after a successor, whatever was deleted.

A store without conditional writes (gs://, az:// through fsspec) gets an unconditional lease:
one warning line, and the weaker guarantee documented.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from trainer.errors import OutputLocked, TrainerError
from trainer.storage.object.client import ObjectClient, PreconditionFailed

log = logging.getLogger("trainer")
LEASE = ".trainer.lease"
TOKEN = ".trainer.lease-token"
"""The fencing token: a counter that only grows, one step per acquisition (module docstring)."""
POLL_S = 0.5


class LeaseLost(OutputLocked):
    """Another attempt took the lease over: this process must not write anything more."""


@dataclass(frozen=True)
class Holder:
    attempt: str
    host: str
    pid: int
    ttl_s: float
    released: bool = False
    """The holder ended and let go (a tombstone): free to take, never to be taken back by it."""

    @classmethod
    def parse(cls, data: bytes) -> "Holder":
        try:
            value = json.loads(data)
            return cls(str(value["attempt"]), str(value["host"]), int(value["pid"]), float(value["ttl_s"]),
                       bool(value.get("released", False)))
        except (ValueError, KeyError, TypeError):
            return cls("?", "?", -1, 0.0)  # unreadable: treat as expired after the watcher's own ttl

    def encode(self, renewed: int, released: bool = False) -> bytes:
        return json.dumps({"attempt": self.attempt, "host": self.host, "pid": self.pid, "ttl_s": self.ttl_s,
                           "renewals": renewed, "renewed_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           **({"released": True} if released else {})}).encode()

    def describe(self) -> str:
        return (f"attempt {self.attempt}, host {self.host}, pid {self.pid}"
                + (" (released: that attempt ended)" if self.released else ""))

    def gone_from_this_host(self) -> bool:
        if self.host != socket.gethostname() or self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class StoreLease:
    def __init__(self, objects: ObjectClient, attempt: str, ttl_s: float, wait_s: float | None):
        self.objects = objects
        self.holder = Holder(attempt, socket.gethostname(), os.getpid(), ttl_s)
        self.wait_s = wait_s
        self._etag: str | None = None
        self._token: int | None = None
        """The counter value this holder's acquisition wrote."""
        self._renewals = 0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()
        """Held while the ETag is renewed or compared, so a fence never sees half a renewal."""

    @property
    def url(self) -> str:
        return self.objects.url_of(LEASE)

    # ----------------------------------------------------------------- taking it
    def acquire(self) -> "StoreLease":
        if not self.objects.conditional:
            log.warning("%s has no conditional writes: the single-writer lease is advisory (two trainers "
                        "started at the same instant could both write); see docs/object-store.md", self.objects.url)
        seen: tuple[str, float] | None = None  # (ETag, when first seen unchanged)
        started = time.monotonic()
        while True:
            current = self._read()
            if current is None:
                if self._write(None):
                    break
                continue
            body, etag = current
            other = Holder.parse(body)
            if seen is None or seen[0] != etag:
                seen = (etag, time.monotonic())
            expired = time.monotonic() - seen[1] > (other.ttl_s or self.holder.ttl_s)
            if other.released:
                if self._write(etag):
                    break
                continue
            if other.gone_from_this_host() or expired:
                how = "its process is gone" if not expired else f"not renewed for {other.ttl_s:.0f}s"
                if self._write(etag):
                    log.warning("took over the lease of %s on %s (%s)", other.describe(), self.objects.url, how)
                    break
                continue
            wait_s = self.wait_s if self.wait_s is not None else other.ttl_s + 5.0
            if time.monotonic() - started >= wait_s:
                raise OutputLocked(f"{self.objects.url} is in use by another trainer ({other.describe()}; its lease "
                                   f"is renewed every {other.ttl_s / 3:.0f}s and expires {other.ttl_s:.0f}s after "
                                   f"the last renewal); wait for it to end or stop it, then retry")
            time.sleep(POLL_S)
        self._token = self._next_token()
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _next_token(self) -> int:
        """Increment the fencing token (conditionally: two holders never get the same one)."""
        while True:
            current = self._read(TOKEN)
            token = (parse_token(current[0]) if current else 0) + 1
            if not self.objects.conditional:
                self.objects.write(TOKEN, str(token).encode())
                return token
            try:
                self.objects.write_conditionally(TOKEN, str(token).encode(), current[1] if current else None)
                return token
            except PreconditionFailed:
                continue  # another holder incremented it first: read again

    def _read(self, key: str = LEASE) -> tuple[bytes, str] | None:
        if self.objects.conditional:
            return self.objects.etag(key)
        data = self.objects.read(key)
        return None if data is None else (data, str(hash(data)))

    def _write(self, if_match: str | None, released: bool = False) -> bool:
        """One conditional write of our holder record; False if another writer won."""
        body = self.holder.encode(self._renewals, released)
        if not self.objects.conditional:
            self.objects.write(LEASE, body)
            self._etag = str(hash(body))
            return True
        try:
            self._etag = self.objects.write_conditionally(LEASE, body, if_match)
        except PreconditionFailed:
            # A retried write whose first try landed (its response lost) fails its own
            # condition: if the store holds exactly what we wrote, the write is ours.
            current = self._read()
            if current is None or current[0] != body:
                return False
            self._etag = current[1]
        return True

    # ----------------------------------------------------------------- keeping it
    def _heartbeat(self) -> None:
        """Renew every third of the ttl. Only evidence loses the lease (the object holds
        another writer's record): a store that does not answer is retried at the next beat,
        and once it answers again the renewal succeeds if nobody took over meanwhile."""
        interval = self.holder.ttl_s / 3
        while not self._stop.wait(interval):
            if self._lost:
                return
            self._renewals += 1
            try:
                with self._mutex:
                    renewed = self._write(self._etag)
                if not renewed:
                    self._lose("another attempt took it over")
                    return
            except Exception as error:  # noqa: BLE001 - a heartbeat must never die quietly
                log.warning("could not renew the lease on %s (%s); retrying in %.0fs", self.objects.url,
                            error, interval)

    def _lose(self, why: str) -> None:
        try:
            current = self._read()
            holder = Holder.parse(current[0]).describe() if current else "nobody"
        except Exception:  # noqa: BLE001 - who holds it now is only for the message
            holder = "unknown (the store did not answer)"
        self._lost = f"lost the lease on {self.objects.url} ({why}; now held by {holder})"
        log.error("%s: this attempt writes nothing more", self._lost)

    def fence(self) -> None:
        """Raise LeaseLost (73) unless the lease is still ours, checked on the object itself."""
        if self._lost:
            raise LeaseLost(f"{self._lost}; exiting without touching the newer attempt's line")
        with self._mutex:
            current = self._read()
            if current is None:  # deleted (an operator, a lifecycle rule): take it again if nobody took it since
                token = self._read(TOKEN)
                if token is None or parse_token(token[0]) != self._token:
                    self._lost = (f"the lease on {self.objects.url} was deleted and its fencing token "
                                  + ("too" if token is None else f"moved on to {parse_token(token[0])} (ours: "
                                                                   f"{self._token}): another attempt held it since"))
                    raise LeaseLost(f"{self._lost}; exiting without touching the newer attempt's line")
                ours = self._write(None)
                current = None if ours else self._read()
            else:
                ours = not self.objects.conditional or current[1] == self._etag
        if not ours:
            holder = Holder.parse(current[0]).describe() if current else "nobody"
            self._lost = f"lost the lease on {self.objects.url} (now held by {holder})"
            raise LeaseLost(f"{self._lost}; exiting without touching the newer attempt's line")

    def held(self) -> bool:
        return self._lost is None

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._lost is not None or self._etag is None:
            return
        try:
            with self._mutex:
                current = self._read()
                if current is not None and (not self.objects.conditional or current[1] == self._etag):
                    self._write(self._etag, released=True)  # a tombstone, not a deletion (module docstring)
                self._lost = "released the lease at the end of this attempt"  # no write may follow
        except Exception as error:  # noqa: BLE001 - the lease expires on its own
            log.warning("could not release the lease on %s (%s); it expires in %.0fs", self.objects.url, error,
                        self.holder.ttl_s)

    def __enter__(self) -> "StoreLease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lost_lease(fence: Callable[[], None]) -> TrainerError | None:
    """After a store operation failed: the lost lease, when a takeover explains the failure (a
    successor removes what a zombie uploaded), else None (the store being down explains it)."""
    try:
        fence()
    except TrainerError as lost:
        return lost
    except Exception:  # noqa: BLE001 - the store is down: the original error says so
        return None
    return None


def parse_token(data: bytes) -> int:
    """The counter in `.trainer.lease-token`; unreadable counts as larger than any (refused)."""
    try:
        return int(data)
    except ValueError:
        return 1 << 62
