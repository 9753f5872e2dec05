"""How fast do recovery snapshots write and load, against what this disk can do?

    python bench/checkpoint_bench.py --size-mb 512 --json out.json
    python bench/checkpoint_bench.py --quick          # 128 MB, about a minute

Builds the example model + SGD state at about --size-mb, then measures (each --repeat times,
median; bytes are the tensor bytes of the state):

  raw_write_gbps        the same bytes, a lean writer with --threads files in parallel + fsync
  raw_read_gbps         reading those files back with cold page cache, --threads in parallel
  torch_save_gbps       torch.save of the state dict to one file + fsync
  dcp_default_save_gbps stock dcp.save with a default FileSystemWriter (fsyncs its files)
  sync_save_s / _gbps   our SyncCheckpointer: write + hash + fsync + manifest + atomic rename
  async_blocking_s      AsyncCheckpointer: save() plus an immediate wait_for_staging(), i.e.
                        the loop blocked with nothing to overlap the staging copy with
  async_save_call_s     save() alone: the blocking when the loop computes for at least the
                        staging time before its next wait_for_staging()
  async_total_s         save() until the generation is published
  load_gbps             our restore of a published generation, cold cache: verify every file
                        against the manifest, then dcp.load (verify_s and load_s also given)
  onepass_load_s        the same generation, cold cache, through the one-read verified load
                        (trainer/checkpoint/onepass.py `verified_load`: the parsed files
                        verified first, the shards hashed while DCP loads them)

Targets: sync >= 0.8x raw write and >= 2x stock dcp.save; async
blocking <= 2% of sync; load >= 0.8x raw read. Page-cache eviction uses
posix_fadvise(DONTNEED) on fsynced files, so "cold" reads are real disk reads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import evict, facts_for, median, print_result, state_bytes, training_state  # noqa: E402

from trainer.checkpoint.checkpointer import AsyncCheckpointer, SyncCheckpointer  # noqa: E402
from trainer.checkpoint.commit import RenameCommit  # noqa: E402
from trainer.layout import generation_name  # noqa: E402
from trainer.checkpoint.onepass import verified_load  # noqa: E402
from trainer.checkpoint.snapshot import load_snapshot, stored_entries  # noqa: E402
from trainer.checkpoint.section import LocalSection  # noqa: E402
from trainer.checkpoint.writer import WriterConfig  # noqa: E402

warnings.filterwarnings("ignore")


def tensors_of(state_dict) -> list[torch.Tensor]:
    if isinstance(state_dict, torch.Tensor):
        return [state_dict]
    if isinstance(state_dict, dict):
        return [t for value in state_dict.values() for t in tensors_of(value)]
    if isinstance(state_dict, (list, tuple)):
        return [t for value in state_dict for t in tensors_of(value)]
    return []


def raw_write(tensors: list[torch.Tensor], directory: Path, threads: int) -> float:
    """The disk's ceiling: tensor bytes straight to `threads` files, then fsync each."""
    directory.mkdir(parents=True)
    buckets: list[list[torch.Tensor]] = [[] for _ in range(threads)]
    sizes = [0] * threads
    for tensor in sorted(tensors, key=lambda t: t.numel() * t.element_size(), reverse=True):
        index = sizes.index(min(sizes))
        buckets[index].append(tensor)
        sizes[index] += tensor.numel() * tensor.element_size()

    def write(index: int) -> None:
        fd = os.open(directory / f"raw-{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for tensor in buckets[index]:
                view = memoryview(tensor.contiguous().numpy()).cast("B")
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
            os.fsync(fd)
        finally:
            os.close(fd)

    started = time.perf_counter()
    run_threads(write, threads)
    return time.perf_counter() - started


def raw_read(directory: Path, threads: int) -> float:
    evict(directory)
    files = sorted(directory.iterdir())

    def read(index: int) -> None:
        for path in files[index::threads]:
            buffer = bytearray(path.stat().st_size)
            with open(path, "rb", buffering=0) as handle:
                view, done = memoryview(buffer), 0
                while done < len(buffer):
                    done += handle.readinto(view[done:])

    started = time.perf_counter()
    run_threads(read, threads)
    return time.perf_counter() - started


def run_threads(target, count: int) -> None:
    workers = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def torch_save(state_dict: dict, directory: Path) -> float:
    directory.mkdir(parents=True)
    started = time.perf_counter()
    with open(directory / "state.pt", "wb") as handle:
        torch.save(state_dict, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def dcp_default_save(state_dict: dict, directory: Path) -> float:
    started = time.perf_counter()
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    return time.perf_counter() - started


def sync_save(state, directory: Path, config: WriterConfig) -> float:
    store = LocalSection(directory)
    checkpointer = SyncCheckpointer(RenameCommit(store), "bench", config)
    started = time.perf_counter()
    checkpointer.save(state.state_dict(), facts_for(1))
    return time.perf_counter() - started


def async_saves(state, directory: Path, config: WriterConfig, repeat: int) -> dict:
    """One checkpointer, repeat+1 saves: the first allocates the staging buffers (reported
    apart), the rest reuse them (the steady state a training run sees)."""
    store = LocalSection(directory)
    checkpointer = AsyncCheckpointer(RenameCommit(store), "bench", torch.device("cpu"), config)
    blocking, calls, totals, buffer_bytes = [], [], [], 0
    for step in range(1, repeat + 2):
        state_dict = state.state_dict()
        started = time.perf_counter()
        checkpointer.save(state_dict, facts_for(step))
        called = time.perf_counter()
        checkpointer.wait_for_staging()
        staged = time.perf_counter()
        checkpointer.drain()
        published = time.perf_counter()
        buffer_bytes = checkpointer.stager.buffer_bytes
        blocking.append(staged - started)
        calls.append(called - started)
        totals.append(published - started)
        shutil.rmtree(store.path(generation_name(step)))
    checkpointer.finalize()
    return {"async_first_blocking_s": blocking[0], "async_blocking_s": median(blocking[1:]),
            "async_save_call_s": median(calls[1:]), "async_total_s": median(totals[1:]),
            "staging_buffer_mb": buffer_bytes / (1 << 20)}


def restore(state, directory: Path) -> tuple[float, float]:
    """(verify_s, load_s) of our restore path, from a cold page cache."""
    store = LocalSection(directory)
    name = generation_name(1)
    evict(store.path(name))
    started = time.perf_counter()
    verification = store.verify(name)
    verified = time.perf_counter()
    assert verification.ok, verification.problem
    template = state.template(stored_entries(store.path(name)))
    load_snapshot(template, store.path(name))
    loaded = time.perf_counter()
    return verified - started, loaded - verified


def onepass_restore(state, directory: Path) -> float:
    """Seconds of the one-read verified load, from a cold page cache."""
    path = directory / generation_name(1)
    evict(path)
    started = time.perf_counter()
    verification, _ = verified_load(path, state.template)
    assert verification.ok
    return time.perf_counter() - started


def measure(size_mb: float, repeat: int, threads: int, base: Path) -> dict:
    device = torch.device("cpu")
    state, _ = training_state(size_mb, device)
    state_dict = state.state_dict()
    nbytes = state_bytes(state)
    gb = nbytes / 1e9
    config = WriterConfig(threads=threads)
    tensors = [t for t in tensors_of(state_dict)]
    runs: dict[str, list[float]] = {name: [] for name in
                                    ("raw_write", "raw_read", "torch_save", "dcp_default", "sync", "verify", "load",
                                     "onepass")}
    for index in range(repeat):
        work = base / f"round-{index}"
        runs["raw_write"].append(raw_write(tensors, work / "raw", threads))
        runs["raw_read"].append(raw_read(work / "raw", threads))
        shutil.rmtree(work / "raw")
        runs["torch_save"].append(torch_save(state_dict, work / "torch"))
        shutil.rmtree(work / "torch")
        runs["dcp_default"].append(dcp_default_save(state_dict, work / "dcp"))
        shutil.rmtree(work / "dcp")
        runs["sync"].append(sync_save(state, work / "ours", config))
        verify_s, load_s = restore(state, work / "ours")
        runs["verify"].append(verify_s)
        runs["load"].append(load_s)
        runs["onepass"].append(onepass_restore(state, work / "ours"))
        shutil.rmtree(work)
    result = {"size_mb": round(nbytes / (1 << 20), 1), "bytes": nbytes, "repeat": repeat, "threads": threads,
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "load_average_at_start": round(os.getloadavg()[0], 2)}
    m = {name: median(values) for name, values in runs.items()}
    result.update({
        "raw_write_gbps": gb / m["raw_write"], "raw_read_gbps": gb / m["raw_read"],
        "torch_save_gbps": gb / m["torch_save"], "dcp_default_save_gbps": gb / m["dcp_default"],
        "sync_save_gbps": gb / m["sync"], "sync_save_s": m["sync"],
        "verify_s": m["verify"], "load_s": m["load"], "load_gbps": gb / (m["verify"] + m["load"]),
        "onepass_load_s": m["onepass"], "onepass_load_gbps": gb / m["onepass"],
    })
    result.update(async_saves(state, base / "async", config, repeat))
    # Same-round ratios: a busy moment on a shared machine slows every method of that round,
    # so the median of per-round ratios is steadier than a ratio of medians.
    per_round = {
        "sync_save / raw_write": [w / s for w, s in zip(runs["raw_write"], runs["sync"])],
        "sync_save / dcp_default_save": [d / s for d, s in zip(runs["dcp_default"], runs["sync"])],
        "load / raw_read": [r / (v + l) for r, v, l in zip(runs["raw_read"], runs["verify"], runs["load"])],
        "onepass_load / raw_read": [r / o for r, o in zip(runs["raw_read"], runs["onepass"])],
    }
    result["same_round_ratios"] = {name: round(median(values), 3) for name, values in per_round.items()}
    result["runs_s"] = {name: [round(v, 4) for v in values] for name, values in runs.items()}
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}


def ratios(r: dict) -> list[tuple[str, float, str]]:
    return [
        ("sync_save / raw_write", r["sync_save_gbps"] / r["raw_write_gbps"], ">= 0.8"),
        ("sync_save / dcp_default_save", r["sync_save_gbps"] / r["dcp_default_save_gbps"], ">= 2"),
        ("async_blocking / sync_save", r["async_blocking_s"] / r["sync_save_s"], "<= 0.02"),
        ("async_save_call / sync_save", r["async_save_call_s"] / r["sync_save_s"], "<= 0.02"),
        ("load / raw_read", r["load_gbps"] / r["raw_read_gbps"], ">= 0.8"),
        ("onepass_load / raw_read", r["onepass_load_gbps"] / r["raw_read_gbps"], ">= 0.83 (restore <= 1.2x read)"),
        ("dcp_default_save / raw_write", r["dcp_default_save_gbps"] / r["raw_write_gbps"], "(reference)"),
    ]


def markdown(r: dict) -> str:
    lines = [f"state: {r['size_mb']} MB, median of {r['repeat']}, {r['threads']} writer threads, "
             f"{r['cpu_count']} CPUs (load average {r['load_average_at_start']} at start), torch {r['torch']}", "",
             "| metric | value |", "|---|---|"]
    for key in ("raw_write_gbps", "raw_read_gbps", "torch_save_gbps", "dcp_default_save_gbps", "sync_save_gbps",
                "sync_save_s", "async_first_blocking_s", "async_blocking_s", "async_save_call_s", "async_total_s",
                "verify_s", "load_s", "load_gbps", "onepass_load_s", "onepass_load_gbps"):
        unit = " GB/s" if key.endswith("gbps") else " s"
        lines.append(f"| {key} | {r[key]:.3f}{unit} |")
    lines += ["", "| ratio | of medians | median of same-round | target |", "|---|---|---|---|"]
    for name, value, target in ratios(r):
        same_round = r["same_round_ratios"].get(name)
        lines.append(f"| {name} | {value:.3f} | {'-' if same_round is None else f'{same_round:.3f}'} | {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=WriterConfig().threads, help="writer threads (ours and raw)")
    parser.add_argument("--quick", action="store_true", help="128 MB, 3 repeats: about a minute")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.repeat = 128, 3
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=args.dir))
    try:
        result = measure(args.size_mb, args.repeat, args.threads, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return print_result(markdown(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
