"""Whether a fork of this process could still use CUDA: the warm spare's rule (DESIGN §15), and
the rule of any later spare (a user script's) that forks after imports.

A CUDA context does not survive a fork, and neither does the driver's state after its first
query: `torch.cuda.is_available()` (and `device_count()` where NVML cannot answer) calls
`cudaGetDeviceCount`, which initialises the driver while `torch.cuda.is_initialized()` stays
False. A worker forked from such a process sees no GPU: `--device auto` becomes CPU and the
fingerprint refuses the resume, `--device cuda` ends in exit 2, and every restart fails. Workloads
and the libraries they import commonly ask at import time, so `is_initialized()` alone is no
guard.

`CudaQueries` records every query from the moment it watches (installed before the workload is
imported): the public `torch.cuda.is_available` and `device_count` (torch's own functions call
them through the module, so its internal calls are seen too) and, on a CUDA build, the runtime's
`torch._C._cuda_getDeviceCount` behind both. `fork_refusal` then says why not to fork, from what
was recorded, whether CUDA was initialised, and whether the CUDA driver library is mapped into the
process at all (another library, cupy or numba, initialised it without torch). Conservative on a
CUDA build: a query answered by NVML (PYTORCH_NVML_BASED_CUDA_CHECK=1) also refuses; a cold
start costs seconds, a poisoned fork costs every restart. On a CPU-only build nothing can be
poisoned and nothing refuses.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

QUERIES = ("is_available", "device_count")
"""torch.cuda's public queries that reach the driver."""
RUNTIME_QUERY = "_cuda_getDeviceCount"
"""torch._C's call of `cudaGetDeviceCount` (CUDA builds only, checked against torch 2.13.0)."""
DRIVER_LIBRARY = "libcuda.so"


class CudaQueries:
    """Every CUDA query made while watching (`watch` before the workload is imported, `stop` once
    the fork is decided). Wraps the functions in place: torch's own module-level calls go
    through the wrapper too."""

    def __init__(self):
        self.seen: list[str] = []
        self._replaced: list[tuple[object, str, object]] = []

    def watch(self) -> "CudaQueries":
        import torch

        for module, name, label in ((torch.cuda, query, f"torch.cuda.{query}()") for query in QUERIES):
            self._wrap(module, name, label)
        if hasattr(torch._C, RUNTIME_QUERY):
            self._wrap(torch._C, RUNTIME_QUERY, "cudaGetDeviceCount")
        return self

    def _wrap(self, module, name: str, label: str) -> None:
        original = getattr(module, name)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if label not in self.seen:
                self.seen.append(label)
            return original(*args, **kwargs)

        setattr(module, name, recorded)
        self._replaced.append((module, name, original))

    def stop(self) -> None:
        """Put torch's functions back (a reference taken meanwhile keeps recording, harmlessly)."""
        for module, name, original in reversed(self._replaced):
            setattr(module, name, original)
        self._replaced.clear()


@dataclass(frozen=True)
class CudaState:
    """What a fork of this process would inherit of CUDA."""

    cuda_build: bool
    initialized: bool
    queried: tuple[str, ...]
    driver_loaded: bool

    @classmethod
    def of_this_process(cls, queries: CudaQueries) -> "CudaState":
        torch = sys.modules.get("torch")
        if torch is None:
            return cls(False, False, tuple(queries.seen), driver_mapped())
        return cls(bool(torch.version.cuda) or hasattr(torch._C, RUNTIME_QUERY), torch.cuda.is_initialized(),
                   tuple(queries.seen), driver_mapped())


WORKLOAD = ("the workload was imported", "ask for the device in build_model instead")
"""Where the trainer's spare watched the queries, and what a workload does instead."""
SCRIPT = ("the script's imports were imported (trainer.launch)", "ask in the script's own code: it runs after the fork")
"""The same for a user's script's spare (trainer/launch.py)."""


def fork_refusal(state: CudaState, during: tuple[str, str] = WORKLOAD) -> str | None:
    """Why a fork of a process in `state` could not use CUDA (None: it can). `during`: what was
    being imported while the queries were watched, and what to do instead."""
    if state.initialized:
        return "CUDA is initialised in this process"
    if state.driver_loaded:
        return "the CUDA driver (libcuda) is loaded in this process"
    if state.cuda_build and state.queried:
        return (f"{state.queried[0]} was called while {during[0]} (it starts the CUDA driver, "
                f"which a fork cannot use; {during[1]})")
    return None


def driver_mapped(maps: str | None = None) -> bool:
    """Whether the CUDA driver library is mapped into this process (`maps`: /proc/self/maps's text)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as mapped:
                maps = mapped.read()
        except OSError:
            return False
    return any(line.rstrip().rsplit("/", 1)[-1].startswith(DRIVER_LIBRARY) for line in maps.splitlines())
