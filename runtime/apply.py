"""Execute a Plan on a model: validate, then apply each parallelism in one order.

The order is torchtitan's, written down once here:

    1. validate        the plan against the model and the world; no collective yet
    2. mesh            build the (dp, tp) DeviceMesh, (dp, cp, tp) with context parallelism;
                       BatchNorm takes statistics over dp           (runtime.batch_norm)
    3. tensor parallel ``parallelize_module`` on the tp axis        (runtime.tensor_parallel)
    3b. expert parallel experts of ``expert_parallel > 1`` layers split over ep dp ranks
                       (replicated over tp), tokens by all-to-all; experts FSDP2 over
                       the dp ranks holding the same experts    (runtime.expert_parallel)
    4. recompute       checkpoint the layers' forwards             (runtime.recompute)
    5. data parallel   DDP, or FSDP2 per layer then the root,      (runtime.data_parallel)
                       with the plan's precision policy            (runtime.precision)
    6. materialize     a model built on meta: each rank allocates  (runtime.materialize)
                       and initialises its own shards only; a model with real weights
                       is broadcast from rank 0 before step 3 instead

TP comes before FSDP because FSDP2 shards DTensor parameters that TP has already
distributed (the 2-D pattern); checkpointing wraps forwards before FSDP hooks the
modules, so FSDP2's all-gathers and casts stay outside the recomputed region. EP comes
before FSDP (torchtitan's order): the experts are their own FSDP2 units, on the ep
replicas' mesh, before the layers around them take the remaining parameters. Under pure
data parallelism (DDP) DDP ignores the experts' parameters, which FSDP2 reduces.

Context parallelism (``mesh.cp > 1``) changes no module: parameters are replicated over
cp as over dp, so the data-parallel engines reduce (and FSDP2 shards) over dp × cp, and
the trainer runs attention on the cp ring (``runtime.context_parallel``, ``runtime.train``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from runtime.batch_norm import convert_batch_norm
from runtime.context_parallel import ContextParallel, position_argument
from runtime.data_parallel import apply_ddp, apply_fsdp, uses_ddp
from runtime.device import rank_device, resolve_device_type
from runtime.expert_parallel import apply_expert_parallel, ep_layers
from runtime.materialize import (
    broadcast_weights,
    check_initializable,
    common_seed,
    materialize,
    on_meta,
)
from runtime.mesh import build_mesh, data_parallel_meshes
from runtime.plan import LayerPlan, Plan, PlanError
from runtime.precision import fsdp_policies, is_mixed
from runtime.recompute import apply_recompute
from runtime.tensor_parallel import apply_tensor_parallel
from runtime.validate import check_async_tp_ranks, check_plan, plan_notes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppliedPlan:
    """A model with a plan applied, and the mesh it runs on."""

    module: nn.Module
    """What to call forward on (a DDP wrapper for pure data parallelism)."""
    model: nn.Module
    """The user's module, parallelized in place (parameter names unchanged)."""
    mesh: DeviceMesh
    plan: Plan
    device: torch.device
    context_parallel: ContextParallel | None = None
    """With mesh.cp > 1: the batch split, position ids and ring attention the trainer uses."""


def check_world(plan: Plan) -> None:
    """Raise PlanError unless torch.distributed runs exactly the plan's number of ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise PlanError(
            "torch.distributed is not initialised; start ranks with runtime.launch.spawn or "
            "torchrun and call runtime.launch.init_from_env() first"
        )
    world = dist.get_world_size()
    if plan.world_size != world:
        raise PlanError(
            f"the plan's mesh ({plan.mesh.describe()}) "
            f"needs {plan.world_size} ranks but {world} are running; launch "
            f"{plan.world_size} ranks or re-plan for {world}"
        )


def validate_plan(model: nn.Module, plan: Plan) -> str | None:
    """Raise PlanError if ``plan`` cannot run ``model`` in this world. Local: no collective.
    Returns the forward argument for position ids when the plan uses context parallelism."""
    if plan.mesh.pp != 1:
        raise PlanError(
            f"mesh.pp={plan.mesh.pp}: a pipeline plan runs on one module per stage; build "
            "the trainer with autopar.lower.make_trainer (it splits the model), or pass the "
            "stage modules to runtime.pipeline.PipelineTrainer"
        )
    check_world(plan)
    if on_meta(model):
        check_initializable(model)
        if ep_layers(list(plan.layers)):
            raise PlanError("expert parallelism needs a model with real weights (each rank "
                            "keeps its experts' slice of rank 0's); build the model on cpu")
    check_plan(model, plan)
    for note in plan_notes(model, plan):
        logger.warning(note)
    return position_argument(model) if plan.mesh.cp > 1 else None


def apply(model: nn.Module, plan: Plan, *, device_type: str = "auto",
          seed: int | None = None) -> AppliedPlan:
    """Validate, then parallelize ``model`` in place; see the module docstring for the order.

    A model on the meta device is parallelized on meta and then materialized, each rank
    allocating and initialising only its own shards from ``seed`` (rank 0's seed when
    None; ``runtime.materialize``). A model with real weights gets rank 0's.
    """
    position_arg = validate_plan(model, plan)
    check_async_tp_ranks(plan, resolve_device_type(device_type))
    device = rank_device(device_type)
    meta = on_meta(model)
    seed = common_seed(seed) if meta else None
    if not meta:
        model.to(device)
    mesh = build_mesh(plan.mesh, device.type)
    logger.info("mesh %s on %s", plan.mesh.describe(), device)
    convert_batch_norm(model, mesh.get_group("dp"))  # validate_plan checked the plan
    layers = list(plan.layers)
    cp = _context_parallel(model, mesh, layers, position_arg)
    if uses_ddp(layers, mixed_precision=is_mixed(plan)):
        if ep_layers(layers):
            broadcast_weights(model)  # before each rank keeps its experts' slice
            _expert_parallel(model, layers, mesh)
        apply_recompute(model, layers)
        if meta:
            materialize(model, device, seed)
        return AppliedPlan(apply_ddp(model, device), model, mesh, plan, device, cp)
    if not meta:
        broadcast_weights(model)  # FSDP2 and TP keep each rank's own values
    meshes = data_parallel_meshes(mesh, plan.hsdp_shard_size)
    apply_tensor_parallel(model, layers, meshes.tp)
    _expert_parallel(model, layers, mesh)
    apply_recompute(model, layers)
    layer_policy, root_policy = fsdp_policies(plan)
    apply_fsdp(model, layers, meshes, mp_policy=layer_policy, root_mp_policy=root_policy)
    if meta:
        materialize(model, device, seed)
    return AppliedPlan(model, model, mesh, plan, device, cp)


def _expert_parallel(model: nn.Module, layers: list[LayerPlan], mesh: DeviceMesh) -> None:
    """Split the experts of EP layers; DDP, if it wraps the model, skips their parameters
    (FSDP2 owns them). Plans without EP are untouched."""
    if not ep_layers(layers):
        return
    blocks = apply_expert_parallel(model, layers, mesh["dp"],
                                   reshard=lambda layer: layer.spec.gather == "per_use")
    names = [name for name, _ in model.named_parameters()
             if any(name.startswith(block.experts + ".") for block in blocks)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def _context_parallel(model: nn.Module, mesh: DeviceMesh, layers: list[LayerPlan],
                      position_arg: str | None) -> ContextParallel | None:
    """Ring attention on the mesh's cp axis, kept through recomputed layers (so call it
    before ``apply_recompute``); None when the plan has no cp axis."""
    if position_arg is None:
        return None
    cp = ContextParallel(model, mesh.get_group("cp"), position_arg)
    for layer in layers:
        if layer.recompute != "none":
            cp.keep_through_recompute(model.get_submodule(layer.module))
    logger.info("context parallel over %d rank(s): ring attention, zigzag chunks",
                mesh.size(mesh.mesh_dim_names.index("cp")))
    return cp


def apply_plan(model: nn.Module, plan: Plan, *, device_type: str = "auto",
               seed: int | None = None) -> nn.Module:
    """Parallelize ``model`` according to ``plan``; return the module to train.

    Raises PlanError, before any collective, if the plan does not fit the model or world.
    """
    return apply(model, plan, device_type=device_type, seed=seed).module
