"""Tier 0's memory budget: what K generations, their replicas and the staging buffers of async
saves need (`Budget`), from the bytes a state stores (`state_bytes`, with optimizer state not
created yet: `lazy_optimizer_bytes`), against what this rank may use (`node_share`). Pure
arithmetic, besides reading a directory's size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

OVERHEAD_BYTES = 256 * 1024
"""Allowed on top of the state's tensor bytes for a generation's index, manifest and pickled
values, until a saved generation gives its real size."""


@dataclass(frozen=True)
class Budget:
    """What tier 0 needs against what it may use."""

    generation_bytes: int
    keep: int
    staging_bytes: int
    limit_bytes: int
    staging_copies: int = 0
    """Host copies of the state the staging buffers hold (async: the durable saves' and tier 0's)."""
    parts: int = 1
    """Parts kept per generation: this rank's own, and (several nodes) the replica of a peer's."""

    @property
    def needed(self) -> int:
        return self.parts * self.keep * self.generation_bytes + self.staging_bytes

    def line(self) -> str:
        copies = f" ({self.staging_copies} host copies: durable and tier-0 saves stage apart)" \
            if self.staging_copies > 1 else ""
        parts = f"{self.parts} parts (its own and a peer's replica) x " if self.parts > 1 else ""
        return (f"{parts}{self.keep} x {self.generation_bytes} bytes of generations + {self.staging_bytes} bytes of "
                f"staging{copies} = {self.needed} bytes")


def state_bytes(state_dict: dict) -> int:
    """The bytes of every tensor in a (nested) state dict: what a generation of it stores."""
    total = 0
    stack = [state_dict]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif hasattr(value, "untyped_storage") and hasattr(value, "nbytes"):
            total += int(value.nbytes)
    return total


def lazy_optimizer_bytes(optimizers) -> int:
    """Optimizer state not created yet, which `state_bytes` cannot see: most optimizers create
    theirs at the first step (Adam's exp_avg and exp_avg_sq, SGD's momentum buffer). DCP's
    `get_optimizer_state_dict` creates it for the optimizers saved under `optim`; an optimizer
    among the workload's own stateful objects (`stateful()`, saved with its plain `state_dict()`)
    keeps none until it steps. Per parameter without state: `lazy_tensors` of its size."""
    return sum(lazy_tensors(group) * int(parameter.nbytes) for optimizer in optimizers
               for group in optimizer.param_groups for parameter in group["params"] if parameter not in optimizer.state)


def lazy_tensors(group: dict) -> int:
    """Tensors of a parameter's size that an optimizer creates per parameter, from the
    hyperparameters naming the known ones: Adam-like (`betas`: exp_avg and exp_avg_sq, a third
    with `amsgrad`), RMSprop (`alpha`: square_avg, plus momentum and centered buffers), SGD
    (`momentum`: its buffer unless 0); any other: 2, as Adam (conservative for most)."""
    if "betas" in group:
        return 3 if group.get("amsgrad") else 2
    if "alpha" in group:
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    if "momentum" in group:
        return 1 if group["momentum"] else 0
    return 2


def directory_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file()) if path.is_dir() else 0



def node_share(free_bytes: int, processes_on_node: int) -> int:
    """One rank's share of what the memory filesystem has free: every process on the node
    writes its parts there, so each may count only its share of it."""
    return free_bytes // max(1, processes_on_node)

