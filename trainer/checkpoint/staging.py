"""Staging for async recovery writes: a private host copy of the state, taken off the loop.

`dcp.async_save` writes whatever `stage()` returns while training goes on, so the staged copy
must not share memory with anything the loop mutates (a shared tensor gives a torn
checkpoint: half old step, half new). This stager implements DCP's `AsyncStager` protocol.

Why not DCP's `DefaultStager` (read on torch 2.13): its CUDA path copies on a side stream
without first waiting for the compute stream, so a copy can overtake an optimizer step that
is still queued on the GPU; and its buffer cache is keyed by the *source storage object*,
so a tensor re-created between saves gets a new pinned buffer each time. Here:

* buffers are keyed by the tensor's path in the state dict, sized exactly to it (no pool
  that rounds up to a power of two), reused while its shape and dtype stay the same, and
  allocated (and on CUDA pinned, `cudaHostRegister`) on the stager's thread, not the loop's;
* what only an optimizer step changes (`defer`: the parameters and the optimizer's state) is
  copied beside the loop's next forward and backward, and only that optimizer step waits for
  it (`fence`); the rest (buffers a forward updates, RNG states, an EMA) is small and copied
  before `stage()` returns (on CUDA: queued, and the compute stream waits for it on the
  device, the host does not);
* on CUDA the copies are queued `non_blocking` on a side stream per device that first waits
  for that device's current stream, and each device's copies end in an event recorded on
  that device (a library user's model may live on `cuda:1`): the loop is blocked only while
  the copies are queued;
* on CPU (no pinning, no non-blocking copy there) the stager's thread does the copies.

* a DTensor (FSDP2's sharded parameters and optimizer state) is staged as its local shard
  only, into a buffer of the shard's size, and handed to DCP as a DTensor with the same
  sharding spec around that buffer: DCP writes each rank's shard as it would from the live
  tensor, and nothing is gathered.

The buffers are reused, so a new staging may start only after the write of the previous one
finished; `AsyncCheckpointer` guarantees that (one write in flight).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

import torch

from trainer import seams
from trainer.errors import ChangedWhileStaged


class DeviceCopies(Protocol):
    """Copies from accelerator memory into host buffers, per device (`CudaCopies`)."""

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        """Where `tensor` lives (its own device, whatever the run's is)."""

    def ready(self, device: torch.device):
        """An event recorded on `device`'s current stream: what copies queued later wait for."""

    def queue(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]], after):
        """Queue `(source, target)` copies of tensors on `device`, after the `ready` event
        `after`; returns an event (`synchronize()`) recorded on `device` after them."""

    def fence(self, device: torch.device, event) -> None:
        """What `device` runs from now on waits for `event` (on the device: the host goes on)."""

    def pin(self, buffer: torch.Tensor) -> bool:
        """Page-lock `buffer` (exactly its size) for DMA; False where the system refuses (a
        low `ulimit -l`): the copies into it still complete, without overlapping the host."""

    def unpin(self, buffer: torch.Tensor) -> None:
        """Undo `pin`."""


class CudaCopies:
    """`DeviceCopies` on CUDA: one side stream per device."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device

    def ready(self, device: torch.device):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def queue(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]], after):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        # Ordered after everything queued on the loop's stream up to `stage()` (the optimizer
        # step that produced these values), even when the stager's thread queues them.
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            for source, target in pairs:
                target.copy_(source, non_blocking=True)
                # The caching allocator must not hand `source` to another tensor before the
                # side stream has read it.
                source.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def fence(self, device: torch.device, event) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    def pin(self, buffer: torch.Tensor) -> bool:
        # cudaHostRegister pins exactly these pages; pin_memory=True would take a block of the
        # caching host allocator, rounded up to a power of two and never given back. Portable:
        # pinned for every device's context, not only the stager's thread's current one.
        if not buffer.numel():
            return False
        cudart = torch.cuda.cudart()
        portable = 1  # cudaHostRegisterPortable
        return cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(),
                                       portable) == cudart.cudaError.success

    def unpin(self, buffer: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def by_device(pairs: Iterable[tuple[torch.device, torch.Tensor, torch.Tensor]]) -> dict[torch.device, list]:
    """`(device, source, target)` copies from a device, grouped by the source's own device."""
    groups: dict[torch.device, list] = {}
    for device, source, target in pairs:
        if device.type != "cpu":
            groups.setdefault(device, []).append((source, target))
    return groups


class _Plan:
    """One `stage()`: the copies still to make, and the staged copy's shape."""

    def __init__(self):
        self.now: list[tuple[torch.device, torch.Tensor, torch.Tensor]] = []
        """(device, source, target) copied before `stage()` returns (or queued, from a device;
        targets allocated on the loop's thread)."""
        self.later: list[tuple[torch.device, tuple, torch.Tensor]] = []
        """(device, path, source) copied beside the loop: the targets allocated on the stager's thread."""
        self.loads: list[int] = []
        """Bytes of the replicas each rank stages (`ReusableStager.defer`'s share)."""


class ReusableStager:
    """`AsyncStager` for `dcp.async_save`: `stage()` returns a Future of the staged copy."""

    # Staging completion is awaited explicitly through the Future (wait_for_staging), not
    # by async_save calling synchronize_staging().
    should_synchronize_after_execute = False

    def __init__(self, device: torch.device, copies: Callable[[], DeviceCopies] = CudaCopies):
        self.device = device
        self.pinned = device.type == "cuda"
        self.copies = copies()
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pinned: list[torch.Tensor] = []
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recovery-staging")
        self._late: frozenset[int] | None = None
        """Set by `defer`: what only an optimizer step changes. Until then every copy is made
        on the stager's thread, and the loop waits for all of them before it changes anything."""
        self._share = (0, 1)
        self._fences: Future | None = None
        self._versions: list = []
        self.torn: ChangedWhileStaged | None = None
        """Set (for good) once a deferred tensor changed before its copy was safe: the save it
        belongs to is never committed (`AsyncCheckpointer`), and the loop hears of it."""
        self.last_staging_s: float | None = None
        """Seconds from stage() to the staged copy being complete (for the manifest)."""
        self.staged: Future | None = None
        """The last stage()'s Future: the staged copy (valid until the next stage())."""

    def defer(self, tensors: Iterable[torch.Tensor], share: tuple[int, int] = (0, 1)) -> None:
        """`tensors` change only in an optimizer step, which calls `fence()` first: their copies
        may go on beside the loop's forward and backward. Every other tensor is copied (or
        queued, on a device) before `stage()` returns.

        `share` (rank, world size): `tensors` are replicas, the same on every rank (DDP's
        parameters and optimizer state). Each one held in a dict is then staged by one rank only,
        the least loaded so far in the state dict's order (DCP's own rule for replicated items,
        `dedup_save_plans`), and left out of the other ranks' staged copies, so each rank stages
        and writes about 1/N of them; every rank computes the same assignment."""
        self._late = frozenset(_storage(tensor) for tensor in tensors) or None
        self._share = share

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The staging buffers currently held (pinned on CUDA)."""
        return tuple(self._buffers.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state_dict: dict) -> Future:
        started = time.monotonic()
        plan = _Plan()
        plan.loads = [0] * self._share[1]
        skeleton = self._mirror(state_dict, (), plan)
        # An in-place change bumps a tensor's version (a state dict's tensors share the live
        # ones' counters): what a deferred copy must find unchanged until it is safe.
        versions = [(device, source, source._version) for device, _, source in plan.later]
        devices = {device for device, *_ in [*plan.now, *plan.later] if device.type != "cpu"}
        ready = {device: self.copies.ready(device) for device in devices}
        now_events = {device: self.copies.queue(device, pairs, ready[device])
                      for device, pairs in by_device(plan.now).items()}
        for device, event in now_events.items():
            self.copies.fence(device, event)  # a forward that updates a buffer runs after its copy
        for device, source, target in plan.now:
            if device.type == "cpu":
                target.copy_(source)
        fences: Future = Future()
        self._fences, self._versions = fences, versions

        def complete() -> dict:
            try:
                staged, device_later = self._copy_later(skeleton, plan)
                self._unchanged(versions, host=True)  # the host copies are complete: a later change is harmless
                later_events = {device: self.copies.queue(device, pairs, ready[device])
                                for device, pairs in device_later.items()}
            except BaseException as error:
                fences.set_exception(error)
                raise
            fences.set_result(later_events)
            for event in [*now_events.values(), *later_events.values()]:
                event.synchronize()
            self.last_staging_s = time.monotonic() - started
            seams.crash_point("after-staging")
            return staged

        self.staged = self._worker.submit(complete)
        return self.staged

    def fence(self) -> None:
        """Before an optimizer step changes what `defer` named: the host copies are done, and
        each device's next work waits for its copies on the device (the host does not)."""
        fences = self._fences
        if fences is None:
            return
        events = fences.result()  # the host copies, and the device copies queued
        self._unchanged(self._versions, host=False)  # queued on the device before this fence: a race
        for device, event in events.items():
            self.copies.fence(device, event)
        # Once per staging: the optimizer step changes the deferred tensors right after it.
        self._fences, self._versions = None, []

    def _unchanged(self, versions: list, host: bool) -> None:
        """Raise `ChangedWhileStaged` (and keep it in `torn`) if a deferred tensor of the
        host's (or of a device's) was changed in place since `stage()`."""
        for device, source, version in versions:
            if (device.type == "cpu") == host and source._version != version:
                self.torn = self.torn or ChangedWhileStaged(
                    f"a parameter or optimizer state ({tuple(source.shape)}, {source.dtype}) was changed in place "
                    f"between a save and the next optimizer step, while the save was copying it; change them only "
                    f"in optimizer.step() (swap an EMA in for evaluation before run.step(), or after the next "
                    f"optimizer step), or save with checkpoint_mode=\"sync\"")
                raise self.torn

    def _copy_later(self, skeleton, plan: _Plan) -> tuple[dict, dict]:
        """On the stager's thread: the deferred buffers (allocated, pinned), host copies made,
        device copies listed by device; the staged copy."""
        targets = {path: self._buffer(path, source) for _, path, source in plan.later}
        for device, path, source in plan.later:
            if device.type == "cpu":
                targets[path].copy_(source)
        return _fill(skeleton, targets), by_device((device, source, targets[path])
                                                    for device, path, source in plan.later)

    def _staged_here(self, source: torch.Tensor, plan: _Plan, in_dict: bool) -> bool:
        """Whether this rank stages the replica `source` (a dict's value: a list keeps its places)."""
        rank, world_size = self._share
        if world_size == 1 or self._late is None or not in_dict:
            return True
        chosen = plan.loads.index(min(plan.loads))
        plan.loads[chosen] += max(1, source.numel() * source.element_size())
        return chosen == rank

    def _mirror(self, value, path: tuple, plan: _Plan, in_dict: bool = False):
        """The state dict with every tensor replaced by its staging buffer, or by a `_Later`
        placeholder for a copy made on the stager's thread, and every other value deep-copied."""
        from torch.distributed.tensor import DTensor  # 0.7 s the first time: imported by a save, not at start-up

        if isinstance(value, DTensor):
            local = self._mirror(value._local_tensor, path, plan)  # a shard: never left to another rank
            return _LaterDTensor(local, value._spec) if isinstance(local, _Later) else \
                DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            source = value.detach()
            device = self.copies.device_of(source)
            if self._late is None or _storage(source) in self._late:
                if not self._staged_here(source, plan, in_dict):
                    return _ELSEWHERE
                plan.later.append((device, path, source))
                return _Later(path)
            target = self._buffer(path, source)
            plan.now.append((device, source, target))
            return target
        if isinstance(value, dict):
            mirrored = {key: self._mirror(inner, path + (key,), plan, in_dict=True) for key, inner in value.items()}
            return {key: inner for key, inner in mirrored.items() if inner is not _ELSEWHERE}
        if isinstance(value, (list, tuple)):
            mirrored = [self._mirror(inner, path + (index,), plan) for index, inner in enumerate(value)]
            if isinstance(value, list):
                return mirrored
            return type(value)(*mirrored) if hasattr(value, "_fields") else tuple(mirrored)
        return copy.deepcopy(value)

    def _buffer(self, path: tuple, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            self._release(buffer)
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu")
            if self.pinned and self.copies.pin(buffer):
                self._pinned.append(buffer)
            self._buffers[path] = buffer
        return buffer

    def _release(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None and any(buffer is pinned for pinned in self._pinned):
            self._pinned = [pinned for pinned in self._pinned if pinned is not buffer]
            self.copies.unpin(buffer)

    def synchronize_staging(self) -> None:
        """Part of the AsyncStager protocol; completion is awaited through the Future."""

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        for buffer in self._pinned:
            self.copies.unpin(buffer)
        self._pinned.clear()
        self._buffers.clear()


def _storage(tensor: torch.Tensor) -> int:
    """Identifies a tensor's memory (a state dict's tensors are views of the live ones; a
    DTensor's is its local shard's)."""
    return getattr(tensor, "_local_tensor", tensor).untyped_storage().data_ptr()


_ELSEWHERE = object()
"""A replica another rank stages (`ReusableStager.defer`): left out of this rank's copy."""


class _Later:
    """A tensor of the staged copy that the stager's thread fills in (`_fill`)."""

    def __init__(self, path: tuple):
        self.path = path


class _LaterDTensor(_Later):
    def __init__(self, local: _Later, spec):
        super().__init__(local.path)
        self.spec = spec


def _fill(value, targets: dict):
    """`value` with every `_Later` replaced by its buffer."""
    if isinstance(value, _LaterDTensor):
        from torch.distributed.tensor import DTensor

        return DTensor(targets[value.path], value.spec, requires_grad=False)
    if isinstance(value, _Later):
        return targets[value.path]
    if isinstance(value, dict):
        return {key: _fill(inner, targets) for key, inner in value.items()}
    if isinstance(value, list):
        return [_fill(inner, targets) for inner in value]
    if isinstance(value, tuple):
        filled = [_fill(inner, targets) for inner in value]
        return type(value)(*filled) if hasattr(value, "_fields") else tuple(filled)
    return value
