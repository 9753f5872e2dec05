"""Objects under a run's prefix in a store: the one place that talks to the store (with
obstore_client.py, S3's client; `open_objects` chooses), through fsspec (gcsfs, adlfs) here, retries transient failures with a bounded backoff, and turns
every failure into one line with an exit code.

Keys are relative to the run directory (`checkpoints/step-00000024/manifest.json`).
Credentials and endpoint come from where each client library looks (for S3: AWS_* variables,
AWS_ENDPOINT_URL, ~/.aws/config and credentials, instance roles); nothing here takes keys.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Callable, Protocol, TypeVar

from trainer.checkpoint.digest import CURRENT, entry, hasher
from trainer.config import StoreConfig
from trainer.errors import NothingToResume, StorageFailure, UsageError, option
from trainer.location import SCHEMES, StoreLocation
from trainer.origin import install_extra

log = logging.getLogger("trainer")
T = TypeVar("T")
CHUNK = 8 << 20
"""Bytes per read when streaming an object to disk (and through the digest)."""
UPLOAD_PART = 16 << 20
"""Bytes per part of an S3 multipart upload (10 parts of an object in flight, s3fs's default).
s3fs's default part, 50 MiB, holds 500 MiB of each large object in memory at once, sends objects
under 100 MiB as one PUT, and cost a third more client CPU per byte than 16 MiB parts (a 514 MB
generation on loopback SeaweedFS: 1.34 vs 1.01 CPU-s); boto3's upload_file uses 8 MiB."""
MAX_PARTS = 10_000
"""S3's limit on the parts of one multipart upload."""
TAKE_THREADS = 8
"""Threads that hash and write streamed chunks (one per download in flight: PARALLEL_OBJECTS)."""
BUDGET_BYTES = 64 << 20
"""A call gets one more --store-timeout-secs for every this many bytes it moves."""

CREDENTIAL_ERRORS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})
"""botocore's "no usable credentials", found by name (this module imports no client library):
no retry can help, so they are refused like a 403 at once, not retried into "unreachable"."""


_takers: list = []
_takers_lock = threading.Lock()


def takers():
    """The threads `stream_object` hands each arriving chunk to (started at the first download)."""
    with _takers_lock:
        if not _takers:
            from concurrent.futures import ThreadPoolExecutor
            _takers.append(ThreadPoolExecutor(TAKE_THREADS, thread_name_prefix="store-take"))
        return _takers[0]


def take_all(take: Callable[[bytes], None], pieces: list[bytes]) -> None:
    for piece in pieces:
        if piece:
            take(piece)


class StoreUnavailable(StorageFailure):
    """The store did not answer within the retry bound (exit 74)."""


class StoreUnreachable(StorageFailure):
    """The store could not be reached when the run started (exit 74): nothing was done."""


class StoreAccessDenied(StorageFailure):
    """The store refused our credentials or permissions (exit 74, like a local EACCES)."""


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed (If-Match)."""


ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def require_endpoint_scheme(environ) -> None:
    """botocore takes `127.0.0.1:8333` and fails at the first call with a ValueError deep in a
    retry loop; refuse it up front, naming the fix (exit 2)."""
    for name in ENDPOINT_VARIABLES:
        value = environ.get(name, "")
        if value and "://" not in value:
            raise UsageError(f"{name}={value} has no scheme; write it as http://{value} (https:// for TLS)")


def open_filesystem(location: StoreLocation, config: StoreConfig):
    """The fsspec filesystem for a URL's scheme, configured so this module owns retries."""
    package = SCHEMES[location.scheme]
    try:
        module = importlib.import_module(package)
    except ImportError:
        install = install_extra("s3") if location.scheme == "s3" else f"pip install {package}"
        raise UsageError(f"{location.url}: {location.scheme}:// needs the {package} package; {install}") from None
    if location.scheme == "s3":
        require_endpoint_scheme(os.environ)
        timeouts = {"connect_timeout": config.timeout_s, "read_timeout": config.timeout_s,
                    "retries": {"total_max_attempts": 1, "mode": "standard"}}
        filesystem = module.S3FileSystem(config_kwargs=timeouts, skip_instance_cache=True, use_listings_cache=False)
        filesystem.retries = 1  # a class attribute, not a constructor argument, in s3fs
        return filesystem
    import fsspec
    return fsspec.filesystem(location.scheme, skip_instance_cache=True, use_listings_cache=False)


def is_transient(error: BaseException) -> bool:
    """Worth another try: the network or the server, not our request."""
    if isinstance(error, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError,
                          NotADirectoryError, PreconditionFailed, ValueError, TypeError, KeyError)):
        return False
    if isinstance(error, OSError) and error.errno in (errno.EINVAL, errno.ENOTEMPTY, errno.EMSGSIZE):
        return False
    return True


def _quiet_loop_errors(loop, context: dict) -> None:
    log.debug("store client: %s", context.get("message"), exc_info=context.get("exception"))


def is_precondition_failure(error: BaseException) -> bool:
    """S3's 412 (If-Match / If-None-Match did not hold), however the client wrapped it."""
    for candidate in (error, error.__cause__, error.__context__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return True
    return False


def describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{error.__class__.__name__}: {text}" if text else error.__class__.__name__


def stream_object(fs, location: StoreLocation, timeout_s: float, key: str,
                  take: Callable[[bytes], None], start: int = 0) -> None:
    """Hand an object's bytes to `take`, in order (`FsspecObjects.download` and `digest`). On S3
    one GET streams the whole object.
    s3fs's buffered file (what other stores use here) issues a ranged GET per block and
    copies every byte through its read-ahead cache: fetching a 514 MB generation from
    loopback SeaweedFS took 3.25 s and 1.86 CPU-s that way, 1.87 s and 0.83 CPU-s streamed.
    On S3 `take` runs on a thread of `takers()`, CHUNK bytes at a time, while fsspec's
    event-loop thread reads on: the digest and the write release the GIL, so the loop keeps
    every other stream moving. When `take` ran on the loop thread itself, every parallel
    download was hashed and written there one after another: a 256 MB fetch took
    0.66-0.68 s where the GETs alone took 0.27-0.29 s (docs/checkpoint-modes.md). Ranged
    GETs in parallel were measured and not kept: no faster where the CPU is the bound.
    `start`: from that byte on (a download resumed after a failed try)."""
    path = location.path(key)
    if location.scheme != "s3":
        with fs.open(path, "rb", block_size=CHUNK) as source:
            source.seek(start)
            while chunk := source.read(CHUNK):
                take(chunk)
        return
    from fsspec.asyn import sync

    async def stream():
        ranged = {"Range": f"bytes={start}-"} if start else {}
        response = await asyncio.wait_for(fs._call_s3("get_object", Bucket=location.bucket,
                                                      Key=path.split("/", 1)[1], **ranged), timeout_s)
        loop, taking, pieces, held = asyncio.get_running_loop(), None, [], 0
        try:
            async with response["Body"] as body:
                while True:
                    # A store that stops sending mid-object must not hang us: a timeout per read.
                    piece = await asyncio.wait_for(body.read(CHUNK), timeout_s)
                    pieces.append(piece)
                    held += len(piece)
                    if held < CHUNK and piece:
                        continue  # a read returns what arrived (~0.75 MB): hand over CHUNK at a time
                    if taking is not None:
                        await taking  # in order, and at most one batch waiting per stream
                    batch, pieces, held = pieces, [], 0
                    taking = loop.run_in_executor(takers(), take_all, take, batch)
                    if not piece:
                        break
        finally:
            if taking is not None:  # no `take` outlives the stream (a failed one: its error)
                await asyncio.wait([taking])
        taking.result()
    sync(fs.loop, stream)


def read_body(fs, response) -> bytes:
    """The whole body of an S3 response, read on fsspec's event loop."""
    from fsspec.asyn import sync

    async def read():
        async with response["Body"] as body:
            return await body.read()
    return sync(fs.loop, read)


class ObjectClient(Protocol):
    """What the object-store backend needs of a client: objects under one run prefix, keyed
    relative to it. `open_objects` opens the real one (obstore for S3, fsspec otherwise; bounded retries); tests of the
    uploader's threading and the lease's policy use an in-memory one (tests/memory_objects.py)."""

    conditional: bool
    """Whether conditional writes (create-only, If-Match) are available."""

    @property
    def url(self) -> str: ...

    def url_of(self, key: str) -> str: ...

    def check_reachable(self) -> None: ...

    def list(self, key: str) -> list[str]: ...

    def read(self, key: str) -> bytes | None: ...

    def read_range(self, key: str, start: int, end: int | None) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int | None: ...

    def download(self, key: str, destination: Path, algorithm: str = CURRENT) -> dict: ...

    def stream_into(self, key: str, destination: Path, progress: Callable[[int], None],
                    algorithm: str = CURRENT) -> dict: ...

    def digest(self, key: str, algorithm: str = CURRENT) -> dict | None: ...

    def upload(self, source: Path, key: str) -> None: ...

    def write(self, key: str, data: bytes) -> None: ...

    def copy(self, source: str, target: str) -> None: ...

    def copy_from(self, other: "ObjectClient", source: str, target: str) -> None: ...

    def delete(self, keys: list[str]) -> None: ...

    def etag(self, key: str) -> tuple[bytes, str] | None: ...

    def write_conditionally(self, key: str, data: bytes, if_match: str | None) -> str: ...


def backoff(config: StoreConfig, attempt: int, jitter: random.Random) -> float:
    """Seconds before retry `attempt + 1`: doubling from --store-backoff-secs, at most 8 s,
    drawn over its upper half, so ranks throttled together (a 503 SlowDown) do not come back
    together. `jitter` is the client's own generator: Python's global one is training state
    (a generation stores it), and a retry drawing from it made a resume inexact."""
    return min(config.backoff_s * 2 ** attempt, 8.0) * jitter.uniform(0.5, 1.0)


class StoreCalls:
    """What every client of a run prefix shares: its URL, and one operation run with bounded
    retries, every failure turned into one line (74). `_probe()` (the client's): does the
    bucket exist (False: 66), raising what a request raises."""

    def __init__(self, location: StoreLocation, config: StoreConfig):
        self.location = location
        self.config = config
        self.jitter = random.Random()
        """The backoff's draws: never Python's global generator, which is training state."""

    @property
    def url(self) -> str:
        return self.location.url

    def url_of(self, key: str) -> str:
        return f"{self.location.scheme}://{self.location.path(key)}"

    def call(self, what: str, operation: Callable[[], T]) -> T:
        """Run one store operation with bounded retries; failures become one line (74)."""
        config, started = self.config, time.monotonic()
        for attempt in range(config.retries + 1):
            try:
                return operation()
            except Exception as error:  # noqa: BLE001 - classified right here
                if isinstance(error, PermissionError) or type(error).__name__ in CREDENTIAL_ERRORS:
                    raise StoreAccessDenied(f"{self.url}: {what} refused: {describe(error)}; check the credentials "
                                            f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the mounted connection "
                                            f"secret) and the bucket's permissions") from None
                if not is_transient(error) or attempt == config.retries:
                    if not is_transient(error):
                        raise
                    raise StoreUnavailable(
                        f"{self.url}: {what} failed after {attempt + 1} tries over "
                        f"{time.monotonic() - started:.0f}s: {describe(error)}; earlier generations are intact; "
                        f"when the store is back, rerun with {option('--resume', 'auto')}") from None
                wait = backoff(config, attempt, self.jitter)
                log.warning("store: %s failed (%s); retry %d/%d in %.1fs", what, describe(error), attempt + 1,
                            config.retries, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def check_reachable(self) -> None:
        """Before any work: the bucket exists and answers with our credentials. One line and
        a non-zero exit otherwise (74 unreachable or refused, 66 no such bucket)."""
        try:
            exists = self.call(f"listing {self.url}", self._probe)
        except StoreUnavailable as error:
            raise StoreUnreachable(f"{self.url}: the store does not answer ({str(error).split(': ', 2)[-1]}"
                                   .split("; earlier generations")[0] +
                                   "); check the endpoint (AWS_ENDPOINT_URL) and the network, then retry") from None
        if not exists:
            raise NothingToResume(f"{self.url}: bucket {self.location.bucket} does not exist; create it first, or "
                                  f"fix the bucket name")

    def _probe(self) -> bool:
        raise NotImplementedError


class FsspecObjects(StoreCalls):
    """Objects under one run prefix through fsspec (gs://, az://; s3fs where asked for). Thread-safe."""

    def __init__(self, location: StoreLocation, config: StoreConfig = StoreConfig(), filesystem=None):
        super().__init__(location, config)
        self.fs = filesystem if filesystem is not None else open_filesystem(location, config)
        self.conditional = location.scheme == "s3"
        """Whether conditional writes (create-only, If-Match) are available."""
        if getattr(self.fs, "async_impl", False) and getattr(self.fs, "loop", None) is not None:
            # A connection reset leaves aiohttp tasks nobody awaits; their tracebacks on stderr
            # would bury the one line a failure gets. The call that failed reports it.
            self.fs.loop.call_soon_threadsafe(self.fs.loop.set_exception_handler, _quiet_loop_errors)

    def _probe(self) -> bool:
        """On S3 one request listing at most one key under the run's prefix: cheap on a huge
        bucket, and enough for credentials that may list only that prefix."""
        try:
            if self.location.scheme == "s3":
                prefix = f"{self.location.prefix}/" if self.location.prefix else ""
                self._s3("list_objects_v2", Prefix=prefix, MaxKeys=1)
            else:
                self._run("ls", self.location.bucket, detail=False, refresh=True)
        except FileNotFoundError:
            return False
        return True

    # ----------------------------------------------------------------- reads
    def list(self, key: str) -> list[str]:
        """Keys of every object under `key/` (relative to the run), sorted; [] if none."""
        base = self.location.path(key)

        def find():
            try:
                return self._run("find", base, withdirs=False)
            except FileNotFoundError:
                return []
        root = self.location.path()
        # Only what lies strictly under `key/`: some stores list an emptied folder as an entry.
        return sorted(path[len(root) + 1:] for path in self.call(f"listing {self.url_of(key)}", find)
                      if path.startswith(base + "/"))

    def read(self, key: str) -> bytes | None:
        """An object's bytes, or None if it does not exist."""
        def cat():
            try:
                return self._run("cat_file", self.location.path(key))
            except FileNotFoundError:
                return None
        return self.call(f"reading {self.url_of(key)}", cat)

    def read_range(self, key: str, start: int, end: int | None) -> bytes:
        """Bytes [start, end) of an object (end None: to its end): one ranged GET (a stream's
        shard read from an offset, a part of a generation's shard, never the whole object)."""
        return self.call(f"reading {self.url_of(key)} bytes {start}-{'' if end is None else end}",
                         lambda: self._run("cat_file", self.location.path(key), start=start, end=end,
                                           size=BUDGET_BYTES if end is None else end - start))

    def described(self, key: str = "") -> dict[str, tuple[int, str]]:
        """{key: (size, ETag)} of every object under `key/` (relative to the prefix), one
        listing: a dataset's fingerprint from what the store already knows, no byte read."""
        base = self.location.path(key).rstrip("/")

        def find():
            try:
                return self._run("find", base, withdirs=False, detail=True)
            except FileNotFoundError:
                return {}
        root = self.location.path().rstrip("/")
        return {path[len(root) + 1:]: (int(info["size"]), str(info.get("ETag", "")).strip('"'))
                for path, info in sorted(self.call(f"listing {self.url_of(key)}", find).items())
                if path.startswith(base + "/")}

    def exists(self, key: str) -> bool:
        return self.call(f"looking up {self.url_of(key)}", lambda: self._run("exists", self.location.path(key)))

    def size(self, key: str) -> int | None:
        def info():
            try:
                return int(self._run("info", self.location.path(key))["size"])
            except FileNotFoundError:
                return None
        return self.call(f"looking up {self.url_of(key)}", info)

    def download(self, key: str, destination: Path, algorithm: str = CURRENT) -> dict:
        """Stream an object into a local file, hashing as it arrives: {"bytes", ALGORITHM}.
        The file is not fsynced: what a download is for is said by its caller
        (`ObjectSection.fetch`: a cache, verified again before any later use)."""
        return self.stream_into(key, destination, lambda written: None, algorithm)

    def stream_into(self, key: str, destination: Path, progress: Callable[[int], None],
                    algorithm: str = CURRENT) -> dict:
        """`download`, telling `progress(bytes written)` as the file grows (a load may read it
        meanwhile: trainer/storage/object/streaming.py). A failed try resumes where the written
        bytes end (a ranged GET): nothing written is written again, the digest goes on in order."""
        digest, size = hasher(algorithm), 0
        with open(destination, "wb") as target:
            def take(chunk: bytes) -> None:
                nonlocal size
                digest.update(chunk)
                target.write(chunk)
                target.flush()
                size += len(chunk)
                progress(size)
            self.call(f"downloading {self.url_of(key)}",
                      lambda: stream_object(self.fs, self.location, self.config.timeout_s, key, take, size))
        return entry(size, algorithm, digest.hexdigest())

    def digest(self, key: str, algorithm: str = CURRENT) -> dict | None:
        """{"bytes", ALGORITHM} of an object, streamed without keeping it; None if missing."""
        def stream():
            digest, size = hasher(algorithm), 0

            def take(chunk: bytes) -> None:
                nonlocal size
                digest.update(chunk)
                size += len(chunk)
            try:
                stream_object(self.fs, self.location, self.config.timeout_s, key, take)
            except FileNotFoundError:
                return None
            return entry(size, algorithm, digest.hexdigest())
        return self.call(f"reading {self.url_of(key)}", stream)

    # ----------------------------------------------------------------- writes
    def upload(self, source: Path, key: str) -> None:
        """Copy a local file to an object (multipart and parallel for large files)."""
        def put():
            options = {}
            if self.location.scheme == "s3":
                options["chunksize"] = max(UPLOAD_PART, -(-source.stat().st_size // MAX_PARTS))
            self._run("put_file", str(source), self.location.path(key), size=source.stat().st_size, **options)
        self.call(f"uploading {self.url_of(key)}", put)

    def write(self, key: str, data: bytes) -> None:
        self.call(f"writing {self.url_of(key)}", lambda: self._run("pipe_file", self.location.path(key), data,
                                                                                size=len(data)))

    def copy(self, source: str, target: str) -> None:
        """A copy inside the store (server-side where the store supports it)."""
        self.copy_from(self, source, target)

    def copy_from(self, other: FsspecObjects, source: str, target: str) -> None:
        """A copy of `other`'s object `source` (another prefix of the same store) to `target` here."""
        self.call(f"copying {other.url_of(source)}", lambda: self._run("copy", other.location.path(source),
                                                                           self.location.path(target)))

    def delete(self, keys: list[str]) -> None:
        """Delete objects in order; one already gone is fine."""
        for key in keys:
            def rm(path=self.location.path(key)):
                try:
                    self._run("rm_file", path)
                except FileNotFoundError:
                    pass
            self.call(f"deleting {self.url_of(key)}", rm)

    # ----------------------------------------------------------------- conditional writes (S3)
    def etag(self, key: str) -> tuple[bytes, str] | None:
        """(body, ETag) of an object, or None if it does not exist."""
        def get():
            try:
                response = self._s3("get_object", Key=self.location.path(key).split("/", 1)[1])
            except FileNotFoundError:
                return None
            return read_body(self.fs, response), response["ETag"]
        return self.call(f"reading {self.url_of(key)}", get)

    def write_conditionally(self, key: str, data: bytes, if_match: str | None) -> str:
        """Write only if the object does not exist (`if_match` None) or still has ETag
        `if_match`; returns the new ETag, or raises PreconditionFailed."""
        condition = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": if_match}

        def put():
            try:
                return self._s3("put_object", Key=self.location.path(key).split("/", 1)[1], Body=data,
                                **condition)["ETag"]
            except FileExistsError as error:
                raise PreconditionFailed(str(error)) from None
            except OSError as error:
                if is_precondition_failure(error):
                    raise PreconditionFailed(str(error)) from None
                raise
        return self.call(f"writing {self.url_of(key)}", put)

    def _run(self, method: str, *args, size: int = 0, **kwargs):
        """One filesystem call with a total time budget. botocore's connect/read timeouts do
        not cover everything: aiohttp waits for a `100 Continue` to a PUT with no timeout, so a
        store that accepts connections but stops answering would hang a save for good."""
        if not getattr(self.fs, "async_impl", False):
            return getattr(self.fs, method)(*args, **kwargs)
        from fsspec.asyn import sync
        return sync(self.fs.loop, getattr(self.fs, "_" + method), *args, timeout=self._budget(size), **kwargs)

    def _budget(self, size: int) -> float:
        """Seconds one call may take: two timeouts, plus one per 64 MiB it moves."""
        return self.config.timeout_s * (2 + size / BUDGET_BYTES)

    def _s3(self, method: str, **kwargs):
        from fsspec.asyn import sync
        return sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.location.bucket,
                    timeout=self._budget(len(kwargs.get("Body") or b"")), **kwargs)


def open_objects(location: StoreLocation, config: StoreConfig = StoreConfig(), forked: bool = False) -> ObjectClient:
    """The client for a store URL: the one place the backend is chosen. s3:// through obstore
    (the client table in bench/store_bench.py, docs/object-store.md); gs:// and az:// through
    fsspec (gcsfs, adlfs), as before: obstore covers them too, but nothing here can test them
    against a real server. `forked`: for a process forked from one that may have used the
    store (a DataLoader worker reading a stream): fsspec, whose event loop is renewed after a
    fork; obstore's runtime is not, and a forked child's first request would wait forever."""
    if location.scheme == "s3" and not forked:
        from trainer.storage.object.obstore_client import ObstoreObjects
        return ObstoreObjects(location, config)
    return FsspecObjects(location, config)
