"""Single writer: an advisory lock on the output directory.

`flock` is released by the kernel when its holder dies (even by kill -9), so a stale lock
from a dead process is taken over without any cleanup. The lock file names its holder so a
refused second trainer can say who holds it. On network filesystems without flock support
this degrades to no protection; we say so in the README rather than pretend.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from trainer.errors import OutputLocked
from trainer.layout import RunDirectory


class OutputLock:
    def __init__(self, output: Path):
        self.path = RunDirectory(output).lock
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputLocked(f"{self.path.parent} is in use by another trainer "
                               f"(host {holder.get('host', '?')}, pid {holder.get('pid', '?')}); "
                               f"wait for it to end or stop it, then retry") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
