"""What does an exact gradient reduction cost? DDP steps per second with DDP's own all-reduce of
its buckets (`bucketed`), with flat buckets of a fixed composition (`fixed-buckets`, the
default) and with each gradient all-reduced on its own (`per-parameter`), all three in the same
run on the same processes, alternating, and each one's ratio to DDP's own; beside them DDP's
own all-reduce as a Python hook (torch's `allreduce_hook`), what any Python hook costs.

    python bench/reduction_bench.py --ranks 3 --size-mb 64 --layers 8 --steps 30
    python bench/reduction_bench.py --quick

`fixed-buckets` sends what DDP's own sends, in as many collectives of about the same size
(trainer/config.py FIXED_BUCKET_MB, DDP's default), overlapping backward as DDP's do: its
price is a copy of the gradients into its buckets and back. `per-parameter` moves the same
bytes in one collective per parameter: its price is latency, paid once per parameter;
`--layers` sets how many parameters share the bytes. On one CPU machine with gloo the ranks
share its cores and its memory bus; on a cluster the figure depends on the interconnect.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.parallel.reduction import BUCKETED, FIXED_BUCKETS, PER_PARAMETER, install  # noqa: E402

TORCH_HOOK = "torch-allreduce-hook"
"""DDP's own all-reduce of its buckets as a Python communication hook (torch's
`default_hooks.allreduce_hook`): what any Python hook costs over none, not exact."""
REDUCTIONS = (BUCKETED, FIXED_BUCKETS, PER_PARAMETER, TORCH_HOOK)
"""DDP's own first: the reference of every ratio."""

BATCH = 16


def model_of(size_mb: float, layers: int) -> nn.Module:
    """`layers` linear layers (2 x layers parameters) holding `size_mb` of weights together."""
    width = max(16, int((size_mb * (1 << 20) / 4 / layers) ** 0.5))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def steps_per_s(model: nn.Module, steps: int) -> float:
    width = model.module[0].in_features
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(BATCH, width)
    model(inputs).square().mean().backward()  # warm-up: DDP rebuilds its buckets here
    optimizer.zero_grad()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    return steps / (time.perf_counter() - started)


def worker(rank: int, ranks: int, port: int, size_mb: float, layers: int, steps: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    rates: dict[str, list[float]] = {reduction: [] for reduction in REDUCTIONS}
    for _ in range(rounds):
        for reduction in REDUCTIONS:
            model = DistributedDataParallel(model_of(size_mb, layers))
            if reduction == TORCH_HOOK:
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            elif reduction != BUCKETED:
                install(model, reduction, None)
            rates[reduction].append(steps_per_s(model, steps))
    if rank == 0:
        Path(out).write_text(json.dumps(rates))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--size-mb", type=float, default=64, help="parameters (and so gradients) per rank")
    parser.add_argument("--layers", type=int, default=8, help="linear layers (each a weight and a bias)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="the reductions alternate this many times")
    parser.add_argument("--quick", action="store_true", help="3 ranks, 4 MB in 4 layers, 10 steps, 2 rounds")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.size_mb, args.layers, args.steps, args.rounds = 3, 4, 4, 10, 2
    with tempfile.TemporaryDirectory(prefix="reduction-bench-", dir=args.dir) as scratch:
        out = Path(scratch) / "rates.json"
        # fork: the ranks start with torch already imported (the parent never joins a group).
        mp.start_processes(worker, (args.ranks, free_port(), args.size_mb, args.layers, args.steps, args.rounds,
                                    str(out)),
                           nprocs=args.ranks, start_method="fork")
        rates = json.loads(out.read_text())
    ratios = {reduction: statistics.median(r / b for r, b in zip(rates[reduction], rates[BUCKETED]))
              for reduction in REDUCTIONS}
    print(f"{args.ranks} ranks on gloo, {args.size_mb:g} MB of gradients in {2 * args.layers} parameters, "
          f"{args.steps} steps x {args.rounds} rounds\n")
    print("| reduction | steps/s (median) | vs bucketed (median of the rounds' ratios) |\n|---|---|---|")
    for reduction in REDUCTIONS:
        print(f"| {reduction} | {statistics.median(rates[reduction]):.2f} | {ratios[reduction]:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"ranks": args.ranks, "size_mb": args.size_mb, "steps": args.steps,
                                         "layers": args.layers, "rates": rates,
                                         "vs_bucketed": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
