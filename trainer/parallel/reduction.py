"""Gradient reduction whose bits do not depend on a process's history.

DDP all-reduces gradients in buckets: flat buffers of several parameters' gradients. A ring
all-reduce sums each element in an order set by the element's offset inside its buffer (each
chunk starts at a different rank), and DDP rebuilds its buckets after a process's first step,
in the order gradients became ready. A resumed process runs its first step with the initial
layout, the uninterrupted run with the rebuilt one. With two ranks a+b == b+a, so nothing
shows; with three, (a+b)+c != a+(b+c) in floating point, and the resumed run drifts by
rounding from its first step.

`per_parameter_mean` all-reduces each parameter's gradient on its own, inside the bucket DDP
hands it: an element's order then depends only on its own parameter's size and the world
size, never on the bucket layout, so a fresh process reduces exactly as a long-running one.
The bytes moved are those of DDP's own all-reduce; the price is one collective per parameter
instead of per bucket (bench/reduction_bench.py measures it against `bucketed`).

FSDP2 needs no hook: it reduce-scatters one flat buffer per layer whose layout is fixed when
the model is sharded, so each element's reduction order is the same in every process of a
given world size.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.
from dataclasses import dataclass

import torch
import torch.distributed as dist

PER_PARAMETER = "per-parameter"
BUCKETED = "bucketed"
REDUCTIONS = (PER_PARAMETER, BUCKETED)


def per_parameter_mean(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: each gradient of the bucket summed over the ranks on its own
    (in place: they are views into the bucket's buffer), then the buffer divided by the world size.

    The result is chained from one of the collectives' own futures, not from `collect_all`: on
    CUDA that future carries the device and its events, so DDP's use of the buffer waits for
    the division, and `wait_all` makes the division's stream wait for every collective and
    raises the first one that failed (a lost peer must fail the step, not halve a gradient)."""
    buffer = bucket.buffer()
    world_size = dist.get_world_size(group)
    summed = [dist.all_reduce(gradient, group=group, async_op=True).get_future() for gradient in bucket.gradients()]

    def mean(_) -> torch.Tensor:
        torch.futures.wait_all(summed)
        return buffer.div_(world_size)

    return summed[-1].then(mean)


@dataclass(frozen=True)
class Exactness:
    """Whether this configuration resumes bit-exactly, and why not when it does not (said at
    start in one line and kept in the attempt record: it never promises silently)."""

    exact: bool
    reason: str | None = None
    """Why not (when not exact), or on what it rests (when it rests on more than this process)."""

    def as_record(self) -> dict:
        return {"exact": self.exact, **({"reason": self.reason} if self.reason else {})}


NCCL_TOPOLOGY = ("NCCL chooses each collective's algorithm and so its summation order from the machines' topology: "
                 "a resume is exact on the same topology (the same kind and number of nodes and GPUs); "
                 "one on other hardware may differ by rounding, which the exactness witness reports")


def exactness(reduction: str, data_parallel: str, world_size: int, device_type: str = "cpu") -> Exactness:
    if world_size > 2 and data_parallel == "ddp" and reduction == BUCKETED:
        return Exactness(False, f"--gradient-reduction {BUCKETED} with {world_size} processes: DDP rebuilds its "
                                f"gradient buckets after the first step, and a sum of 3 or more ranks depends "
                                f"on each element's place in its bucket, so a resumed run differs by rounding; "
                                f"use --gradient-reduction {PER_PARAMETER} for an exact resume")
    if world_size > 1 and device_type == "cuda":
        return Exactness(True, NCCL_TOPOLOGY)
    return Exactness(True)
