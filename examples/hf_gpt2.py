"""A Hugging Face transformers GPT-2, trained on the streaming token shards of stream_lm.py, whose
export loads with `from_pretrained`: the pattern for bringing an HF model.

    python -m trainer --output outputs/gpt2 --workload examples/hf_gpt2.py:HFGPT2 \
        --lm-shard-dir outputs/stream-shards --max-steps 20 --num-workers 2

What it shows: the model built from a `GPT2Config` (no download), its loss from `labels`,
AdamW with two weight-decay groups; the data, the warmup and cosine schedule from
`plan(steps)` and the clipping are stream_lm.py's (this workload extends it); and
`architecture()` returning `{**model.config.to_dict(), "architectures": ["GPT2LMHeadModel"]}`:
the export directory (model.safetensors + config.json) then loads with
`GPT2LMHeadModel.from_pretrained(export_dir)`. Needs `transformers` (requirements-dev.txt).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from stream_lm import StreamLM  # a sibling module, as `python file.py` finds it
from trainer.options import positive_int


class HFGPT2(StreamLM):
    @staticmethod
    def add_options(group) -> None:
        StreamLM.add_options(group)
        group.add_argument("--lm-layers", type=positive_int, default=1)

    def __init__(self, options):
        super().__init__(options)
        dropout = options.lm_dropout
        self.config = GPT2Config(vocab_size=len(self.vocabulary), n_positions=options.lm_context,
                                 n_embd=options.lm_width, n_layer=options.lm_layers, n_head=2, resid_pdrop=dropout,
                                 embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                                 attn_implementation="eager")

    def build_model(self) -> nn.Module:
        return GPT2LMHeadModel(self.config)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = [parameter for parameter in model.parameters() if parameter.dim() >= 2]
        rest = [parameter for parameter in model.parameters() if parameter.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=self.options.lm_lr)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(input_ids=batch["inputs"], labels=batch["inputs"]).loss

    def architecture(self) -> dict:
        return {**self.config.to_dict(), "architectures": ["GPT2LMHeadModel"]}
