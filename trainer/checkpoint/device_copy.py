"""A restore's way onto the device: load into host memory, then one batch of copies.

DCP fills a template by reading each item into host memory and copying it into the template's
tensor: for a template on a GPU, one blocking host-to-device copy per tensor from pageable
memory, R at a fraction of the link's bandwidth. `DeviceCopies` gives the load a template whose
device tensors are replaced by host buffers (pinned where the device is CUDA, so the copies run
at the link's speed and need no bounce buffer), then copies every buffer to its device tensor
without blocking and waits once per device (`copy_back`), and puts the device tensors back in
place, so the state receives what it would have. Everything else in the template (CPU tensors,
DTensors: DCP places their shards itself, plain values) is left as it is. Without a device
tensor the plan is empty and the load is what it was.
"""

from __future__ import annotations

from typing import Callable

import torch


def staged_on_host(tensor) -> bool:
    """A plain tensor or parameter on an accelerator (a DTensor or a CPU tensor is loaded where it is)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type != "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceCopies:
    """The copy plan of one restore: (container, key, device tensor, host buffer) per staged tensor."""

    def __init__(self, template: dict, wait: Callable[[torch.device], None] = synchronize):
        self.copies: list[tuple[dict | list, object, torch.Tensor, torch.Tensor]] = []
        self.waits = 0
        """How many times the copies were waited for (one per device)."""
        self._wait = wait
        self.template = self._stage(template)
        """What the load fills: `template`'s structure with host buffers for its device tensors."""

    def _stage(self, value):
        if isinstance(value, dict):
            staged = dict(value)
            keys = staged.keys()
        elif isinstance(value, list):
            staged = list(value)
            keys = range(len(staged))
        else:
            return value
        for key in list(keys):
            item = staged[key]
            if staged_on_host(item):
                host = torch.empty(item.shape, dtype=item.dtype, pin_memory=item.device.type == "cuda")
                self.copies.append((staged, key, item, host))
                staged[key] = host
            else:
                staged[key] = self._stage(item)
        return staged

    def copy_back(self) -> dict:
        """Every host buffer into its device tensor (non-blocking), one wait per device; the
        loaded template with the device tensors in place, for the state to take."""
        devices = []
        with torch.no_grad():  # a parameter in the template is filled in place, as DCP would
            for container, key, device_tensor, host in self.copies:
                device_tensor.copy_(host, non_blocking=True)
                container[key] = device_tensor
                if device_tensor.device not in devices:
                    devices.append(device_tensor.device)
        for device in devices:  # the host buffers are freed after this: the copies must have landed
            self._wait(device)
            self.waits += 1
        return self.template
