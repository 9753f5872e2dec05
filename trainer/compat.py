"""Every private API the trainer relies on, in one place, each checked against one version.

Upstream may move or rename a private name in any release. Each use is wrapped here with the
version it was last checked against, and tests/test_compat.py resolves every one of them, so
an upgrade that breaks one fails a fast unit test naming the name and this file, instead of
a save or a restore failing deep in a run. Nothing here is imported at module load: torch
is imported only by the wrappers that need it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from trainer.errors import TrainerError


class PrivateApiMoved(TrainerError):
    """A private name we depend on is gone: the installed version differs from the checked
    one. One line naming the name and this file, never a traceback deep inside a save."""


@dataclass(frozen=True)
class PrivateName:
    module: str
    name: str
    package: str
    checked: str
    """The `package` version this use was checked against."""
    why: str
    listed_in = "trainer/compat.py"
    """The file to update when the name moves (a class attribute, not a field)."""

    def resolve(self):
        try:
            return getattr(importlib.import_module(self.module), self.name)
        except (ImportError, AttributeError):
            raise PrivateApiMoved(
                f"{self.module}.{self.name} is gone ({self.package} {installed_version(self.package)} installed, "
                f"checked against {self.checked}); it is used for {self.why}: update {self.listed_in}") from None


def installed_version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


DCP_STORAGE_INFO = PrivateName(
    "torch.distributed.checkpoint.filesystem", "_StorageInfo", "torch", "2.13.0",
    "recording where each tensor lies in a shard, in the format stock DCP readers expect")
DCP_FLATTEN_STATE_DICT = PrivateName(
    "torch.distributed.checkpoint._nested_dict", "flatten_state_dict", "torch", "2.13.0",
    "naming a state dict's tensors by the flat keys DCP stores them under")
SET_PG_TIMEOUT = PrivateName(
    "torch.distributed.distributed_c10d", "_set_pg_timeout", "torch", "2.13.0",
    "bounding a background gloo group's collectives by the save time measured after it was created")
TORCH_ELEMENT_SIZE = PrivateName(
    "torch._utils", "_element_size", "torch", "2.13.0",
    "the byte size of a dtype when spreading tensors across shard files")
RUN_EXIT_HANDLERS = PrivateName(
    "atexit", "_run_exitfuncs", "python", "3.11",
    "running exit handlers (Polyaxon's event flush) before a multi-process rank's os._exit")
DCP_INIT_OPTIM_STATE = PrivateName(
    "torch.distributed.checkpoint.state_dict", "_init_optim_state", "torch", "2.13.0",
    "materialising lazily created optimizer state (a zero-lr step on zero gradients) before a restore template")
TORCH_SET_DETERMINISTIC = PrivateName(
    "torch._C", "_set_deterministic_algorithms", "torch", "2.13.0",
    "turning deterministic algorithms on without `torch.use_deterministic_algorithms`, which imports "
    "the whole of inductor (0.9 s of every start) only to set its `deterministic` flag")
DCP_SET_ELEMENT = PrivateName(
    "torch.distributed.checkpoint._traverse", "set_element", "torch", "2.13.0",
    "putting a non-tensor value loaded weights-only where DCP's default planner would put it")
COMPILED_ORIGINAL = "_orig_mod"
"""Attribute of `torch.compile`'s wrapper module (`OptimizedModule`, checked against torch
2.13.0) holding the module it compiled; its `state_dict()` prefixes every key with it."""
GROUP_BACKEND = "_get_backend"
"""Method of torch's ProcessGroup (checked against torch 2.13.0) giving the backend object of one
device type (ProcessGroupNCCL for CUDA), whose public `abort()` ends its collectives in progress:
what `torch.distributed.distributed_c10d._abort_process_group` calls, without that function's
clearing of the process-wide group registry (unsafe from a watcher thread)."""
SCHEDULER_LAST_LR = "_last_lr"
"""Attribute of every torch LRScheduler (checked against torch 2.13.0) behind
`get_last_lr()`; it has no public setter."""

RENDEZVOUS_HANDLERS = PrivateName(
    "torch.distributed.rendezvous", "_rendezvous_handlers", "torch", "2.13.0",
    "keying `env://` and `tcp://` by torchrun's restart round (trainer/parallel/rendezvous.py): the public "
    "`register_rendezvous_handler` refuses a scheme already registered")

PRIVATE_NAMES = (DCP_STORAGE_INFO, DCP_FLATTEN_STATE_DICT, TORCH_ELEMENT_SIZE, RUN_EXIT_HANDLERS, DCP_INIT_OPTIM_STATE,
                 TORCH_SET_DETERMINISTIC, DCP_SET_ELEMENT, SET_PG_TIMEOUT, RENDEZVOUS_HANDLERS)
INDUCTOR_DETERMINISTIC_ENV = "TORCHINDUCTOR_DETERMINISTIC"
"""Read by torch._inductor.config at import (checked against torch 2.13.0): "1" makes its
`deterministic` flag True, as `torch.use_deterministic_algorithms(True)` would."""


def storage_info(relative_path: str, offset: int, length: int):
    return DCP_STORAGE_INFO.resolve()(relative_path, offset, length)


def flatten_state_dict(state_dict: dict) -> dict:
    """The state dict's leaves by DCP's flat keys ("model.net.0.weight")."""
    flat, _ = DCP_FLATTEN_STATE_DICT.resolve()(state_dict)
    return flat


def set_element(root: dict, path, value) -> None:
    """Put `value` at `path` (a tuple of keys and indices) inside a nested state dict."""
    DCP_SET_ELEMENT.resolve()(root, path, value)


def set_group_timeout(group, seconds: float) -> None:
    """The timeout of a process group's later collectives (gloo: every context of the group)."""
    from datetime import timedelta

    SET_PG_TIMEOUT.resolve()(timedelta(seconds=seconds), group)


def element_size(dtype) -> int:
    return TORCH_ELEMENT_SIZE.resolve()(dtype)


def init_optimizer_state(optimizer) -> None:
    """DCP's own materialisation: if the optimizer has no state and no gradients, one step
    with zero gradients at learning rate 0, then the gradients are cleared. A no-op once
    state exists."""
    DCP_INIT_OPTIM_STATE.resolve()(optimizer)


def use_deterministic_algorithms(warn_only: bool = False) -> None:
    """What `torch.use_deterministic_algorithms(True, warn_only=warn_only)` does, without
    importing inductor: the ATen flag now, and inductor's flag through its environment variable,
    read if and when a workload compiles (or set directly if inductor is already imported).
    `warn_only` once set (an opt-in: --allow-nondeterministic-ops) stays set for the process."""
    import torch

    import os
    import sys

    os.environ[INDUCTOR_DETERMINISTIC_ENV] = "1"
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True
    TORCH_SET_DETERMINISTIC.resolve()(True, warn_only=warn_only or torch.is_deterministic_algorithms_warn_only_enabled())


class DeviceCommunicator:
    """The training group's CUDA backend (NCCL), as trainer/parallel/silence.py's `Communicator`."""

    def __init__(self, group=None):
        self.group = group

    def abort(self) -> None:
        import torch
        import torch.distributed as dist

        group = self.group or dist.group.WORLD
        if not hasattr(group, GROUP_BACKEND):
            raise PrivateApiMoved(f"ProcessGroup.{GROUP_BACKEND} is gone (torch {installed_version('torch')} "
                                  f"installed, checked against 2.13.0); it is used for aborting NCCL's communicator "
                                  f"when a peer falls silent: update trainer/compat.py")
        getattr(group, GROUP_BACKEND)(torch.device("cuda")).abort()


def run_exit_handlers() -> None:
    RUN_EXIT_HANDLERS.resolve()()


def set_scheduler_last_lr(scheduler, learning_rates: list[float]) -> None:
    """What `get_last_lr()` reports until the scheduler's next step."""
    if not hasattr(scheduler, SCHEDULER_LAST_LR):
        raise PrivateApiMoved(f"{type(scheduler).__name__} has no {SCHEDULER_LAST_LR} (torch "
                              f"{installed_version('torch')} installed, checked against 2.13.0); it is used "
                              f"for an allowed --lr drift: update trainer/compat.py")
    setattr(scheduler, SCHEDULER_LAST_LR, list(learning_rates))


def uncompiled(module):
    """The module `torch.compile` wrapped (sharing its parameters), or `module` itself: its
    state and export keys are the model's own names (`net.0.weight`, not
    `_orig_mod.net.0.weight`), so an export loads into the uncompiled model. Looked up
    without importing torch._dynamo (a compiled model has already imported it)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None or not isinstance(module, dynamo.OptimizedModule):
        return module
    return getattr(module, COMPILED_ORIGINAL)
