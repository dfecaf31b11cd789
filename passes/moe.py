"""Record which layers hold mixture-of-experts blocks, and what the capture counted for them.

The blocks are found on the model by ``runtime.moe_blocks.find_moe_blocks`` (the same
detector the expert-parallel runtime shards with). A block belongs to the layer whose
module holds both its router and its experts; one whose parts straddle layers is not
recorded (it is planned as captured, without expert parallelism).

The capture's numbers for the experts module (the sums over the representative's nodes
that ran inside it: FLOPs, saved bytes, bytes moved, kernels) are those of every expert
on one rank; the planner subtracts them and prices the experts under each expert-parallel
degree itself (autopar/planner/moe_costs.py). Layers of one class are identical, so the
representative's records serve its class.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch.nn as nn
from torch.fx import Node

from cost_models.moe import ExpertShape
from passes import meta_keys as K
from passes.group_layers import LayerGroup
from passes.memory_bound import memory_bound_bytes
from passes.records import LayerInfo, MoEInfo
from runtime.moe_blocks import MoEBlock, find_moe_blocks


def attach_moe_blocks(layers: tuple[LayerInfo, ...], groups: list[LayerGroup],
                      model: nn.Module) -> tuple[LayerInfo, ...]:
    """``layers`` with ``LayerInfo.moe`` set on the layers holding MoE blocks. ``groups``:
    the layer groups the layers were made from, their representatives annotated."""
    blocks = find_moe_blocks(model)
    if not blocks:
        return layers
    by_class: dict[str, tuple[MoEInfo, ...]] = {}
    for group in groups:
        if group.layer_class not in by_class:
            records = (_record(group, b) for b in blocks if _inside(b, group.name))
            by_class[group.layer_class] = tuple(r for r in records if r is not None)
    return tuple(replace(layer, moe=by_class.get(_class_of(layer, groups), ()))
                 for layer in layers)


def _class_of(layer: LayerInfo, groups: list[LayerGroup]) -> str:
    """The layer's class before the loss layer got one of its own (layer_graph)."""
    return next(g.layer_class for g in groups if g.name == layer.name)


def _inside(block: MoEBlock, layer: str) -> bool:
    return _under(block.router, layer) and _under(block.experts, layer)


def _under(path: str, layer: str) -> bool:
    return path == layer or path.startswith(layer + ".")


def _relative(path: str, layer: str) -> str:
    return "" if path == layer else path[len(layer) + 1:]


def _record(group: LayerGroup, block: MoEBlock) -> MoEInfo | None:
    """The block's record, or None when the capture shows no router output to count its
    tokens by (it is then planned as captured, without expert parallelism)."""
    calls = [n for n in group.nodes
             if n.op in ("call_function", "call_method", "call_module")]
    experts = [n for n in calls if _under(n.meta.get(K.MODULE_PATH, ""), block.experts)]
    saved = [n.meta[K.SAVED] for n in experts if K.SAVED in n.meta]
    shape = ExpertShape(num_experts=block.num_experts, top_k=block.top_k,
                        hidden_size=block.hidden_size,
                        intermediate_size=block.intermediate_size, gated=block.gated)
    params = [p for name, p in group.params if _under(name, block.experts)]
    tokens = _tokens(calls, block)
    if tokens is None:
        return None
    return MoEInfo(
        block=_relative(block.path, group.name),
        experts=_relative(block.experts, group.name),
        shape=shape,
        tokens=tokens,
        param_count=sum(p.numel() for p in params) or block.expert_params,
        param_tensors=len(params) or len(block.expert_param_names),
        fwd_flops=float(sum(n.meta.get(K.FLOPS, 0.0) for n in experts)),
        selective_fwd_flops=float(sum(n.meta.get(K.SELECTIVE_FLOPS, 0.0) for n in experts)),
        saved_bytes=int(sum(r.nbytes for r in saved)),
        saved_fixed_bytes=int(sum(r.fixed_nbytes for r in saved)),
        selective_saved_bytes=int(sum(r.selective_nbytes for r in saved)),
        selective_fixed_bytes=int(sum(r.selective_fixed_nbytes for r in saved)),
        mem_bytes=int(sum(n.meta.get(K.MEM_BYTES, 0) for n in experts)),
        memory_bound_bytes=memory_bound_bytes(experts),
        num_ops=sum(1 for n in experts if K.OP_KIND in n.meta and n.meta[K.OP_KIND].is_kernel),
    )


def _tokens(calls: list[Node], block: MoEBlock) -> int | None:
    """Rows the router scores: the first output under the router ending in num_experts
    (its logits [..., E])."""
    for node in calls:
        if not _under(node.meta.get(K.MODULE_PATH, ""), block.router) or \
                K.TENSOR not in node.meta:
            continue
        for t in node.meta[K.TENSOR].tensors:
            if t.shape and t.shape[-1] == block.num_experts:
                return math.prod(t.shape[:-1])
    return None
