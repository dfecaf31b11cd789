"""A training step a user's own loop can call, with a plan applied.

Loss convention: the global loss is the mean over the global batch, and gradients equal
those of one process training on the whole batch. Each data-parallel rank takes an equal
slice of the global batch (dim 0), computes the mean loss of its slice, and the engines
average gradients over dp, which is exact for equal slices of a mean loss. The ranks of
one tp group take the same slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from runtime.apply import apply
from runtime.plan import Plan, PlanError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Trainer:
    """Applies ``plan`` to ``model`` (in place) and trains it one step at a time."""

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        loss_fn: LossFn,
        optimizer_factory: OptimizerFactory = _adamw,
        *,
        device_type: str = "cpu",
    ) -> None:
        self.applied = apply(model, plan, device_type=device_type)
        self.plan = plan
        self.module = self.applied.module
        self.loss_fn = loss_fn
        self.optimizer = optimizer_factory(self.module.parameters())
        mesh = self.applied.mesh
        self.dp_rank = mesh.get_local_rank("dp")
        self.dp_size = mesh.size(mesh.mesh_dim_names.index("dp"))

    @property
    def device(self) -> torch.device:
        return self.applied.device

    def shard_batch(self, inputs: tuple, targets: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """This rank's dp slice (dim 0) of a global batch, moved to the device."""
        batch = targets.shape[0]
        if batch % self.dp_size:
            raise PlanError(
                f"global batch of {batch} samples is not divisible by the data-parallel "
                f"degree dp={self.dp_size}; use a multiple of {self.dp_size}"
            )
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.shape[0] != batch:
                raise PlanError(
                    f"inputs[{i}] has {x.shape[0]} samples but targets have {batch}; "
                    "dim 0 must be the batch in every input"
                )
        local = batch // self.dp_size
        lo, hi = self.dp_rank * local, (self.dp_rank + 1) * local

        def cut(x):
            return x[lo:hi].to(self.device) if isinstance(x, torch.Tensor) else x

        return tuple(cut(x) for x in inputs), cut(targets)

    def forward_backward(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward on this rank's local batch; return the global mean loss.

        Every dp rank must hold the same number of samples (``shard_batch`` ensures it).
        """
        loss = self.loss_fn(self.module(*inputs), targets)
        loss.backward()
        # tp ranks of one group hold the same loss, so the world mean is the dp mean.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)
        return global_loss / dist.get_world_size()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, inputs: tuple, targets: torch.Tensor, *, global_batch: bool = True) -> float:
        """One optimizer step; ``global_batch`` says the batch is global and must be sliced."""
        if global_batch:
            inputs, targets = self.shard_batch(inputs, targets)
        loss = self.forward_backward(inputs, targets)
        self.step()
        return loss.item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters, by the user's names, on CPU, on every rank. Collective."""
        out: dict[str, torch.Tensor] = {}
        for name, param in self.applied.model.named_parameters():
            value = param.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[name] = value.cpu().clone()
        return out
