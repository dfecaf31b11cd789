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


WGRAD_FRACTION = 0.5
"""Share of backward compute that computes weight gradients: a matmul's backward is two
matmuls of the forward's size, one for the input gradient and one for the weight gradient.
Zero-bubble schedules run it as a separate W pass."""


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    strategy: str
    microbatches: int
    fwd_s: float
    """Per micro-batch: forward compute, TP collectives, FSDP all-gather."""
    bwd_s: float
    """Per micro-batch: input-gradient compute, TP collectives, FSDP all-gather."""
    wgrad_s: float
    """Per micro-batch: weight-gradient compute."""
    step_s: float
    """Per step: data-parallel gradient reduction and the optimizer step."""
    compute_s: float
    """Per step, all compute (micro-batches and optimizer)."""
    comm_s: float
    """Per step, all communication."""
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    """Saved activations of one micro-batch."""
    buffer_bytes: float
    """Transient memory while this layer runs (an FSDP layer's gathered parameters and
    unsharded gradient); the plan holds the largest over its layers, not the sum."""
    output_bytes: float
    """The layer's output for one micro-batch (what crosses a pipeline stage boundary)."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def states_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def resident_bytes(self) -> float:
        """States plus the activations of one micro-batch in flight."""
        return self.states_bytes + self.activations_bytes

    def resident_with(self, inflight: int) -> float:
        return self.states_bytes + inflight * self.activations_bytes


def allowed_strategies(layer: LayerInfo, mesh: Mesh) -> tuple[str, ...]:
    """Strategies this layer can take on this mesh."""
    options = ["replicate", "fsdp"]
    if mesh.tp > 1 and layer.tp is not None and all(d % mesh.tp == 0 for d in layer.tp.divisors):
        options += ["tp", "tp_fsdp"] if mesh.dp > 1 else ["tp"]
    return tuple(options)


def layer_cost(
    layer: LayerInfo,
    strategy: str,
    mesh: Mesh,
    cluster: Cluster,
    prec: Precision,
    microbatches: int = 1,
) -> LayerCost:
    dp, tp, m = mesh.dp, mesh.tp, microbatches
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

    # One micro-batch is 1 / (dp · m) of the captured global batch.
    fwd_flops = _local_flops(layer, is_tp, dp * m, tp)
    ratio = fwd_flops / layer.fwd_flops if layer.fwd_flops else 1.0 / (dp * m)
    mem = layer.mem_bytes * ratio * act_scale
    device, dtype = cluster.device, prec.compute_dtype
    fwd_compute = roofline_s(fwd_flops, mem, layer.num_ops, device, dtype)
    bwd_compute = roofline_s(layer.bwd_flops * ratio, 2 * mem, 2 * layer.num_ops, device, dtype)
    optimizer = optimizer_step_s(local_params, prec.state_bytes, device)

    saved = layer.saved_bytes * act_scale / (dp * m)
    if is_tp:
        assert layer.tp is not None
        sharded_saved = layer.tp.sharded_saved_bytes * act_scale / (dp * m)
        activations = saved - sharded_saved + sharded_saved / tp
    else:
        activations = saved

    tp_fwd, tp_bwd = _tp_comm_s(layer, strategy, mesh, cluster, act_scale / (dp * m))
    gather, sync = _dp_comm_s(strategy, mesh, cluster, prec, tp_params)
    buffer = 0.0
    if strategy in ("fsdp", "tp_fsdp"):
        # FSDP2 holds the gathered layer, the next one prefetched, and the unsharded gradient.
        buffer = tp_params * (2 * prec.param_bytes + prec.grad_bytes)
    return LayerCost(
        strategy=strategy,
        microbatches=m,
        fwd_s=fwd_compute + tp_fwd + gather,
        bwd_s=(1 - WGRAD_FRACTION) * bwd_compute + tp_bwd + gather,
        wgrad_s=WGRAD_FRACTION * bwd_compute,
        step_s=sync + optimizer,
        compute_s=m * (fwd_compute + bwd_compute) + optimizer,
        comm_s=m * (tp_fwd + tp_bwd + 2 * gather) + sync,
        params_bytes=local_params * prec.param_bytes,
        grads_bytes=local_params * prec.grad_bytes,
        optimizer_bytes=local_params * prec.optimizer_bytes,
        activations_bytes=activations,
        buffer_bytes=buffer,
        output_bytes=layer.output_bytes * act_scale / (dp * m),
    )


def _local_flops(layer: LayerInfo, is_tp: bool, batch_shards: int, tp: int) -> float:
    if not is_tp:
        return layer.fwd_flops / batch_shards
    assert layer.tp is not None
    sharded = layer.tp.sharded_fwd_flops
    return (layer.fwd_flops - sharded) / batch_shards + sharded / (batch_shards * tp)


def _tp_comm_s(layer: LayerInfo, strategy: str, mesh: Mesh, cluster: Cluster,
               scale: float) -> tuple[float, float]:
    """Forward and backward tensor-parallel collectives of one micro-batch."""
    if strategy not in TP_STRATEGIES:
        return 0.0, 0.0
    assert layer.tp is not None
    group = Group(mesh.tp, 1)
    times = {"fwd": 0.0, "bwd": 0.0}
    for c in layer.tp.collectives:
        times[c.phase] += collective_s(c.kind, c.nbytes * scale, group, cluster)
    return times["fwd"], times["bwd"]


def _dp_comm_s(strategy: str, mesh: Mesh, cluster: Cluster, prec: Precision,
               tp_params: float) -> tuple[float, float]:
    """(FSDP all-gather before each use, per micro-batch; gradient reduction, per step)."""
    dp, tp = mesh.dp, mesh.tp
    group = Group(dp, tp) if strategy in TP_STRATEGIES else Group(dp * tp, 1)
    param_bytes = tp_params * prec.param_bytes
    grad_bytes = tp_params * prec.grad_bytes
    if strategy in ("replicate", "tp"):
        return 0.0, all_reduce_s(grad_bytes, group, cluster)
    # FSDP2 default: gather for forward, reshard, gather again for backward; gradients are
    # reduce-scattered once, after the last micro-batch.
    return all_gather_s(param_bytes, group, cluster), reduce_scatter_s(grad_bytes, group, cluster)
