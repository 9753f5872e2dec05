"""The toy workload as a user who already has a torchdata `StatefulDataLoader` writes it:
`build_dataset` returns the loader (trainer/workload/adapters.py `from_loader`). `--form`
chooses the loader:

- `map`: over the toy's map-style data, `batch_size=6, shuffle=True, num_workers=2` and a
  random, MLM-style masking `collate_fn` (adopted: exact at any worker count);
- `stream`: over the same regression data as a stream (`shards()` and `read(shard, offset)`,
  a torch `IterableDataset` too), with the same collate (adopted);
- `moving`: a map-style dataset whose `stateful()` cursor moves on every fetch
  (tests/workloads/edge_cases.py `CursorStream`) under the loader's 2 workers: refused at start,
  the line naming the loader's num_workers (or --num-workers, when given) as the cause;
- every other form is a loader the trainer cannot make exact, refused in one line:
  `sequential` (shuffle=False), `sampler` (a WeightedRandomSampler), `batch-sampler`,
  `drop-last`, `generator`, `worker-init`, `iterable` (an IterableDataset without the
  streaming protocol).

`--loader-batch-size` sets the loader's batch_size (6; the global batch, split across
processes under torchrun).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, WeightedRandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from edge_cases import CursorStream
from toy import NoisyRegression, ToyWorkload

FORMS = ("map", "stream", "moving", "sequential", "sampler", "batch-sampler", "drop-last", "generator", "worker-init",
         "iterable")
SIZES = (9, 7, 8)
"""The stream's shards: 24 records, unequal."""


def masking_collate(samples: list[dict]) -> dict:
    """Stacks the samples and zeroes a random quarter of the inputs (MLM-style masking):
    randomness in the collate, which the trainer keys by the batch's first position."""
    batch = torch.utils.data.default_collate(samples)
    batch["inputs"] = batch["inputs"] * (torch.rand(batch["inputs"].shape) >= 0.25)
    batch["masked"] = torch.ones(())
    return batch


class RegressionStream(IterableDataset):
    """The toy's regression data in three shards, read from an offset: the streaming protocol."""

    def shards(self) -> list[tuple[str, int]]:
        return [(f"shard-{index}", size) for index, size in enumerate(SIZES)]

    def read(self, shard: tuple[str, int], offset: int):
        index = int(shard[0].removeprefix("shard-"))
        generator = torch.Generator().manual_seed(index)
        for position in range(SIZES[index]):
            inputs = torch.randn(4, generator=generator)
            if position >= offset:
                yield {"inputs": inputs, "target": inputs.sum(dim=0, keepdim=True)}

    def __iter__(self):
        for shard in self.shards():
            yield from self.read(shard, 0)


class Unresumable(IterableDataset):
    def __iter__(self):
        yield from ({"inputs": torch.zeros(4), "target": torch.zeros(1)} for _ in range(24))


class LoaderRegression(ToyWorkload):
    @staticmethod
    def add_options(group) -> None:
        ToyWorkload.add_options(group)
        group.add_argument("--form", choices=FORMS, default="map")
        group.add_argument("--loader-batch-size", type=int, default=6)

    def build_dataset(self):
        data = NoisyRegression(self.options.toy_samples, self.options.features, self.options.seed)
        form = self.options.form
        batch = self.options.loader_batch_size
        settings = {"batch_size": batch, "num_workers": 2, "collate_fn": masking_collate}
        if form == "stream":
            data = RegressionStream()
        elif form == "moving":
            data = CursorStream(self.options.toy_samples, self.options.features, self.options.seed)
            settings["shuffle"], self.moving = True, data
        elif form == "iterable":
            data = Unresumable()
        elif form == "sampler":
            settings["sampler"] = WeightedRandomSampler([1.0] * len(data), len(data))
        elif form == "batch-sampler":
            settings = {"batch_sampler": BatchSampler(RandomSampler(data), batch, False), "num_workers": 2}
        elif form != "sequential":
            settings["shuffle"] = True
            settings.update({"drop-last": {"drop_last": True}, "generator": {"generator": torch.Generator()},
                             "worker-init": {"worker_init_fn": print}}.get(form, {}))
        with warnings.catch_warnings():  # torchdata 0.11 warns about its own use of torch.set_vital
            warnings.simplefilter("ignore")
            return StatefulDataLoader(data, **settings)

    def stateful(self) -> dict:
        moving = getattr(self, "moving", None)
        return {**super().stateful(), **({"stream": moving} if moving is not None else {})}

    def loss(self, model, batch: dict) -> torch.Tensor:
        if "masked" not in batch:
            raise RuntimeError("the loader's collate_fn did not run")
        return super().loss(model, batch)
