"""Run by tests/test_scale_out.py under `torchrun --nproc_per_node 2` (gloo on CPU, FSDP2): with
several ranks, an async save writes the values of the moment it was staged.

Every rank saves generation 1 sync (the reference), then generation 2 async from the same
state with its writes held back; once staging is complete every rank mutates its parameter
shards and optimizer state in place, and only then are the writes let go. Generation 3, saved
sync after the mutation, shows the mutation reached what a save sees. Rank 0 prints one
`isolated N tensors` line, or raises.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

from trainer.checkpoint.checkpointer import AsyncCheckpointer, SyncCheckpointer
from trainer.checkpoint.commit import RenameCommit
from trainer.checkpoint.manifest import GenerationFacts
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.snapshot import load_flat
from trainer.checkpoint.writer import HashingFileSystemWriter
from trainer.config import WorkloadConfig
from trainer.parallel.launch import LaunchEnvironment
from trainer.parallel.ranks import process_group
from trainer.run.state import TrainingState
from trainer.workload import build_workload

CPU = torch.device("cpu")


class HeldWriter(HashingFileSystemWriter):
    def __init__(self, path, gate: threading.Event):
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan, planner):
        assert self.gate.wait(300), "the gate never opened"
        return super().write_data(plan, planner)


class HeldCheckpointer(AsyncCheckpointer):
    def __init__(self, commit, coordinator, gate: threading.Event):
        super().__init__(commit, "async", CPU, coordinator=coordinator)
        self.gate = gate

    def new_writer(self, directory):
        return HeldWriter(directory, self.gate)


def facts(step: int) -> GenerationFacts:
    return GenerationFacts(step, 0, step, {}, (), {}, "test")


def main(root: Path) -> None:
    with process_group(LaunchEnvironment.from_environ(os.environ), CPU) as ranks:
        workload = build_workload(WorkloadConfig())
        torch.manual_seed(0)
        model = workload.build_model()
        sharded = ranks.data_parallel(model, "fsdp")
        optimizer = workload.build_optimizer(model)
        state = TrainingState(model, optimizer, workload.build_scheduler(optimizer),
                              torch.amp.GradScaler("cpu", enabled=False), rank=ranks.rank, world_size=ranks.world_size)
        sharded(torch.randn(8, workload.workload.config.features)).square().mean().backward()
        optimizer.step()  # the momentum buffers exist from here on
        commit = RenameCommit(LocalSection(root / "checkpoints"))
        SyncCheckpointer(commit, "sync", coordinator=ranks).save(state.state_dict(), facts(1))

        gate = threading.Event()
        held = HeldCheckpointer(commit, ranks, gate)
        held.save(state.state_dict(), facts(2))
        held.wait_for_staging()
        live = [*model.parameters(), *(value for per_parameter in optimizer.state.values()
                                       for value in per_parameter.values() if isinstance(value, torch.Tensor))]
        with torch.no_grad():
            for tensor in live:
                tensor.add_(1000.0)
        gate.set()  # the writes start only now, after every mutation
        held.finalize()
        SyncCheckpointer(commit, "sync", coordinator=ranks).save(state.state_dict(), facts(3))
        primary = ranks.is_primary
    if primary:  # outside the process group: loading is then a single process's read
        before, staged, after = (load_flat(root / "checkpoints" / f"step-{step:08d}") for step in (1, 2, 3))
        compared = [key for key in before if key.startswith(("model.", "optim.state."))]
        assert len(compared) >= 6, compared
        for key in compared:
            assert torch.equal(staged[key].view(torch.uint8), before[key].view(torch.uint8)), f"{key} is torn"
            assert not torch.equal(staged[key], after[key]), f"{key} was not mutated"
        print(f"isolated {len(compared)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
