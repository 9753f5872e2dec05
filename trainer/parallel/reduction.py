"""Gradient reduction whose bits do not depend on a process's history.

DDP all-reduces gradients in buckets: flat buffers of several parameters' gradients. A ring
all-reduce sums each element in an order set by the element's offset inside its buffer and the
buffer's size (each chunk starts at a different rank), and DDP rebuilds its buckets after a
process's first step, in the order gradients became ready. A resumed process runs its first
step with the initial layout, the uninterrupted run with the rebuilt one. With two ranks a+b ==
b+a, so nothing shows; with three, (a+b)+c != a+(b+c) in floating point, and the resumed run
drifts by rounding from its first step. The order also depends on the world size and on the
backend's algorithm (gloo's ring, NCCL's choice from the topology): 2 ranks prove nothing
about 3, and a resume is exact at the world size and on the hardware it was saved with.

Two exact reductions, both DDP communication hooks (so a user's own DDP model gets one too):

- `FixedBuckets` (`fixed-buckets`, the default) reduces in flat buckets of its own, composed
  once from the model alone (parameters in reverse registration order, so the last layers'
  bucket fills first; a small first bucket, then `FIXED_BUCKET_MB` each, one per dtype and
  device: trainer/config.py), and all-reduces each bucket (divided by the world size first) as
  one collective, in a fixed order, as soon as all of its gradients are there, while backward
  goes on. Every element then has the same place in the same buffer at every step of every
  process: DDP's own layout, and the order in which autograd finishes gradients, change
  nothing but when a bucket is sent. Where DDP's own bucket has the plan's layout (what DDP
  rebuilds for a sequential model) it is sent as it is; elsewhere the price over DDP's own is
  a copy of the gradients in and out.
- `per_parameter_mean` (`per-parameter`, the default before `fixed-buckets`) all-reduces each
  parameter's gradient on its own: an element's order depends only on its own parameter's
  size. One collective per parameter: hundreds a step (bench/reduction_bench.py measures
  both against DDP's own `bucketed`). A run saved with it keeps it (trainer/config.py).

The two sum in different orders, so they give different bits: the reduction is fingerprinted.

FSDP2 needs no hook: it reduce-scatters one flat buffer per layer whose layout is fixed when
the model is sharded, so each element's reduction order is the same in every process of a
given world size.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import FIRST_FIXED_BUCKET_MB, FIXED_BUCKET_MB

FIXED_BUCKETS = "fixed-buckets"
PER_PARAMETER = "per-parameter"
BUCKETED = "bucketed"
REDUCTIONS = (FIXED_BUCKETS, PER_PARAMETER, BUCKETED)
EXACT = (FIXED_BUCKETS, PER_PARAMETER)
"""The reductions this module installs as a DDP communication hook (`install`)."""


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


def bucket_plan(tensors: Sequence[tuple[object, int]], first_bytes: int, cap_bytes: int) -> list[list[int]]:
    """Which tensors share a bucket, from (kind, bytes) per tensor in registration order: the
    indices taken in reverse order (the last layers' gradients are ready first), each into the
    open bucket of its kind (dtype and device: one buffer holds one), which closes once it holds
    `first_bytes` (the kind's first bucket: sent early, as DDP's is) or `cap_bytes` (the others).
    Buckets in the order of their first tensor. Pure: the model alone decides it, never the
    order gradients arrive in or DDP's own layout (which it equals where DDP rebuilt its buckets
    in reverse registration order, as for a sequential model: then no gradient is copied)."""
    buckets: list[list[int]] = []
    filling: dict[object, list] = {}
    """kind -> [its open bucket, the bytes left before it closes]."""
    started: set[object] = set()
    for index in reversed(range(len(tensors))):
        kind, size = tensors[index]
        if kind not in filling:
            buckets.append([])
            filling[kind] = [buckets[-1], cap_bytes if kind in started else first_bytes]
            started.add(kind)
        filling[kind][0].append(index)
        filling[kind][1] -= size
        if filling[kind][1] <= 0:
            del filling[kind]
    return buckets


class _Round:
    """One backward's progress through the buckets (DDP hands its own buckets to the hook in its
    index order, the first at index 0): what each bucket still waits for, what it sends (its own
    buffer, or DDP's bucket where that has the same layout), the collectives launched so far (in
    the plan's order), and DDP's buckets waiting for theirs."""

    def __init__(self, buffers: list[torch.Tensor], members: list[int]):
        self.missing = list(members)
        self.sent = list(buffers)
        self.reduced: list[torch.futures.Future] = []
        self.waiting: list[tuple[list[int], list, dist.GradBucket, torch.futures.Future]] = []


class FixedBuckets:
    """The state of the `fixed_buckets_mean` hook for one DDP model: the plan and its buffers.
    Built from the parameters DDP reduces, in registration order; the same on every rank, so
    the ranks launch the same collectives in the same order."""

    def __init__(self, parameters: Sequence[torch.Tensor], group, first_bytes: int = FIRST_FIXED_BUCKET_MB << 20,
                 cap_bytes: int = FIXED_BUCKET_MB << 20):
        self.group, self.world_size = group, dist.get_world_size(group)
        self.parameters = list(parameters)  # held, so that no other tensor takes an id below
        plan = bucket_plan([((p.dtype, p.device), p.numel() * p.element_size()) for p in self.parameters],
                           first_bytes, cap_bytes)
        self.slots: dict[int, tuple[int, int, int]] = {}
        """id(parameter) -> (bucket, offset, elements)."""
        self.buffers: list[torch.Tensor] = []
        for bucket, members in enumerate(plan):
            offset = 0
            for index in members:
                self.slots[id(self.parameters[index])] = (bucket, offset, self.parameters[index].numel())
                offset += self.parameters[index].numel()
            first = self.parameters[members[0]]
            self.buffers.append(torch.zeros(offset, dtype=first.dtype, device=first.device))
        self.layouts = [[id(self.parameters[index]) for index in members] for members in plan]
        self.devices = sorted({str(buffer.device) for buffer in self.buffers if buffer.device.type == "cuda"})
        """Where a result future's tensors live, for CUDA's stream synchronization (none on CPU)."""
        self.round = _Round(self.buffers, [len(members) for members in plan])

    @classmethod
    def of(cls, model: nn.parallel.DistributedDataParallel, group) -> "FixedBuckets":
        """The plan for what `model` reduces: its module's parameters that need a gradient, but
        those it was told to ignore (`parameters_to_ignore`), as DDP lists them."""
        return cls([parameter for name, parameter in model.module.named_parameters()
                    if parameter.requires_grad and name not in model.parameters_to_ignore], group)

    def view(self, parameter: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        bucket, offset, elements = self.slots[id(parameter)]
        return self.buffers[bucket][offset:offset + elements].view(shape)

    def same_layout(self, bucket: dist.GradBucket) -> int | None:
        """The plan's bucket that DDP's `bucket` equals element for element (the same gradients at
        the same offsets of a buffer of the same size and dtype), so that it can be sent as it is:
        its sum is then the plan's, bit for bit."""
        parameters = bucket.parameters()
        index = self.slots[id(parameters[0])][0]
        buffer, ours = bucket.buffer(), self.buffers[index]
        if [id(p) for p in parameters] != self.layouts[index] or buffer.numel() != ours.numel() \
                or buffer.dtype != ours.dtype or not buffer.is_contiguous():
            return None
        for parameter, gradient in zip(parameters, bucket.gradients()):
            offset = self.slots[id(parameter)][1]
            if not gradient.is_contiguous() or \
                    gradient.data_ptr() - buffer.data_ptr() != offset * buffer.element_size():
                return None
        return index

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's `bucket` is final: send it as it is where its layout is the plan's bucket's,
        else copy its gradients into their slots; send every bucket of the plan that is now
        complete (in the plan's order: the same collectives on every rank), each divided by
        the world size first (a sum of the shares, as DDP's own), and return a future
        of `bucket`'s buffer holding the means, complete once the buckets its gradients went to
        are reduced (perhaps sent by a later call: DDP waits for the results only at the end of
        backward, after its last bucket)."""
        if bucket.index() == 0:
            self.round = _Round(self.buffers, [len(layout) for layout in self.layouts])  # a new backward
        this = self.round
        copies = []
        same = self.same_layout(bucket)
        if same is not None:
            this.sent[same], this.missing[same], needs = bucket.buffer(), 0, {same}
        else:
            copies = list(zip(bucket.parameters(), bucket.gradients()))
            needs = set()
            for parameter, gradient in copies:
                self.view(parameter, gradient.shape).copy_(gradient)
                needs.add(self.slots[id(parameter)][0])
                this.missing[self.slots[id(parameter)][0]] -= 1
        # DDP's last bucket: every gradient is in (a bucket still missing one holds a parameter
        # DDP does not reduce; sent anyway, so that every rank's collectives stay matched).
        while len(this.reduced) < len(self.buffers) and (this.missing[len(this.reduced)] == 0 or bucket.is_last()):
            sent = this.sent[len(this.reduced)].div_(self.world_size)  # before: no pass over it on gloo's thread
            this.reduced.append(dist.all_reduce(sent, group=self.group, async_op=True).get_future())
        result = torch.futures.Future(devices=self.devices)
        this.waiting.append((sorted(needs), copies, bucket, result))
        for waiting in [w for w in this.waiting if w[0][-1] < len(this.reduced)]:
            this.waiting.remove(waiting)
            needs_of, copies_of, of, future = waiting
            this.reduced[needs_of[-1]].then(partial(self._copy_out, [this.reduced[i] for i in needs_of], copies_of,
                                                    of, future))
        return result

    def _copy_out(self, reduced: list[torch.futures.Future], copies: list, bucket: dist.GradBucket,
                  result: torch.futures.Future, _) -> None:
        """Chained from the last of `reduced` (on CUDA its streams are this callback's), waits
        for the others (raising what a collective raised: a lost peer fails the step), and fills
        DDP's bucket with the means (`copies`: none where DDP's bucket was sent itself);
        `result` carries the buffer, or the first collective's error."""
        try:
            torch.futures.wait_all(reduced)
            for parameter, gradient in copies:
                gradient.copy_(self.view(parameter, gradient.shape))
        except BaseException as error:  # noqa: BLE001 (handed to DDP's wait, which raises it)
            result.set_exception(error)
            return
        result.set_result(bucket.buffer())


def fixed_buckets_mean(state: FixedBuckets, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the gradients all-reduced in `state`'s fixed buckets (`FixedBuckets.reduce`)."""
    return state.reduce(bucket)


def install(model: nn.parallel.DistributedDataParallel, reduction: str, group) -> None:
    """Give `model` the exact `reduction` (one of EXACT) as its communication hook. Raises
    RuntimeError where the model has a hook already (DDP allows one)."""
    if reduction == FIXED_BUCKETS:
        model.register_comm_hook(FixedBuckets.of(model, group), fixed_buckets_mean)
    else:
        model.register_comm_hook(group, per_parameter_mean)


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
                                f"use --gradient-reduction {FIXED_BUCKETS} for an exact resume")
    if world_size > 1 and device_type == "cuda":
        return Exactness(True, NCCL_TOPOLOGY)
    return Exactness(True)
