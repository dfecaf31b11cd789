"""The device mesh of a plan, and the sub-meshes the data-parallel engines need.

The axes and their order are ``runtime.plan.AXES``. The ``pp`` axis is only present when
the plan has more than one pipeline stage, the ``cp`` axis only when ``mesh.cp > 1``, so
plans without them get the meshes they always had.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runtime.plan import AXES, Mesh, PlanError

# Meshes are pure topology, so one per (world, shape) is reused: creating one makes process
# groups, which cost time and sockets and are never freed before the world is destroyed.
_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}
_DP_MESHES: dict[tuple, tuple[DeviceMesh, DataParallelMeshes]] = {}
"""(root mesh id, dim names, ranks, hsdp shard size) -> (root, meshes); the root is kept so
its id is not reused while the entry lives."""


def build_mesh(plan_mesh: Mesh, device_type: str) -> DeviceMesh:
    """A DeviceMesh with axes ``("dp", "tp")``, ``("dp", "cp", "tp")`` when cp > 1, or
    ``("pp", "dp", "tp")`` when pp > 1.

    Collective: every rank of the default process group must call it. Raises PlanError,
    before any collective, for a world of the wrong size.
    """
    world = dist.get_world_size()
    if plan_mesh.world_size != world:
        raise PlanError(
            f"plan mesh {plan_mesh.describe()} needs {plan_mesh.world_size} ranks but the "
            f"process group has {world}; launch {plan_mesh.world_size} ranks or re-plan "
            f"for {world}"
        )
    names = tuple(axis for axis in AXES if axis in ("dp", "tp") or plan_mesh.size(axis) > 1)
    shape = tuple(plan_mesh.size(axis) for axis in names)
    world_group = dist.group.WORLD
    cached = _MESHES.get((shape, names, device_type))
    if cached is not None and cached[0] is world_group:
        return cached[1]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _MESHES[(shape, names, device_type)] = (world_group, mesh)
    return mesh


@dataclass(frozen=True)
class DataParallelMeshes:
    """Sub-meshes of one pipeline stage, named by what shards or replicates over them.

    FSDP2 takes a 1-D mesh (shard over it) or a 2-D ``(replicate, shard)`` mesh (HSDP).
    A 2-D mesh whose shard axis has size 1 is pure replication: gradients are all-reduced
    over the replicate axis, nothing is sharded. That is how ``replicate`` and ``tp``
    layers join an FSDP2 model (see ``runtime.data_parallel``).
    """

    dp: DeviceMesh
    """1-D, the replicas of a TP shard: the dp axis, or dp × cp flattened when cp > 1
    (``tp_fsdp`` shards over it)."""
    tp: DeviceMesh
    """1-D, the tensor-parallel axis."""
    world: DeviceMesh
    """1-D, every rank of the stage, dp-major (``fsdp`` shards over it)."""
    dp_replicate: DeviceMesh
    """2-D ``(dp * cp, 1)``: replicate over the replicas, shard over nobody (``tp`` layers)."""
    world_replicate: DeviceMesh
    """2-D ``(dp * cp * tp, 1)``: replicate over every rank (``replicate`` layers, the root)."""
    hsdp: DeviceMesh | None = None
    """2-D ``(dp * cp * tp / s, s)`` for ``Plan.hsdp_shard_size`` s: shard inside runs of
    s consecutive ranks (a node), replicate across them (``hsdp`` layers)."""
    cp: DeviceMesh | None = None
    """1-D, the context-parallel axis (ring attention's group); None when cp = 1."""


def data_parallel_meshes(mesh: DeviceMesh, hsdp_shard_size: int | None = None
                         ) -> DataParallelMeshes:
    """Derive the sub-meshes from a mesh made by ``build_mesh``. Collective.

    All are slices, flattenings or unflattenings of the one root mesh, so FSDP2 can
    combine them with the TP mesh into one SPMD mesh (it requires a common root).
    ``DeviceMesh._flatten`` / ``_unflatten`` are private in torch 2.13 (torchtitan uses
    ``_flatten`` the same way); the numerics tests catch a change in their behaviour.
    """
    # Keyed by the root and the ranks, not the object: slicing a pipeline stage's mesh out
    # of the root makes a new object each time, and each miss would make new groups.
    root = mesh._get_root_mesh()
    key = (id(root), mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()), hsdp_shard_size)
    cached = _DP_MESHES.get(key)
    if cached is not None and cached[0] is root:
        return cached[1]
    if hsdp_shard_size is None:
        meshes = _base_meshes(mesh)
    else:
        base = data_parallel_meshes(mesh)
        meshes = replace(base, hsdp=_hsdp_mesh(base.world, hsdp_shard_size))
    _DP_MESHES[key] = (root, meshes)
    return meshes


def _base_meshes(mesh: DeviceMesh) -> DataParallelMeshes:
    names = mesh.mesh_dim_names or ()
    if "pp" in names:
        raise NotImplementedError("pipeline stages: slice the stage's (dp, tp) mesh first")
    if "cp" in names:
        return _context_parallel_meshes(mesh)
    dp, tp = mesh.size(0), mesh.size(1)
    world = mesh["dp", "tp"]._flatten("dp_tp")
    dp_replicate = mesh._unflatten("dp", (dp, 1), ("dp_replicate", "dp_shard"))
    world_replicate = world._unflatten(0, (dp * tp, 1), ("world_replicate", "world_shard"))
    return DataParallelMeshes(
        dp=mesh["dp"],
        tp=mesh["tp"],
        world=world,
        dp_replicate=dp_replicate["dp_replicate", "dp_shard"],
        world_replicate=world_replicate,
    )


def _context_parallel_meshes(mesh: DeviceMesh) -> DataParallelMeshes:
    """Sub-meshes of a ``(dp, cp, tp)`` mesh: cp ranks hold the same parameters as dp
    ranks do (they differ only in which tokens they see), so every data-parallel role
    of the dp axis goes to dp × cp flattened, as torchtitan's ``dp_shard_cp``."""
    replicas = mesh["dp", "cp"]._flatten("dp_cp")
    world = mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")
    n, size = replicas.size(), world.size()
    return DataParallelMeshes(
        dp=replicas,
        tp=mesh["tp"],
        world=world,
        dp_replicate=replicas._unflatten(0, (n, 1), ("dp_cp_replicate", "dp_cp_shard")),
        world_replicate=world._unflatten(0, (size, 1), ("cp_world_replicate",
                                                       "cp_world_shard")),
        cp=mesh["cp"],
    )


def _hsdp_mesh(world: DeviceMesh, shard_size: int | None) -> DeviceMesh | None:
    """``world`` unflattened to ``(replicate, shard)``: row-major, so shard groups are runs
    of consecutive ranks (one node each). Names carry the size, since a root mesh keeps
    every name it has been given."""
    if shard_size is None:
        return None
    n = world.size()
    names = (f"hsdp{shard_size}_replicate", f"hsdp{shard_size}_shard")
    return world._unflatten(0, (n // shard_size, shard_size), names)
