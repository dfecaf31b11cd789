"""PyTorch's async tensor parallelism: what it needs, in one place, and how it is enabled.

Async TP (micro-pipelined TP) splits a sequence-parallel layer's all-gather into one chunk
per rank and multiplies each chunk while the next one arrives
(``torch.ops.symm_mem.fused_all_gather_matmul``); a matmul whose output is reduce-scattered
is computed chunk by chunk and each chunk sent as soon as it is done
(``fused_matmul_reduce_scatter``). Inductor's post-grad pass ``micro_pipeline_tp_pass``
(torch/_inductor/fx_passes/micro_pipeline_tp.py) rewrites those patterns when
``torch._inductor.config._micro_pipeline_tp`` is set. torchtitan 0.3.0 turns it on with
``--compile.enable --compile.enable_async_tensor_parallel`` (``_maybe_enable_async_tp`` in
torchtitan/distributed/compile.py; before 0.3 the switch was
``--parallelism.enable_async_tensor_parallel``). The runtime does what that function does,
and compiles each async layer as torchtitan compiles each TransformerBlock.

Requirements, the one place they are written (``LayerPlan.async_tp`` asks for it):

1. Sequence parallelism on the layer (``LayerPlan.sequence_parallel``). The pass fuses
   all-gather -> matmul and matmul -> reduce-scatter; plain TP's all-reduces are left as
   they are, so async TP without SP would change nothing.          (``layer_problem``)
2. CUDA GPUs and NCCL: the pass fuses nothing unless ``torch.distributed.is_nccl_available()``,
   and the fused ops run on CUDA streams over symmetric memory.    (``device_problem``)
3. Peer-to-peer access among the tp ranks: the fused ops copy chunks straight out of the
   peers' symmetric-memory buffers, so the tp group lies in one node, on NVLink.
   (``cluster_problem``: tp ≤ devices per node, NVLink inside; ``device_problem``: the tp
   ranks are local ranks of one host)
4. Compute capability 9.0 or newer (Hopper): where PyTorch's async TP is tested and where its
   published speed-ups were measured (torchtitan's H100 benchmarks); it is offered there
   only. (``Device.cuda_capability`` for planning, ``torch.cuda.get_device_capability`` at
   run time)
5. Symmetric memory enabled on the tp group: ``enable_symm_mem_for_group``, deprecated in
   torch 2.13 but still what the pass's ``is_symm_mem_enabled_for_group`` reads, so
   torchtitan calls it and so does ``enable_async_tp``.
6. ``torch.compile`` (Inductor) of the layer: the pass runs on compiled graphs only.
   ``enable_async_tp`` compiles each async layer's module (``nn.Module.compile``).

It has not run on a GPU yet; README lists it with the other paths that have not.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from cost_models.hardware import Cluster

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

MIN_CAPABILITY = (9, 0)
"""The oldest CUDA compute capability async TP is offered on (requirement 4)."""
FLAG = "async_tp"
"""The plan's name for it (``LayerPlan.async_tp``), which every message uses."""


def layer_problem(*, tensor_parallel: bool, sequence_parallel: bool) -> str | None:
    """Why a layer with these choices cannot ask for async TP (requirement 1), or None."""
    if not tensor_parallel:
        return f"{FLAG} needs a tensor-parallel strategy (it overlaps TP's collectives)"
    if not sequence_parallel:
        return (f"{FLAG} needs sequence_parallel: PyTorch's async TP fuses the all-gathers and "
                "reduce-scatters of sequence parallelism into the matmuls, and leaves plain "
                "TP's all-reduces exposed; set sequence_parallel true or async_tp false")
    return None


def cluster_problem(cluster: Cluster, tp: int) -> str | None:
    """Why a tp group of ``tp`` devices of ``cluster`` cannot run async TP (requirements
    2-4), or None: what the planner reads before offering it."""
    device = cluster.device
    if device.capability is None:
        return (f"the cluster's device {device.name!r} is not a CUDA GPU of known compute "
                "capability (cuda_capability in its [device] table); async TP runs on CUDA "
                f"GPUs of capability {_version(MIN_CAPABILITY)} or newer")
    if device.capability < MIN_CAPABILITY:
        return (f"the cluster's device {device.name!r} has compute capability "
                f"{device.cuda_capability}; PyTorch's async TP is offered on "
                f"{_version(MIN_CAPABILITY)} (H100) or newer, where it is tested and measured")
    if tp > cluster.devices_per_node or cluster.intra_node.kind != "nvlink":
        return (f"a tp group of {tp} needs peer-to-peer access over NVLink inside one node; "
                f"the cluster has {cluster.devices_per_node} device(s) per node on "
                f"{cluster.intra_node.kind}")
    return None


def device_problem(*, device_type: str, backend: str | None,
                   capability: tuple[int, int] | None, local_world_size: int | None,
                   tp: int) -> str | None:
    """Why this rank cannot run async TP (requirements 2-4), from the facts at hand, or
    None. ``backend``: the process group's; ``local_world_size``: ranks on this host."""
    if device_type != "cuda":
        return (f"ranks run on {device_type}, and PyTorch's async TP runs on CUDA GPUs only "
                "(symmetric memory, NCCL); set async_tp false in the plan's layers to run "
                "here, or run on CUDA GPUs")
    if backend != "nccl":
        return (f"the process group's backend is {backend!r}; async TP needs NCCL (start the "
                "ranks with backend 'nccl', or set async_tp false)")
    if capability is None or capability < MIN_CAPABILITY:
        have = "unknown" if capability is None else _version(capability)
        return (f"this GPU has compute capability {have}; async TP is offered on "
                f"{_version(MIN_CAPABILITY)} (H100) or newer: set async_tp false")
    if local_world_size is not None and local_world_size % tp:
        return (f"tp = {tp} ranks do not fit in the {local_world_size} local ranks of one host; "
                "async TP copies between the tp ranks' GPUs peer to peer, so a tp group must "
                "lie in one node: use a tp degree that divides the GPUs per node, or set "
                "async_tp false")
    return None


def rank_problem(device_type: str, tp: int, group: object | None = None) -> str | None:
    """``device_problem`` for this rank: its device type, the backend of ``group`` (the
    default process group when None), its current GPU's capability and LOCAL_WORLD_SIZE
    (torchrun's, when set)."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    backend = dist.get_backend(group) if initialized else None
    capability = (torch.cuda.get_device_capability()
                  if device_type == "cuda" and torch.cuda.is_available() else None)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return device_problem(device_type=device_type, backend=backend, capability=capability,
                          local_world_size=int(local) if local else None, tp=tp)


def refusal(modules: Sequence[str], problem: str) -> str:
    """The message refusing a plan whose layers ``modules`` ask for async TP."""
    more = f" and {len(modules) - 1} more layer(s)" if len(modules) > 1 else ""
    return f"layer {modules[0]!r}{more} asks for {FLAG}, but {problem}"


def enable_async_tp(modules: Sequence[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Symmetric memory on the tp group, Inductor's micro-pipeline pass on, and each of
    ``modules`` compiled (torchtitan's ``_maybe_enable_async_tp`` and ``apply_compile``).

    ``nn.Module.compile`` compiles the module's call, hooks and ``forward`` included, at its
    first call, so it may precede recomputation (which replaces ``forward``) and FSDP2 (which
    adds hooks, and which torchtitan also applies after compiling). Graph breaks are
    allowed (``fullgraph=False``, unlike torchtitan's blocks): the layers' own hooks check
    shapes in Python, and the pass rewrites each graph it is given.
    """
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still needed (5)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    inductor_config._micro_pipeline_tp = True
    for module in modules:
        module.compile()
    logger.info("async TP (micro-pipelined TP) on a tp group of %d: %d layer(s) compiled",
                tp_mesh.size(), len(modules))


def _version(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"
