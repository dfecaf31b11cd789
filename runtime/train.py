"""A training step a user's own loop can call, with a plan applied.

Batches: ``inputs`` is a tensor, a tuple of positional arguments, a dict of keyword
arguments (Hugging Face's ``model(**batch)``) or ``runtime.batch.Inputs`` for both; the
tensors holding the batch in dim 0 are sliced, the rest broadcast (``runtime.batch``).
The loss is ``loss_fn(output, targets)`` with the model's output as it is (a Hugging Face
``ModelOutput`` included), or without a ``loss_fn`` the loss the model returns
(``output.loss``, ``output["loss"]``, or a 0-dim output); targets are then optional.

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

A user's own loop: ``runtime.data.data_loader`` gives each rank its local batches (pass
them with ``global_batch=False``), ``clip_grad_norm_`` clips by the global norm,
``optimizer`` and ``lr_scheduler`` are the ones the factories made (``step`` steps both),
and ``runtime.step_log.StepLog`` logs a line every N steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from runtime.apply import apply
from runtime.batch import Inputs, as_inputs, like, model_loss, shard_rows, split_rows
from runtime.clip import clip_grads, total_grad_norm
from runtime.context_parallel import ContextParallel
from runtime.data_parallel import microbatch_sync
from runtime.plan import Plan, PlanError
from runtime.precision import make_loss_scaler

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, targets)``: the model's output as it returns it, and the targets."""
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""``optimizer_factory(params)``: the optimizer over this rank's parameters (DTensor
shards for sharded layers)."""
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
"""``lr_scheduler_factory(optimizer)``: a scheduler that ``Trainer.step`` steps once per
optimizer step, after it."""


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The default optimizer: AdamW with lr 1e-3 and torch's other defaults."""
    return torch.optim.AdamW(params, lr=1e-3)


class Trainer:
    """Applies ``plan`` to ``model`` (in place) and trains it one step at a time."""

    context_parallel: ContextParallel | None = None
    """With mesh.cp > 1: the sequence split, position ids and ring attention. A class
    default, since ``runtime.pipeline.PipelineTrainer`` (no cp) sets up its own state."""
    has_first = True
    """This rank runs the model's first stage: it needs the inputs (always without pp)."""
    has_last = True
    """This rank runs the model's last stage: it needs the targets (always without pp)."""
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        loss_fn: LossFn | None = None,
        optimizer_factory: OptimizerFactory = _adamw,
        *,
        device_type: str = "auto",
        seed: int | None = None,
        lr_scheduler_factory: SchedulerFactory | None = None,
    ) -> None:
        self.applied = apply(model, plan, device_type=device_type, seed=seed)
        self.plan = plan
        self.module = self.applied.module
        self.loss_fn = loss_fn
        self.make_optimizer(list(self.module.parameters()), optimizer_factory,
                            lr_scheduler_factory)
        mesh = self.applied.mesh
        self.dp_rank = mesh.get_local_rank("dp")
        self.dp_size = mesh.size(mesh.mesh_dim_names.index("dp"))
        self.context_parallel = self.applied.context_parallel
        self.loss_scaler = make_loss_scaler(plan, self.device)
        """``ShardedGradScaler`` of a float16 plan (``loss_scaling = "dynamic"``), else None."""

    def make_optimizer(self, params: list[nn.Parameter], optimizer_factory: OptimizerFactory,
                       lr_scheduler_factory: SchedulerFactory | None) -> None:
        """``self.optimizer`` over ``params`` and ``self.lr_scheduler`` over it (or None)."""
        self.optimizer = optimizer_factory(params)
        if lr_scheduler_factory is not None:
            self.lr_scheduler = lr_scheduler_factory(self.optimizer)

    @property
    def device(self) -> torch.device:
        return self.applied.device

    def local_batch(self, inputs: Any, targets: Any = None) -> tuple[Any, Any]:
        """A batch that is already this rank's dp share (``runtime.data``), moved to the
        device; with context parallelism, of its sequences (dim 1) this rank's chunks."""
        cp = self.context_parallel

        def move(x: torch.Tensor) -> torch.Tensor:
            return (x if cp is None else cp.shard(x)).to(self.device)

        local, targets = shard_rows(as_inputs(inputs), targets, 0, 1, move)
        return like(inputs, local), targets

    def shard_batch(self, inputs: Any, targets: Any = None) -> tuple[Any, Any]:
        """This rank's dp slice (dim 0) of a global batch, moved to the device; with
        context parallelism, of that slice's sequences (dim 1) its zigzag chunks. The
        inputs come back in the form they were given (tensor, tuple, dict or Inputs)."""
        cp = self.context_parallel

        def move(x: torch.Tensor) -> torch.Tensor:
            return (x if cp is None else cp.shard(x)).to(self.device)

        local, targets = shard_rows(as_inputs(inputs), targets, self.dp_rank, self.dp_size,
                                    move)
        return like(inputs, local), targets

    def forward_backward(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Forward and backward on this rank's local batch, in ``plan.gradient_accumulation``
        micro-batches; return the global mean loss.

        Every dp rank must hold the same number of samples (``shard_batch`` ensures it).
        """
        parts = split_rows(as_inputs(inputs), targets, self.plan.gradient_accumulation,
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

    def _forward_backward_one(self, x: Inputs, y: Any, parts: int) -> torch.Tensor:
        """One micro-batch; with context parallelism, ring attention stays on through
        backward (checkpointed layers rerun their forward there)."""
        if self.context_parallel is None:
            loss = self.loss(x.call(self.module), y)
            self._backward(loss / parts)
            return loss
        with self.context_parallel.attention(_seq_len(x, y), self.device) as positions:
            loss = self.loss(self.module(*x.args, **x.kwargs, **positions), y)
            self._backward(loss / parts)
        return loss

    def loss(self, output: Any, targets: Any) -> torch.Tensor:
        """``loss_fn(output, targets)``, or the model's own loss when there is no loss_fn."""
        return model_loss(output) if self.loss_fn is None else self.loss_fn(output, targets)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        loss.backward()

    def step(self) -> None:
        """Optimizer step, then the LR scheduler's, then zero the gradients. With loss
        scaling the gradients are unscaled first, and the step is skipped on every rank if
        any rank's overflowed."""
        if self.loss_scaler is None:
            self.optimizer.step()
        else:
            self.loss_scaler.step(self.optimizer)
            self.loss_scaler.update()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global ``norm_type`` norm is at most
        ``max_norm``; return the norm before clipping, the same on every rank and equal to
        one process's on the full gradients (``runtime.clip``). Call between
        ``forward_backward`` and ``step``. Collective. With loss scaling the gradients are
        unscaled first (``step`` does not unscale them again)."""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self.optimizer)
        total = total_grad_norm(self.norm_parameters(), norm_type, self.pp_group(),
                                self.device)
        clip_grads(self.grad_parameters(), max_norm, total)
        return total

    def grad_parameters(self) -> list[nn.Parameter]:
        """This rank's trained parameters (each once)."""
        return list(self.module.parameters())

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients make up the global norm on this rank."""
        return self.grad_parameters()

    def pp_group(self) -> dist.ProcessGroup | None:
        """The group over which stages' norms add up (None: one stage holds everything)."""
        return None

    def train_step(self, inputs: Any, targets: Any = None, *, global_batch: bool = True
                   ) -> float:
        """One optimizer step; ``global_batch`` says the batch is global and must be sliced.
        With ``global_batch=False`` the batch is this rank's, on its device, as
        ``runtime.data.data_loader`` yields it (``local_batch`` makes one). ``targets`` may
        be left out when the model computes its own loss."""
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


def split_microbatches(inputs: Any, targets: Any, count: int, dp: int
                       ) -> list[tuple[Any, Any]]:
    """Cut a local batch into ``count`` equal micro-batches along dim 0 (inputs without
    the batch dimension are passed to each as they are; see ``runtime.batch``)."""
    return [(like(inputs, x), y) for x, y in split_rows(as_inputs(inputs), targets, count, dp)]


def _seq_len(inputs: Inputs, targets: Any) -> int:
    """The local sequence length under context parallelism: dim 1 of the targets, else of
    the first input with one."""
    for leaf in [targets, *pytree.tree_leaves((inputs.args, dict(inputs.kwargs)))]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            return int(leaf.shape[1])
    raise PlanError("context parallelism needs an input or targets with a sequence in dim 1")
