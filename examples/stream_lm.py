"""A streaming language model on token shards: the usual LLM-pretraining shape, brought with
--workload, living outside the trainer package.

    python -m trainer --output outputs/stream --workload examples/stream_lm.py:StreamLM \
        --lm-shard-dir outputs/stream-shards --max-steps 40 --shuffle-buffer 256 --num-workers 2

The data is a stream, not a map-style dataset: `shards()` names token files on disk with their
record counts (a record is a window of `--lm-context + 1` tokens), and `read(shard, offset)`
yields records from an offset by memory-mapping the file. The trainer owns the rest: the shard
order per epoch, the deterministic shuffle buffer, the split across ranks and DataLoader
workers, and the cursor in every generation, so a kill -9 mid-epoch resumes exactly, with any
--num-workers. The run is counted in optimizer steps (--max-steps); the warmup and cosine
schedule is built from the plan the trainer hands over (`plan(steps)`), not from --epochs.

The shards are written from examples/data/corpus.txt into --lm-shard-dir when absent (a stand-in
for a tokenizer's output: uint16 token files), each with the `.sha256` beside it that a data
pipeline would write, so the fingerprint reads it instead of hashing the shard
(trainer/workload/files.py).

With --lm-shard-url s3://BUCKET/PREFIX the same shards are read from an object store instead
(upload the `tokens-*.bin` files there): ranged GETs of exactly the records each block needs,
no full download per reader, the fingerprint from the objects' sizes and ETags, credentials as
the run directory's and the run's --store-* retries and timeouts (`options.store_config`,
trainer/workload/objects.py):

    python -m trainer --output outputs/stream-s3 --workload examples/stream_lm.py:StreamLM \
        --lm-shard-url s3://datasets/corpus-tokens --max-steps 40 --num-workers 2
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainer.options import positive_float, positive_int
from trainer.workload.files import file_fingerprint
from trainer.workload.objects import ObjectFiles

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def write_shards(folder: Path, shards: int, vocabulary: list[str]) -> list[Path]:
    """The corpus as `shards` uint16 token files of unequal lengths, written once (each by
    an atomic rename, so ranks starting together never read half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    index = {char: i for i, char in enumerate(vocabulary)}
    tokens = np.array([index[char] for char in CORPUS.read_text()], dtype=np.uint16)
    cuts = np.linspace(0, len(tokens), shards + 1).astype(int)
    cuts[1:-1] += np.arange(1, shards) * 97 % 211 - 105  # unequal sizes: shards rarely are
    paths = []
    for number, (start, end) in enumerate(zip(cuts[:-1], cuts[1:])):
        path = folder / f"tokens-{number:03d}.bin"
        if not path.exists():
            data = tokens[start:end].tobytes()
            for target, content in ((path.with_name(path.name + ".sha256"), hashlib.sha256(data).hexdigest() + "\n"),
                                    (path, data)):
                scratch = target.with_name(f".{target.name}.{os.getpid()}")
                scratch.write_bytes(content if isinstance(content, bytes) else content.encode())
                os.replace(scratch, target)
        paths.append(path)
    return paths


class LocalFiles:
    """Token files in a folder, memory-mapped."""

    def __init__(self, paths: list[Path]):
        self.paths = {path.name: path for path in paths}

    def names(self) -> list[str]:
        return sorted(self.paths)

    def size(self, name: str) -> int:
        return self.paths[name].stat().st_size

    def tokens(self, name: str, start: int, end: int) -> np.ndarray:
        return np.memmap(self.paths[name], dtype=np.uint16, mode="r")[start:end]

    def fingerprint(self) -> str:
        return hashlib.sha256("".join(f"{name}={file_fingerprint(self.paths[name])};" for name in self.names())
                              .encode()).hexdigest()


class StoredFiles(ObjectFiles):
    """Token files in an object store, read by ranged GETs."""

    def tokens(self, name: str, start: int, end: int) -> np.ndarray:
        return np.frombuffer(self.read(name, 2 * start, 2 * end), dtype=np.uint16)


class TokenShards:
    """The stream: token files cut into windows of `context + 1` tokens (inputs and targets)."""

    def __init__(self, files: LocalFiles | StoredFiles, context: int):
        self.files, self.context = files, context

    def shards(self) -> list[tuple[str, int]]:
        return [(name, (self.files.size(name) // 2 - 1) // self.context) for name in self.files.names()]

    def read(self, shard: tuple[str, int], offset: int, stop: int | None = None):
        """Records of `shard` from `offset` to `stop` (its end by default): the tokens they
        span, fetched at once (from the store: one ranged GET)."""
        name, records = shard
        stop, context = records if stop is None else stop, self.context
        tokens = self.files.tokens(name, offset * context, stop * context + 1)
        for record in range(stop - offset):
            window = np.asarray(tokens[record * context:(record + 1) * context + 1], dtype=np.int64)
            yield {"inputs": torch.from_numpy(window[:-1]), "targets": torch.from_numpy(window[1:])}

    def fingerprint(self) -> str:
        return self.files.fingerprint()


class TinyLM(nn.Module):
    """Token and position embeddings, a causal convolution and an MLP: small enough for CPU tests."""

    def __init__(self, vocabulary: int, context: int, width: int, dropout: float):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocabulary, width), nn.Embedding(context, width)
        self.mix = nn.Conv1d(width, width, kernel_size=3)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(2 * width, vocabulary))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.tokens(inputs) + self.positions(torch.arange(inputs.shape[1], device=inputs.device))
        mixed = self.mix(nn.functional.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2)  # sees only the past
        return self.mlp(x + mixed)


class StreamLM:
    @staticmethod
    def add_options(group) -> None:
        group.add_argument("--lm-shard-dir", default="outputs/stream-shards",
                           help="where the token shards are (written from the corpus when absent)")
        group.add_argument("--lm-shard-url", default=None, metavar="s3://BUCKET/PREFIX",
                           help="read the token shards (tokens-*.bin) from an object store instead of --lm-shard-dir")
        group.add_argument("--lm-shards", type=positive_int, default=5)
        group.add_argument("--lm-context", type=positive_int, default=32)
        group.add_argument("--lm-width", type=positive_int, default=32)
        group.add_argument("--lm-dropout", type=float, default=0.1)
        group.add_argument("--lm-lr", type=positive_float, default=3e-3)
        group.add_argument("--lm-warmup-steps", type=positive_int, default=4)

    def __init__(self, options):
        self.options = options
        self.vocabulary = sorted(set(CORPUS.read_text()))
        self.total_steps = 1

    def build_dataset(self) -> TokenShards:
        if self.options.lm_shard_url:
            files = StoredFiles(self.options.lm_shard_url, suffix=".bin", config=self.options.store_config)
            return TokenShards(files, self.options.lm_context)
        paths = write_shards(Path(self.options.lm_shard_dir), self.options.lm_shards, self.vocabulary)
        return TokenShards(LocalFiles(paths), self.options.lm_context)

    def plan(self, steps) -> None:
        self.total_steps = steps.total

    def build_model(self) -> nn.Module:
        return TinyLM(len(self.vocabulary), self.options.lm_context, self.options.lm_width, self.options.lm_dropout)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.options.lm_lr, weight_decay=0.01)

    def build_scheduler(self, optimizer):
        warmup, total = self.options.lm_warmup_steps, self.total_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["inputs"])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))

    def after_backward(self, model: nn.Module, optimizer) -> None:
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def architecture(self) -> dict:
        return {"kind": "TinyLM", "vocabulary": len(self.vocabulary), "context": self.options.lm_context,
                "width": self.options.lm_width}
