"""BatchNorm under a split batch: statistics over the whole data-parallel batch.

A BatchNorm layer in training mode normalises with its batch's mean and variance. Data
parallelism gives each rank a slice of the batch, so an unchanged layer would normalise
with its slice's statistics and train a different model from one process (0.17 loss
apart at the first step of a small ResNet). ``convert_batch_norm`` replaces every
BatchNorm module by ``DataParallelBatchNorm``, which all-reduces the statistics over the
data-parallel group, so forward, gradients and the running statistics are those of one
process on the global batch.

Why not ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: torch's SyncBatchNorm refuses
CPU tensors ("SyncBatchNorm expected input tensor to be on GPU"), and its kernels
(``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``) have no CPU
implementation, so it cannot run on the gloo ranks where every strategy is tested.

How: two autograd-aware all-reduces (``torch.distributed._functional_collectives.all_reduce``,
which ``torch.distributed.nn.functional.all_reduce`` is deprecated for) per
layer and forward: the per-channel sums with the sample count, then the per-channel sums
of squared deviations from the global mean. Two passes, like one process's kernel, rather
than sum and sum of squares in one (E[x²] - E[x]² cancels catastrophically when the mean
is large against the spread). Backward all-reduces the statistics' gradients the same
way: rank r's input gradient then holds every rank's loss's dependence on its samples
through the shared statistics, and the engines' gradient average over the ranks gives the
gradient of the global mean loss (the argument torch's SyncBatchNorm backward rests on).

Batch statistics also depend on how many samples one forward sees, so plans that cut
the batch further change them: gradient accumulation and pipeline micro-batches.
``check_batch_statistics`` refuses such plans for models with BatchNorm in training mode
(and context parallelism, whose ranks would each see part of every sample).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_reduce
from torch.nn.modules.batchnorm import _BatchNorm

from runtime.plan import Plan, PlanError

logger = logging.getLogger(__name__)


def batch_statistics_modules(model: nn.Module) -> list[str]:
    """Paths of the BatchNorm modules that normalise with batch statistics: in training
    mode, or without running statistics to use instead."""
    return [name for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)]


def check_batch_statistics(model: nn.Module, plan: Plan) -> None:
    """Raise PlanError if ``plan`` gives a BatchNorm layer fewer samples per forward than
    one process would: gradient accumulation or pipeline micro-batches."""
    names = batch_statistics_modules(model)
    if not names:
        return
    first = f"first: {names[0]!r}, {len(names)} in all"
    if plan.mesh.pp > 1:
        raise PlanError(
            f"mesh.pp={plan.mesh.pp}: a pipeline runs BatchNorm layers ({first}) on one "
            "micro-batch at a time, so their batch statistics, and training, would differ "
            "from one process; use a plan with mesh.pp = 1, put the model in eval mode, or "
            "replace BatchNorm (e.g. by GroupNorm)")
    if plan.mesh.cp > 1:
        raise PlanError(
            f"mesh.cp={plan.mesh.cp}: BatchNorm layers ({first}) are not synchronised over "
            "context-parallel ranks; use a plan with mesh.cp = 1")
    k = plan.gradient_accumulation
    if k > 1:
        raise PlanError(
            f"gradient_accumulation={k} normalises BatchNorm layers ({first}) with the "
            f"statistics of 1/{k} of each rank's batch, so training would differ from one "
            "process; use gradient_accumulation = 1 (a smaller global batch if memory binds), "
            "put the model in eval mode, or replace BatchNorm (e.g. by GroupNorm)")


class DataParallelBatchNorm(_BatchNorm):
    """A BatchNorm whose training statistics are those of the whole batch split over
    ``group`` (see the module docstring). Same parameters, buffers and names as the
    module it replaces; in eval mode it is that module."""

    def __init__(self, source: _BatchNorm, group: dist.ProcessGroup) -> None:
        super().__init__(source.num_features, source.eps, source.momentum, source.affine,
                         source.track_running_stats, device="meta")
        # The source's own tensors, not copies: optimizer and state dict see no change.
        self._parameters, self._buffers = source._parameters, source._buffers
        self._non_persistent_buffers_set = source._non_persistent_buffers_set
        self.train(source.training)
        self.group = group
        self.source_type = type(source)
        """BatchNorm1d/2d/3d: which input ranks are valid."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        self.source_type._check_input_dim(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training or self.running_mean is None):
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        # Statistics in at least float32, as torch's CPU and CUDA kernels keep them.
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        count = torch.full((1,), x.numel() // x.shape[1], dtype=xf.dtype, device=x.device)
        sums = all_reduce(torch.cat([xf.sum(dims), count]), "sum", self.group)
        n = sums[-1]
        mean = sums[:-1] / n
        centred = xf - mean.view(shape)
        var = all_reduce((centred * centred).sum(dims), "sum", self.group) / n
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        # A recomputed forward (activation checkpointing) runs inside backward: its batch
        # was counted when it first ran.
        recomputing = torch._C._current_graph_task_id() != -1
        if self.training and self.track_running_stats and not recomputing:
            self._update_running_stats(mean.detach(), var.detach(), n.detach())
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor,
                              n: torch.Tensor) -> None:
        """As ``F.batch_norm`` does: running stats move by ``momentum`` (by 1/steps when
        momentum is None) towards the batch mean and the unbiased batch variance."""
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        unbiased = var * (n / (n - 1).clamp(min=1))
        self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean)
        self.running_var.copy_(factor * unbiased + (1 - factor) * self.running_var)


def convert_batch_norm(model: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Replace, in place, every BatchNorm module of ``model`` by a DataParallelBatchNorm
    over ``group``; return their paths. Nothing changes when the group has one rank."""
    if dist.get_world_size(group) == 1:
        return []
    converted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, _BatchNorm) and not isinstance(module, DataParallelBatchNorm):
            if not name:
                raise PlanError(f"the model itself is a {type(module).__name__}; wrap it in "
                                "a module so its statistics can be synchronised")
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).register_module(
                child, DataParallelBatchNorm(module, group))
            converted.append(name)
    if converted:
        logger.info("batch norm: %d layer(s) take statistics over %d data-parallel rank(s)",
                    len(converted), dist.get_world_size(group))
    return converted
