"""What context parallelism needs from the graph: the attention sites, their K/V bytes and
FLOPs, and whether the model can run on sequence chunks at all.

Context parallelism (runtime/context_parallel.py) gives every rank two chunks of each
sample's sequence and runs ``F.scaled_dot_product_attention`` as ring attention: K/V
blocks travel around the cp group. That is only exact when attention is the one op that
mixes tokens, and when the model takes the global positions of its tokens. The check here
is deliberately conservative: a model gets context parallelism only when

- its forward accepts position ids (one of POSITION_ARGUMENTS);
- it calls fused SDPA, causal, without an explicit mask or attention dropout;
- no other op multiplies two activations (``q @ k.T`` of a hand-written attention, whose
  masked s×s scores ring attention cannot replace).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.fx import GraphModule, Node

from passes import meta_keys as K
from passes.annotate import SDPA_TARGETS, op_name, sdpa_arguments

POSITION_ARGUMENTS = ("pos", "position_ids")
"""Forward parameters through which the runtime hands a rank its tokens' global positions."""

_SDPA_NAMES = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                         "_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_efficient_attention"})
_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum", "__matmul__", "mm"})


def is_attention(node: Node) -> bool:
    return node.op == "call_function" and (node.target in SDPA_TARGETS
                                           or op_name(node) in _SDPA_NAMES)


def kv_bytes(nodes: list[Node]) -> int:
    """Bytes of the keys and values the layer's attention reads (at the captured batch):
    what one ring step sends."""
    return int(sum(_bytes(n.args[i]) for n in nodes if is_attention(n) for i in (1, 2)))


def attention_flops(nodes: list[Node]) -> float:
    """Forward FLOPs of the layer's attention (the part ring steps overlap with)."""
    return float(sum(n.meta.get(K.FLOPS, 0.0) for n in nodes if is_attention(n)))


def context_parallel_problem(gm: GraphModule, model: nn.Module) -> str | None:
    """Why ``model`` cannot be context-parallel, or None when it can."""
    params = inspect.signature(model.forward).parameters
    if not any(p in params for p in POSITION_ARGUMENTS):
        return (f"{type(model).__name__}.forward takes no position ids (one of "
                f"{', '.join(POSITION_ARGUMENTS)}), so sequence chunks cannot know where they "
                "are in the sample")
    sites = [n for n in gm.graph.nodes if is_attention(n)]
    if not sites:
        return "the model calls no F.scaled_dot_product_attention (ring attention replaces it)"
    for node in sites:
        problem = _sdpa_problem(node)
        if problem:
            return f"{problem} at {_where(node)}"
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and op_name(node) in _PRODUCTS:
            operands = [a for a in node.all_input_nodes if _is_activation(a)]
            if len(operands) >= 2:
                return (f"{op_name(node)} of two activations at {_where(node)} mixes tokens "
                        "outside F.scaled_dot_product_attention (hand-written attention)")
    return None


def _sdpa_problem(node: Node) -> str | None:
    given = sdpa_arguments(node)
    if given.get("attn_mask") is not None:
        return "attention with an explicit mask"
    if given.get("dropout_p", 0.0):
        return f"attention dropout {given['dropout_p']}"
    if not given.get("is_causal", False):
        return "non-causal attention"
    return None


def _is_activation(node: Node) -> bool:
    """A floating tensor computed from the inputs (not a parameter or buffer read)."""
    if node.op == "get_attr":
        return False
    meta = node.meta.get(K.TENSOR)
    return bool(meta and meta.tensors and getattr(torch, meta.tensors[0].dtype).is_floating_point)


def _bytes(arg: object) -> int:
    meta = arg.meta.get(K.TENSOR) if isinstance(arg, Node) else None
    return sum(t.nbytes for t in meta.tensors) if meta else 0


def _where(node: Node) -> str:
    path = node.meta.get(K.MODULE_PATH) or "the model's top level"
    return f"{path} (node {node.name})"
