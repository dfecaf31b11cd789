"""Time and memory of one layer under one strategy on one mesh.

The bridge between the layer records (passes.records) and the machine estimators
(cost_models): every number the ILP sees is made here, in seconds or bytes.

Conventions (runtime/plan.py defines the strategies):
- A layer that is not tensor-parallel computes redundantly inside its tp group, on the
  batch slice of its dp replica; its replicas span all ``dp * tp`` ranks.
- A TP layer splits its sharded FLOPs, parameters and saved activations by ``tp``.
- Communication is not overlapped with compute here (all of it is exposed).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.comm import Group, all_gather_s, all_reduce_s, collective_s, reduce_scatter_s
from cost_models.compute import optimizer_step_s, roofline_s
from cost_models.hardware import Cluster
from cost_models.memory import Precision
from passes.records import LayerInfo
from runtime.plan import TP_STRATEGIES, Mesh

CAPTURE_ACTIVATION_BYTES = 4
"""Capture runs in fp32: recorded activation sizes are scaled by precision / this."""


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    strategy: str
    compute_s: float
    comm_s: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffer_bytes: float
    """Transient memory while this layer runs (an FSDP layer's gathered parameters and
    unsharded gradient); the plan holds the largest over its layers, not the sum."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def resident_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


def allowed_strategies(layer: LayerInfo, mesh: Mesh) -> tuple[str, ...]:
    """Strategies this layer can take on this mesh."""
    options = ["replicate", "fsdp"]
    if mesh.tp > 1 and layer.tp is not None and all(d % mesh.tp == 0 for d in layer.tp.divisors):
        options += ["tp", "tp_fsdp"] if mesh.dp > 1 else ["tp"]
    return tuple(options)


def layer_cost(
    layer: LayerInfo, strategy: str, mesh: Mesh, cluster: Cluster, prec: Precision
) -> LayerCost:
    dp, tp = mesh.dp, mesh.tp
    world = dp * tp
    is_tp = strategy in TP_STRATEGIES
    act_scale = prec.activation_bytes / CAPTURE_ACTIVATION_BYTES

    # Parameters this rank holds before any data-parallel sharding.
    if is_tp:
        assert layer.tp is not None
        frac = layer.tp.sharded_param_bytes / layer.param_bytes if layer.param_bytes else 0.0
        tp_params = layer.param_count * (1 - frac + frac / tp)
    else:
        tp_params = float(layer.param_count)
    shards = {"replicate": 1, "fsdp": world, "tp": 1, "tp_fsdp": dp}[strategy]
    local_params = tp_params / shards

    fwd_local = _local_flops(layer, is_tp, dp, tp)
    ratio = fwd_local / layer.fwd_flops if layer.fwd_flops else 1.0 / dp
    bwd_local = layer.bwd_flops * ratio
    mem_local = layer.mem_bytes * ratio * act_scale
    device, dtype = cluster.device, prec.compute_dtype
    compute = (
        roofline_s(fwd_local, mem_local, layer.num_ops, device, dtype)
        + roofline_s(bwd_local, 2 * mem_local, 2 * layer.num_ops, device, dtype)
        + optimizer_step_s(local_params, prec.state_bytes, device)
    )

    saved = layer.saved_bytes * act_scale
    if is_tp:
        assert layer.tp is not None
        sharded_saved = layer.tp.sharded_saved_bytes * act_scale
        activations = (saved - sharded_saved) / dp + sharded_saved / (dp * tp)
    else:
        activations = saved / dp

    comm = _comm_s(layer, strategy, mesh, cluster, prec, tp_params, act_scale)
    buffer = 0.0
    if strategy in ("fsdp", "tp_fsdp"):
        # FSDP2 holds the gathered layer, the next one prefetched, and the unsharded gradient.
        buffer = tp_params * (2 * prec.param_bytes + prec.grad_bytes)
    return LayerCost(
        strategy=strategy,
        compute_s=compute,
        comm_s=comm,
        params_bytes=local_params * prec.param_bytes,
        grads_bytes=local_params * prec.grad_bytes,
        optimizer_bytes=local_params * prec.optimizer_bytes,
        activations_bytes=activations,
        buffer_bytes=buffer,
    )


def _local_flops(layer: LayerInfo, is_tp: bool, dp: int, tp: int) -> float:
    if not is_tp:
        return layer.fwd_flops / dp
    assert layer.tp is not None
    sharded = layer.tp.sharded_fwd_flops
    return (layer.fwd_flops - sharded) / dp + sharded / (dp * tp)


def _comm_s(
    layer: LayerInfo,
    strategy: str,
    mesh: Mesh,
    cluster: Cluster,
    prec: Precision,
    tp_params: float,
    act_scale: float,
) -> float:
    dp, tp = mesh.dp, mesh.tp
    if strategy in TP_STRATEGIES:
        assert layer.tp is not None
        tp_group = Group(tp, 1)
        t = sum(
            collective_s(c.kind, c.nbytes * act_scale / dp, tp_group, cluster)
            for c in layer.tp.collectives
        )
        dp_group = Group(dp, tp)
    else:
        t = 0.0
        dp_group = Group(dp * tp, 1)
    param_bytes = tp_params * prec.param_bytes
    grad_bytes = tp_params * prec.grad_bytes
    if strategy in ("replicate", "tp"):
        t += all_reduce_s(grad_bytes, dp_group, cluster)
    else:
        # FSDP2 default: gather for forward, reshard, gather again for backward, then
        # reduce-scatter the gradients.
        t += 2 * all_gather_s(param_bytes, dp_group, cluster)
        t += reduce_scatter_s(grad_bytes, dp_group, cluster)
    return t
