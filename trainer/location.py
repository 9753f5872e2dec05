"""Where a run lives: a local directory, or a prefix in an object store named by URL.

`--output` takes either, parsed once into a `Location` (`parse_location`): a `OnDisk`, or a
`InStore` with this machine's local tier of it. A URL's run directory has the same layout as
a local one (`checkpoints/step-%08d/`, `exports/…`, `attempts/…`), as objects under its prefix.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Union

from trainer.errors import UsageError

SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
"""Store URL schemes and the fsspec package that serves each (Polyaxon uses the same ones)."""
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
LOCAL_TIER_ENV = "TRAINER_LOCAL_TIER"
"""Parent folder of default local tiers (default: the system temporary directory)."""


@dataclass(frozen=True)
class StoreLocation:
    scheme: str
    bucket: str
    prefix: str
    """The run directory's key prefix inside the bucket, without leading or trailing '/'."""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    def path(self, key: str = "") -> str:
        """The fsspec path (`bucket/prefix/key`) of a key relative to the run directory."""
        parts = [self.bucket] + [part for part in (self.prefix, key.strip("/")) if part]
        return "/".join(parts)

    def child(self, key: str) -> StoreLocation:
        """The location of a folder under this one (`key` relative to the prefix)."""
        return StoreLocation(self.scheme, self.bucket, self.path(key).partition("/")[2])

    def default_local_tier(self) -> Path:
        """A working directory private to this machine for this run: outside any folder a
        Polyaxon sidecar uploads, so nothing is uploaded twice."""
        parent = Path(os.environ.get(LOCAL_TIER_ENV) or Path(tempfile.gettempdir()) / "training-recovery")
        return parent / self.scheme / self.bucket / (self.prefix or "_root")


@dataclass(frozen=True)
class OnDisk:
    """A run directory on this machine's disk."""

    root: Path
    in_store: ClassVar[bool] = False
    store_url: ClassVar[None] = None
    """What the attempt record names as the run's store: none."""

    def with_local_tier(self, local_tier: Path | None) -> OnDisk:
        """As it is: a run on this disk has no local tier (the command line refuses
        `--local-tier` without a store)."""
        return self

    def __str__(self) -> str:
        return str(self.root)


@dataclass(frozen=True)
class InStore:
    """A run directory in an object store, and this machine's working copy of it (its local
    tier: where generations are published before they are uploaded, and where a restore
    finds a copy it need not download)."""

    store: StoreLocation
    local_tier: Path
    in_store: ClassVar[bool] = True

    @property
    def store_url(self) -> str:
        return self.store.url

    def with_local_tier(self, local_tier: Path | None) -> InStore:
        """This run with an explicit local tier (`--local-tier`, a tracked run's), or as it is."""
        return self if local_tier is None else replace(self, local_tier=local_tier)

    def __str__(self) -> str:
        return self.store.url


@dataclass(frozen=True)
class ClaimedByPrimary:
    """The run directory rank 0 claims and every other rank joins: on the other ranks of a
    tracked run whose store is not exposed, only rank 0 knows the tracking run's outputs path."""

    in_store: ClassVar[bool] = False
    store_url: ClassVar[None] = None

    def with_local_tier(self, local_tier: Path | None) -> ClaimedByPrimary:
        return self

    def __str__(self) -> str:
        return "the run directory rank 0 claims"


Location = Union[OnDisk, InStore, ClaimedByPrimary]
"""Where a run directory lives, parsed once from `--output` (or a tracked run's placement)."""


def parse_location(text: str) -> OnDisk | InStore:
    """A local path, or a store URL with its default local tier; UsageError (exit 2) naming
    what is wrong with a URL."""
    if is_url(text):
        store = parse_store_url(text)
        return InStore(store, store.default_local_tier())
    return OnDisk(Path(text))


def is_url(text: str) -> bool:
    return URL.match(text) is not None


def parse_store_url(text: str) -> StoreLocation:
    """A store URL, or UsageError naming what is wrong with it (exit 2)."""
    match = URL.match(text)
    if not match:
        raise UsageError(f"{text!r} is not a store URL; use s3://BUCKET/PREFIX (or gs://, az://) or a local path")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        raise UsageError(f"--output {text}: pass a local run directory as a plain path, not a file:// URL")
    if scheme not in SCHEMES:
        known = ", ".join(f"{name}://" for name in ("s3", "gs", "az"))
        raise UsageError(f"--output {text}: unknown store scheme {scheme}://; use a local path or one of {known}")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"--output {text}: no bucket; use {scheme}://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UsageError(f"--output {text}: the prefix has an empty, '.' or '..' part; use {scheme}://BUCKET/a/b")
    return StoreLocation(scheme, bucket, prefix)
