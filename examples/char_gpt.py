"""A character-level GPT on examples/data/corpus.txt: a workload brought with --workload,
living outside the trainer package.

    python -m trainer --output outputs/gpt --workload examples/char_gpt.py:CharGPT \
        --batch-size 8 --grad-accum 2 --amp --epochs 4

What it exercises: random block sampling with the global torch RNG inside the dataset (made
exact by the trainer's per-sample seeding), tied input/output embeddings, AdamW with two
weight-decay groups, linear warmup then cosine decay over a fixed number of optimizer steps
(`--gpt-decay-steps`, an option, so it is fingerprinted and --epochs may grow), gradient clipping
in `after_backward`, and bf16 autocast with --amp on CPU.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import nn

from trainer.options import positive_float, positive_int, unit_interval

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class RandomBlocks(torch.utils.data.Dataset):
    """`blocks` samples per epoch, each a random window of the corpus (the offset is drawn
    from the global torch RNG, as training scripts usually do)."""

    def __init__(self, text: str, block_size: int, blocks: int):
        self.vocabulary = sorted(set(text))
        index = {char: i for i, char in enumerate(self.vocabulary)}
        self.tokens = torch.tensor([index[char] for char in text], dtype=torch.int64)
        self.text, self.block_size, self.blocks = text, block_size, blocks

    def __len__(self) -> int:
        return self.blocks

    def __getitem__(self, index: int) -> dict:
        start = int(torch.randint(0, len(self.tokens) - self.block_size - 1, ()))
        window = self.tokens[start:start + self.block_size + 1]
        return {"inputs": window[:-1], "targets": window[1:]}

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.block_size}:{self.blocks}:{self.text}".encode()).hexdigest()


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocabulary: int, block_size: int, width: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.tokens.weight  # tied
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        length = inputs.shape[1]
        x = self.tokens(inputs) + self.positions(torch.arange(length, device=inputs.device))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=inputs.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


class CharGPT:
    @staticmethod
    def add_options(group) -> None:
        group.add_argument("--gpt-block-size", type=positive_int, default=32)
        group.add_argument("--gpt-blocks-per-epoch", type=positive_int, default=32)
        group.add_argument("--gpt-width", type=positive_int, default=32)
        group.add_argument("--gpt-layers", type=positive_int, default=2)
        group.add_argument("--gpt-heads", type=positive_int, default=2)
        group.add_argument("--gpt-dropout", type=unit_interval, default=0.1)
        group.add_argument("--gpt-lr", type=positive_float, default=3e-3)
        group.add_argument("--gpt-weight-decay", type=float, default=0.1)
        group.add_argument("--gpt-warmup-steps", type=int, default=2)
        group.add_argument("--gpt-decay-steps", type=positive_int, default=100,
                           help="optimizer steps of the cosine decay (the LR stays at its floor after)")
        group.add_argument("--gpt-clip", type=positive_float, default=1.0, help="gradient-norm clipping")

    def __init__(self, options):
        self.options = options
        self.text = CORPUS.read_text()

    def build_dataset(self) -> RandomBlocks:
        return RandomBlocks(self.text, self.options.gpt_block_size, self.options.gpt_blocks_per_epoch)

    def build_model(self) -> nn.Module:
        o = self.options
        return TinyGPT(len(set(self.text)), o.gpt_block_size, o.gpt_width, o.gpt_layers, o.gpt_heads, o.gpt_dropout)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.options.gpt_weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=self.options.gpt_lr,
                                 betas=(0.9, 0.95))

    def build_scheduler(self, optimizer: torch.optim.Optimizer):
        warmup, decay = self.options.gpt_warmup_steps, self.options.gpt_decay_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, decay - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["inputs"])
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())

    def after_backward(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.options.gpt_clip)

    def architecture(self) -> dict:
        o = self.options
        return {"architecture": "TinyGPT", "vocabulary": "".join(sorted(set(self.text))),
                "block_size": o.gpt_block_size, "width": o.gpt_width, "layers": o.gpt_layers, "heads": o.gpt_heads,
                "tied": ["head.weight", "tokens.weight"]}
