"""Per-layer data parallelism with PyTorch's engines: DDP and FSDP2 ``fully_shard``.

Semantics (``runtime.plan``): a layer that is not tensor-parallel computes redundantly
inside its tp group, so its replicas span the whole world. With context parallelism
(``mesh.cp > 1``) the cp ranks of a sample hold the same parameters and see different
tokens of it, so they are replicas too: "dp" below means dp × cp (``DataParallelMeshes``
flattens the two axes), and "world" is dp × cp × tp.

Every layer runs under ``fully_shard`` on the mesh its spec (``runtime.strategies``)
names: its data-parallel group (every rank of the stage, or dp for a tensor-parallel
layer, after TP as torchtitan's 2-D), 1-D when the spec shards anything, 2-D
``(group, 1)`` when it only replicates, ``(group / s, s)`` for hybrid sharding with
s = ``Plan.hsdp_shard_size``; gathered parameters are freed after forward when the spec
gathers ``per_use``. A spec with ``units == "modules"`` (``fsdp_modules``) first makes each
of the layer's ``module_units`` an FSDP2 unit on the same mesh; the layer's own unit then
holds the rest of its parameters. The parameters outside the planned layers go to the root, as
``replicate``. Gradients are averaged over the layer's group.

Averaging identical tp copies of a non-TP gradient over the world equals averaging over dp.
Averaging over cp is exact too: each cp rank's gradient is that of its local mean loss
(ring attention's backward sends the K/V part of it to the ranks owning those tokens),
and equal token counts per rank make the mean of the local means the global mean.

Across the ``Plan.gradient_accumulation`` micro-batches of one step
(``microbatch_sync``, called before each micro-batch's forward), the spec's ``gather``
and ``reduce`` set FSDP2's flags:

    gather, reduce              parameters between        gradient communication
                                micro-batches
    never, per_step             (replicated)              all-reduced once, last micro-batch
    per_step, per_step          kept unsharded            accumulated unsharded, reduce-
    (zero1, tp_zero1)           (gathered once)           scattered once, last micro-batch
    per_step, per_microbatch    kept unsharded            reduce-scattered every micro-batch,
    (zero2, tp_zero2)           (gathered once)           accumulated sharded
    per_use, per_microbatch     resharded after forward   reduce-scattered every micro-batch
    (fsdp, tp_fsdp)             and backward
    hybrid (hsdp)               as per_use in a group     reduce-scattered every micro-batch;
                                                          all-reduced across groups once

zero1/zero2 (and their tensor-parallel forms) reshard after the last micro-batch's
backward, so the optimizer updates the sharded (float32) parameters and the next step's
first forward gathers the new values: for a TP layer, the dp shard of its tp shard, which
is Megatron-LM's distributed optimizer (runtime.strategies).
With one micro-batch zero1 and zero2 are the same program: ZeRO-3 without resharding after
forward. Under pipelining the schedule drives these flags itself (every FSDP2 module of a
stage accumulates unsharded and reduces once, see ``runtime.pipeline``).

``offload`` (layers whose spec is ``offloadable``): ``CPUOffloadPolicy``; FSDP2 keeps the sharded
parameters and gradients in host memory and the optimizer steps them there. The host
memory is pinned on CUDA ranks (so copies overlap compute) and not on CPU ranks, where
pinning fails without an accelerator.

Mixed precision: every ``fully_shard`` takes ``runtime.precision.fsdp_policies``.

Why FSDP2 for everything once a plan mixes strategies: one engine owns every gradient,
and its root orchestrates all the per-layer groups in one backward, so there is one set
of hooks and one place where reduction happens. An HSDP mesh whose shard axis has size 1
is FSDP2's own way of saying "replicate": its reduce-scatter is over one rank, so only
the all-reduce over the replicate axis remains, which is exactly DDP's collective; and
FSDP2 already knows how to combine such a mesh with TP's DTensor parameters (the
``tp`` strategy). The alternatives need private or experimental entry points and run
two engines side by side: DDP over the non-FSDP parameters with FSDP2's excluded via
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (and DDP does not
take DTensor parameters without ``tensor.parallel.ddp._pre_dp_module_transform``), or
``torch.distributed._composable.replicate`` (FSDP2-based DDP, private). A float32 plan
whose layers are all ``replicate`` (pure data parallelism) uses DDP itself: bucketed,
overlapped, the reference implementation (mixed-precision plans stay on FSDP2, see
``runtime.precision``). Gradients of every combination are checked against one process
in tests/runtime/test_runtime_numerics.py and tests/runtime/test_runtime_dims.py.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from runtime.mesh import DataParallelMeshes
from runtime.plan import LayerPlan, PlanError
from runtime.strategies import StrategySpec, spec
from runtime.tied import check_ties

logger = logging.getLogger(__name__)


def uses_ddp(layers: list[LayerPlan], *, mixed_precision: bool = False) -> bool:
    """Pure float32 data parallelism: every planned layer is ``replicate``."""
    return not mixed_precision and all(layer.spec.ddp for layer in layers)


def apply_ddp(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Wrap the whole model in DDP over ``group`` (default: the world, dp × cp × tp)."""
    device_ids = [device] if device.type == "cuda" else None
    # Gradients as views into DDP's all-reduce buckets: one copy of them, not two (the cost
    # model's 'replicate' holds G once; bench/memory_dims.py measured +25% without this).
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                  gradient_as_bucket_view=True)
    size = dist.get_world_size(group)
    logger.info("applied DDP over %d rank(s) (all layers replicate)", size)
    return ddp


def _mesh_for(layer: LayerPlan, meshes: DataParallelMeshes) -> DeviceMesh:
    """The sub-mesh FSDP2 runs a layer on: its data-parallel group (runtime.strategies),
    sharded over or only replicated over (a 2-D mesh whose shard axis has size 1)."""
    s = layer.spec
    if s.hybrid:
        if meshes.hsdp is None:
            raise PlanError(f"layer {layer.module!r} uses {layer.strategy!r} but the plan has "
                            "no hsdp_shard_size")
        return meshes.hsdp
    if s.tensor_parallel:
        return meshes.dp if s.sharded else meshes.dp_replicate
    return meshes.world if s.sharded else meshes.world_replicate


def _offload(layer: LayerPlan, device: torch.device) -> OffloadPolicy:
    """Offloaded states live in host memory, pinned when the device is a GPU (pinned
    pages let the copies overlap compute; on a CPU rank there is nothing to pin for)."""
    if not layer.offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def apply_fsdp(
    model: nn.Module,
    layers: list[LayerPlan],
    meshes: DataParallelMeshes,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    root_mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """``fully_shard`` each layer on the mesh of its strategy, then the root (in place).

    Layers must be disjoint (``apply_plan`` checks). Layers sharing a parameter (tied
    weights, ``runtime.tied``) are one FSDP2 unit, ``fully_shard([a, b])``: FSDP2 lets a
    parameter belong to one group only, and one unit gathers and reduces it once.
    ``mp_policy`` applies to the layers, ``root_mp_policy`` to the root
    (``runtime.precision.fsdp_policies``).
    """
    counts: dict[str, int] = {}
    for unit in _units(model, layers):
        layer = unit[0]
        modules = [model.get_submodule(la.module) for la in unit]
        shard = dict(mesh=_mesh_for(layer, meshes),
                     reshard_after_forward=layer.spec.gather == "per_use",
                     mp_policy=mp_policy or MixedPrecisionPolicy(),
                     offload_policy=_offload(layer, torch.device(meshes.world.device_type)))
        if layer.spec.units == "modules":  # one module, never a tie (check_ties)
            for sub in module_units(modules[0]):
                fully_shard(sub, **shard)
        fully_shard(modules if len(modules) > 1 else modules[0], **shard)
        key = layer.strategy + (" offloaded" if layer.offload else "")
        counts[key] = counts.get(key, 0) + len(unit)
    # The root holds every parameter outside the planned layers; replicate them.
    fully_shard(model, mesh=meshes.world_replicate, reshard_after_forward=False,
                mp_policy=root_mp_policy or MixedPrecisionPolicy())
    logger.info(
        "applied FSDP2 per layer (%s) + replicated root over %d rank(s)",
        ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no layers",
        meshes.world.size(),
    )
    return model


def module_units(layer: nn.Module) -> list[nn.Module]:
    """The submodules of ``layer`` that ``units == "modules"`` strategies shard as FSDP2
    units of their own: every one below the layer owning a parameter of two or more
    dimensions (``nn.Linear``, ``nn.Embedding``, convolutions, Hugging Face's ``Conv1D``),
    children before their parents, as ``fully_shard`` must be applied. Parameters outside
    them (norms, the layer's own) stay in the layer's unit."""
    return [m for name, m in reversed(list(layer.named_modules()))
            if name and any(p.dim() >= 2 for p in m.parameters(recurse=False))]


def _units(model: nn.Module, layers: list[LayerPlan]) -> list[list[LayerPlan]]:
    """The layers grouped into FSDP2 units: tied layers together (``check_ties`` validates
    that they share a strategy), every other layer alone; in plan order. Layers tied to a
    parameter of the root are left to the root's unit (they are 'replicate', as it is).
    A layer without parameters is no unit: it has nothing to shard or reduce, and one
    called on several pipeline stages (``passes.group_layers.stateless_layers``) belongs
    to each stage's module, which FSDP2 refuses for one unit."""
    by_name = {layer.module: layer for layer in layers}
    unit_of: dict[str, list[LayerPlan]] = {}
    for tie in check_ties(model, layers):
        unit = [by_name[m] for m in tie.modules if m] if "" not in tie.modules else []
        unit_of.update((m, unit) for m in tie.modules if m)
    out: list[list[LayerPlan]] = []
    for layer in layers:
        unit = unit_of.get(layer.module, [layer])
        if unit and unit[0] is layer and any(
                next(model.get_submodule(la.module).parameters(), None) is not None
                for la in unit):
            out.append(unit)
    return out


def _sync_flags(module: FSDPModule, s: StrategySpec, last: bool) -> None:
    """Set one FSDP2 module's communication for the next micro-batch (table above)."""
    if s.reduce == "per_step":
        module.set_requires_gradient_sync(last, recurse=False)
    if s.gather == "per_step":
        module.set_reshard_after_backward(last, recurse=False)
    if s.hybrid:
        module.set_requires_all_reduce(last, recurse=False)


def microbatch_sync(module: nn.Module, layers: list[LayerPlan], *, last: bool
                    ) -> contextlib.AbstractContextManager:
    """Before a micro-batch's forward: the context to run its forward and backward in.

    DDP: ``no_sync`` unless ``last``. FSDP2: per-layer flags as in the module docstring;
    the root (replicated) syncs only on the last micro-batch.
    """
    if isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext() if last else module.no_sync()
    for layer in layers:
        sub = module.get_submodule(layer.module)
        if isinstance(sub, FSDPModule):  # not a layer tied to the root's parameter
            _sync_flags(sub, layer.spec, last)
    _sync_flags(module, spec("replicate"), last)
    return contextlib.nullcontext()
