"""The toy's regression data as a Hugging Face `datasets.IterableDataset` of 3 generator shards,
brought through the adapter (trainer/workload/adapters.py `HFStream`). `--form` chooses what
`build_dataset` returns: `adapted` (the stream), `shuffled` (the adapter over HF's buffered
shuffle: refused), `raw` (the HF dataset itself: refused, naming the adapter), `loader` (a
torchdata StatefulDataLoader over it: refused, naming HFStream), `loader-adapted` (that
loader built over the HFStream: adopted, its 2 workers included).
"""

from __future__ import annotations

import warnings

import datasets
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from toy import ToyWorkload
from trainer.workload.adapters import HFStream

SHARDS = (0, 1, 2)
SIZES = (9, 7, 8)  # 24 records, unequal shards


def rows(shards):
    for shard in shards:
        generator = torch.Generator().manual_seed(shard)
        for _ in range(SIZES[shard]):
            inputs = torch.randn(4, generator=generator)
            yield {"inputs": inputs.tolist(), "target": [float(inputs.sum())]}


class HFRegression(ToyWorkload):
    @staticmethod
    def add_options(group) -> None:
        ToyWorkload.add_options(group)
        group.add_argument("--form", choices=("adapted", "shuffled", "raw", "loader", "loader-adapted"),
                           default="adapted")

    def build_dataset(self):
        dataset = datasets.IterableDataset.from_generator(rows, gen_kwargs={"shards": list(SHARDS)})
        dataset = dataset.with_format("torch")
        if self.options.form == "shuffled":
            return HFStream(dataset.shuffle(seed=0, buffer_size=8), spec="hf_stream.py:HFRegression")
        if self.options.form == "raw":
            return dataset
        if self.options.form == "loader":
            with warnings.catch_warnings():  # torchdata 0.11 warns about its own use of torch.set_vital
                warnings.simplefilter("ignore")
                return StatefulDataLoader(dataset, batch_size=6, num_workers=2)
        stream = HFStream(dataset, records=SIZES, fingerprint="toy-regression-v1")
        if self.options.form == "loader-adapted":  # the fix the `loader` form's refusal names
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return StatefulDataLoader(stream, batch_size=6, num_workers=2)
        return stream
