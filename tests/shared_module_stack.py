"""A model calling one parameterless module at every depth: after the embedding, after each
block and after the norm, as models share a dropout or an activation across depths (T5's
stacks call one ``dropout`` before their first block and after their last)."""

from __future__ import annotations

import torch
import torch.nn as nn


class SharedActivationStack(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.act = nn.GELU()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.act(self.emb(ids))
        for block in self.blocks:
            h = self.act(block(h))
        return self.head(self.act(self.norm(h)))
