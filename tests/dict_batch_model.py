"""A model written the way Hugging Face models are called: ``model(**batch)`` with a dict
batch of token ids, an attention mask over padding and labels, returning its own loss.

Each sample is classified from the mean of its unpadded positions' features, so the loss
is the mean over samples (cross-entropy), which data-parallel slicing keeps exact.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class DictBatchClassifier(nn.Module):
    """``forward(input_ids, attention_mask, labels=None)`` -> ``{"logits", "loss"}``
    (``loss`` only with labels), like a Hugging Face sequence classifier."""

    def __init__(self, vocab: int = 32, dim: int = 16, n_layer: int = 2, classes: int = 4,
                 *, return_logits: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layer))
        self.head = nn.Linear(dim, classes)
        self.return_logits = return_logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        mask = attention_mask.to(h.dtype).unsqueeze(-1)
        logits = self.head((h * mask).sum(1) / mask.sum(1))
        out = {"logits": logits} if self.return_logits else {}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def make_batch(batch: int, seq: int, *, vocab: int = 32, classes: int = 4,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, a mask with each sample's padding at its end (lengths 1..seq), labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    return {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=g),
        "attention_mask": (torch.arange(seq) < lengths[:, None]).long(),
        "labels": torch.randint(0, classes, (batch,), generator=g),
    }
