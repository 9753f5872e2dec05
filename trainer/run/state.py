"""What is captured and restored: the complete, deterministic training state.

Only values that two equal trainings share go here (no wall-clock times, hosts or attempt
ids: those live in manifests and attempt records), so equal trainings give equal snapshots.
RNG states are restored last because building the model and optimizer consumes randomness.

Per-rank entries. One process stores its RNG under `rng`, as it always has. In a run of
several processes every rank has its own RNG streams and its own slice of each global batch,
and DCP keeps only one copy of a value that several ranks save under the same key; so each
rank saves its RNG under `rng_by_rank.<rank>`, its data position under `data_by_rank.<rank>`
and a user's loop's own extras (`rank_extras`: a batch fetched ahead from its RNG, a value
only rank 0 computes) under `workload_by_rank.<rank>`, and every other entry (model,
optimizer, progress, ...) is identical on all ranks and stored once. The shared extras
(`workload`: a workload's `stateful()`, a loop's `shared_extras`) are stored once too, and
that copy is rank 0's (trainer/checkpoint/writer.py `RankZeroCopies`). Per-rank extras do
not move to another world size: that restore is refused (`template`). On restore a rank reads its own entries. After an allowed change
of world size, rank r takes the RNG streams stored for rank r if that rank existed (rank 0 of
a single-process generation is its `rng`), keeps its freshly seeded streams otherwise, and
the old ranks' data positions are ignored: the global position decides where each new rank's
slice starts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from trainer import compat, seams
from trainer.errors import CorruptGeneration, UsageError
from trainer.storage.memory.budget import lazy_optimizer_bytes, state_bytes
from trainer.workload import needs_closure

RNG_BY_RANK = "rng_by_rank"
DATA_BY_RANK = "data_by_rank"
WORKLOAD, WORKLOAD_BY_RANK = "workload", "workload_by_rank"
PER_RANK = ("rng", RNG_BY_RANK, DATA_BY_RANK, WORKLOAD_BY_RANK)
"""Top-level keys of per-rank entries: the template takes this rank's, if stored."""
log = logging.getLogger("trainer")


@dataclass
class Progress:
    """Where training stands: optimizer steps done, current epoch, (micro-)batches done in it."""

    global_step: int = 0
    epoch: int = 0
    position: int = 0

    def advance(self, batches: int, batches_per_epoch: int) -> bool:
        """Count one optimizer step over `batches` micro-batches; True when it completed an epoch."""
        self.global_step += 1
        self.position += batches
        if self.position < batches_per_epoch:
            return False
        self.epoch += 1
        self.position = 0
        return True


@dataclass
class History:
    """Per-step metrics, saved so a resumed run's record equals an uninterrupted one."""

    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"loss": torch.tensor(self.loss, dtype=torch.float64),
                "lr": torch.tensor(self.lr, dtype=torch.float64)}

    def load_state_dict(self, stored: dict) -> None:
        self.loss = stored["loss"].tolist()
        self.lr = stored["lr"].tolist()


def capture_rng() -> dict:
    """Every global RNG, as tensors and plain numbers (comparable bit for bit)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return states


def restore_rng(states: dict, skip: frozenset[str] = frozenset()) -> None:
    """Set every global RNG from `states`; `skip` exists only for the test that proves each
    RNG matters (leaving one out must make the resumed run differ)."""
    if "python" not in skip:
        py = states["python"]
        random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    if "numpy" not in skip:
        npy = states["numpy"]
        keys = npy["keys"].numpy().astype(np.uint32)
        np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    if "torch" not in skip:
        torch.set_rng_state(states["torch"])
    if "cuda" not in skip and "cuda" in states:
        torch.cuda.set_rng_state_all([states["cuda"][str(i)] for i in range(len(states["cuda"]))])


def stored_world_size(stored_entries: dict) -> int:
    """How many processes wrote a snapshot: the number of ranks with their own RNG entries
    (a single-process snapshot has none, only `rng`)."""
    ranks = {key.split(".")[1] for key in stored_entries if key.startswith(RNG_BY_RANK + ".")}
    return len(ranks) or 1


def stored_rng_key(stored_entries: dict, rank: int) -> tuple[str, ...] | None:
    """Where this rank's RNG states are in a snapshot, or None if it has none for this rank."""
    candidates = [(RNG_BY_RANK, str(rank))] + ([("rng",)] if rank == 0 else [])
    return next((key for key in candidates if ".".join(key + ("torch",)) in stored_entries), None)


@dataclass
class TrainingState:
    """The Stateful bundle handed to the recovery writer and restored from a generation."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]
    """As `build_optimizer` returned it: one optimizer (stored under `optim`), or several by
    name (each under `optim.<name>`)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | Mapping[str, torch.optim.lr_scheduler.LRScheduler]
    """Likewise: one (`scheduler`) or several by name (`scheduler.<name>`)."""
    scaler: torch.amp.GradScaler
    progress: Progress = field(default_factory=Progress)
    history: History = field(default_factory=History)
    rank: int = 0
    world_size: int = 1
    extras: dict = field(default_factory=dict)
    """The workload's own stateful objects (`Workload.stateful()`), saved under `workload`;
    absent when it has none, so such generations keep their layout."""
    rank_extras: dict = field(default_factory=dict)
    """A user's loop's own stateful objects that each rank keeps its own of (`restore(extras=)`):
    saved under `workload` beside `extras` in one process, under `workload_by_rank.<rank>`
    with several, and restored to the same rank."""
    cursors: dict = field(default_factory=dict)
    """Data cursors derived from the progress, saved under their name and checked against it
    on restore (`stream`: trainer/data/stream.py); none for map-style data."""

    def state_dict(self) -> dict:
        return self._state_dict(lambda optimizer: dcp_state_dict().get_optimizer_state_dict(self.model, optimizer))

    def estimated_bytes(self) -> int:
        """What a generation of this state will store, before the first step: the state as it
        is, each optimizer by its plain `state_dict()`, plus the optimizer state the first step
        creates (`lazy_optimizer_bytes`). Not through DCP's `get_optimizer_state_dict`: it
        creates missing state by taking an optimizer step, which a closure optimizer (LBFGS)
        cannot take there."""
        return state_bytes(self._state_dict(lambda optimizer: optimizer.state_dict())) + \
            lazy_optimizer_bytes(self.optimizers())

    def _state_dict(self, optimizer_state) -> dict:
        return {
            "model": dcp_state_dict().get_model_state_dict(self.model),
            "optim": per_name(self.optimizer, optimizer_state),
            "scheduler": per_name(self.scheduler, lambda scheduler: scheduler.state_dict()),
            "scaler": self.scaler.state_dict(),
            "progress": {"global_step": self.progress.global_step, "epoch": self.progress.epoch,
                         "position": self.progress.position},
            "history": self.history.state_dict(),
            **self._extras_state(),
            **{name: cursor.state(self.progress) for name, cursor in self.cursors.items()},
            **self._per_rank_state(),
        }

    def _extras_state(self) -> dict:
        """`workload` (shared, and one process's own) and `workload_by_rank.<rank>` (several
        processes' own); absent when empty, so such generations keep their layout."""
        tree: dict = {}
        for path, kept in self._extras():
            _nest(tree, path, kept.state_dict())
        return tree

    def _extras(self) -> list[tuple[tuple[str, ...], object]]:
        """Each extra with the path it is saved under."""
        return [((WORKLOAD, name), kept) for name, kept in self.extras.items()] + \
            [(self._own_section() + (name,), kept) for name, kept in self.rank_extras.items()]

    def _own_section(self) -> tuple[str, ...]:
        return (WORKLOAD,) if self.world_size == 1 else (WORKLOAD_BY_RANK, str(self.rank))

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer the state holds: those saved under `optim`, and any among the
        workload's own stateful objects."""
        return [*named(self.optimizer).values(),
                *(kept for _, kept in self._extras() if isinstance(kept, torch.optim.Optimizer))]

    def _per_rank_state(self) -> dict:
        if self.world_size == 1:
            return {"rng": capture_rng()}
        rank = str(self.rank)
        return {DATA_BY_RANK: {rank: self._data_position()}, RNG_BY_RANK: {rank: capture_rng()}}

    def _data_position(self) -> dict:
        """This rank's place in the data: it has consumed its slice of the first `position`
        global batches of `epoch` (every rank moves in lockstep, one global batch per step)."""
        return {"epoch": self.progress.epoch, "position": self.progress.position}

    def template(self, stored_entries: dict) -> dict:
        """A state dict shaped like the stored one, for DCP to load into: model and
        optimizer tensors from the live objects, and history sized from the snapshot's
        metadata. State created during training is prepared in two ways:
        - materialised (a zero-learning-rate step on zero gradients): every optimizer, and
          every optimizer among the workload's extras (a discriminator's, kept in
          `stateful()`); most optimizers create their state lazily;
        - taken from the stored metadata (`lazily_created`): what a closure optimizer
          creates only on real iterations (LBFGS's history), and the entries a declared
          extra lacks (a dict that grows), at their stored shape and type.
        Whatever is still unmatched is refused by the strict check."""
        closure_optimizers = {name for name, optimizer in named(self.optimizer).items() if needs_closure(optimizer)}
        for optimizer in self.optimizers():
            materialise(optimizer)
        template = self.state_dict()
        for name in closure_optimizers:
            section = ("optim", name) if name else ("optim",)
            lazily_created(template, section, stored_entries, compat.set_element)
        self.refuse_own_extras_elsewhere(template, stored_entries)
        for path, _ in self._extras():
            _nest(template, path, _copy_dicts(_at(template, path)))
            lazily_created(template, path, stored_entries, _nest)
        for name in template["history"]:
            size = stored_entries[f"history.{name}"].size
            template["history"][name] = torch.empty(size, dtype=torch.float64)
        for key in ("rng", RNG_BY_RANK, DATA_BY_RANK):
            template.pop(key, None)
        rng_key = stored_rng_key(stored_entries, self.rank)
        if rng_key is not None:
            rng = capture_rng()
            if ".".join(rng_key + ("cuda", "0")) not in stored_entries:
                rng.pop("cuda", None)
            _nest(template, rng_key, rng)
        if self.world_size > 1 and stored_world_size(stored_entries) == self.world_size:
            _nest(template, (DATA_BY_RANK, str(self.rank)), self._data_position())
        return template

    def refuse_own_extras_elsewhere(self, template: dict, stored_entries: dict) -> None:
        """Each rank's own extras belong to that rank: a generation saved at another world size
        holds none under this rank's path (`workload` in one process, `workload_by_rank.<rank>`
        with several), and no rule says whose a new rank should take (one line, exit 2)."""
        own = [".".join(self._own_section() + (name,)) for name in self.rank_extras]
        flat = compat.flatten_state_dict(template)
        missing = [path for path in own if any(key.startswith(path + ".") for key in flat) and
                   not any(key.startswith(path + ".") for key in stored_entries)]
        if missing:
            saved_by = stored_world_size(stored_entries)
            raise UsageError(f"the extras {', '.join(repr(path.rsplit('.', 1)[1]) for path in missing)} are kept per "
                             f"rank, and this generation was saved by {saved_by} processes, not {self.world_size}: "
                             f"resume at {saved_by} processes, or pass the extras that are the same on every rank "
                             f"as restore(shared_extras=...) (rank 0's copy goes to every rank)")

    def unread_by_design(self, stored_key: str) -> bool:
        """Per-rank entries the template did not take: other ranks' RNG streams and data
        positions, a CUDA RNG on a machine without CUDA (see the module docstring)."""
        return stored_key.split(".", 1)[0] in PER_RANK

    def load_state_dict(self, stored: dict) -> None:
        dcp = dcp_state_dict()
        dcp.set_model_state_dict(self.model, stored["model"])
        for name, optimizer in named(self.optimizer).items():
            # LBFGS keeps its state under its first parameter only, which DCP's own strict
            # check reads as missing state: ours (`refuse_unmatched_keys`) already matched every key.
            dcp.set_optimizer_state_dict(self.model, optimizer, stored_part(stored["optim"], self.optimizer, name),
                                         options=dcp.StateDictOptions(strict=not needs_closure(optimizer)))
        for name, scheduler in named(self.scheduler).items():
            scheduler.load_state_dict(stored_part(stored["scheduler"], self.scheduler, name))
        if stored["scaler"]:  # empty when AMP is off
            self.scaler.load_state_dict(stored["scaler"])
        self.progress = Progress(**stored["progress"])
        self.history.load_state_dict(stored["history"])
        for name, cursor in self.cursors.items():
            cursor.check(stored[name], self.progress)
        for path, kept in self._extras():
            kept.load_state_dict(_at(stored, path))
        position = stored.get(DATA_BY_RANK, {}).get(str(self.rank))
        if position is not None and position != self._data_position():
            raise CorruptGeneration(f"rank {self.rank}'s stored data position {position} disagrees with the "
                                    f"global progress {self._data_position()}; restore an earlier generation")
        rng = stored.get("rng", stored.get(RNG_BY_RANK, {}).get(str(self.rank)))
        if rng is None:
            log.warning("no RNG state stored for rank %d (the generation was written by fewer processes); "
                        "it continues from its fresh per-rank seed", self.rank)
            return
        restore_rng(rng, seams.skip_rng_restore())  # last: everything above may consume randomness


def dcp_state_dict():
    """DCP's state-dict helpers (they see through FSDP2's sharded parameters), imported by the
    first save or restore: importing DCP costs about 0.7 s, which importing the package (and
    `from trainer import recovery`) must not pay (docs/development.md, start-up)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def named(built) -> dict:
    """What `build_optimizer` or `build_scheduler` returned, by name: several as given, one
    under the empty name."""
    return dict(built) if isinstance(built, Mapping) else {"": built}


def per_name(built, state_of) -> dict:
    """The state of one object, or `{name: state}` of several: a single optimizer keeps the
    layout generations have always had (`optim.state...`)."""
    if isinstance(built, Mapping):
        return {name: state_of(each) for name, each in built.items()}
    return state_of(built)


def stored_part(stored: dict, built, name: str) -> dict:
    return stored[name] if isinstance(built, Mapping) else stored


def materialise(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily created state without changing a parameter: DCP's
    zero-learning-rate step on zero gradients, or for one that needs a closure the same
    step through a closure returning a zero loss (DCP's would call it without one)."""
    if not needs_closure(optimizer):
        compat.init_optimizer_state(optimizer)
        return
    if optimizer.state:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step(lambda: torch.zeros(()))
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def lazily_created(template: dict, section: tuple, stored_entries: dict, put) -> None:
    """Add to `template` every stored entry under `section` it lacks: a tensor at its stored
    shape and type, any other value as a placeholder DCP replaces, at the path it was saved
    from (DCP's planner data). `put` places it: `compat.set_element` where an integer is a
    list index (an optimizer's state by parameter name), `_nest` where every level is a dict
    (a workload's extra)."""
    flat = compat.flatten_state_dict(template)
    prefix = ".".join(section) + "."
    paths = getattr(stored_entries, "paths", {})
    for key, entry in stored_entries.items():
        if not key.startswith(prefix) or key in flat:
            continue
        value = torch.empty(tuple(entry.size), dtype=entry.properties.dtype) if hasattr(entry, "size") else 0
        put(template, tuple(paths.get(key, key.split("."))), value)  # a plain dict: split at dots


def _copy_dicts(tree):
    return {key: _copy_dicts(value) for key, value in tree.items()} if isinstance(tree, dict) else tree


def _at(tree: dict, key: tuple[str, ...]):
    for part in key:
        tree = tree[part]
    return tree


def _nest(tree: dict, key: tuple[str, ...], value) -> None:
    for part in key[:-1]:
        tree = tree.setdefault(part, {})
    tree[key[-1]] = value
