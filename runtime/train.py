"""A training step a user's own loop can call, with a plan applied.

Loss convention: the global loss is the mean over the global batch, and gradients equal
those of one process training on the whole batch. Each data-parallel rank takes an equal
slice of the global batch (dim 0), computes the mean loss of its slice, and the engines
average gradients over dp, which is exact for equal slices of a mean loss. The ranks of
one tp group take the same slice.

Context parallelism (``mesh.cp > 1``): the cp ranks of a dp replica take the same samples
and split every sequence (dim 1 of each input and of the targets) into their zigzag
chunks (``runtime.context_parallel``); the model gets the local tokens' positions through
its position-ids argument, and its ``F.scaled_dot_product_attention`` calls run as ring
attention during forward and backward. Each rank's loss is the mean over its local
tokens, and the engines average gradients over dp × cp: every rank holds the same number
of tokens, so this is the gradient of the global mean, as on one process.

Gradient accumulation (``Plan.gradient_accumulation`` = k): the local slice is cut into
k equal micro-batches along dim 0; each micro-batch's mean loss is divided by k before
its backward, so the accumulated gradient is the mean over the local slice, as without
accumulation. Communication across the micro-batches follows each strategy
(``runtime.data_parallel.microbatch_sync``: DDP ``no_sync`` until the last one, FSDP2
flags per layer). float16 plans scale each micro-batch's loss
(``runtime.precision.make_loss_scaler``) and ``step`` skips a step whose gradients
overflowed on any rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from runtime.apply import apply
from runtime.context_parallel import ContextParallel
from runtime.data_parallel import microbatch_sync
from runtime.plan import Plan, PlanError
from runtime.precision import make_loss_scaler

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Trainer:
    """Applies ``plan`` to ``model`` (in place) and trains it one step at a time."""

    context_parallel: ContextParallel | None = None
    """With mesh.cp > 1: the sequence split, position ids and ring attention. A class
    default, since ``runtime.pipeline.PipelineTrainer`` (no cp) sets up its own state."""

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
        self.context_parallel = self.applied.context_parallel
        self.loss_scaler = make_loss_scaler(plan, self.device)
        """``ShardedGradScaler`` of a float16 plan (``loss_scaling = "dynamic"``), else None."""

    @property
    def device(self) -> torch.device:
        return self.applied.device

    def shard_batch(self, inputs: tuple, targets: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """This rank's dp slice (dim 0) of a global batch, moved to the device; with
        context parallelism, of that slice's sequences (dim 1) its zigzag chunks."""
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

        cp = self.context_parallel

        def cut(x):
            if not isinstance(x, torch.Tensor):
                return x
            x = x[lo:hi]
            return (x if cp is None else cp.shard(x)).to(self.device)

        return tuple(cut(x) for x in inputs), cut(targets)

    def forward_backward(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward on this rank's local batch, in ``plan.gradient_accumulation``
        micro-batches; return the global mean loss.

        Every dp rank must hold the same number of samples (``shard_batch`` ensures it).
        """
        parts = split_microbatches(inputs, targets, self.plan.gradient_accumulation,
                                   self.dp_size)
        losses = []
        for i, (x, y) in enumerate(parts):
            with microbatch_sync(self.module, list(self.plan.layers), last=i == len(parts) - 1):
                loss = self._forward_backward_one(x, y, len(parts))
            losses.append(loss.detach().float())
        # tp ranks of one group hold the same loss, so the world mean is the mean over
        # dp × cp: over the samples, and over equal token counts of each sequence.
        global_loss = torch.stack(losses).mean()
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)
        return global_loss / dist.get_world_size()

    def _forward_backward_one(self, x: tuple, y: torch.Tensor, parts: int) -> torch.Tensor:
        """One micro-batch; with context parallelism, ring attention stays on through
        backward (checkpointed layers rerun their forward there)."""
        if self.context_parallel is None:
            loss = self.loss_fn(self.module(*x), y)
            self._backward(loss / parts)
            return loss
        with self.context_parallel.attention(y.shape[1], self.device) as positions:
            loss = self.loss_fn(self.module(*x, **positions), y)
            self._backward(loss / parts)
        return loss

    def _backward(self, loss: torch.Tensor) -> None:
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        loss.backward()

    def step(self) -> None:
        """Optimizer step, then zero the gradients. With loss scaling the gradients are
        unscaled first, and the step is skipped on every rank if any rank's overflowed."""
        if self.loss_scaler is None:
            self.optimizer.step()
        else:
            self.loss_scaler.step(self.optimizer)
            self.loss_scaler.update()
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


def split_microbatches(inputs: tuple, targets: torch.Tensor, count: int, dp: int
                       ) -> list[tuple[tuple, torch.Tensor]]:
    """Cut a local batch into ``count`` equal micro-batches along dim 0 (non-tensor inputs
    are passed to each as they are)."""
    local = targets.shape[0]
    if local % count:
        raise PlanError(
            f"the local batch of {local} samples does not split into "
            f"gradient_accumulation={count} equal micro-batches; use a global batch that "
            f"is a multiple of dp × gradient_accumulation = {dp * count}, or change "
            "gradient_accumulation"
        )
    size = local // count

    def cut(x, i):
        return x[i * size:(i + 1) * size] if isinstance(x, torch.Tensor) else x

    return [(tuple(cut(x, i) for x in inputs), cut(targets, i)) for i in range(count)]
