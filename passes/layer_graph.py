"""``build_layer_graph``: model + example inputs -> ``records.LayerGraph``, the planner's view.

The steps, in order: copy the model to meta (no weights allocated) -> capture ->
annotate module paths, shapes, op kinds -> group layers and recognise identical ones ->
for one representative layer per class: FLOPs, saved-for-backward bytes, bytes moved,
tensor-parallel options -> copy the representative's numbers to its class (identical by
construction: same module class, parameter shapes, op sequence and shapes).

Capture tries ``symbolic_trace`` first here and falls back to ``torch.export``. Why: both
are sound at the captured shapes (symbolic_trace raises on control flow over tensor values
or shapes rather than specialising), and on this 2-core machine gpt3-175b (96 blocks,
batch 1536, seq 2048) captures in ~0.4 s with symbolic_trace against ~6.4 s with export,
which alone would take most of the 10 s budget for planning it on 1,024 GPUs. Hugging Face
models fail symbolic_trace at once (~10 ms) and are exported. ``autopar.capture.capture``
keeps export as the primary method for every other use.

What recomputation costs and saves comes from the same runs: saved bytes split by dtype
and by the aten op that produced each saved storage, FLOPs of the ops selective
recomputation repeats (``passes.annotate``), and the bytes of the floating tensors entering
the layer, which full recomputation keeps (``_input_bytes``), and of those the layer modifies
in place, which recomputation copies (``passes.inplace``).

Each layer also lists the GEMMs its forward runs (``LayerInfo.gemms``), named by module
relative to the layer, so the cost model can map their sizes under each option.

The layer producing the model's output also records the float32 size of that output
(``LayerInfo.loss_bytes``): the loss's memory, which the cost model charges to it. It is
read from the graph's output, per layer, after classing; a layer it sets apart from its
identical siblings gets a class of its own (``_split_loss_classes``).

Backward FLOPs follow the usual convention ``bwd_flops = 2 × fwd_flops`` (each matmul-like
op needs one matmul for the input gradient and one for the weight gradient; FlopCounterMode
counts only matmul-like ops and attention, see ``passes.annotate``). Attention backward
with recomputation (flash) is ~2.5×; the difference is inside the cost model's noise.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from passes import meta_keys as K
from passes.annotate import (
    annotate_module_paths,
    count_bytes,
    count_flops,
    count_ops,
    count_saved_bytes,
    propagate_shapes,
)
from passes.constants import constant_nodes
from passes.context_parallel import attention_flops, context_parallel_problem, kv_bytes
from passes.group_layers import (
    CALL_OPS,
    LayerGroup,
    find_ties,
    group_layers,
    owning_layer,
    read_by_others,
    stateless_layers,
)
from passes.inplace import count_inplace_inputs, inplace_input_bytes
from passes.low_precision import casts_up, saved_at_16_bits
from passes.memory_bound import memory_bound_bytes
from passes.moe import attach_moe_blocks
from passes.records import GemmShape, LayerGraph, LayerInfo, SavedSplit, TPOption
from passes.tensor_parallel import find_tensor_parallel
from passes.trace import inputs_to_meta, placeholder_values, to_meta, trace_module
from runtime.batch import Inputs, as_inputs, batch_size
from runtime.data_parallel import module_units
from runtime.stage_graphs import weight_uses

BWD_FLOPS_PER_FWD = 2.0
LOSS_DTYPE_BYTES = 4
"""The loss reads the model's output in float32 (``LayerInfo.loss_bytes``)."""


def build_layer_graph(
    model: nn.Module,
    example_inputs: object,
    *,
    model_name: str = "",
    opaque: Iterable[str] = (),
    seq_len: int | None = None,
    prefer: str = "symbolic_trace",
) -> LayerGraph:
    """Layers of ``model`` in execution order, with costs at the example inputs' batch.

    ``example_inputs``: one global batch as ``runtime.batch.as_inputs`` reads it (a
    tensor, a tuple, a dict of keyword arguments, or ``Inputs``); its batch is found as
    the runtime finds it (``runtime.batch.batch_size``).
    ``prefer``: capture method to try first ('symbolic_trace' or 'export'; see above).
    """
    start = time.perf_counter()
    opaque = tuple(opaque)
    meta_model = to_meta(model)
    inputs = inputs_to_meta(as_inputs(example_inputs))
    batch = batch_size(inputs)  # first: an input without the batch dim is named, not traced
    gm = trace_module(meta_model, inputs, opaque=opaque, prefer=prefer)
    captured = time.perf_counter()
    annotate_module_paths(gm)
    env = propagate_shapes(gm, placeholder_values(gm, inputs))
    count_ops(gm)
    groups = group_layers(gm, meta_model, opaque)
    by_class: dict[str, tuple[LayerCosts, TPOption | None]] = {}
    representative: dict[str, str] = {}
    for group in groups:
        if group.layer_class not in by_class:
            by_class[group.layer_class] = annotate_layer(gm, meta_model, group, env)
            representative[group.layer_class] = group.name
    low = _saved_low(gm, meta_model, inputs, opaque, prefer, set(representative.values()))
    loss = _loss_bytes(gm, groups)
    layers = _split_loss_classes(tuple(
        replace(_layer_info(group, *by_class[group.layer_class], loss.get(group.name, 0)),
                saved_low=low.get(representative[group.layer_class]))
        for group in groups
    ))
    layers = attach_moe_blocks(layers, groups, meta_model)
    info: K.CaptureInfo = gm.meta[K.CAPTURE]
    ties = find_ties(meta_model, groups)
    stateless = stateless_layers(meta_model, [g.name for g in groups])
    spans = _value_spans(gm, groups, stateless)
    return LayerGraph(
        layers=layers,
        batch_size=batch,
        seq_len=seq_len if seq_len is not None else _seq_len(inputs),
        param_dtype=_param_dtype(model),
        model_name=model_name,
        context_parallel_problem=context_parallel_problem(gm, model),
        uncuttable=uncuttable_boundaries(gm, groups, spans, stateless),
        boundary_bytes=boundary_bytes(len(groups), spans),
        ties=ties,
        read_by_others=read_by_others(gm, meta_model, groups),
        returns_loss=any(_is_scalar_float(a) for n in gm.graph.find_nodes(op="output")
                         for a in n.all_input_nodes),
        exported_stages=info.method == "export" or bool(inputs.kwargs) or bool(ties),
        extra={
            "capture_method": info.method,
            "capture_fallback_reason": info.fallback_reason,
            "capture_s": captured - start,
            "build_s": time.perf_counter() - start,
            "graph_nodes": len(gm.graph.nodes),
            "bwd_flops_convention": f"{BWD_FLOPS_PER_FWD:g} x fwd_flops",
            "source": "modelled",
        },
    )


def _saved_low(gm: GraphModule, meta_model: nn.Module, inputs: Inputs, opaque: tuple[str, ...],
               prefer: str, layers: set[str]) -> dict[str, SavedSplit]:
    """``LayerInfo.saved_low`` of the named layers (passes/low_precision.py): only where the
    graph casts up, and nothing where the 16-bit capture fails (the estimators then scale
    the float32 capture's bytes, as they do for every other graph)."""
    if not casts_up(gm):
        return {}
    try:
        return saved_at_16_bits(meta_model, inputs, opaque=opaque, prefer=prefer,
                                layers=layers)
    except Exception as e:  # noqa: BLE001 - a refinement; the float32 capture stands alone
        logging.getLogger(__name__).debug(
            "no 16-bit capture (%s: %s); saved activations scale the float32 capture's",
            type(e).__name__, e)
        return {}


class LayerCosts:
    """Per-layer sums over one representative's nodes."""

    def __init__(self, nodes: list[Node], layer: str) -> None:
        calls = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
        self.fwd_flops = float(sum(n.meta.get(K.FLOPS, 0.0) for n in calls))
        self.selective_fwd_flops = float(sum(n.meta.get(K.SELECTIVE_FLOPS, 0.0) for n in calls))
        saved = [n.meta[K.SAVED] for n in calls if K.SAVED in n.meta]
        self.saved_bytes = int(sum(r.nbytes for r in saved))
        self.saved_fixed_bytes = int(sum(r.fixed_nbytes for r in saved))
        self.selective_saved_bytes = int(sum(r.selective_nbytes for r in saved))
        self.selective_fixed_bytes = int(sum(r.selective_fixed_nbytes for r in saved))
        self.mem_bytes = int(sum(n.meta.get(K.MEM_BYTES, 0) for n in calls))
        self.memory_bound_bytes = memory_bound_bytes(calls)
        self.num_ops = sum(1 for n in calls if n.meta[K.OP_KIND].is_kernel)
        self.output_bytes = _output_bytes(nodes)
        self.output_last_dims = _output_last_dims(nodes)
        self.input_bytes = _input_bytes(nodes)
        self.inplace_input_bytes = inplace_input_bytes(nodes)
        self.attention_kv_bytes = kv_bytes(nodes)
        self.attention_fwd_flops = attention_flops(nodes)
        self.gemms = _gemms(calls, layer)
        self.batch_norm_channels: tuple[int, ...] = ()
        self.module_units: tuple[int, ...] = ()
        self.reuses_weights = _reuses_weights(nodes)


def annotate_layer(gm: GraphModule, model: nn.Module, group: LayerGroup,
                   env: dict[Node, object]) -> tuple[LayerCosts, TPOption | None]:
    """Run the cost passes and the TP search on one layer's nodes."""
    count_flops(gm, group.nodes, env)
    count_saved_bytes(gm, group.nodes, env)
    count_bytes(gm, group.nodes)
    count_inplace_inputs(gm, group.nodes, env)
    costs = LayerCosts(group.nodes, group.name)
    costs.batch_norm_channels = batch_norm_channels(model, group.name)
    costs.module_units = module_unit_params(model, group)
    return costs, find_tensor_parallel(gm, model, group)


def batch_norm_channels(model: nn.Module, layer: str) -> tuple[int, ...]:
    """``LayerInfo.batch_norm_channels``: the BatchNorm modules at or under ``layer`` that
    use batch statistics (training mode, or no running statistics)."""
    return tuple(m.num_features for m in model.get_submodule(layer).modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and (m.training or m.running_mean is None))


def module_unit_params(model: nn.Module, group: LayerGroup) -> tuple[int, ...]:
    """``LayerInfo.module_units``: per module unit of the layer, its parameters that the
    layer owns (a tied parameter counts in its owner's layer, as ``param_count`` does)."""
    own = {id(p) for _, p in group.params}
    counts = (sum(p.numel() for p in m.parameters(recurse=False) if id(p) in own)
              for m in module_units(model.get_submodule(group.name)))
    return tuple(n for n in counts if n)


def _layer_info(group: LayerGroup, costs: LayerCosts, tp: TPOption | None,
                loss_bytes: int) -> LayerInfo:
    return LayerInfo(
        name=group.name,
        layer_class=group.layer_class,
        index=group.index,
        param_count=sum(p.numel() for _, p in group.params),
        param_tensors=len(group.params),
        param_bytes=sum(p.numel() * p.element_size() for _, p in group.params),
        fwd_flops=costs.fwd_flops,
        bwd_flops=BWD_FLOPS_PER_FWD * costs.fwd_flops,
        saved_bytes=costs.saved_bytes,
        output_bytes=costs.output_bytes,
        mem_bytes=costs.mem_bytes,
        num_ops=costs.num_ops,
        memory_bound_bytes=costs.memory_bound_bytes,
        saved_fixed_bytes=costs.saved_fixed_bytes,
        selective_saved_bytes=costs.selective_saved_bytes,
        selective_fixed_bytes=costs.selective_fixed_bytes,
        selective_fwd_flops=costs.selective_fwd_flops,
        input_bytes=costs.input_bytes,
        inplace_input_bytes=costs.inplace_input_bytes,
        attention_kv_bytes=costs.attention_kv_bytes,
        attention_fwd_flops=costs.attention_fwd_flops,
        gemms=costs.gemms,
        tp=tp,
        loss_bytes=loss_bytes,
        batch_norm_channels=costs.batch_norm_channels,
        module_units=costs.module_units,
        output_last_dims=costs.output_last_dims,
        reuses_weights=costs.reuses_weights,
    )


def _reuses_weights(nodes: list[Node]) -> bool:
    """``LayerInfo.reuses_weights``, counted as a pipeline stage's are
    (``runtime.stage_graphs.weight_uses``)."""
    if not nodes:
        return False
    gm = nodes[0].graph.owning_module
    uses = weight_uses(gm, nodes, {id(p) for p in gm.parameters()})
    return any(n > 1 for n in uses.values())


def _loss_bytes(gm: GraphModule, groups: list[LayerGroup]) -> dict[str, int]:
    """Float32 bytes of the floating tensors the model returns, by the layer producing them
    (``LayerInfo.loss_bytes``): the runtime hands the output to the user's loss in float32
    whatever the plan's precision (runtime/precision.py casts it up at the root), so its
    size is counted at 4 bytes per element, not at the captured dtype. Every floating
    tensor returned counts (an upper bound when the loss reads only the logits).

    A model that computes its own loss (Hugging Face's ``labels=``) returns a 0-dim tensor
    made outside every layer: the layers' outputs that loss is computed from (the logits)
    count instead, each tensor once however many outputs it reaches."""
    layer_of = {n: g.name for g in groups for n in g.nodes}
    out: dict[str, int] = {}
    for node in _loss_inputs(gm, layer_of):
        floating = [t for t in node.meta[K.TENSOR].tensors
                    if getattr(torch, t.dtype).is_floating_point]
        size = sum(math.prod(t.shape) * LOSS_DTYPE_BYTES for t in floating)
        out[layer_of[node]] = out.get(layer_of[node], 0) + size
    return out


def _loss_inputs(gm: GraphModule, layer_of: dict[Node, str]) -> list[Node]:
    """The nodes whose values count as the loss's input, each once, in a stable order: the
    returned ones, except that a returned 0-dim loss the model computes in its own code
    (outside every layer's module; ``group_layers`` files such nodes under the previous
    layer) is replaced by what it is computed from in the layers' modules (the logits)."""
    names = set(layer_of.values())
    returned = [a for n in gm.graph.find_nodes(op="output") for a in n.all_input_nodes]
    found: dict[Node, None] = {}
    stack = [a for a in reversed(returned) if a in layer_of]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or node.op in ("placeholder", "get_attr"):  # inputs, weights
            continue
        seen.add(node)
        own_code = names != {""} and not owning_layer(node.meta.get(K.MODULE_PATH, ""), names)
        if own_code and (node not in returned or _is_scalar_float(node)):
            stack += reversed(node.all_input_nodes)
        elif node in layer_of and K.TENSOR in node.meta:
            found.setdefault(node)
    return list(found)


def _is_scalar_float(node: Node) -> bool:
    meta = node.meta.get(K.TENSOR)
    return (meta is not None and meta.is_tensor and meta.tensors[0].shape == ()
            and getattr(torch, meta.tensors[0].dtype).is_floating_point)


def layer_of_call(gm: GraphModule, groups: list[LayerGroup], stateless: set[str]
                  ) -> dict[Node, int]:
    """The index of the layer each node runs in, as the pipeline split places it: a call of
    a ``stateless`` layer after later layers have run belongs to the latest of them (the
    split runs it there: ``passes.split_export``, ``passes.split_stages``)."""
    index = {n: i for i, g in enumerate(groups) for n in g.nodes}
    latest = -1
    for node in gm.graph.nodes:
        i = index.get(node) if node.op in CALL_OPS else None
        if i is None:
            continue
        if i < latest and groups[i].name in stateless:
            index[node] = i = latest
        latest = max(latest, i)
    return index


def _value_spans(gm: GraphModule, groups: list[LayerGroup], stateless: set[str]
                 ) -> list[tuple[Node, int, int]]:
    """(node, made, used) for each value a later layer uses: the layer making it (-1: a model
    input), the last layer using it (the model's output is used on the last stage). A
    constant (Hugging Face Llama's boolean causal mask, its positions) is left out: each
    stage remakes it (``passes.constants``), so it crosses no cut."""
    layer_index = layer_of_call(gm, groups, stateless)
    last = len(groups) - 1
    constants = constant_nodes(gm)
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            made = -1
        elif node in layer_index and node not in constants:
            made = layer_index[node]
        else:
            continue
        used = max((last if u.op == "output" else layer_index.get(u, made) for u in node.users),
                   default=made)
        if used > max(made, 0):
            out.append((node, made, used))
    return out


def uncuttable_boundaries(gm: GraphModule, groups: list[LayerGroup],
                          spans: list[tuple[Node, int, int]],
                          stateless: set[str]) -> frozenset[int]:
    """Indices k at which no pipeline stage may start (``LayerGraph.uncuttable``):

    - a stage starting at layer k would receive a value that is not a tensor (a Python
      value made at the model's top level). A value made in layer i (or an input: before
      layer 0) and used in layer j > i (``spans``, from ``_value_spans``) crosses every
      cut i < k <= j.
      Python values made inside a layer are not checked: the runtime's split keeps each
      layer whole and traces such values inside it.
    - layer k runs between two calls of an earlier layer i (one module called again after
      others): layer i is on one stage, so the layers between its calls are too; unless
      layer i is ``stateless`` (``passes.group_layers.stateless_layers``): the split runs
      its later calls on the stage of the layers around them."""
    layer_index = layer_of_call(gm, groups, stateless)
    out: set[int] = set()
    latest = -1  # the highest layer index run so far
    for node in gm.graph.nodes:
        i = layer_index.get(node) if node.op in CALL_OPS else None
        if i is not None and i < latest:  # layer i again, after layers up to `latest`
            out.update(range(i + 1, latest + 1))
        latest = max(latest, -1 if i is None else i)
    for node, made, used in spans:
        if not _sendable(node, inside_layer=made >= 0):
            out.update(range(max(made, 0) + 1, used + 1))
    return frozenset(out)


def boundary_bytes(layers: int, spans: list[tuple[Node, int, int]]) -> tuple[int, ...]:
    """``LayerGraph.boundary_bytes`` of ``layers`` layers: a value made in layer i (or an
    input: before layer 0) and used in layer j > i (``spans``) crosses every cut between
    them, as the split sends it (``passes.split_export``'s pass-through); its tensors count,
    integer ones (token ids, positions) included."""
    change = [0] * (layers + 1)  # += where a value starts crossing, -= where it stops
    for node, made, used in spans:
        if node.op == "get_attr" or K.TENSOR not in node.meta:
            continue  # a parameter: each stage holds its own
        nbytes = sum(t.nbytes for t in node.meta[K.TENSOR].tensors)
        change[max(made, 0)] += nbytes
        change[used] -= nbytes
    return tuple(itertools.accumulate(change[:-1]))


def _sendable(node: Node, *, inside_layer: bool) -> bool:
    """A tensor of any dtype crosses a cut; a Python value made at the model's top level
    would have to cross as is, and cannot."""
    meta = node.meta.get(K.TENSOR)
    if meta is not None and meta.tensors:
        return True
    return inside_layer and node.meta.get(K.MODULE_PATH, "") != ""


def _split_loss_classes(layers: tuple[LayerInfo, ...]) -> tuple[LayerInfo, ...]:
    """A layer whose output is the model's (``loss_bytes`` > 0) costs more than its
    identical siblings (a stack of blocks whose last one is returned), and the planner
    solves a class once from its first member: give it a class of its own."""
    loss_by_class: dict[str, set[int]] = {}
    for layer in layers:
        loss_by_class.setdefault(layer.layer_class, set()).add(layer.loss_bytes)
    out = []
    for layer in layers:
        values = loss_by_class[layer.layer_class]
        nonzero = sorted(v for v in values if v)
        if len(values) > 1 and layer.loss_bytes:
            suffix = "" if len(nonzero) == 1 else str(nonzero.index(layer.loss_bytes))
            layer = replace(layer, layer_class=f"{layer.layer_class}+loss{suffix}")
        out.append(layer)
    return tuple(out)


def _gemms(calls: list[Node], layer: str) -> tuple[GemmShape, ...]:
    """The GEMMs of the layer's nodes, each named by the module that ran it relative to the
    layer, as ``TPOption.styles`` names modules (a called Linear is its own module)."""
    out: list[GemmShape] = []
    for node in calls:
        path = str(node.target) if node.op == "call_module" else node.meta[K.MODULE_PATH]
        rel = "" if path == layer else path.removeprefix(layer + "." if layer else "")
        out += [replace(g, module=rel) for g in node.meta.get(K.GEMMS, ())]
    return tuple(out)


def _output_bytes(nodes: list[Node]) -> int:
    """Bytes of the tensors the layer hands to later layers (or returns)."""
    inside = set(nodes)
    out = [n for n in nodes if n.op != "get_attr" and any(u not in inside for u in n.users)]
    return int(sum(n.meta[K.TENSOR].nbytes for n in out if K.TENSOR in n.meta))


def _output_last_dims(nodes: list[Node]) -> tuple[int, ...]:
    """``LayerInfo.output_last_dims``: of the floating tensors ``_output_bytes`` counts."""
    inside = set(nodes)
    out = [n for n in nodes if n.op != "get_attr" and any(u not in inside for u in n.users)]
    return tuple(t.shape[-1] if t.shape else 1 for n in out if K.TENSOR in n.meta
                 for t in n.meta[K.TENSOR].tensors if getattr(torch, t.dtype).is_floating_point)


def _input_bytes(nodes: list[Node]) -> int:
    """Bytes of the floating tensors the layer reads from earlier layers or the model's
    inputs (parameters and buffers excluded): what a checkpoint of the layer keeps.
    Token ids and other integer inputs are left out, as LayerInfo.input_bytes says."""
    inside = set(nodes)
    outside = {a for n in nodes for a in n.all_input_nodes
               if a not in inside and a.op != "get_attr" and K.TENSOR in a.meta}
    return int(sum(t.nbytes for a in outside for t in a.meta[K.TENSOR].tensors
                   if getattr(torch, t.dtype).is_floating_point))


def _seq_len(inputs: Inputs) -> int | None:
    leaves = pytree.tree_leaves((inputs.args, dict(inputs.kwargs)))
    first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
    if first is not None and first.dim() >= 2 and not first.is_floating_point():
        return int(first.shape[1])  # token ids [batch, seq]
    return None


def _param_dtype(model: nn.Module) -> str:
    counts = Counter(str(p.dtype) for p in model.parameters())
    return counts.most_common(1)[0][0].removeprefix("torch.") if counts else "float32"


__all__ = ["build_layer_graph", "annotate_layer", "BWD_FLOPS_PER_FWD"]
