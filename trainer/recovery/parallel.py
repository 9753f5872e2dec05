"""The model as a user's script wrapped it under torchrun: DistributedDataParallel or FSDP2.

The state is read from and loaded into the module itself (DDP's `module`, which shares its
parameters; an FSDP2 module is its own, sharded in place), so a generation's keys are the same
at any world size and under either wrapping, as in the trainer's own loop. What the wrapping
changes in the trained bits is part of the run's settings (`data_parallel`,
`gradient_reduction`: fingerprinted, and what the record says of exactness).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import WorkloadConfig
from trainer.parallel.ranks import Ranks
from trainer.parallel.reduction import BUCKETED, EXACT, install


def plain_model(model: nn.Module) -> nn.Module:
    """The module whose state is saved: DDP's wrapped module, else the model itself (Lightning
    wraps its LightningModule once more, in `_forward_module`, before DDP: the keys are the
    LightningModule's, as in one process)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return getattr(inner, "_forward_module", inner)


def data_parallel_settings(model: nn.Module, settings: WorkloadConfig, ranks: Ranks) -> WorkloadConfig:
    """`settings` with the wrapping `model` came in. A DDP model gets the trainer's exact
    gradient reduction, `settings`' own (`fixed-buckets` unless the run resumes a generation
    made with another: trainer/parallel/reduction.py, `Claim.kept`), unless it has a
    communication hook already; then its reduction is the user's, which an exact resume at 3
    or more ranks cannot rest on (the record says so). An FSDP2 model in one process (the
    script's own group of one) is FSDP2 too: its state holds DTensors, gathered whole for the
    export."""
    if not ranks.distributed and not torch.distributed.is_initialized():
        return settings
    from torch.distributed.fsdp import FSDPModule  # only a process group's members pay for importing it

    if isinstance(model, FSDPModule):
        return replace(settings, data_parallel="fsdp")
    if not ranks.distributed or not isinstance(model, DistributedDataParallel):
        return settings
    if settings.gradient_reduction not in EXACT:  # a resume of a generation made with the script's own hook
        return replace(settings, data_parallel="ddp")
    try:
        install(model, settings.gradient_reduction, ranks.group)
    except RuntimeError:  # "can only be called once": the script registered its own
        return replace(settings, data_parallel="ddp", gradient_reduction=BUCKETED)
    return replace(settings, data_parallel="ddp")
