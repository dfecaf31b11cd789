"""What the runtime's parallel engines add to a layer beyond its compute and collectives:
FSDP2's copies into and out of its collectives' buffers, the host time of FSDP2, tensor
parallelism and DTensor on devices whose host work does not hide behind kernels (CPU
ranks), and the skew a replicated layer's gradient all-reduce waits. Each say how often
the runtime (runtime/data_parallel.py) runs it; ``autopar.planner.costs`` adds them up."""

from __future__ import annotations

from cost_models.compute import roofline_s
from cost_models.hardware import Cluster, Device
from cost_models.memory import Precision
from passes.records import LayerInfo
from runtime.plan import Mesh
from runtime.strategies import StrategySpec


def all_reduce_wait_s(s: StrategySpec, mesh: Mesh, cluster: Cluster, prec: Precision,
                      tp_params: float) -> tuple[float, float]:
    """(Skew a replicated layer's gradient all-reduce waits per step, the part of it a plan
    run on DDP does not wait). FSDP2 issues the all-reduce per layer and blocks on each;
    DDP reduces gradients in buckets of ``Overlap.ddp_bucket_bytes`` and waits once per
    bucket, so a layer waits its share of one bucket's skew (``back_to_back_skew_s``), as
    it does in a pipeline. Exposed: a wait hides behind nothing."""
    group = s.group_ranks(mesh.replicas, mesh.tp)
    if s.sharded or group == 1 or not tp_params:
        return 0.0, 0.0
    grads = tp_params * prec.grad_bytes
    if mesh.pp > 1:  # reduced after the last micro-batch, back to back (never on DDP)
        return back_to_back_skew_s(grads, cluster), 0.0
    skew = cluster.device.skew_s(grads)
    if not s.ddp:  # TP layers never run on DDP
        return skew, 0.0
    return skew, skew - back_to_back_skew_s(grads, cluster)


def back_to_back_skew_s(nbytes: float, cluster: Cluster) -> float:
    """The skew of a collective issued right after others, with no compute between them
    (DDP's buckets; the gradient reductions a pipeline runs after its last micro-batch;
    ZeRO-1's around the optimizer step): the ranks come apart once, at the run's first
    collective, so one of ``nbytes`` waits its share of one bucket's skew."""
    bucket = cluster.overlap.ddp_bucket_bytes
    return min(1.0, nbytes / bucket) * cluster.device.skew_s(bucket)


FSDP_COPY_KERNELS = 2
"""Kernels of one FSDP2 collective's copies: into its buffer, and out of it."""


def fsdp_copies_s(s: StrategySpec, m: int, pipelined: bool, tp_params: float, shards: int,
                  prec: Precision, device: Device, units: int = 1) -> tuple[float, float]:
    """(Per micro-batch, per step) seconds of FSDP2's copies around its collectives
    (torch.distributed.fsdp: ``foreach_all_gather`` copies this rank's shards into one
    buffer, ``foreach_all_gather_copy_out`` the gathered buffer out into each unsharded
    parameter; ``foreach_reduce`` copies the unsharded gradients into one buffer and the
    reduced shard into each sharded gradient): 2P/N + 2P bytes read and written per
    all-gather, 2G + 2G/N per reduce-scatter, at the memory-bound kernels' bandwidth. How
    often each runs is the spec's ``gather`` and ``reduce`` (runtime.strategies): replicated
    layers (a one-rank shard) copy before each micro-batch's forward, a ``per_step`` gather
    once, a ``per_use`` gather for forward and again for backward; pipelines keep every
    layer gathered and reduce once. The same bytes in ``units`` FSDP2 units launch
    ``units`` times the kernels."""
    if not tp_params:
        return 0.0, 0.0  # FSDP2 groups no parameters: no collectives, no copies
    p = tp_params * prec.param_bytes
    g = tp_params * prec.grad_bytes
    kernels = FSDP_COPY_KERNELS * units
    gather = roofline_s(0.0, 2 * p / shards + 2 * p, kernels, device, prec.compute_dtype)
    scatter = roofline_s(0.0, 2 * g + 2 * g / shards, kernels, device, prec.compute_dtype)
    if pipelined:
        return 0.0, gather + scatter
    gathers_per_micro = {"never": 1, "per_step": 0, "per_use": 2}[s.gather]
    per_micro = gathers_per_micro * gather + (scatter if s.reduce == "per_microbatch" else 0.0)
    per_step = (gather if s.gather == "per_step" else 0.0) + (
        scatter if s.reduce == "per_step" else 0.0)
    return per_micro, per_step


def engine_host_s(layer: LayerInfo, is_tp: bool, sp: bool, cluster: Cluster, units: int = 1
                  ) -> tuple[float, float]:
    """(Per micro-batch, per step) host time the parallel engines add to this layer on a
    device whose host work does not hide behind its kernels (CPU ranks; ``Device``'s
    overheads are 0 elsewhere). Every layer outside a DDP plan runs under FSDP2
    (runtime/data_parallel.py): its hooks each micro-batch, and DTensor's dispatch of each
    of the optimizer's ops on its parameters (FSDP2 keeps them as DTensors). A
    tensor-parallel layer's modules add their DTensor hooks and dispatch. ``units``: the
    layer's FSDP2 units, each with its hooks."""
    device, adam = cluster.device, cluster.adam_kernels
    per_micro = device.fsdp_overhead_s * units
    if is_tp:
        assert layer.tp is not None
        styles = layer.tp.sp_styles if sp and layer.tp.sp_styles else layer.tp.styles
        per_micro += len(styles) * device.tp_overhead_s
    ops = adam.kernels * (layer.param_tensors if adam.per_tensor else 1)
    per_step = ops * device.dtensor_op_overhead_s if layer.param_tensors else 0.0
    return per_micro, per_step
