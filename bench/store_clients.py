"""Which S3 client should the run directory use? The same objects, the same server, each
client in turn (store_bench.py's client table; issue 58).

Each client uploads the same files (objects in parallel, 16 MiB parts, as ObjectSection.commit)
and downloads them again into preallocated buffers, every byte through the digest as it arrives
(as a restore does). Per direction: wall time, throughput, this process's CPU seconds (all
threads: a client's own Rust/C threads are this process's too) per GB, and the server's CPU
seconds (its /proc stat) apart. The digest's own CPU is measured alone and reported beside it,
so the client's share can be read off: `client CPU - digest CPU`.

Clients, where installed (each is skipped with a note otherwise):
  s3fs       FsspecObjects (the client before issue 58) through fsspec/s3fs over aiobotocore (the trainer's code path)
  ours       open_objects' S3 client (obstore_client.py): ranged GETs in flight, hashed as they land
  obstore    Rust's object_store (obstore): put with multipart, get streamed
  obstore-ranged  the same, the download as parallel ranged GETs (16 MiB) into the buffer
  crt        s3torchconnectorclient's MountpointS3Client (the AWS CRT, as s3torchconnector uses)
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

PART = 16 << 20
OBJECTS_IN_FLIGHT = 4
"""Objects moved at once (ObjectSection's parallelism), each with the client's own part concurrency."""


def hasher():
    """The digest every client's download goes through (the manifest's algorithm: BLAKE3 for
    a new generation, trainer/checkpoint/digest.py)."""
    from trainer.checkpoint.digest import CURRENT, hasher as manifest_hasher

    return manifest_hasher(CURRENT)


def hasher_of(data: bytes) -> str:
    digest = hasher()
    digest.update(data)
    return digest.hexdigest()


class Transfers:
    """One client's upload(path, key) and chunks(key, size) -> iterator of buffers, or
    ranged(key, size, into) filling a memoryview in parallel (digest after)."""

    name = "?"

    def upload(self, path: Path, key: str) -> None:
        raise NotImplementedError

    def chunks(self, key: str, size: int):
        raise NotImplementedError

    def cleanup(self, keys: list[str]) -> None:
        pass


class S3fsTransfers(Transfers):
    name = "s3fs (today's ObjectStore)"

    def __init__(self, bucket: str, prefix: str):
        from trainer.config import StoreConfig
        from trainer.location import StoreLocation
        from trainer.storage.object.client import FsspecObjects
        self.store = FsspecObjects(StoreLocation("s3", bucket, prefix), StoreConfig())

    def upload(self, path, key):
        self.store.upload(path, key)

    def download_into(self, key, size, view, digest):
        from trainer.storage.object.client import stream_object
        offset = 0

        def take(chunk):
            nonlocal offset
            view[offset:offset + len(chunk)] = chunk
            digest.update(chunk)
            offset += len(chunk)
        stream_object(self.store.fs, self.store.location, 20.0, key, take)
        return offset


class OursTransfers(Transfers):
    name = "ours: ObstoreObjects (ranged GETs in flight)"

    def __init__(self, bucket: str, prefix: str):
        from trainer.config import StoreConfig
        from trainer.location import StoreLocation
        from trainer.storage.object.client import open_objects
        self.store = open_objects(StoreLocation("s3", bucket, prefix), StoreConfig())

    def upload(self, path, key):
        self.store.upload(path, key)

    def download_into(self, key, size, view, digest):
        offset = 0
        for piece in self.store.pieces(key, size):
            piece = memoryview(piece)
            view[offset:offset + len(piece)] = piece
            digest.update(piece)
            offset += len(piece)
        return offset


class ObstoreTransfers(Transfers):
    name = "obstore 0.12 (streamed GET)"
    ranged = False

    def __init__(self, bucket: str, prefix: str):
        import obstore
        from obstore.store import S3Store
        self.obs, self.prefix = obstore, prefix
        self.store = S3Store(bucket, endpoint=os.environ["AWS_ENDPOINT_URL"], virtual_hosted_style_request=False,
                             client_options={"allow_http": True, "timeout": "60s"})

    def upload(self, path, key):
        self.obs.put(self.store, f"{self.prefix}/{key}", path, chunk_size=PART, max_concurrency=8)

    def download_into(self, key, size, view, digest):
        path = f"{self.prefix}/{key}"
        if not self.ranged:
            offset = 0
            for chunk in self.obs.get(self.store, path).stream(min_chunk_size=8 << 20):
                view[offset:offset + len(chunk)] = chunk
                digest.update(chunk)
                offset += len(chunk)
            return offset
        starts = list(range(0, size, PART))
        ends = [min(start + PART, size) for start in starts]
        # parallel ranged GETs (object_store coalesces and runs them concurrently), each buffer
        # hashed in order as the list returns
        for start, buffer in zip(starts, self.obs.get_ranges(self.store, path, starts=starts, ends=ends)):
            piece = memoryview(buffer)
            view[start:start + len(piece)] = piece
            digest.update(piece)
        return size


class ObstoreRangedTransfers(ObstoreTransfers):
    name = "obstore 0.12 (ranged GETs)"
    ranged = True


class CrtTransfers(Transfers):
    name = "s3torchconnectorclient 1.5 (AWS CRT)"

    def __init__(self, bucket: str, prefix: str):
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client
        self.bucket, self.prefix = bucket, prefix
        self.client = MountpointS3Client(os.environ.get("AWS_REGION", "us-east-1"), part_size=PART,
                                         endpoint=os.environ["AWS_ENDPOINT_URL"], force_path_style=True)

    def upload(self, path, key):
        stream = self.client.put_object(self.bucket, f"{self.prefix}/{key}")
        with open(path, "rb") as source:
            while chunk := source.read(PART):
                stream.write(chunk)
        stream.close()

    def download_into(self, key, size, view, digest):
        offset = 0
        for chunk in self.client.get_object(self.bucket, f"{self.prefix}/{key}"):
            view[offset:offset + len(chunk)] = chunk
            digest.update(chunk)
            offset += len(chunk)
        return offset


CLIENTS: list[type[Transfers]] = [S3fsTransfers, OursTransfers, ObstoreTransfers, ObstoreRangedTransfers, CrtTransfers]


def compare(files: list[Path], bucket: str, measure: Callable, rounds: int = 1) -> list[dict]:
    """Rows of the client table. `measure(row, name)` is store_bench's Clock.measure."""
    sizes = {path.name: path.stat().st_size for path in files}
    total = sum(sizes.values())
    buffers = {name: bytearray(size) for name, size in sizes.items()}  # preallocated, reused by all
    rows = []
    digest_row: dict = {}
    contents = [path.read_bytes() for path in files]
    with measure(digest_row, "digest"):
        for data in contents:
            hasher().update(data)
    del contents
    expected = {path.name: hasher_of(path.read_bytes()) for path in files}
    warm = S3fsTransfers(bucket, "clients-warm-up")  # the server's first volumes, counted by no client
    with ThreadPoolExecutor(OBJECTS_IN_FLIGHT) as pool:
        list(pool.map(lambda path: warm.upload(path, path.name), files))
    for client in CLIENTS:
        row: dict = {"client": client.name}
        try:
            transfers = client(bucket, f"clients-{client.__name__}")
        except Exception as error:  # noqa: BLE001 - not installed or not configured: noted
            row["skipped"] = f"{type(error).__name__}: {error}"
            rows.append(row)
            continue
        samples: dict[str, list] = {}
        for _ in range(rounds):
            sample: dict = {}
            with ThreadPoolExecutor(OBJECTS_IN_FLIGHT) as pool:
                with measure(sample, "upload"):
                    list(pool.map(lambda path: transfers.upload(path, path.name), files))
                digests = {}

                def fetch(name):
                    digest = hasher()
                    got = transfers.download_into(name, sizes[name], memoryview(buffers[name]), digest)
                    assert got == sizes[name], (client.name, name, got, sizes[name])
                    digests[name] = digest.hexdigest()
                with measure(sample, "download"):
                    list(pool.map(fetch, sizes))
            assert digests == expected, f"{client.name}: downloaded bytes differ"
            for key, value in sample.items():
                samples.setdefault(key, []).append(value)
        for key, values in samples.items():
            row[key] = sorted(values)[len(values) // 2]
        gb = total / 1e9
        for direction in ("upload", "download"):
            row[f"{direction}_gbps"] = gb / row[f"{direction}_s"]
            row[f"{direction}_cpu_per_gb"] = row[f"{direction}_cpu_s"] / gb
            if f"{direction}_server_cpu_s" in row:
                row[f"{direction}_server_cpu_per_gb"] = row[f"{direction}_server_cpu_s"] / gb
        rows.append(row)
    for row in rows:
        row["digest_cpu_per_gb"] = digest_row["digest_cpu_s"] / (total / 1e9)
    return rows


def table(rows: list[dict], total_bytes: int) -> list[str]:
    lines = [f"clients: {total_bytes / 1e6:.0f} MB in {OBJECTS_IN_FLIGHT}-way parallel objects, {PART >> 20} MiB "
             f"parts; CPU-s per GB (client: this process, all threads; downloads include the manifest's digest (BLAKE3) at "
             f"{rows[0]['digest_cpu_per_gb']:.2f} CPU-s/GB measured alone)", "",
             "| client | up GB/s | up client CPU-s/GB | up server CPU-s/GB | down GB/s | down client CPU-s/GB "
             "| down client CPU-s/GB less digest | down server CPU-s/GB |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['client']} | skipped: {row['skipped'][:80]} |||||||")
            continue
        server_up, server_down = row.get("upload_server_cpu_per_gb"), row.get("download_server_cpu_per_gb")
        lines.append(f"| {row['client']} | {row['upload_gbps']:.3f} | {row['upload_cpu_per_gb']:.2f} | "
                     f"{'-' if server_up is None else f'{server_up:.2f}'} | {row['download_gbps']:.3f} | "
                     f"{row['download_cpu_per_gb']:.2f} | "
                     f"{row['download_cpu_per_gb'] - row['digest_cpu_per_gb']:.2f} | "
                     f"{'-' if server_down is None else f'{server_down:.2f}'} |")
    return lines
