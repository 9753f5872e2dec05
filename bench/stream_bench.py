"""What does the trainer's streaming reader cost against a plain DataLoader over the same shards,
and how much does it read?

    python bench/stream_bench.py                       # 8 shards x 4096 windows of 128 tokens
    python bench/stream_bench.py --quick

Token shards (uint16 files, memory-mapped) are read two ways, in the same process, alternating
round by round: the trainer's stream (`trainer.data.stream.StreamSource`: shard order per
epoch, the block shuffle buffer, sample ids for the ledger) and a plain map-style DataLoader with
`shuffle=True` over the same windows. Each is timed reading batches alone (the reader's own
cost) and under a small language model's training step (what a run feels), for each worker
count. The ratios are stream / plain: 1.00 is free.

Read amplification: one epoch read by every rank's loader (ranks x DataLoader workers, on a
number of lanes: the run's, fixed when it starts; the ranks one after another in this process,
each with its own worker processes), counting every record the stream's `read()` yields in any
process; records read / records in the dataset, 1.00 is each record once
(trainer/data/stream.py), in batches of 24. 1x0, 2x2 and 4x2 on as many lanes as ranks (a run at the size it
started with), 2x2 on 4 lanes (a shrink the lanes divide), 3x2 on 4 lanes (one they do not:
each rank reads every lane, world size / gcd(lanes, world size) = 3x) and 3x2 on 12 (a lane
count with many divisors).

From an object store: the same shards uploaded to a fresh bucket on AWS_ENDPOINT_URL's server,
else on a SeaweedFS this bench starts (tests/s3server.py; `--no-store` skips the part), read
through `trainer.workload.objects.ObjectFiles` (ranged GETs of exactly the records a block
needs), one epoch at 1x0 and 2x2: bytes fetched / bytes of the shards (every byte trained on
once per epoch), 1.00 is no byte fetched twice.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.data.order import EpochShape  # noqa: E402
from trainer.data.stream import StreamSource  # noqa: E402
from trainer.workload.objects import ObjectFiles  # noqa: E402

warnings.filterwarnings("ignore")
VOCABULARY = 256
READERS = ((1, 0, 1), (2, 2, 2), (4, 2, 4), (2, 2, 4), (3, 2, 4), (3, 2, 12))
"""(ranks, DataLoader workers per rank, lanes) whose read amplification is measured."""
READ_BATCH = 24
"""The batch of the read-amplification epochs: 1, 2, 3 and 4 ranks share it evenly."""


def write_shards(folder: Path, shards: int, records: int, context: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for number in range(shards):
        path = folder / f"tokens-{number:03d}.bin"
        rng.integers(0, VOCABULARY, records * context + 1, dtype=np.uint16).tofile(path)
        paths.append(path)
    return paths


def window(tokens: np.ndarray, record: int, context: int) -> dict:
    data = np.asarray(tokens[record * context:(record + 1) * context + 1], dtype=np.int64)
    return {"inputs": torch.from_numpy(data[:-1]), "targets": torch.from_numpy(data[1:])}


class TokenStream:
    """The streaming protocol over the shards."""

    def __init__(self, paths: list[Path], records: int, context: int):
        self.paths, self.records, self.context = paths, records, context

    def shards(self):
        return [(path.name, self.records) for path in self.paths]

    def read(self, shard, offset: int):
        tokens = np.memmap(self.paths[0].with_name(shard[0]), dtype=np.uint16, mode="r")
        for record in range(offset, shard[1]):
            yield window(tokens, record, self.context)


class CountedTokenStream(TokenStream):
    """The same stream, adding the records each `read()` yielded to a counter shared with the
    DataLoader's (forked) workers."""

    def __init__(self, paths: list[Path], records: int, context: int, counter):
        super().__init__(paths, records, context)
        self.counter = counter

    def read(self, shard, offset: int):
        yielded = 0
        try:
            for record in super().read(shard, offset):
                yielded += 1
                yield record
        finally:
            with self.counter.get_lock():
                self.counter.value += yielded


class StoredTokenStream:
    """The shards in an object store: `read(shard, offset, stop)` fetches the bytes of records
    [offset, stop) with ranged GETs, adding them to a counter shared with the workers."""

    def __init__(self, files: ObjectFiles, records: int, context: int, counter):
        self.files, self.records, self.context, self.counter = files, records, context, counter

    def shards(self):
        return [(name, self.records) for name in self.files.names()]

    def read(self, shard, offset: int, stop: int | None = None):
        stop = shard[1] if stop is None else stop
        data = self.files.read(shard[0], 2 * offset * self.context, 2 * (stop * self.context + 1))
        with self.counter.get_lock():
            self.counter.value += len(data)
        tokens = np.frombuffer(data, dtype=np.uint16)
        for record in range(stop - offset):
            yield window(tokens, record, self.context)


def one_epoch(stream, args, ranks: int, workers: int, lanes: int | None = None, batch: int | None = None) -> int:
    """Every rank's loader through one epoch (the ranks one after another) on `lanes` lanes (the
    world size by default) in batches of `batch` (--batch by default); returns its samples."""
    source = StreamSource(stream, seed=1, buffer=args.buffer, spec="bench", lanes=lanes)
    shape = EpochShape(len(source), batch or args.batch)
    for rank in range(ranks):
        for _ in source.loader(shape, 0, 0, rank, ranks, workers):
            pass
    return len(source)


def read_amplification(args, paths, ranks: int, workers: int, lanes: int) -> float:
    """Records read in one epoch by every rank's loader / records in the dataset."""
    counter = multiprocessing.get_context("fork").Value("q", 0)
    records = one_epoch(CountedTokenStream(paths, args.records, args.context, counter), args, ranks, workers, lanes,
                        READ_BATCH)
    return counter.value / records


@contextmanager
def store_bucket():
    """A fresh bucket: on the server AWS_ENDPOINT_URL names (keys from AWS_* variables), else on
    a SeaweedFS this bench starts (tests/s3server.py) and kills at the end; emptied and removed."""
    with ExitStack() as stack:
        if not os.environ.get("AWS_ENDPOINT_URL"):
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from s3server import SeaweedServer
            root = Path(tempfile.mkdtemp(prefix="stream-bench-s3-"))  # short: its unix sockets live there
            stack.callback(shutil.rmtree, root, ignore_errors=True)
            server = SeaweedServer(root)
            server.start()
            stack.callback(server.kill)
            os.environ.update(server.env())
        import boto3
        client = boto3.client("s3")
        bucket = f"stream-bench-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        try:
            yield client, bucket
        finally:
            listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
            for item in listed:
                client.delete_object(Bucket=bucket, Key=item["Key"])
            client.delete_bucket(Bucket=bucket)


def store_amplification(args, paths) -> list[dict]:
    """Bytes fetched from the object store in one epoch / bytes of the shards, at 1x0 and 2x2."""
    with store_bucket() as (client, bucket):
        for path in paths:
            client.upload_file(str(path), bucket, f"tokens/{path.name}")
        files = ObjectFiles(f"s3://{bucket}/tokens", suffix=".bin")
        shard_bytes = sum(path.stat().st_size for path in paths)
        rows = []
        for ranks, workers in ((1, 0), (2, 2)):
            counter = multiprocessing.get_context("fork").Value("q", 0)
            one_epoch(StoredTokenStream(files, args.records, args.context, counter), args, ranks, workers)
            rows.append({"ranks": ranks, "workers": workers, "bytes_fetched": counter.value,
                         "bytes_trained": shard_bytes, "fetched_per_trained": counter.value / shard_bytes})
        return rows


class TokenWindows(Dataset):
    """The same windows, map-style, for a plain DataLoader."""

    def __init__(self, paths: list[Path], records: int, context: int):
        self.paths, self.records, self.context = paths, records, context
        self.tokens = None

    def __len__(self) -> int:
        return len(self.paths) * self.records

    def __getitem__(self, index: int) -> dict:
        if self.tokens is None:  # opened in the process that reads (a worker)
            self.tokens = [np.memmap(path, dtype=np.uint16, mode="r") for path in self.paths]
        shard, record = divmod(index, self.records)
        return window(self.tokens[shard], record, self.context)


def stream_batches(paths, records, context, batch, workers, buffer):
    source = StreamSource(TokenStream(paths, records, context), seed=1, buffer=buffer, spec="bench")
    return (fetched.batch for fetched in source.loader(EpochShape(len(source), batch), 0, 0, 0, 1, workers))


def plain_batches(paths, records, context, batch, workers, buffer):
    return iter(DataLoader(TokenWindows(paths, records, context), batch_size=batch, shuffle=True,
                           num_workers=workers, generator=torch.Generator().manual_seed(1)))


def model_step(context: int):
    model = nn.Sequential(nn.Embedding(VOCABULARY, 64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, VOCABULARY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: dict) -> None:
        logits = model(batch["inputs"])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), batch["targets"].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def timed(batches, steps: int, step) -> float:
    """Seconds per batch after the first (worker start-up and the first block excluded)."""
    step(next(batches))
    started = time.perf_counter()
    for _ in range(steps):
        step(next(batches))
    return (time.perf_counter() - started) / steps


def measure(args, paths) -> dict:
    rows = []
    for workers in args.workers:
        for training in (False, True):
            seconds = {"stream": [], "plain": []}
            for _ in range(args.rounds):
                for name, make in (("stream", stream_batches), ("plain", plain_batches)):
                    step = model_step(args.context) if training else (lambda batch: None)
                    batches = make(paths, args.records, args.context, args.batch, workers, args.buffer)
                    seconds[name].append(timed(batches, args.steps, step))
                    del batches
            stream, plain = statistics.median(seconds["stream"]), statistics.median(seconds["plain"])
            rows.append({"workers": workers, "what": "training step" if training else "reading only",
                         "stream_s": stream, "plain_s": plain, "ratio": stream / plain})
    amplification = [{"ranks": ranks, "workers": workers, "lanes": lanes,
                      "read_per_record": read_amplification(args, paths, ranks, workers, lanes)}
                     for ranks, workers, lanes in READERS]
    return {"shards": args.shards, "records": args.records, "context": args.context, "batch": args.batch,
            "buffer": args.buffer, "steps": args.steps, "rounds": args.rounds, "rows": rows,
            "read_amplification": amplification,
            "store": [] if args.no_store else store_amplification(args, paths)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--records", type=int, default=4096, help="windows per shard")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--buffer", type=int, default=1024, help="--shuffle-buffer")
    parser.add_argument("--steps", type=int, default=100, help="batches timed per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--quick", action="store_true", help="4 shards x 256 windows of 32 tokens, 20 batches, 1 round")
    parser.add_argument("--dir", type=Path, default=None, help="where the shards are written (removed after)")
    parser.add_argument("--no-store", action="store_true", help="skip the object-store stream (SeaweedFS)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.shards, args.records, args.context, args.batch, args.buffer = 4, 256, 32, 8, 64
        args.steps, args.rounds, args.workers = 20, 1, [0, 2]
    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="stream-bench-", dir=args.dir))
    try:
        report = measure(args, write_shards(scratch, args.shards, args.records, args.context))
    finally:
        shutil.rmtree(scratch)
    print(f"{args.shards} shards x {args.records} windows of {args.context} tokens, batch {args.batch}, shuffle "
          f"buffer {args.buffer}, {args.steps} batches timed, median of {args.rounds} rounds\n")
    print("| workers | measured | stream s/batch | plain DataLoader s/batch | stream / plain |\n|---|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['workers']} | {row['what']} | {row['stream_s']:.5f} | {row['plain_s']:.5f} | "
              f"{row['ratio']:.2f} |")
    print("\n| ranks x workers | lanes | records read / records in the dataset (one epoch) |\n|---|---|---|")
    for row in report["read_amplification"]:
        print(f"| {row['ranks']} x {row['workers']} | {row['lanes']} | {row['read_per_record']:.2f} |")
    if report["store"]:
        print("\n| object store, ranks x workers | bytes fetched | bytes of the shards | fetched / trained |\n"
              "|---|---|---|---|")
        for row in report["store"]:
            print(f"| {row['ranks']} x {row['workers']} | {row['bytes_fetched']} | {row['bytes_trained']} | "
                  f"{row['fetched_per_trained']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
