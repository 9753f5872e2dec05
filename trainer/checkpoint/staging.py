"""Staging for async recovery writes: a private host copy of the state, taken off the loop.

`dcp.async_save` writes whatever `stage()` returns while training goes on, so the staged copy
must not share memory with anything the loop mutates (a shared tensor gives a torn
checkpoint: half old step, half new). This stager implements DCP's `AsyncStager` protocol.

Why not DCP's `DefaultStager` (read on torch 2.13): its CUDA path copies on a side stream
without first waiting for the compute stream, so a copy can overtake an optimizer step that
is still queued on the GPU; and its buffer cache is keyed by the *source storage object*,
so a tensor re-created between saves gets a new pinned buffer each time. Here:

* buffers are keyed by the tensor's path in the state dict and reused while its shape and
  dtype stay the same (pinned on CUDA, allocated once; plain memory on CPU);
* on CUDA the copies are queued on a side stream that first waits for the current stream,
  `non_blocking`, and finish when a CUDA event fires: the loop is blocked only while the
  copies are queued;
* on CPU (no pinning, no non-blocking copy there) one background thread does the copies,
  overlapping them with whatever the loop does before `wait_for_staging()`.

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
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from trainer import seams


class ReusableStager:
    """`AsyncStager` for `dcp.async_save`: `stage()` returns a Future of the staged copy."""

    # Staging completion is awaited explicitly through the Future (wait_for_staging), not
    # by async_save calling synchronize_staging().
    should_synchronize_after_execute = False

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recovery-staging")
        self._stream = torch.cuda.Stream(device) if self.pinned else None
        self.last_staging_s: float | None = None
        """Seconds from stage() to the staged copy being complete (for the manifest)."""
        self.staged: Future | None = None
        """The last stage()'s Future: the staged copy (valid until the next stage())."""

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The staging buffers currently held (pinned on CUDA)."""
        return tuple(self._buffers.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state_dict: dict) -> Future:
        started = time.monotonic()
        host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        device_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._mirror(state_dict, (), host_copies, device_copies)
        event = None
        if device_copies:
            # Order the copies after everything already queued on the compute stream
            # (the optimizer step that produced these values).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for source, target in device_copies:
                    target.copy_(source, non_blocking=True)
                    # The caching allocator must not hand `source` to another tensor
                    # before the side stream has read it.
                    source.record_stream(self._stream)
                event = torch.cuda.Event()
                event.record(self._stream)

        def complete() -> dict:
            for source, target in host_copies:
                target.copy_(source)
            if event is not None:
                event.synchronize()
            self.last_staging_s = time.monotonic() - started
            seams.crash_point("after-staging")
            return staged

        self.staged = self._worker.submit(complete)
        return self.staged

    def _mirror(self, value, path: tuple, host_copies: list, device_copies: list):
        """The state dict with every tensor replaced by its staging buffer (copies are only
        listed here, not done) and every other value deep-copied."""
        from torch.distributed.tensor import DTensor  # 0.7 s the first time: imported by a save, not at start-up

        if isinstance(value, DTensor):
            local = self._mirror(value._local_tensor, path, host_copies, device_copies)
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            target = self._buffer(path, value)
            (device_copies if value.device.type == "cuda" else host_copies).append((value.detach(), target))
            return target
        if isinstance(value, dict):
            return {key: self._mirror(inner, path + (key,), host_copies, device_copies)
                    for key, inner in value.items()}
        if isinstance(value, (list, tuple)):
            mirrored = [self._mirror(inner, path + (index,), host_copies, device_copies)
                        for index, inner in enumerate(value)]
            if isinstance(value, list):
                return mirrored
            return type(value)(*mirrored) if hasattr(value, "_fields") else tuple(mirrored)
        return copy.deepcopy(value)

    def _buffer(self, path: tuple, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pinned)
            self._buffers[path] = buffer
        return buffer

    def synchronize_staging(self) -> None:
        """Part of the AsyncStager protocol; completion is awaited through the Future."""

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._buffers.clear()
