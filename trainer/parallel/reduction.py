"""Gradient reduction whose bits do not depend on a process's history.

DDP's default all-reduce sums each gradient element in an order set by the element's offset
inside its bucket (a ring all-reduce starts each chunk at a different rank), and DDP rebuilds
its buckets after the first iteration, in the order gradients became ready. A process that
resumes runs its first step with the initial layout, the uninterrupted run with the rebuilt
one. With two ranks a+b == b+a, so nothing shows; with three, (a+b)+c != a+(b+c) in floating
point, and the resumed run drifts by rounding from its first step.

`ordered_mean` makes the sum independent of the layout and of the collective's algorithm:
every rank gathers every rank's bucket and adds them in rank order, element by element, then
divides by the world size. Same inputs, same bits, on gloo and NCCL alike, at any world size.
It moves world_size/2 times the bytes of a ring all-reduce and holds world_size copies of a
bucket while it sums (bench/loop_overhead.py --ranks measures it against `native`).

FSDP2 needs no hook: it reduce-scatters one flat buffer per layer whose layout is fixed when
the model is sharded, so each element's reduction order is the same in every process of a
given world size.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.
from dataclasses import dataclass

import torch
import torch.distributed as dist

ORDERED = "ordered"
NATIVE = "native"
REDUCTIONS = (ORDERED, NATIVE)


def ordered_mean(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the mean of every rank's bucket, summed in rank order."""
    tensor = bucket.buffer()
    world_size = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    gathered = dist.all_gather(parts, tensor, group=group, async_op=True).get_future()

    def mean(_) -> torch.Tensor:
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return tensor.copy_(total.div_(world_size))

    return gathered.then(mean)


@dataclass(frozen=True)
class Exactness:
    """Whether this configuration resumes bit-exactly, and why not when it does not (said at
    start in one line and kept in the attempt record: it never promises silently)."""

    exact: bool
    reason: str | None = None

    def as_record(self) -> dict:
        return {"exact": self.exact, **({"reason": self.reason} if self.reason else {})}


def exactness(reduction: str, data_parallel: str, world_size: int) -> Exactness:
    if world_size > 2 and data_parallel == "ddp" and reduction == NATIVE:
        return Exactness(False, f"--gradient-reduction native with {world_size} processes: DDP rebuilds its "
                                f"gradient buckets after the first step, and a sum of 3 or more ranks depends "
                                f"on each element's place in its bucket, so a resumed run differs by rounding; "
                                f"use --gradient-reduction ordered for an exact resume")
    return Exactness(True)
