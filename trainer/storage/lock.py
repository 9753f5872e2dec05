"""Single writer: an advisory lock on the output directory.

The lock is a POSIX record lock (`lockf`), not a `flock`, because of who holds it. A `flock`
belongs to the open file, and a forked child (a DataLoader worker, any `fork()` without
`exec`) shares that open file: after a `kill -9` of the trainer its orphaned workers kept the
run directory locked until their parent check fired, and a supervisor restarting at once (the
torchrun agent, a container restart) was refused with 73. A record lock belongs to the
process alone: the kernel drops it the moment the holder dies, whatever its children do, so a
successor never waits on a dead process's leftovers, and a live second trainer is still
refused. The lock file names its holder so a refused second trainer can say who holds it.

The price of record locks: closing *any* descriptor of the lock file in the holding process
drops the lock, so the trainer never opens the file other than here (`list` reads it from a
process of its own); and a second lock of the same file in the same process is granted, so one
process must not open one run directory twice. (The holder's recorded pid cannot tell: after a
container restart the successor often has the dead holder's pid and host name.)
On network filesystems without lock support this degrades to no protection; the docs say so.
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
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
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
            os.ftruncate(self._fd, 0)  # names no holder once released (a later reader sees none)
            os.close(self._fd)  # closing drops the record lock
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
