"""Per-layer data parallelism with PyTorch's engines: DDP and FSDP2 ``fully_shard``.

Semantics (``runtime.plan``): a layer that is not tensor-parallel computes redundantly
inside its tp group, so its replicas span the whole world.

    strategy    engine                                         gradients averaged over
    replicate   fully_shard, HSDP mesh (world, 1): nothing sharded  world
    fsdp        fully_shard, 1-D mesh of the world                  world (sharded)
    tp          fully_shard, HSDP mesh (dp, 1), after TP            dp
    tp_fsdp     fully_shard, 1-D dp mesh, after TP (torchtitan 2-D) dp (sharded)
    (the rest)  fully_shard on the root, as ``replicate``           world

Averaging identical tp copies of a non-TP gradient over the world equals averaging over dp.

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
``torch.distributed._composable.replicate`` (FSDP2-based DDP, private). A plan whose
layers are all ``replicate`` (pure data parallelism) uses DDP itself: bucketed,
overlapped, the reference implementation. Gradients of every combination are checked
against one process in tests/test_runtime_numerics.py.

Offloading (``CPUOffloadPolicy``) is never switched on here. On CPU-only machines its
default ``pin_memory=True`` fails ("Cannot access accelerator device"); a caller that
wants offload must pass ``CPUOffloadPolicy(pin_memory=False)`` there.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from runtime.mesh import DataParallelMeshes
from runtime.plan import LayerPlan

logger = logging.getLogger(__name__)


def uses_ddp(layers: list[LayerPlan]) -> bool:
    """Pure data parallelism: every planned layer is ``replicate``."""
    return all(layer.strategy == "replicate" for layer in layers)


def apply_ddp(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Wrap the whole model in DDP over ``group`` (default: the world)."""
    device_ids = [device] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group)
    size = dist.get_world_size(group)
    logger.info("applied DDP over %d rank(s) (all layers replicate)", size)
    return ddp


def _mesh_for(layer: LayerPlan, meshes: DataParallelMeshes):
    return {
        "replicate": meshes.world_replicate,
        "fsdp": meshes.world,
        "tp": meshes.dp_replicate,
        "tp_fsdp": meshes.dp,
    }[layer.strategy]


def apply_fsdp(model: nn.Module, layers: list[LayerPlan], meshes: DataParallelMeshes) -> nn.Module:
    """``fully_shard`` each layer on the mesh of its strategy, then the root (in place).

    Layers must be disjoint (``apply_plan`` checks). Sharded layers reshard after
    forward (ZeRO-3); replicated ones have nothing to reshard.
    """
    counts: dict[str, int] = {}
    for layer in layers:
        module = model.get_submodule(layer.module)
        sharded = layer.strategy in ("fsdp", "tp_fsdp")
        fully_shard(module, mesh=_mesh_for(layer, meshes), reshard_after_forward=sharded)
        counts[layer.strategy] = counts.get(layer.strategy, 0) + 1
    # The root holds every parameter outside the planned layers; replicate them.
    fully_shard(model, mesh=meshes.world_replicate, reshard_after_forward=False)
    logger.info(
        "applied FSDP2 per layer (%s) + replicated root over %d rank(s)",
        ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no layers",
        meshes.world.size(),
    )
    return model
