"""Workload mistakes and edge cases a new user hits (issue #24), as variants of the toy:

- `--case foreign-tensor`: the optimizer holds a tensor that is not a model parameter (refused
  before the first step, exit 2: it could never be saved);
- `--case uncovered`: a model parameter the optimizer does not cover (legal: trained state
  is saved and resumed exactly);
- `--case lazy-extra`: a `stateful()` tensor that gets its shape at the first step (refused
  at restore, naming the extra and the fix);
- `--case raising-factory`: the factory refuses its options with a ValueError (exit 2);
- `--case optimizer-list`, `shared-parameter`, `lbfgs`: optimizers the trainer cannot step or
  save (a list, a parameter in two of them, a closure optimizer without `train_step`): refused
  before the first step, exit 2 (issue #29);
- `--case compiled`: the model through `torch.compile` (the eager backend: no C++ build).

`TorchOnlyClaimed`: a dataset that declares it draws from torch's global RNG alone and draws
from NumPy's and Python's too (refused at start, exit 2, naming the declaration to write).

`ClosureStep` is the LBFGS case done right: its own `train_step` hands the closure over.
"""

from __future__ import annotations

import torch

from toy import NoisyRegression, ToyWorkload  # a sibling module: a workload given by path finds it, as `python file.py` would


class LazyAverage:
    """An average of the weights allocated at the first update: the wrong way to keep extra state."""

    def __init__(self):
        self.average = torch.zeros(0)

    def update(self, model) -> None:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        self.average = weights.clone() if self.average.numel() == 0 else 0.9 * self.average + 0.1 * weights

    def state_dict(self) -> dict:
        return {"average": self.average}

    def load_state_dict(self, state: dict) -> None:
        self.average.copy_(state["average"])


class EdgeCase(ToyWorkload):
    CASES = ("foreign-tensor", "uncovered", "lazy-extra", "raising-factory", "optimizer-list", "shared-parameter",
             "lbfgs", "compiled")

    @staticmethod
    def add_options(group) -> None:
        ToyWorkload.add_options(group)
        group.add_argument("--case", choices=EdgeCase.CASES, default="uncovered")

    def __init__(self, options):
        if options.case == "raising-factory":
            raise ValueError(f"bad --width {options.width}: this case always refuses")
        super().__init__(options)
        self.lazy = LazyAverage()

    def build_optimizer(self, model):
        parameters = list(model.parameters())
        if self.options.case == "foreign-tensor":
            temperature = torch.ones(1, requires_grad=True)  # trained, but not part of the model
            return torch.optim.SGD([*parameters, temperature], lr=self.options.toy_lr, momentum=0.9)
        if self.options.case == "uncovered":
            return torch.optim.SGD(parameters[:2], lr=self.options.toy_lr, momentum=0.9)  # the head stays fixed
        if self.options.case == "optimizer-list":
            return [torch.optim.SGD(parameters[:2], lr=0.1), torch.optim.SGD(parameters[2:], lr=0.1)]
        if self.options.case == "shared-parameter":
            return {"body": torch.optim.SGD(parameters, lr=0.1), "head": torch.optim.SGD(parameters[2:], lr=0.1)}
        if self.options.case == "lbfgs":
            return torch.optim.LBFGS(parameters, lr=0.1, max_iter=2)
        return super().build_optimizer(model)

    def build_model(self):
        model = super().build_model()
        return torch.compile(model, backend="eager") if self.options.case == "compiled" else model

    def after_step(self, model, optimizer) -> None:
        super().after_step(model, optimizer)
        if self.options.case == "lazy-extra":
            self.lazy.update(model)

    def stateful(self) -> dict:
        extras = super().stateful()
        if self.options.case == "lazy-extra":
            extras["average"] = self.lazy
        return extras


class ClosureStep(EdgeCase):
    """LBFGS through the workload's own step: the closure re-evaluates the whole window."""

    def __init__(self, options):
        options.case = "lbfgs"
        super().__init__(options)

    def train_step(self, model, optimizer, batches, step) -> torch.Tensor:
        def closure():
            optimizer.zero_grad()
            total = 0.0
            for batch in batches:
                with step.autocast():
                    loss = self.loss(model, batch)
                step.backward(loss)
                total = total + loss.detach() / len(batches)
            return total
        return step.step(optimizer, closure)


class CursorStream(torch.utils.data.Dataset):
    """The workaround users write for a stream (issue #29): a map-style dataset that ignores
    its index and returns the next row, its cursor returned by stateful()."""

    def __init__(self, samples: int, features: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(samples, features, generator=generator)
        self.cursor = torch.zeros((), dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict:
        row = self.inputs[int(self.cursor) % len(self.inputs)]
        self.cursor += 1
        return {"inputs": row, "target": row.sum(dim=0, keepdim=True)}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor.copy_(state["cursor"])


class StreamInDataset(ToyWorkload):
    def build_dataset(self):
        self.stream = CursorStream(self.options.toy_samples, self.options.features, self.options.seed)
        return self.stream

    def stateful(self) -> dict:
        return {**super().stateful(), "stream": self.stream}


class Planned(ToyWorkload):
    """Warmup then cosine over the run's optimizer steps, told by `plan` (no --total-steps of
    its own, no reading of --epochs)."""

    def plan(self, steps) -> None:
        self.steps = steps

    def build_scheduler(self, optimizer):
        total, warmup = self.steps.total, max(1, self.steps.total // 4)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup, total))

    def architecture(self) -> dict:
        return {**super().architecture(), "steps_per_epoch": self.steps.per_epoch, "total_steps": self.steps.total}


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    import math

    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


class MaskingRows(torch.utils.data.Dataset):
    """Rows with an MLM-style collator: `collate` masks random positions with the global RNG."""

    def __init__(self, samples: int, features: int, seed: int):
        self.inputs = torch.randn(samples, features, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.inputs[index]

    def collate(self, rows: list) -> dict:
        batch = torch.stack(rows)
        masked = torch.rand(batch.shape) < 0.3
        return {"inputs": batch.masked_fill(masked, 0.0), "target": batch.sum(dim=1, keepdim=True)}


class MaskedCollate(ToyWorkload):
    def build_dataset(self):
        return MaskingRows(self.options.toy_samples, self.options.features, self.options.seed)


class ShardStream(torch.utils.data.IterableDataset):
    """What a user writes first for streamed shards: an IterableDataset without a length."""

    def __iter__(self):
        for index in range(32):
            yield {"inputs": torch.full((4,), float(index)), "target": torch.ones(1)}


class NotAStream(ToyWorkload):
    """An IterableDataset that is not the streaming protocol (no shards(), no read()): refused in one line."""

    def build_dataset(self):
        return ShardStream()


class TorchOnlyClaimed(ToyWorkload):
    def build_dataset(self):
        dataset = NoisyRegression(self.options.toy_samples, self.options.features, self.options.seed)
        dataset.draws_from_global_rngs = ("torch",)  # its jitter draws from all three
        return dataset
