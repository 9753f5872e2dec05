"""An in-memory `ObjectClient` (trainer/storage/object/client.py): the project's own client
interface, held in a dict, for unit tests of the uploader's threading and the lease's
policy. Not an S3 mock: the end-to-end tests run the real server (tests/s3server.py).

Faults are switched on per test: `fail_uploads` (every upload raises the store's one-line
failure), `upload_gate` (uploads block until it is set: back-pressure), `lose_next_response`
(the next conditional write lands but reports a failed precondition, as a retry whose first
response was lost does).
"""

from __future__ import annotations

import threading
from pathlib import Path

from trainer.checkpoint.digest import CURRENT, of_bytes
from trainer.storage.object.client import PreconditionFailed, StoreUnavailable


class MemoryObjects:
    conditional = True

    def __init__(self, url: str = "s3://bucket/run"):
        self._url = url
        self.objects: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.uploaded: list[str] = []
        """Keys in the order their uploads finished."""
        self.fail_uploads = False
        self.upload_gate = threading.Event()
        self.upload_gate.set()
        self.lose_next_response = False
        self.ranges_read: list[tuple[str, int, int | None]] = []
        """(key, start, end) of every ranged read, in order."""
        self._lock = threading.Lock()
        self._version = 0

    @property
    def url(self) -> str:
        return self._url

    def url_of(self, key: str) -> str:
        return f"{self._url}/{key}"

    def check_reachable(self) -> None:
        pass

    # ----------------------------------------------------------------- reads
    def list(self, key: str) -> list[str]:
        with self._lock:
            return sorted(name for name in self.objects if name.startswith(key.rstrip("/") + "/"))

    def read(self, key: str) -> bytes | None:
        with self._lock:
            return self.objects.get(key)

    def read_range(self, key: str, start: int, end: int | None) -> bytes:
        data = self.read(key)
        if data is None:
            raise FileNotFoundError(key)
        self.ranges_read.append((key, start, end))
        return data[start:end]

    def exists(self, key: str) -> bool:
        return self.read(key) is not None

    def size(self, key: str) -> int | None:
        data = self.read(key)
        return None if data is None else len(data)

    def download(self, key: str, destination: Path, algorithm: str = CURRENT) -> dict:
        data = self.read(key)
        if data is None:
            raise FileNotFoundError(key)
        destination.write_bytes(data)
        return of_bytes(data, algorithm)

    def stream_into(self, key: str, destination: Path, progress, algorithm: str = CURRENT) -> dict:
        digest = self.download(key, destination, algorithm)
        progress(digest["bytes"])
        return digest

    def digest(self, key: str, algorithm: str = CURRENT) -> dict | None:
        data = self.read(key)
        return None if data is None else of_bytes(data, algorithm)

    # ----------------------------------------------------------------- writes
    def upload(self, source: Path, key: str) -> None:
        self.upload_gate.wait()
        if self.fail_uploads:
            raise StoreUnavailable(f"{self.url_of(key)}: uploading failed after 5 tries; earlier generations are "
                                   f"intact; when the store is back, rerun with --resume auto")
        self.write(key, source.read_bytes())
        with self._lock:
            self.uploaded.append(key)

    def write(self, key: str, data: bytes) -> None:
        with self._lock:
            self._put(key, data)

    def copy(self, source: str, target: str) -> None:
        self.copy_from(self, source, target)

    def copy_from(self, other: "MemoryObjects", source: str, target: str) -> None:
        with self._lock:
            self._put(target, other.objects[source])

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self.objects.pop(key, None)
                self.etags.pop(key, None)

    def etag(self, key: str) -> tuple[bytes, str] | None:
        with self._lock:
            return None if key not in self.objects else (self.objects[key], self.etags[key])

    def write_conditionally(self, key: str, data: bytes, if_match: str | None) -> str:
        with self._lock:
            current = self.etags.get(key)
            if (if_match is None and current is not None) or (if_match is not None and current != if_match):
                raise PreconditionFailed(f"{key}: precondition failed")
            etag = self._put(key, data)
            if self.lose_next_response:
                self.lose_next_response = False
                raise PreconditionFailed(f"{key}: the response was lost (the write landed)")
            return etag

    def _put(self, key: str, data: bytes) -> str:
        self._version += 1
        self.objects[key] = bytes(data)
        self.etags[key] = f'"{self._version}"'
        return self.etags[key]
