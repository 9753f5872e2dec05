"""A stream's files in an object store (`s3://bucket/prefix`): listed once with their sizes and
ETags, read by ranged GETs, through the run directory's own client.

A workload whose shards live in a bucket builds its stream on `ObjectFiles` instead of a
local folder: `shards()` counts records from the objects' sizes, `read(shard, offset, stop)`
asks for exactly the bytes of records [offset, stop) (the trainer passes `stop`,
trainer/data/stream.py), and `fingerprint()` digests names, sizes and ETags: the store's
own word for the content, no byte read and no full download per reader.
Credentials come from where the run directory's come from (AWS_* variables, AWS_ENDPOINT_URL,
~/.aws), and every GET has the same bounded retries and one-line failures (exit 74):
`trainer.storage.object.client.ObjectClient`, under the run's --store-* settings when the
workload passes them (`config=options.store_config`: the factory is handed them). A DataLoader worker opens its own client (an
fsspec filesystem does not cross a fork), and counts the bytes it fetched (`fetched`).
"""

from __future__ import annotations

import hashlib
import os

from trainer.config import StoreConfig
from trainer.errors import UsageError
from trainer.location import parse_store_url
from trainer.storage.object.client import ObjectClient, open_objects

RANGE_BYTES = 8 << 20
"""The most one ranged GET asks for: a longer read is split (each part retried on its own)."""


class ObjectFiles:
    """The objects under a store URL whose names end with `suffix`, for a stream's reader."""

    def __init__(self, url: str, suffix: str = "", config: StoreConfig = StoreConfig()):
        self.url, self.config = url.rstrip("/"), config
        self.location = parse_store_url(self.url)
        self.store_of: tuple[int, object] | None = None
        self.fetched = 0
        """Bytes this process fetched."""
        self.files = {name: described for name, described in self.store().described().items()
                      if name.endswith(suffix) and "/" not in name}
        """{name: (size, ETag)}: the objects directly under the prefix."""
        if not self.files:
            raise UsageError(f"{self.url}: no objects ending in {suffix!r} under it; upload the shards there, or "
                             f"fix the URL")

    def store(self):
        """This process's client (a worker opens its own, forked: open_objects says why)."""
        if self.store_of is None or self.store_of[0] != os.getpid():
            self.store_of = (os.getpid(), open_objects(self.location, self.config, forked=True))
        return self.store_of[1]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "store_of": None}

    def names(self) -> list[str]:
        return sorted(self.files)

    def size(self, name: str) -> int:
        return self.files[name][0]

    def read(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object, by ranged GETs of at most RANGE_BYTES."""
        parts = []
        for at in range(start, end, RANGE_BYTES):
            parts.append(self.store().read_range(name, at, min(end, at + RANGE_BYTES)))
        data = b"".join(parts)
        self.fetched += len(data)
        return data

    def fingerprint(self) -> str:
        """A digest of the objects' names, sizes and ETags (an object rewritten gets a new ETag)."""
        digest = hashlib.sha256()
        for name in self.names():
            size, etag = self.files[name]
            digest.update(f"{name}\0{size}\0{etag}\n".encode())
        return f"objects:{digest.hexdigest()}"
