"""What many tests share: the single-process reference training loop, and a small
Hugging Face model built from a config (random init, no downloads)."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from autopar.zoo import get_model


def single_process_losses(name: str, *, steps: int, seed: int = 0) -> list[float]:
    """What `autopar run` trains, on one process: the seeded model, AdamW(lr=1e-3), the
    model's default global batch with batch seeds seed + 1 + step."""
    spec = get_model(name)
    model = spec.build(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        (x,), y = spec.make_batch(spec.default_batch, seed=seed + 1 + step)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def hf_gpt2(use_cache: bool = False) -> nn.Module:
    """A 2-layer Hugging Face GPT-2 (fused qkv Conv1D), seeded."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                  n_positions=64, use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)

