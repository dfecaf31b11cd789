"""The single-process reference that distributed runs are compared with."""

from __future__ import annotations

import torch

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
