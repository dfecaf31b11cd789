"""Synthetic layer graphs and clusters for planner tests (no capture needed)."""

from __future__ import annotations

from cost_models.hardware import Cluster, Device, Link, Overlap
from passes.records import Collective, LayerGraph, LayerInfo, TPOption

GiB = 1024**3


def make_layer(name: str, cls: str, index: int, *, params: int, fwd_flops: float,
               saved_bytes: int, act_bytes: int, tp: bool = True, divisor: int = 64
               ) -> LayerInfo:
    """A transformer-ish layer: most FLOPs and activations split under TP."""
    option = None
    if tp:
        option = TPOption(
            styles={"fc_in": "colwise", "fc_out": "rowwise"},
            divisors=(divisor,),
            sharded_param_bytes=int(params * 4 * 0.99),
            sharded_fwd_flops=fwd_flops * 0.95,
            sharded_saved_bytes=int(saved_bytes * 0.7),
            collectives=(
                Collective(kind="all_reduce", nbytes=act_bytes, phase="fwd"),
                Collective(kind="all_reduce", nbytes=act_bytes, phase="bwd"),
            ),
        )
    return LayerInfo(name=name, layer_class=cls, index=index, param_count=params,
                     param_bytes=params * 4, fwd_flops=fwd_flops, bwd_flops=2 * fwd_flops,
                     saved_bytes=saved_bytes, output_bytes=act_bytes, mem_bytes=3 * act_bytes,
                     num_ops=10, input_bytes=act_bytes, tp=option)


def make_cluster(*, nodes: int = 1, per_node: int = 4, memory_bytes: int = 80 * GiB,
                 margin: float = 0.1, overlap: Overlap | None = None) -> Cluster:
    return Cluster(
        name="test",
        device=Device(name="test-gpu", peak_flops={"float32": 100e12, "bfloat16": 400e12},
                      memory_bytes=memory_bytes, memory_bandwidth_GBps=2000.0),
        nodes=nodes, devices_per_node=per_node,
        intra_node=Link(kind="nvlink", bandwidth_GBps=200.0, latency_s=5e-6),
        inter_node=Link(kind="network", bandwidth_GBps=20.0, latency_s=10e-6),
        memory_margin_fraction=margin,
        overlap=overlap or Overlap(),
    )


def graph_of(layers: list[LayerInfo], batch: int) -> LayerGraph:
    return LayerGraph(layers=tuple(layers), batch_size=batch, model_name="synthetic")
