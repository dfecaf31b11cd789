"""Pipeline sends scattered across the tensor-parallel group (``PipelineSpec.scatter_sends``).

Megatron-LM's scatter/gather optimisation (Narayanan et al., SC'21, section 4.1). At a
stage boundary every tp rank holds the same activation: TP layers end replicated
(``runtime.tensor_parallel`` turns their Replicate output local, and a sequence-parallel
layer whose neighbour across the boundary is not gathers its output back), and any other
layer runs as identical copies on the tp ranks. So instead of every tp rank sending the
whole activation to its peer on the next stage, each sends its own 1/tp slice of the last
dim, and the receiving stage all-gathers the slices over its tp group (NVLink inside a
node, where the pp link is the network between nodes).

Sequence shards (``sequence_sharded_boundaries``). Where the last plan layer of a stage and
the first of the next are both sequence-parallel, the residual stream stays a Shard(1)
DTensor across the boundary, as between two SP layers of one stage (Megatron-LM with
sequence parallelism sends each tp rank's shard likewise): the sending stage returns the
DTensor, ``PipelineStage`` sends its local tensor (1/tp of the activation) and rebuilds the
DTensor on the receiving stage's tp mesh (``runtime.pipeline``'s ``get_mesh``), whose first
SP layer takes it as its input. No gather, no slice; the hooks below leave DTensors alone,
whether or not the plan scatters. Between two stages of one rank the DTensor is handed
over in memory.

Autograd, with r this rank's tp coordinate:

    sending stage     forward: x -> x[..., r-th slice]     backward: all-gather the
                                                           gradient slices (the full
                                                           gradient, as every tp rank
                                                           holds it)
    receiving stage   forward: all-gather the slices      backward: this rank's slice of
                                                           the (replicated) gradient

The receiving side's backward is a slice, not a reduce-scatter: the gradient it receives
is the same on every tp rank, and a reduce-scatter would sum tp identical copies.
(``_functional_collectives.all_gather_tensor_autograd`` reduce-scatters in backward, so
this module has its own ``autograd.Function`` over ``all_gather_single``.)

Which tensors: every floating tensor a stage sends to a stage on another pipeline rank;
an integer one (token ids, an index) crosses whole, as it is small. Neighbouring stages on one
rank (the V schedules' turn) hand tensors over in memory, so they are left whole. Both
sides decide from the plan alone, so the receiver never needs the sender's shapes; the
last dim of every such tensor must divide by tp: ``check_sends`` refuses the plan from the
shapes the pipeline split finds on meta (``passes.split_stages``), before any rank starts,
and the sender checks again before it sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from runtime.plan import LayerPlan, Plan, PlanError, stage_rank


class Send(NamedTuple):
    """A tensor a pipeline stage hands to the next (recorded by the split on meta)."""

    name: str
    shape: tuple[int, ...]
    module: str
    """The module that made it (its fully-qualified name; '' for the root's ops)."""
    floating: bool = True
    """False for an integer or boolean tensor (token ids, an index): sent whole."""


def scattered_boundaries(plan: Plan) -> tuple[set[int], set[int]]:
    """(stages that send a slice to the next stage, stages that gather from the previous
    one): every boundary between stages on different pipeline ranks, when the plan
    scatters its sends."""
    if plan.pipeline is None or not plan.pipeline.scatter_sends or plan.mesh.tp == 1:
        return set(), set()
    senders = {s for s in range(plan.num_stages - 1)
               if stage_rank(s, plan.mesh.pp, plan.pipeline)
               != stage_rank(s + 1, plan.mesh.pp, plan.pipeline)}
    return senders, {s + 1 for s in senders}


def sequence_sharded_boundaries(plan: Plan) -> set[int]:
    """Stages s whose boundary to s + 1 joins two sequence-parallel layers (the last plan
    layer of s and the first of s + 1): the residual stream crosses it as each tp rank's
    sequence shard, a Shard(1) DTensor that the pipeline sends as its local tensor."""
    if plan.pipeline is None or plan.mesh.tp == 1:
        return set()
    first: dict[int, LayerPlan] = {}
    last: dict[int, LayerPlan] = {}
    for layer in plan.layers:
        first.setdefault(layer.stage, layer)
        last[layer.stage] = layer
    return {s for s in range(plan.num_stages - 1)
            if s in last and s + 1 in first
            and last[s].sequence_parallel and first[s + 1].sequence_parallel}


def check_sends(plan: Plan, sends: Sequence[Sequence[Send]]) -> None:
    """Refuse, before any rank starts, a plan whose scattered sends cannot split a tensor
    that crosses a boundary between pipeline ranks (its last dim does not divide by tp).

    ``sends``: per boundary, what crosses it, from the pipeline split on meta tensors
    (``passes.split_export.StageSplit.sends``), whose shapes are one micro-batch's, as
    the ranks run it. Only the sender could find out otherwise, at its first step, while
    its peers wait for its tensor until the process group times out. The residual stream
    at a boundary between sequence-parallel layers is exempt: it crosses as the shard; so
    is an integer tensor, which crosses whole.
    """
    senders, _ = scattered_boundaries(plan)
    sharded = sequence_sharded_boundaries(plan)
    last = {layer.stage: layer.module for layer in plan.layers}
    tp = plan.mesh.tp
    for s in sorted(senders):
        for send in sends[s] if s < len(sends) else ():
            if not send.floating or s in sharded and _made_by(send.module, last[s]):
                continue
            if not send.shape or send.shape[-1] % tp:
                made = f"made by {send.module!r}" if send.module else f"{send.name!r}"
                raise PlanError(_unsplittable(s, send.shape, tp, f" ({made})"))


def _made_by(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _unsplittable(stage_id: int, shape: tuple[int, ...], tp: int, what: str = "") -> str:
    return (f"stage {stage_id} sends a tensor{what} of shape {shape} to stage "
            f"{stage_id + 1}: pipeline.scatter_sends splits the last dim of what crosses a "
            f"stage boundary over tp={tp}, and {shape[-1] if shape else 'a scalar'} does not "
            "split; set pipeline.scatter_sends false (the whole tensor is sent)")


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup, tp: int) -> torch.Tensor:
    """The tp ranks' slices, concatenated along the last dim (rank order)."""
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x, group=group)  # ranks' tensors stacked along dim 0
    return torch.cat(out.view(tp, *x.shape).unbind(0), dim=-1)


def _slice_last_dim(x: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    # A copy: p2p sends need contiguous tensors, and the split-backward schedules
    # ``detach_()`` a stage's outputs, which a view refuses.
    return x.chunk(tp, dim=-1)[rank].clone(memory_format=torch.contiguous_format)


class _Scatter(torch.autograd.Function):
    """Forward: this rank's slice of a tensor every tp rank holds; backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, rank: int, tp: int):
        ctx.group, ctx.tp = group, tp
        return _slice_last_dim(x, rank, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_last_dim(grad, ctx.group, ctx.tp), None, None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather the tp ranks' slices; backward: this rank's slice of the
    gradient, which is the same on every tp rank (not a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, rank: int, tp: int):
        ctx.rank, ctx.tp = rank, tp
        return _gather_last_dim(x, group, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _slice_last_dim(grad, ctx.rank, ctx.tp), None, None, None


def _floating(t: torch.Tensor) -> bool:
    """A tensor the hooks scatter or gather: floating, and not a DTensor (a sequence
    shard, already 1/tp of the whole on each rank, crosses as it is)."""
    return t.is_floating_point() and not isinstance(t, DTensor)


def add_scattered_sends(module: nn.Module, stage_id: int, plan: Plan,
                        group: dist.ProcessGroup, rank: int) -> None:
    """Hook one stage module: slice what it sends to another pipeline rank, gather what it
    receives from one. ``group``: this stage's tp group; ``rank``: this rank's place in it."""
    senders, receivers = scattered_boundaries(plan)
    tp = plan.mesh.tp
    if stage_id in receivers:
        def gather(_module: nn.Module, args: tuple) -> tuple:
            return tree_map_only(
                torch.Tensor,
                lambda t: _Gather.apply(t, group, rank, tp) if _floating(t) else t, args)

        module.register_forward_pre_hook(gather)
    if stage_id in senders:
        def scatter(_module: nn.Module, _args: tuple, output: object) -> object:
            def one(t: torch.Tensor) -> torch.Tensor:
                if not _floating(t):
                    return t
                if t.dim() == 0 or t.shape[-1] % tp:
                    raise PlanError(_unsplittable(stage_id, tuple(t.shape), tp))
                return _Scatter.apply(t, group, rank, tp)

            return tree_map_only(torch.Tensor, one, output)

        module.register_forward_hook(scatter)
