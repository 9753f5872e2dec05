"""Workloads: the part of the trainer a user replaces with their own model and data.

`protocol.Workload` is the interface the loop talks to; `example.ExampleWorkload` (an MLP on
generated data) is the default one.
"""

from __future__ import annotations

from trainer.config import WorkloadConfig
from trainer.workload.protocol import Workload

__all__ = ["Workload", "build_workload"]


def build_workload(config: WorkloadConfig) -> Workload:
    from trainer.workload.example import ExampleWorkload

    return ExampleWorkload(config)
