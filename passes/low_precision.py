"""What each layer saves for backward when it runs in 16 bits, where scaling the float32
capture would be wrong.

The capture runs in float32, and a mixed-precision plan's activations are mostly half its
bytes. Not where the model casts up: RMSNorm's ``hidden_states.to(torch.float32)``, a
float32 softmax. At 16 bits each is a 4-byte copy that autograd saves; in a float32
capture the same line returns its input, and the graph cannot even tell that cast from the
cast back (``.to(input_dtype)`` was ``.to(float32)`` too; torch.export merges the no-op
into its input's other uses). So where a graph has such casts, the model is captured once
more with 16-bit parameters and inputs, as FSDP2's MixedPrecisionPolicy runs it (buffers
stay float32), and each layer's saved bytes are counted there (``LayerInfo.saved_low``).
Graphs without them scale exactly and pay nothing.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from passes import meta_keys as K
from passes.annotate import (
    annotate_module_paths,
    count_ops,
    count_saved_bytes,
    op_name,
    propagate_shapes,
)
from passes.group_layers import group_layers
from passes.records import SavedSplit
from passes.trace import placeholder_values, trace_module
from runtime.batch import Inputs

LOW_PRECISION = torch.bfloat16
"""The 16-bit dtype of the second capture (float16 saves the same bytes)."""
_CAST_METHODS = frozenset({"to", "float", "type", "_to_copy"})


def casts_up(gm: GraphModule) -> bool:
    """Whether the float32 graph casts anything to float32 explicitly (``.float()``,
    ``.to(torch.float32)``, a ``dtype=torch.float32`` argument): what a 16-bit run keeps
    at 4 bytes."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if op_name(node) == "float" or node.kwargs.get("dtype") is torch.float32:
            return True
        if op_name(node) in _CAST_METHODS and torch.float32 in node.args[1:]:
            return True
    return False


def saved_at_16_bits(meta_model: nn.Module, inputs: Inputs, *, opaque: tuple[str, ...],
                     prefer: str, layers: set[str]) -> dict[str, SavedSplit]:
    """Saved bytes of each named layer in a 16-bit capture of the model, in that run's
    bytes; a layer missing from the result had no counterpart there."""
    low = _with_parameters_in(meta_model, LOW_PRECISION)
    low_inputs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(LOW_PRECISION) if t.is_floating_point() else t, inputs)
    gm = trace_module(low, low_inputs, opaque=opaque, prefer=prefer)
    annotate_module_paths(gm)
    env = propagate_shapes(gm, placeholder_values(gm, low_inputs))
    count_ops(gm)
    out: dict[str, SavedSplit] = {}
    for group in group_layers(gm, low, opaque):
        if group.name not in layers:
            continue
        count_saved_bytes(gm, group.nodes, env)
        records = [n.meta[K.SAVED] for n in group.nodes if K.SAVED in n.meta]
        out[group.name] = SavedSplit(
            floating=sum(r.nbytes - r.fixed_nbytes for r in records),
            fixed=sum(r.fixed_nbytes for r in records),
            freed=sum(r.selective_nbytes for r in records),
            freed_fixed=sum(r.selective_fixed_nbytes for r in records))
    return out


def _with_parameters_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A structural copy of the meta ``model`` whose floating parameters are ``dtype``
    (tied ones stay tied); buffers are shared, not cast, as FSDP2 leaves them."""
    memo: dict[int, object] = {id(b): b for b in model.buffers()}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(
                torch.empty_like(p, dtype=dtype if p.is_floating_point() else p.dtype),
                p.requires_grad)
    return copy.deepcopy(model, memo)
