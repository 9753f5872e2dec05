"""A Hugging Face transformers GPT-2, trained on the streaming token shards of stream_lm.py, whose
export loads with `from_pretrained`: the pattern for bringing an HF model.

    python -m trainer --output outputs/gpt2 --workload examples/hf_gpt2.py:HFGPT2 \
        --shard-dir outputs/stream-shards --max-steps 20 --num-workers 2

What it shows: the model built from a `GPT2Config` (no download), its loss from `labels`,
AdamW with a warmup and cosine schedule from `plan(steps)`, clipping in `after_backward`, and
`architecture()` returning `{**model.config.to_dict(), "architectures": ["GPT2LMHeadModel"]}`:
the export directory (model.safetensors + config.json) then loads with
`GPT2LMHeadModel.from_pretrained(export_dir)`. Needs `transformers` (requirements-dev.txt).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from stream_lm import CORPUS, TokenShards, write_shards  # a sibling module, as `python file.py` finds it
from trainer.options import positive_float, positive_int


class HFGPT2:
    @staticmethod
    def add_options(group) -> None:
        group.add_argument("--shard-dir", default="outputs/stream-shards",
                           help="where the token shards are (written from the corpus when absent)")
        group.add_argument("--shards", type=positive_int, default=5)
        group.add_argument("--context", type=positive_int, default=32)
        group.add_argument("--width", type=positive_int, default=32)
        group.add_argument("--layers", type=positive_int, default=1)
        group.add_argument("--lr", type=positive_float, default=3e-3)
        group.add_argument("--warmup-steps", type=positive_int, default=2)

    def __init__(self, options):
        self.options = options
        self.vocabulary = sorted(set(CORPUS.read_text()))
        self.total_steps = 1
        self.config = GPT2Config(vocab_size=len(self.vocabulary), n_positions=options.context, n_embd=options.width,
                                 n_layer=options.layers, n_head=2, bos_token_id=0, eos_token_id=0,
                                 attn_implementation="eager")

    def build_dataset(self) -> TokenShards:
        paths = write_shards(Path(self.options.shard_dir), self.options.shards, self.vocabulary)
        return TokenShards(paths, self.options.context)

    def plan(self, steps) -> None:
        self.total_steps = steps.total

    def build_model(self) -> nn.Module:
        return GPT2LMHeadModel(self.config)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for name, p in model.named_parameters() if p.dim() >= 2]
        rest = [p for name, p in model.named_parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=self.options.lr)

    def build_scheduler(self, optimizer):
        warmup, total = self.options.warmup_steps, self.total_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(input_ids=batch["inputs"], labels=batch["inputs"]).loss

    def after_backward(self, model: nn.Module, optimizer) -> None:
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def architecture(self) -> dict:
        return {**self.config.to_dict(), "architectures": ["GPT2LMHeadModel"]}
