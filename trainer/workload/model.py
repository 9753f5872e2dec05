"""The example model: an MLP with dropout (dropout draws from the global torch RNG)."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    def __init__(self, features: int, hidden_size: int, layers: int, classes: int, dropout: float):
        super().__init__()
        blocks: list[nn.Module] = []
        width = features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden_size), nn.GELU(), nn.Dropout(dropout)]
            width = hidden_size
        blocks.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*blocks)

    def forward(self, inputs):
        return self.net(inputs)
