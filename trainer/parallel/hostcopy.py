"""Values a step computed on the device, brought to the host without making the loop wait.

A `.item()` or `.tolist()` of a tensor the step just produced waits for every kernel queued
before it: on a GPU the CPU stops queueing the next step's work until the device drains. The
per-step values (the loss, the witness's checksum, the step's agreement) are instead copied
into pinned host memory on a side stream with `non_blocking=True`, an event marking when the
copy landed, and read one step later: by then the copy is done, or waiting for it waits for
that copy alone, never for the step queued since. On a CPU the tensor is already on the host
and is read as it is (pinning needs CUDA).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Landed(Protocol):
    def values(self) -> list:
        """The tensor's values (a flat list), waiting for its copy (and its collective) only."""


class OnHost:
    """A host tensor, read when asked; `work`: the async collective that writes it, waited then."""

    def __init__(self, tensor: torch.Tensor, work=None):
        self.tensor, self.work = tensor, work

    def values(self) -> list:
        if self.work is not None:
            self.work.wait()
        return self.tensor.reshape(-1).tolist()


class Pinned:
    """A device tensor's copy in pinned host memory and the event that marks it landed."""

    def __init__(self, host: torch.Tensor, landed: torch.cuda.Event):
        self.host, self.landed = host, landed

    def values(self) -> list:
        self.landed.synchronize()
        return self.host.reshape(-1).tolist()


class HostCopier:
    """Copies per-step tensors of one device to the host in the background (`copy`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        """A side stream per CUDA device copied from, made at its first copy (not at start:
        nothing here touches CUDA before the loop does)."""

    def copy(self, tensor: torch.Tensor, work=None) -> Landed:
        """`tensor`'s values, to be read later; `work` (an async collective writing `tensor`)
        is waited on the side stream, so the compute stream never waits for it."""
        if tensor.device.type != "cuda":
            return OnHost(tensor, work)
        stream = self.streams.get(tensor.device) or self.streams.setdefault(tensor.device,
                                                                            torch.cuda.Stream(tensor.device))
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the values are computed first
        with torch.cuda.stream(stream):
            if work is not None:
                work.wait()  # makes the side stream (the current one here) wait for the collective
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # the allocator keeps it until the copy ran
            landed = torch.cuda.Event()
            landed.record(stream)
        return Pinned(host, landed)
