"""What does tier 0 (`--memory-dir`) save on a restart, and what does it cost the loop?

    python bench/memory_tier_bench.py --size-mb 512 --json out.json
    python bench/memory_tier_bench.py --quick          # 64 MB, one round each (the suite's smoke test)

Builds the example model + SGD state at about --size-mb, publishes one generation into tier 0
(a folder under /dev/shm, a memory filesystem) and one onto the disk (--dir, default a folder
under /tmp) with the trainer's own SyncCheckpointer, RenameCommit and LocalSection, then
measures in the same run (each --repeat times, median):

  tier0_restore_s       our restore from tier 0: verify every file against the manifest, then
                        dcp.load into the live state (what `--resume` does from tier 0);
                        _verify_s and _load_s are its two parts
  disk_restore_s        our restore from the local disk tier, cold page cache (the restart of a
                        new process on a node whose cache was dropped, or a new pod), as
                        `--resume` of one process does it: the manifest and `.metadata`
                        verified (_verify_s), then the shards hashed while they load (_load_s,
                        trainer/checkpoint/onepass.py)
  disk_warm_restore_s   the same, warm page cache (a restart soon after the save, same node)
  peer_restore_s        our restore from the peer replica (a replaced node): two processes spawned
                        on loopback (gloo on 127.0.0.1, world size 2). The partner holds the
                        generation published into tier 0 above and sends it as `MemoryTier.fetch`
                        does on the rank that keeps it (`Outgoing`, `exchange`: file by file in
                        chunks of storage/memory/replication.py's CHUNK_BYTES); the replacement, a fresh process
                        with an empty tier 0 (a second folder there) and a live state of the same
                        shape, times in itself the fetch (`exchange`: each chunk written and
                        hashed as it arrives, every file checked against the manifest, renamed
                        into place; the partner's reads included), _fetch_s; then the same
                        restore as tier0_restore_s (_verify_s, _load_s)
  peer_receiver_extra_mb, peer_sender_extra_mb  how far the fetch raised each end's resident set
                        above what it held before (VmHWM, reset through /proc/self/clear_refs just
                        before; the largest of the rounds), against part_mb, the part's size
  tier0_save_s, disk_save_s  one sync save into each
  step_s, step_with_tier0_s  mean step time of the training loop without saves, and with a
                        tier-0 save every --every steps (the loop's overhead of tier 0, sync saves)
  step_with_async_tier0_s   the same with async tier-0 saves (`--checkpoint-mode async`): the
                        trainer's own MemoryDirSaves (trainer/storage/memory/) as the attempt drives
                        it: wait for the staged copy before each step, poll what committed after
                        it, stage on cadence, the write and commit in the background
  tier0_async_blocked_s, tier0_async_save_s  per async tier-0 save: what the loop was held
                        (the save call plus the wait for its staged copy before the next step)
                        and its whole time until committed (mean)
  peak_rss_mb           the process's peak resident set (ru_maxrss); tier 0's pages are shared
                        memory, charged to the pod's memory but not to this RSS

Ratios: tier-0 restore / disk restore (cold and warm), peer restore / tier-0 restore and / cold
disk restore, each end's peak extra memory during a peer fetch / the part, the loop overhead of
tier 0 (sync and async saves), what an async tier-0 save holds the loop against a sync one, and
the async loop overhead against the sync one (on CPU the background write shares the cores with
the loop, so it is more than the time held).

The restart cost R from the object store is measured by bench/store_bench.py (`store_restore_s`,
and "store restore / local restore (time)": the store's fetch + load against the local tier's
verify + load, in the same round), so not here: with this bench it gives R from all four places.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import evict, facts_for, median, print_result, state_bytes, train_step, training_state  # noqa: E402

from trainer.checkpoint.checkpointer import SyncCheckpointer  # noqa: E402
from trainer.checkpoint.commit import RenameCommit  # noqa: E402
from trainer.checkpoint.coordination import SingleProcess  # noqa: E402
from trainer.checkpoint.onepass import load_verified  # noqa: E402
from trainer.checkpoint.section import LocalSection  # noqa: E402
from trainer.checkpoint.snapshot import load_snapshot, stored_entries  # noqa: E402
from trainer.config import MemoryTierConfig  # noqa: E402
from trainer.layout import generation_name  # noqa: E402
from trainer.storage.memory.replication import CHUNK_BYTES, Outgoing, exchange  # noqa: E402
from trainer.storage.memory.tier import MemoryDirTier  # noqa: E402

warnings.filterwarnings("ignore")
SHM = Path("/dev/shm")
PEER_TIMEOUT = datetime.timedelta(minutes=5)
PARTNER, REPLACEMENT = 0, 1


def save(state, section: LocalSection, step: int) -> float:
    checkpointer = SyncCheckpointer(RenameCommit(section), "bench")
    started = time.perf_counter()
    checkpointer.save(state.state_dict(), facts_for(step))
    return time.perf_counter() - started


def restore(state, section: LocalSection, name: str, cold: bool, one_pass: bool) -> tuple[float, float]:
    """(verify_s, load_s) of the trainer's restore path; `cold`: the disk's pages evicted first;
    `one_pass`: the shards hashed while they load (the local disk's path under `--resume`)."""
    if cold:
        evict(section.path(name))
    started = time.perf_counter()
    verification = section.verify(name, shards=not one_pass)
    assert verification.ok, verification.problem
    verified = time.perf_counter()
    template = state.template(stored_entries(section.path(name)))
    if one_pass:
        load_verified(template, section.path(name), verification.manifest.files)
    else:  # a tier-0 part is read by its rank alone (trainer/run/restoring.py), in a process group too
        load_snapshot(template, section.path(name), alone=True)
    return verified - started, time.perf_counter() - verified


def restores(state, section: LocalSection, name: str, cold: bool, repeat: int, prefix: str,
             one_pass: bool = False) -> dict:
    """The median total of `repeat` restores, with the verify and load parts of that one."""
    rounds = sorted((restore(state, section, name, cold, one_pass) for _ in range(repeat)), key=sum)
    verify_s, load_s = rounds[len(rounds) // 2]
    return {f"{prefix}_restore_s": verify_s + load_s, f"{prefix}_verify_s": verify_s, f"{prefix}_load_s": load_s}


@dataclass(frozen=True)
class PeerRun:
    """What the two processes of the peer restore share: the store's port, the partner's
    committed generation, the replacement's (empty) tier 0 and where it writes its rounds."""

    port: int
    held: Path
    replacement: Path
    size_mb: float
    repeat: int
    out: Path


def peer_process(rank: int, run: PeerRun) -> None:
    """One of the two processes on loopback: the partner (rank 0) sends its replica of the
    generation each round, as `MemoryTier.fetch` does on the rank that keeps it (`Outgoing`
    opened at the fetch, then `exchange`); the replacement (rank 1), a fresh process with an empty
    tier 0 and a live state of the same shape, times what its `--resume` does with it."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    store = dist.TCPStore("127.0.0.1", run.port, 2, False, timeout=PEER_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=PEER_TIMEOUT)
    try:
        if rank == PARTNER:
            peaks = []
            for _ in range(run.repeat):
                dist.barrier()
                before = peak_reset()
                with Outgoing(run.held) as outgoing:
                    exchange(dist.group.WORLD, REPLACEMENT, outgoing, None, None)
                peaks.append(peak_extra(before))
            run.out.with_suffix(".sender.json").write_text(json.dumps(peaks))
        else:
            state, _ = training_state(run.size_mb, torch.device("cpu"))
            section = LocalSection(run.replacement / "checkpoints")
            rounds = [peer_restore(state, section, run.held.name) for _ in range(run.repeat)]
            run.out.write_text(json.dumps(rounds))
    finally:
        dist.destroy_process_group()


def peer_restore(state, section: LocalSection, name: str) -> tuple[float, float, float, int]:
    """(fetch_s, verify_s, load_s, peak extra bytes) of one restore from the peer: the part
    received into this rank's tier 0 (`exchange`: written chunk by chunk, hashed on the way,
    every file checked against the generation's manifest, renamed into place), then tier 0's
    restore (`restore`: the verify every restore does, then the load). The peak extra bytes:
    how far the fetch raised this process's resident set above what it held before it."""
    for old in section.names():
        section.remove(old)
    dist.barrier()
    before = peak_reset()
    started = time.perf_counter()
    exchange(dist.group.WORLD, None, None, PARTNER, section)
    fetched = time.perf_counter()
    extra = peak_extra(before)
    verify_s, load_s = restore(state, section, name, False, False)
    return fetched - started, verify_s, load_s, extra


def status_bytes(field: str) -> int:
    """A `/proc/self/status` figure (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_reset() -> int:
    """Start measuring a peak: the resident bytes now, and the peak (VmHWM) reset to them."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def peak_extra(before: int) -> int:
    """How far the resident set peaked above `before` since `peak_reset`."""
    return max(0, status_bytes("VmHWM") - before)


def peer_restores(held: Path, size_mb: float, repeat: int, scratch: Path) -> dict:
    """The median total of `repeat` restores from the peer (two spawned processes, gloo on
    127.0.0.1), with the fetch, verify and load parts of that one, and each end's peak extra memory."""
    scratch.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=PEER_TIMEOUT, wait_for_workers=False)
    run = PeerRun(store.port, held, scratch, size_mb, repeat, scratch / "rounds.json")
    torch.multiprocessing.spawn(peer_process, args=(run,), nprocs=2, join=True)
    measured = json.loads(run.out.read_text())
    rounds = sorted((timings[:3] for timings in measured), key=sum)
    fetch_s, verify_s, load_s = rounds[len(rounds) // 2]
    part = sum(entry.stat().st_size for entry in held.iterdir() if entry.is_file())
    return {"peer_restore_s": fetch_s + verify_s + load_s, "peer_fetch_s": fetch_s, "peer_verify_s": verify_s,
            "peer_load_s": load_s, "part_mb": part / (1 << 20), "chunk_mb": CHUNK_BYTES / (1 << 20),
            "peer_receiver_extra_mb": max(timings[3] for timings in measured) / (1 << 20),
            "peer_sender_extra_mb": max(json.loads(run.out.with_suffix(".sender.json").read_text())) / (1 << 20)}


def loop(state, workload, steps: int, every: int | None, section: LocalSection | None) -> float:
    """Mean seconds per step, with a tier-0 save (pruned to one kept) every `every` steps."""
    device = torch.device("cpu")
    started = time.perf_counter()
    for step in range(1, steps + 1):
        train_step(state, workload, device)
        if every and step % every == 0:
            for old in section.names():
                section.remove(old)
            save(state, section, 1000 + step)
    return (time.perf_counter() - started) / steps


def async_loop(state, workload, steps: int, every: int, memory: Path) -> tuple[float, list, float]:
    """Mean seconds per step with an async tier-0 save every `every` steps (one kept), through
    the trainer's MemorySaves as the attempt calls it; the saves it published; the seconds the
    loop waited for staged copies (on CPU the copy runs on the stager's thread)."""
    device = torch.device("cpu")
    tier = MemoryDirTier(MemoryTierConfig(memory, every_steps=every), None)
    saves = tier.saver("bench", SingleProcess(), "async", device)
    published, waited = [], 0.0
    started = time.perf_counter()
    for step in range(1, steps + 1):
        waited += saves.wait_for_staging()
        train_step(state, workload, device)
        published += saves.completed()
        if step % every == 0:  # the run's fixed cadence (trainer/run/cadence.py memory_policy)
            published += saves.save(state.state_dict(), facts_for(2000 + step))
    elapsed = time.perf_counter() - started
    published += saves.finalize()  # the last write drains outside the timed loop, as in a long run
    for name in tier.own.section.names():
        tier.own.section.remove(name)
    return elapsed / steps, published, waited


def measure(size_mb: float, repeat: int, steps: int, every: int, disk: Path, memory: Path) -> dict:
    state, workload = training_state(size_mb, torch.device("cpu"))
    tier0, local = LocalSection(memory / "checkpoints"), LocalSection(disk / "checkpoints")
    result = {"size_mb": size_mb, "state_mb": state_bytes(state) / (1 << 20), "memory_dir": str(memory),
              "memory_is_tmpfs": memory.is_relative_to(SHM), "disk_dir": str(disk), "steps": steps, "every": every,
              "tier0_save_s": save(state, tier0, 1), "disk_save_s": save(state, local, 1)}
    name = generation_name(1)
    result["generation_mb"] = sum(p.stat().st_size for p in tier0.path(name).iterdir()) / (1 << 20)
    result |= restores(state, tier0, name, False, repeat, "tier0")
    result |= restores(state, local, name, True, repeat, "disk", one_pass=True)
    result |= restores(state, local, name, False, repeat, "disk_warm", one_pass=True)
    replacement = memory / "replacement"
    result |= peer_restores(tier0.path(name), size_mb, repeat, replacement)
    shutil.rmtree(replacement)
    tier0.remove(name)
    loop(state, workload, 2, None, None)  # warm-up
    result["step_s"] = median([loop(state, workload, steps, None, None) for _ in range(repeat)])
    result["step_with_tier0_s"] = median([loop(state, workload, steps, every, tier0) for _ in range(repeat)])
    rounds = [async_loop(state, workload, steps, every, memory) for _ in range(repeat)]
    result["step_with_async_tier0_s"] = median([step_s for step_s, _, _ in rounds])
    published = [generation for _, saved, _ in rounds for generation in saved]
    # what the loop was held per save: the save() call, plus the wait for its staged copy
    result["tier0_async_blocked_s"] = (sum(g.blocked_s for g in published)
                                       + sum(waited for _, _, waited in rounds)) / max(1, len(published))
    result["tier0_async_save_s"] = sum(g.save_s for g in published) / max(1, len(published))
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["ratios"] = {
        "tier-0 restore / cold disk restore (time)": result["tier0_restore_s"] / result["disk_restore_s"],
        "tier-0 restore / warm disk restore (time)": result["tier0_restore_s"] / result["disk_warm_restore_s"],
        "peer restore / tier-0 restore (time)": result["peer_restore_s"] / result["tier0_restore_s"],
        "peer restore / cold disk restore (time)": result["peer_restore_s"] / result["disk_restore_s"],
        f"loop overhead of a tier-0 save every {every} steps": result["step_with_tier0_s"] / result["step_s"] - 1,
        f"loop overhead of an async tier-0 save every {every} steps":
            result["step_with_async_tier0_s"] / result["step_s"] - 1,
        "async tier-0 save: loop held / sync tier-0 save": result["tier0_async_blocked_s"] / result["tier0_save_s"],
        "loop overhead, async tier 0 / sync tier 0": (result["step_with_async_tier0_s"] - result["step_s"])
        / (result["step_with_tier0_s"] - result["step_s"]),
        "peak RSS / state": result["peak_rss_mb"] / result["state_mb"],
        "peer fetch: receiver's peak extra memory / part": result["peer_receiver_extra_mb"] / result["part_mb"],
        "peer fetch: sender's peak extra memory / part": result["peer_sender_extra_mb"] / result["part_mb"],
    }
    return result


def markdown(r: dict) -> str:
    lines = [f"state {r['state_mb']:.0f} MB (generation {r['generation_mb']:.0f} MB); tier 0 in {r['memory_dir']}"
             f"{'' if r['memory_is_tmpfs'] else ' (NOT a memory filesystem)'}, disk in {r['disk_dir']}", "",
             "| measure | value |", "|---|---|"]
    for key in ("tier0_restore_s", "tier0_verify_s", "tier0_load_s", "disk_restore_s", "disk_verify_s", "disk_load_s",
                "disk_warm_restore_s", "peer_restore_s", "peer_fetch_s", "peer_verify_s", "peer_load_s",
                "tier0_save_s", "disk_save_s",
                "step_s", "step_with_tier0_s", "step_with_async_tier0_s", "tier0_async_blocked_s",
                "tier0_async_save_s", "peak_rss_mb", "part_mb", "peer_receiver_extra_mb", "peer_sender_extra_mb"):
        lines.append(f"| {key} | {r[key]:.4f} |")
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {name} | {value:.3f} |" for name, value in r["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="loop steps per round")
    parser.add_argument("--every", type=int, default=5, help="a tier-0 save every N loop steps")
    parser.add_argument("--quick", action="store_true", help="64 MB, one round of each, 10 steps: the suite's smoke test "
                        "(the docs' 64 MB figures: --size-mb 64 --steps 10)")
    parser.add_argument("--dir", type=Path, help="the disk tier's scratch (default: a temporary folder under /tmp)")
    parser.add_argument("--memory-dir", type=Path, help="tier 0's scratch (default: a temporary folder under "
                                                         "/dev/shm, else under --dir)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.repeat, args.steps = 64, 1, 10
    torch.set_num_threads(1)
    disk = Path(tempfile.mkdtemp(prefix="memory-tier-bench-", dir=args.dir))
    memory_base = args.memory_dir or (SHM if SHM.is_dir() else disk)
    memory = Path(tempfile.mkdtemp(prefix="memory-tier-bench-", dir=memory_base))
    try:
        result = measure(args.size_mb, args.repeat, args.steps, args.every, disk, memory)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    print(f"bench/memory_tier_bench.py --size-mb {args.size_mb:g}" + (" (--quick)" if args.quick else ""))
    return print_result(markdown(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
