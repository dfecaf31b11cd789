"""Plans of a real model (gpt-small captured on meta) written by hand for the export tests:
each sets the fields an engine export must carry, with known values."""

from __future__ import annotations

from functools import cache

from autopar.zoo import get_model
from passes.layer_graph import build_layer_graph
from passes.records import LayerGraph
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan
from runtime.strategies import spec

BATCH, SEQ = 64, 64
TP_OF = {"replicate": "tp", "zero1": "tp_zero1", "zero2": "tp_zero2", "fsdp": "tp_fsdp",
         "hsdp": "tp_fsdp"}
"""The tensor-parallel strategy of a layer that splits, by the plan's data-parallel one."""


@cache
def gpt_small() -> LayerGraph:
    """gpt-small: wte, wpe, four identical blocks h.0-h.3, ln_f, lm_head."""
    model = get_model("gpt-small")
    inputs = model.example_inputs(BATCH, SEQ, device="meta")
    return build_layer_graph(model.build("meta"), inputs, model_name=model.name, seq_len=SEQ)


def plan_of(*, mesh: Mesh, strategy: str = "replicate", recompute: tuple[str, ...] = (),
            stages: tuple[int, ...] | None = None, pipeline: PipelineSpec | None = None,
            sequence_parallel: bool = False, offload: bool = False,
            overrides: dict[str, str] | None = None, **plan_fields) -> Plan:
    """Every layer ``strategy`` (its TP variant where mesh.tp > 1 and the layer splits),
    ``recompute[k]`` for block k, ``stages[i]`` for layer i, ``overrides`` per module."""
    graph = gpt_small()
    layers = []
    for i, layer in enumerate(graph.layers):
        name = (overrides or {}).get(layer.name, strategy)
        if mesh.tp > 1 and layer.tp is not None:
            name = TP_OF[name]
        is_tp = spec(name).tensor_parallel
        block = layer.name.startswith("h.")
        layers.append(LayerPlan(
            module=layer.name, layer_class=layer.layer_class, strategy=name,
            tp_styles=dict(layer.tp.styles) if is_tp else {},
            stage=stages[i] if stages else 0,
            recompute=recompute[int(layer.name[2:])] if block and recompute else "none",
            sequence_parallel=sequence_parallel and is_tp and layer.tp.sp_collectives is not None,
            offload=offload and spec(name).offloadable))
    return Plan(model="gpt-small", cluster="test", global_batch=BATCH, seq_len=SEQ, mesh=mesh,
                layers=tuple(layers), pipeline=pipeline, **plan_fields)


INTERLEAVED = dict(
    mesh=Mesh(pp=2, dp=2, tp=2), strategy="zero1", recompute=("full",) * 4,
    stages=(0, 0, 0, 1, 2, 3, 3, 3), sequence_parallel=True, param_dtype="bfloat16",
    pipeline=PipelineSpec(schedule="Interleaved1F1B", num_microbatches=4, virtual_stages=2))
"""An interleaved pp 2 × dp 2 × tp 2 plan with SP and full recomputation, which every
engine export is asked to carry whole."""
