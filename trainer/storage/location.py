"""Where a run lives: a local directory, or a prefix in an object store named by URL.

`--output` takes either. A URL's run directory has the same layout as a local one
(`checkpoints/step-%08d/`, `exports/…`, `attempts/…`), as objects under its prefix.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

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

    def default_local_tier(self) -> Path:
        """A working directory private to this machine for this run: outside any folder a
        Polyaxon sidecar uploads, so nothing is uploaded twice."""
        parent = Path(os.environ.get(LOCAL_TIER_ENV) or Path(tempfile.gettempdir()) / "training-recovery")
        return parent / self.scheme / self.bucket / (self.prefix or "_root")


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
