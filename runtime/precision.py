"""Mixed precision (``Plan.param_dtype``, ``reduce_dtype``, ``loss_scaling``) with FSDP2's
``MixedPrecisionPolicy`` and a distributed ``GradScaler``.

What a plan with ``param_dtype`` other than float32 executes, on every strategy:

- master weights and optimizer states stay float32 (FSDP2 keeps the sharded parameters
  in their original dtype and casts a copy for compute);
- parameters are all-gathered and computed in ``param_dtype``: FSDP2 casts each layer's
  (sharded) parameters before the all-gather, so the gather moves ``param_dtype`` bytes,
  and the whole forward and backward run in that dtype, norms and softmax included;
  floating-point inputs of every FSDP2 module are cast to it too;
- the model's output is cast back to float32 at the root (``output_dtype``), so the
  user's loss runs in float32;
- gradients are produced in ``param_dtype``, cast to ``reduce_dtype`` and then
  reduce-scattered / all-reduced in ``reduce_dtype``; the reduced gradient is stored in
  float32 next to the master weights;
- float16 scales the loss (``ShardedGradScaler``, i.e. ``torch.amp.GradScaler`` whose
  inf/nan check is all-reduced over every rank): a step whose gradients hold inf or nan
  on any rank (each rank sees only its shards) is skipped on every rank, and the scale
  backs off; otherwise it grows as GradScaler's does.

Why FSDP2 and not ``torch.autocast`` + a DDP comm hook for all-replicate plans: one
casting rule for every plan. Autocast keeps norms, softmax and losses in float32 while
FSDP2 computes everything in ``param_dtype``; two rules would give two sets of numbers
for the same layers depending on their neighbours' strategies, and two behaviours for
the cost model. So a mixed-precision plan runs under FSDP2 even when every layer is
``replicate`` (a 2-D ``(world, 1)`` mesh: gradients all-reduced, nothing sharded, as DDP);
only float32 all-replicate plans use DDP. Pipelines run FSDP2 too and so honour the
same rule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from runtime.plan import Plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""runtime.plan.COMPUTE_DTYPES name -> torch dtype."""


def is_mixed(plan: Plan) -> bool:
    """Whether the plan computes in a dtype other than float32."""
    return plan.param_dtype != "float32"


def fsdp_policies(plan: Plan) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(per-layer policy, root policy); the root's also casts the output to float32.

    For float32 plans both are FSDP2's default policy (nothing cast).
    """
    if not is_mixed(plan):
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    compute, reduce = DTYPES[plan.param_dtype], DTYPES[plan.reduce_dtype]
    layer = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
    root = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce,
                                output_dtype=torch.float32)
    return layer, root


def make_loss_scaler(plan: Plan, device: torch.device) -> ShardedGradScaler | None:
    """The dynamic loss scaler of a ``loss_scaling = "dynamic"`` plan (None otherwise).

    Its inf/nan flag is all-reduced over the whole world, so every rank (every shard,
    every pipeline stage) skips the same steps and keeps the same scale.
    """
    if plan.loss_scaling != "dynamic":
        return None
    return ShardedGradScaler(device=device.type, process_group=dist.group.WORLD)
