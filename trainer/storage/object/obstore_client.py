"""Objects under a run's prefix in S3 through obstore (Rust's object_store): the run
directory's client for s3://, chosen by measurement (bench/store_bench.py's client table,
docs/object-store.md): the same bytes cost less client CPU than fsspec/s3fs over aiobotocore,
downloads are ranged GETs in parallel whose buffers are written and hashed where they land (no
copy into Python bytes), and conditional writes (create-only, If-Match) are native.

What stays as before (client.py `StoreCalls`): bounded retries with jittered backoff under the
--store-* settings (object_store's own retries are off, so a try is a try), one-line errors.
Credentials come from botocore's chain, as s3fs took them: AWS_* variables, AWS_PROFILE and
~/.aws files, SSO, container and instance roles; the endpoint from AWS_ENDPOINT_URL(_S3).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from trainer.checkpoint.digest import CURRENT, entry, hasher
from trainer.config import StoreConfig
from trainer.errors import UsageError
from trainer.location import StoreLocation
from trainer.origin import install_extra
from trainer.storage.object.client import (BUDGET_BYTES, ENDPOINT_VARIABLES, MAX_PARTS, UPLOAD_PART,
                                           PreconditionFailed, StoreCalls, require_endpoint_scheme)

RANGE_BYTES = 16 << 20
"""Bytes per ranged GET of a download: each its own request (its own timeout and retry)."""
RANGES_IN_FLIGHT = 4
"""Ranged GETs of one object in flight at once (ahead of the one being written and hashed)."""
GET_THREADS = 16
"""Threads that wait on GETs (obstore's blocking calls release the GIL)."""
PUT_CONCURRENCY = 8
"""Parts of one multipart upload in flight at once."""
CREDENTIALS_TTL = timedelta(minutes=10)
"""How long object_store keeps credentials before asking botocore again (which refreshes
expiring ones itself)."""


NO_CREDENTIALS = "Unable to locate credentials"
"""botocore's words when its chain finds none: refused at once (74), never retried."""


def botocore_credentials():
    """obstore's credential provider from botocore's chain (what s3fs used): variables,
    profiles, SSO, container and instance roles (none of them a secret we hold or log)."""
    import botocore.session
    credentials = botocore.session.Session().get_credentials()

    def provide():
        if credentials is None:
            raise PermissionError(f"NoCredentialsError: {NO_CREDENTIALS}")
        frozen = credentials.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.now(timezone.utc) + CREDENTIALS_TTL}
    return provide


def open_s3(location: StoreLocation, config: StoreConfig, whole_bucket: bool = False):
    """The obstore S3Store for the run's prefix (`whole_bucket`: for the bucket, keys are
    `prefix/key`), with object_store's retries off (ours count)."""
    try:
        from obstore.store import S3Store
    except ImportError:
        raise UsageError(f"{location.url}: s3:// needs the obstore package; {install_extra('s3')}") from None
    require_endpoint_scheme(os.environ)
    endpoint = next((os.environ[name] for name in reversed(ENDPOINT_VARIABLES) if os.environ.get(name)), None)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    options = {"connect_timeout": timedelta(seconds=config.timeout_s),
               "read_timeout": timedelta(seconds=config.timeout_s),
               "timeout": timedelta(seconds=config.timeout_s * (2 + RANGE_BYTES / BUDGET_BYTES)),
               "allow_http": bool(endpoint and endpoint.startswith("http://"))}
    settings = {"virtual_hosted_style_request": False} if endpoint else {}
    if endpoint:
        settings["endpoint"] = endpoint
    if region:
        settings["region"] = region
    prefix = None if whole_bucket else location.prefix or None
    return S3Store(location.bucket, prefix=prefix, client_options=options,
                   retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=config.timeout_s)},
                   credential_provider=botocore_credentials(), **settings)


class ObstoreObjects(StoreCalls):
    """Objects under one run prefix in S3. Thread-safe: uploads and downloads run in parallel."""

    conditional = True
    """Conditional writes (create-only, If-Match) are native (PutMode)."""

    def __init__(self, location: StoreLocation, config: StoreConfig = StoreConfig()):
        super().__init__(location, config)
        import obstore
        self.obs = obstore
        self.store = open_s3(location, config)
        self.gets = ThreadPoolExecutor(GET_THREADS, thread_name_prefix="store-get")
        self.budget = config.timeout_s * (2 + RANGE_BYTES / BUDGET_BYTES)

    def _probe(self) -> bool:
        """One request listing at most one key under the run's prefix: cheap on a huge bucket,
        and enough for credentials that may list only that prefix."""
        try:
            next(iter(self.obs.list(self.store, chunk_size=1)), None)
        except FileNotFoundError:
            return False
        except Exception as error:  # noqa: BLE001 - a missing bucket is a 404 with its own code
            if "NoSuchBucket" in str(error):
                return False
            raise refined(error) from None
        return True

    # ----------------------------------------------------------------- reads
    def list(self, key: str) -> list[str]:
        """Keys of every object under `key/` (relative to the run), sorted; [] if none."""
        return sorted(self.described(key))

    def described(self, key: str = "") -> dict[str, tuple[int, str]]:
        """{key: (size, ETag)} of every object under `key/`, one listing."""
        def find():
            found = {}
            for batch in self.obs.list(self.store, prefix=key.strip("/") or None):
                for meta in batch:
                    found[meta["path"]] = (int(meta["size"]), str(meta.get("e_tag") or "").strip('"'))
            return found
        base = key.strip("/")
        return {path: value for path, value in sorted(self.guarded(f"listing {self.url_of(key)}", find).items())
                if not base or path.startswith(base + "/")}

    def read(self, key: str) -> bytes | None:
        """An object's bytes, or None if it does not exist."""
        def get():
            try:
                return bytes(self.obs.get(self.store, key).bytes())
            except FileNotFoundError:
                return None
        return self.guarded(f"reading {self.url_of(key)}", get)

    def read_range(self, key: str, start: int, end: int | None) -> bytes:
        """Bytes [start, end) of an object (end None: to its end): one ranged GET."""
        span = {"offset": start} if end is None else (start, end)
        return self.guarded(f"reading {self.url_of(key)} bytes {start}-{'' if end is None else end}",
                            lambda: bytes(self.obs.get(self.store, key, options={"range": span}).bytes()))

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        def head():
            try:
                return int(self.obs.head(self.store, key)["size"])
            except FileNotFoundError:
                return None
        return self.guarded(f"looking up {self.url_of(key)}", head)

    def download(self, key: str, destination: Path, algorithm: str = CURRENT) -> dict:
        """Download an object into a local file, hashing as it arrives: {"bytes", ALGORITHM}
        (the manifest's algorithm). Not fsynced: its caller says what it is for."""
        return self.stream_into(key, destination, lambda written: None, algorithm)

    def stream_into(self, key: str, destination: Path, progress: Callable[[int], None],
                    algorithm: str = CURRENT) -> dict:
        """`download`, telling `progress(bytes written)` as the file grows, front to back. Ranged
        GETs in parallel (RANGES_IN_FLIGHT ahead), each buffer written and hashed in order as
        it lands, from object_store's own memory (no copy into Python bytes). Each GET is
        one try of the bounded retries; a failed one is asked again from its offset."""
        size = self.size(key)
        if size is None:
            raise FileNotFoundError(self.url_of(key))
        digest, written = hasher(algorithm), 0
        with open(destination, "wb", buffering=0) as target:
            for piece in self.pieces(key, size):
                view = memoryview(piece)
                digest.update(view)
                while view:
                    view = view[target.write(view):]
                written += len(piece)
                progress(written)
        return entry(written, algorithm, digest.hexdigest())

    def pieces(self, key: str, size: int):
        """The object's bytes as buffers in order, fetched RANGES_IN_FLIGHT ranged GETs ahead.
        The last GET reads to the object's end, so a longer object is counted, not cut."""
        starts = list(range(0, max(size, 1), RANGE_BYTES))
        pending: deque[Future] = deque()
        try:
            for index, start in enumerate(starts):
                end = None if index == len(starts) - 1 else start + RANGE_BYTES
                pending.append(self.gets.submit(self.get_range, key, start, end))
                if len(pending) > RANGES_IN_FLIGHT:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    def get_range(self, key: str, start: int, end: int | None):
        span = {"offset": start} if end is None else (start, end)
        return self.guarded(f"downloading {self.url_of(key)} bytes {start}-{'' if end is None else end}",
                            lambda: self.obs.get(self.store, key, options={"range": span}).bytes())

    def digest(self, key: str, algorithm: str = CURRENT) -> dict | None:
        """{"bytes", ALGORITHM} of an object, streamed without keeping it; None if missing."""
        size = self.size(key)
        if size is None:
            return None
        digest, total = hasher(algorithm), 0
        try:
            for piece in self.pieces(key, size):
                digest.update(memoryview(piece))
                total += len(piece)
        except FileNotFoundError:
            return None
        return entry(total, algorithm, digest.hexdigest())

    # ----------------------------------------------------------------- writes
    def upload(self, source: Path, key: str) -> None:
        """Copy a local file to an object (multipart, PUT_CONCURRENCY parts at once, for large files)."""
        part = max(UPLOAD_PART, -(-source.stat().st_size // MAX_PARTS))
        self.guarded(f"uploading {self.url_of(key)}",
                     lambda: self.obs.put(self.store, key, source, chunk_size=part, max_concurrency=PUT_CONCURRENCY))

    def write(self, key: str, data: bytes) -> None:
        self.guarded(f"writing {self.url_of(key)}", lambda: self.obs.put(self.store, key, data))

    def copy(self, source: str, target: str) -> None:
        """A copy inside the run prefix (server-side)."""
        self.guarded(f"copying {self.url_of(source)}", lambda: self.obs.copy(self.store, source, target))

    def copy_from(self, other: StoreCalls, source: str, target: str) -> None:
        """A copy of `other`'s object `source` (another run prefix) to `target` here: server-side
        within one bucket (CopyObject on the bucket's keys), through this machine between two."""
        if other.location.bucket != self.location.bucket:
            data = other.read(source)
            if data is None:
                raise FileNotFoundError(other.url_of(source))
            return self.write(target, data)
        bucket = open_s3(self.location, self.config, whole_bucket=True)

        def key_of(location: StoreLocation, key: str) -> str:
            return location.path(key).split("/", 1)[1]
        self.guarded(f"copying {other.url_of(source)}",
                     lambda: self.obs.copy(bucket, key_of(other.location, source), key_of(self.location, target)))

    def delete(self, keys: list[str]) -> None:
        """Delete objects in order; one already gone is fine (S3's DELETE succeeds on it)."""
        for key in keys:
            self.guarded(f"deleting {self.url_of(key)}", lambda key=key: self.obs.delete(self.store, key))

    # ----------------------------------------------------------------- conditional writes
    def etag(self, key: str) -> tuple[bytes, str] | None:
        """(body, ETag) of an object, or None if it does not exist."""
        def get():
            try:
                result = self.obs.get(self.store, key)
            except FileNotFoundError:
                return None
            return bytes(result.bytes()), result.meta["e_tag"]
        return self.guarded(f"reading {self.url_of(key)}", get)

    def write_conditionally(self, key: str, data: bytes, if_match: str | None) -> str:
        """Write only if the object does not exist (`if_match` None) or still has ETag
        `if_match`; returns the new ETag, or raises PreconditionFailed."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError
        mode = "create" if if_match is None else {"e_tag": if_match}

        def put():
            try:
                return self.obs.put(self.store, key, data, mode=mode)["e_tag"]
            except (AlreadyExistsError, PreconditionError) as error:
                raise PreconditionFailed(str(error).splitlines()[0]) from None
        return self.guarded(f"writing {self.url_of(key)}", put)

    def guarded(self, what: str, operation):
        """`call`, with object_store's errors named as the retry policy knows them."""
        def attempt():
            try:
                return operation()
            except (FileNotFoundError, PreconditionFailed):
                raise
            except Exception as error:  # noqa: BLE001 - refined, then classified by `call`
                raise refined(error) from None
        return self.call(what, attempt)


class StoreRequestFailed(ConnectionError):
    """A request object_store gave up on (network, 5xx, 429 SlowDown): worth another try."""


def refined(error: BaseException) -> BaseException:
    """obstore's error as the retry policy reads it: refused (403, a bad signature, no
    credentials) → PermissionError, never retried; a configuration or path error stays itself
    (not transient); everything else (network, 5xx, throttling) → a transient failure, one line."""
    from obstore import exceptions
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if NO_CREDENTIALS in text:
        return PermissionError(f"NoCredentialsError: {NO_CREDENTIALS}")
    if isinstance(error, (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError)) or any(
            code in text for code in ("403 Forbidden", "SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied")):
        return PermissionError(scrubbed(summary(text) or first))
    if isinstance(error, (exceptions.InvalidPathError, exceptions.UnknownConfigurationKeyError,
                          exceptions.NotSupportedError)):
        return ValueError(scrubbed(first))
    if isinstance(error, (exceptions.AlreadyExistsError, exceptions.PreconditionError)):
        return PreconditionFailed(scrubbed(first))
    return StoreRequestFailed(scrubbed(summary(text) or first))


def summary(text: str) -> str:
    """The useful words of object_store's multi-line error: the status and S3's code, or the
    underlying cause (connection refused, timed out)."""
    if "status code: " in text:
        status = text.split("status code: ", 1)[1].split("<", 1)[0].split("\n", 1)[0].strip().rstrip(":")
        code = text.split("<Code>", 1)[1].split("<", 1)[0] if "<Code>" in text else ""
        return f"{status[:80]} {code}".strip()
    for cause in ("Connection refused", "timed out", "operation timed out", "connection closed", "reset by peer",
                  "error sending request", "dns error", "Connection reset"):
        if cause.lower() in text.lower():
            return cause
    return ""


def scrubbed(text: str) -> str:
    """Never a secret in a log line: object_store's errors can quote a presigned or signed URL."""
    return text.split("X-Amz-Signature", 1)[0].split("X-Amz-Credential", 1)[0]


