"""What makes a living rank's heartbeat late? The longest gap between two of its beats, as the
other ranks see them in the store, while this process's main thread does what can hold the beat
back, against the silence bound (`--peer-silence-secs`) that would name the rank frozen.

    python bench/heartbeat_bench.py            # each case about 10 s
    python bench/heartbeat_bench.py --quick    # each case about 1 s (for CI)

Cases (the main thread; the beat runs on its own thread, as in training):
  idle           nothing: the baseline, the machine's own scheduling delay
  torch          matrix products on every thread (torch releases the GIL: only the CPU is shared)
  gil-call       one C call that holds the GIL throughout (`list.sort` of millions of floats)
  fork           os.fork() of this process with --fork-mb of memory touched (a DataLoader worker
                 of a big process), the child exiting at once
  python         pure Python work (the interpreter hands the GIL over every 5 ms)

It reports, per case, the longest gap between beats, the longest single stall of the main
thread's work item, and the gap as a share of the silence bound. Run it on a loaded machine:
a gap near the bound is what would name a living rank frozen.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import print_result  # noqa: E402
from trainer.config import PeerWaitConfig  # noqa: E402
from trainer.parallel.heartbeat import Heartbeat  # noqa: E402
from trainer.parallel.launch import LaunchEnvironment  # noqa: E402


def work(case: str, seconds: float, fork_mb: int) -> float:
    """Run `case` for about `seconds`; the longest single item (one call, one fork)."""
    if case == "fork":
        ballast = bytearray(fork_mb << 20)
        for offset in range(0, len(ballast), 4096):
            ballast[offset] = 1  # touched: the fork copies its page tables
    floats = [random.random() for _ in range(3_000_000)] if case == "gil-call" else None
    matrix = torch.randn(512, 512) if case == "torch" else None
    longest, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        if case == "idle":
            time.sleep(0.05)
        elif case == "torch":
            matrix @ matrix
        elif case == "gil-call":
            sorted(floats)
        elif case == "fork":
            child = os.fork()
            if child == 0:
                os._exit(0)
            os.waitpid(child, 0)
        elif case == "python":
            sum(i * i for i in range(200_000))
        longest = max(longest, time.monotonic() - began)
    return longest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a second per case (for CI)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per case (default 10)")
    parser.add_argument("--fork-mb", type=int, default=2048, help="memory touched before each fork (default 2048)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dir", type=Path, help="unused (every benchmark takes it)")
    args = parser.parse_args()
    seconds, fork_mb = (1.0, 256) if args.quick else (args.seconds, args.fork_mb)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    silence_s = PeerWaitConfig().silence_s
    load = os.getloadavg()[0]
    rows = ["| case | longest beat gap s | longest work item s | gap / silence bound |", "|---|---|---|---|"]
    cases = {}
    for case in ("idle", "torch", "gil-call", "fork", "python"):
        beat = Heartbeat(LaunchEnvironment(0, 2, master_addr="127.0.0.1", master_port=store.port)).start()
        longest = work(case, seconds, fork_mb)
        beat.stop(left=False)
        gap = beat.longest_gap_s
        cases[case] = {"gap_s": round(gap, 3), "longest_item_s": round(longest, 3), "share": round(gap / silence_s, 3)}
        rows.append(f"| {case} | {gap:.3f} | {longest:.3f} | {gap / silence_s:.3f} |")
    rows.append(f"\nsilence bound {silence_s:g} s; load average {load:.2f} at the start; {os.cpu_count()} CPUs")
    return print_result("\n".join(rows), {"silence_s": silence_s, "load": load, "cases": cases}, args.json)


if __name__ == "__main__":
    sys.exit(main())
