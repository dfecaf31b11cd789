"""Find Megatron tensor-parallel splits of a layer that provably give one device's results.

Detected from the graph, not from class names. A split is offered only when every tensor
it shards flows through ops that are exact on shards, ending in a row-parallel Linear
(whose all-reduce restores the full tensor):

- MLP: Linear A (colwise) -> elementwise ops (gelu/relu/silu/dropout/..., or the product
  of two colwise outputs, as in SwiGLU) -> Linear B (rowwise).
- Attention: q/k/v Linears (colwise) -> view splitting features into (heads, head_dim) ->
  transpose -> scaled_dot_product_attention -> transpose -> reshape -> out Linear (rowwise).
  The degree must divide the number of heads (of kv heads under grouped-query attention).
  On the way, ops along other dims act per head shard: Hugging Face's rotary embedding
  (halves of head_dim sliced, negated and concatenated, cos/sin broadcast over heads),
  its ``repeat_kv`` (unsqueeze, expand) and reductions over head_dim. A tensor that needs
  a gradient and is broadcast over the heads (Qwen3's per-head norm weight, a learned bias
  shared by heads) gets no split: each rank's gradient of it would sum its own heads only.
  Limitation: only head *alignment* can be checked; the model's reshapes must read the
  head count from the tensor (``view(B, T, -1, hd)``, as autopar.zoo does). A literal
  head count with every other size literal fails loudly on a shard; with another size
  inferred (Hugging Face OPT's ``view(b, -1, num_heads, hd)``) the inferred size would
  silently take the shard's smaller extent and regroup the wrong elements, so such a view
  gets no split.
- A layer that is one ``nn.Linear`` -> ``colwise_gather``; one ``nn.Embedding`` ->
  ``embedding_rowwise``.

Anything else (fused qkv Conv1D as in Hugging Face GPT-2, a sharded tensor meeting a bias
add or leaving the layer, tied weights) gets no option.

Collectives (Megatron f/g operators; bytes of the full tensor at the captured batch): each
rowwise output all-reduced forward; each distinct colwise input all-reduced backward;
colwise_gather all-gathers its output forward and all-reduces its input backward;
embedding_rowwise all-reduces its output forward.

Sequence parallelism (Korthikanti et al. 2022) is offered on top of a block's split when
the graph shows that everything outside the TP regions acts per token, so it can run on
sequence shards (dim 1 of the [batch, seq, hidden] residual stream):

- the layer reads one floating [b, s, h] tensor from outside (the residual stream) and
  hands one of the same shape on; every node of the layer runs under the layer's module
  (no root ops joined). What else it reads from outside (rotary tables, masks) is whole
  on every rank and needs no gradient (a gradient taken on shards would be partial), and
  may be read inside the gathered parents or where it is constant along the sequence;
- every node outside the TP-sharded set that touches the residual stream is a norm over
  the last dim, dropout, an element-wise op (anything it combines with the stream is
  constant along the sequence) or a reduction over the last dim; shape reads of the
  stream, views and token-mixing ops are refused;
- each distinct colwise input is gathered once (one all-gather along the sequence) where
  the runtime gathers it: on entry to the colwise Linears' parent module when that is a
  submodule of the layer (torchtitan's ``PrepareModuleInput`` on ``attention``), which
  must read no other value made on shards and may read the gathered tensor only through the
  colwise Linears and shape queries (those then see the whole sequence); at each colwise
  Linear when they sit directly in the layer;
- parameters used on sequence shards belong to submodules run wholly on shards; those
  submodules get the 'sequence_parallel' style (their gradients are then reduced over
  the tp group by DTensor), and there is at least one.

Each gather is an all-gather forward and a reduce-scatter backward; each rowwise output
is reduce-scattered forward and all-gathered backward (full-tensor bytes, as above).
``sp_saved_bytes`` is what the ops run on shards save (norm inputs and statistics,
dropout masks, ...); the gathered colwise inputs are not among them: the colwise Linears
save the gathered, whole-sequence tensor, as under plain TP.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from passes import meta_keys as K
from passes.annotate import SDPA_TARGETS, fail, needs_grad, op_name, sdpa_arguments
from passes.group_layers import LayerGroup
from passes.memory_bound import memory_bound_bytes
from passes.records import Collective, SavedSplit, TPOption

_UNARY = {"gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "erf", "neg", "contiguous",
          "clone", "alias", "pow", "mul", "add", "sub", "div", "truediv", "to", "_to_copy",
          "type_as", "float", "half", "bfloat16", "relu_", "gelu_", "dropout_", "feature_dropout",
          "rsqrt", "sqrt", "exp", "log", "abs"}
_BINARY = {"mul", "add", "sub", "div", "truediv"}
_MASKED = {"masked_fill", "masked_fill_", "where"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
_BATCHED_PRODUCTS = {"matmul", "__matmul__", "bmm"}
_UNARY_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)
_VIEWS = {"view", "reshape", "_unsafe_view"}
_LINEAR_TARGETS = (torch.ops.aten.linear.default, F.linear)
_EMBEDDING_TARGETS = (torch.ops.aten.embedding.default, F.embedding)

State = tuple[int, int]  # (sharded dim, unit): the TP degree must divide unit


class _Reject(Exception):
    """This seed set gives no exact split."""


def find_tensor_parallel(gm: GraphModule, model: nn.Module, group: LayerGroup
                         ) -> TPOption | None:
    """TP_STYLE on the split nodes; returns the option, or None when no exact split is known.

    Needs TENSOR, MODULE_PATH, FLOPS and SAVED on the group's nodes.
    """
    if group.tied:
        return None
    try:
        module = model.get_submodule(group.name)
        if isinstance(module, nn.Linear):
            return _single_linear(gm, model, group)
        if isinstance(module, nn.Embedding):
            return _single_embedding(gm, model, group, module)
        return _blocks(gm, model, group)
    except _Reject:
        return None
    except Exception as e:
        raise fail("find_tensor_parallel", group.nodes[0], e) from e


# -- single-module layers -------------------------------------------------------------------


def _single_linear(gm: GraphModule, model: nn.Module, group: LayerGroup) -> TPOption | None:
    nodes = [n for n in group.nodes if linear_of(gm, model, n) is not None]
    if len(nodes) != 1 or linear_of(gm, model, nodes[0])[0] != group.name:
        return None
    node = nodes[0]
    _, lin = linear_of(gm, model, node)
    node.meta[K.TP_STYLE] = "colwise_gather"
    return TPOption(
        styles={"": "colwise_gather"},
        divisors=(lin.out_features,),
        sharded_param_bytes=_nbytes(lin.weight) + _nbytes(lin.bias),
        sharded_fwd_flops=node.meta[K.FLOPS],
        sharded_saved_bytes=0,
        collectives=(
            Collective(kind="all_gather", nbytes=_bytes(node), phase="fwd"),
            Collective(kind="all_reduce", nbytes=_bytes(node.args[0]), phase="bwd"),
        ),
    )


def _single_embedding(gm: GraphModule, model: nn.Module, group: LayerGroup,
                      emb: nn.Embedding) -> TPOption | None:
    nodes = [n for n in group.nodes if _is_embedding(gm, model, n, group.name)]
    calls = [n for n in group.nodes if n.meta[K.MODULE_PATH] == group.name
             and n.op != "get_attr" and op_name(n) not in ("getattr", "getitem")]
    if len(nodes) != 1 or len(calls) != 1 or emb.max_norm is not None:
        return None  # max_norm renormalises rows in place, across shards
    node = nodes[0]
    node.meta[K.TP_STYLE] = "embedding_rowwise"
    return TPOption(
        styles={"": "embedding_rowwise"},
        divisors=(emb.num_embeddings,),
        sharded_param_bytes=_nbytes(emb.weight),
        sharded_fwd_flops=0.0,
        sharded_saved_bytes=0,
        collectives=(Collective(kind="all_reduce", nbytes=_bytes(node), phase="fwd"),),
    )


def _is_embedding(gm: GraphModule, model: nn.Module, node: Node, path: str) -> bool:
    if node.op == "call_module":
        return node.target == path and isinstance(gm.get_submodule(path), nn.Embedding)
    return node.target in _EMBEDDING_TARGETS and node.meta[K.MODULE_PATH] == path


# -- blocks: column -> row regions -----------------------------------------------------------


def _blocks(gm: GraphModule, model: nn.Module, group: LayerGroup) -> TPOption | None:
    inside = set(group.nodes)
    linears = [n for n in group.nodes if linear_of(gm, model, n) is not None]
    colwise: set[Node] = set()
    rowwise: set[Node] = set()
    states: dict[Node, State] = {}
    units: list[int] = []
    for seed in linears:
        if seed in colwise or seed in rowwise:
            continue
        trial = {seed}
        for _ in range(len(linears)):
            try:
                result = _propagate(gm, model, group, inside, trial)
            except _Reject:
                result = None
                break
            need, rows, found, found_units = result
            if not need:
                break
            trial |= need
        if result is None or need or rows & (colwise | trial) or trial & rowwise:
            continue
        colwise |= trial
        rowwise |= rows
        states |= found
        units += [u for u in found_units if u not in units]
    if not colwise:
        return None
    return _option(gm, model, group, colwise, rowwise, states, units)


def _propagate(gm, model, group, inside, seeds):
    """Sweep the layer in graph order from colwise ``seeds``.

    Returns (more seeds needed, rowwise linears, sharded states, divisors).
    """
    states: dict[Node, State] = {}
    for s in seeds:
        states[s] = (_ndim(s) - 1, linear_of(gm, model, s)[1].out_features)
    need: set[Node] = set()
    rows: set[Node] = set()
    units: list[int] = []
    for node in group.nodes:
        if node in seeds:
            if node.args[0] in states:
                raise _Reject
            continue
        sharded = [a for a in node.all_input_nodes if a in states]
        if not sharded:
            continue
        if linear_of(gm, model, node) is not None:
            dim, unit = states[node.args[0]] if node.args[0] in states else (-1, 0)
            if node.args[0] not in states or dim != _ndim(node.args[0]) - 1 or len(sharded) > 1:
                raise _Reject
            rows.add(node)
            units.append(unit)
            continue
        new = _rule(gm, node, states, need, seeds, model)
        if new is None:
            continue  # waiting for co-seeds
        states[node] = new
    for node in states:
        for user in node.users:
            if user not in inside or user.op == "output":
                raise _Reject  # a shard would leave the layer
    if need - inside:
        raise _Reject  # the operand comes from a Linear of another layer
    return need, rows, states, units


def _rule(gm, node: Node, states: dict[Node, State], need: set[Node], seeds, model
          ) -> State | None:
    name = op_name(node)
    if node.op == "call_module":
        if not isinstance(gm.get_submodule(str(node.target)), _UNARY_MODULES):
            raise _Reject
        return states[node.args[0]]
    if node.op == "call_function" and node.target in SDPA_TARGETS:
        return _sdpa(node, states, need, seeds, gm, model)
    if name in _VIEWS:
        return _view(node, states[node.args[0]])
    if name == "transpose":
        return _transpose(node, states[node.args[0]])
    if name == "permute":
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dim, unit = states[node.args[0]]
        return [d % _ndim(node) for d in dims].index(dim), unit
    if name in _UNARY or name in _BINARY or name in _MASKED:
        return _elementwise(node, states, need, seeds, gm, model)
    if name in _SOFTMAX:
        return _softmax(node, states[node.args[0]])
    if name in ("size", "sym_size"):
        _size_of_unsharded_dim(node, states[node.args[0]])
        return None  # an int, the same on every shard
    if name == "_assert_tensor_metadata":
        return None  # export's dtype check at a `.to()`, no output: eager runs none
    if name in ("mean", "sum", "amax", "amin"):  # (self, dim, keepdim, ...) in each
        return _reduction(node, states[node.args[0]])
    if name == "unsqueeze":
        return _unsqueeze(node, states[node.args[0]])
    if name == "expand":
        return _expand(node, states[node.args[0]])
    if name == "slice":
        return _slice(node, states[node.args[0]])
    if name == "cat":
        return _cat(node, states, need, seeds, gm, model)
    if name in _BATCHED_PRODUCTS:
        return _batched_product(node, states, need, seeds, gm, model)
    raise _Reject


def _dim_arg(node: Node, default: int | None = None) -> int | None:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", default)
    return dim if isinstance(dim, int) else None


def _reduction(node: Node, state: State) -> State:
    """A reduction over other dims acts per shard (Qwen3's RMSNorm over head_dim)."""
    dim, unit = state
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    ndim = _ndim(node.args[0])
    if not dims or any(not isinstance(d, int) for d in dims) or \
            dim in {d % ndim for d in dims}:
        raise _Reject
    return (dim if keep else dim - sum(d % ndim < dim for d in dims)), unit


def _unsqueeze(node: Node, state: State) -> State:
    """A new dim of size 1 (Hugging Face's ``repeat_kv``: ``x[:, :, None]`` under export)."""
    dim, unit = state
    new = _dim_arg(node)
    if new is None:
        raise _Reject
    return (dim + 1 if new % _ndim(node) <= dim else dim), unit


def _expand(node: Node, state: State) -> State:
    """Broadcast along other dims (Hugging Face's ``repeat_kv``: kv heads expanded to
    (kv heads, groups)). The sharded dim keeps its extent; were it given as a literal it
    would broadcast a one-head shard to the whole extent, which then meets the
    shard-sized operands it is combined with (the query heads) or the row-parallel
    Linear's weight: a loud shape error, never a silent one."""
    dim, unit = state
    s_in, s_out = _shape(node.args[0]), _shape(node)
    out_dim = dim + len(s_out) - len(s_in)
    if s_out[out_dim] != s_in[dim]:
        raise _Reject
    return out_dim, unit


def _slice(node: Node, state: State) -> State:
    """A slice along another dim (rotary embedding's halves of head_dim) acts per shard."""
    dim, unit = state
    along = _dim_arg(node, 0)
    if along is None or along % _ndim(node) == dim:
        raise _Reject
    return state


def _cat(node, states, need, seeds, gm, model) -> State | None:
    """Concatenation along another dim of tensors sharded alike (``rotate_half``)."""
    parts, along = node.args[0], _dim_arg(node, 0)
    if not isinstance(parts, (list, tuple)) or not all(isinstance(t, Node) for t in parts) \
            or along is None:
        raise _Reject
    if _await_operands(parts, states, need, seeds, gm, model):
        return None
    found = {states[t][0] for t in parts}
    (dim,) = found if len(found) == 1 else (None,)
    if dim is None or along % _ndim(node) == dim or \
            any(_ndim(t) != _ndim(node) for t in parts):
        raise _Reject
    return dim, math.gcd(*(states[t][1] for t in parts))


def _size_of_unsharded_dim(node: Node, state: State) -> None:
    """``x.size(d)`` reads the same value on every shard unless d is the sharded dim."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dim, int) or dim % _ndim(node.args[0]) == state[0]:
        raise _Reject


def _softmax(node: Node, state: State) -> State:
    """Softmax over a dim other than the sharded one acts within each shard."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dim, int) or dim % _ndim(node) == state[0]:
        raise _Reject
    return state


def _batched_product(node, states, need, seeds, gm, model) -> State | None:
    """``a @ b`` of two head-sharded activations (a hand-written attention's QKᵀ and ·V):
    exact per shard when both are sharded on the same batch dim (not a contracted one)."""
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, Node) and isinstance(b, Node)) or _ndim(a) != _ndim(b) or \
            _ndim(a) < 3:
        raise _Reject
    if _await_operands((a, b), states, need, seeds, gm, model):
        return None
    (dim_a, unit_a), (dim_b, unit_b) = states[a], states[b]
    if dim_a != dim_b or dim_a >= _ndim(a) - 2:
        raise _Reject
    return dim_a, math.gcd(unit_a, unit_b)


def _await_operands(operands, states, need, seeds, gm, model) -> bool:
    """Whether some operand is not sharded yet: its producing Linear joins the seeds
    (``need``) and the node waits for the next sweep. Raises _Reject when none can."""
    missing = [t for t in operands if t not in states]
    for t in missing:
        producer = _trace_back(t, gm, model)
        if producer is None or producer in seeds:
            raise _Reject
        need.add(producer)
    return bool(missing)


def _elementwise(node, states, need, seeds, gm, model) -> State | None:
    tensors = _tensor_inputs(node)
    shape = _shape(node)
    out: State | None = None
    for a in tensors:
        if a in states:  # broadcast along other dims only (RMSNorm's per-head statistics)
            a_dim, unit = states[a]
            dim = a_dim + len(shape) - len(_shape(a))
            if _shape(a)[a_dim] != shape[dim] or (out and out[0] != dim):
                raise _Reject
            out = (dim, math.gcd(unit, out[1]) if out else unit)
    dim = out[0]
    for a in tensors:
        if a in states:
            continue
        a_shape = _shape(a)
        offset = len(shape) - len(a_shape)
        if dim - offset < 0 or a_shape[dim - offset] == 1:
            if needs_grad(gm, a):  # Qwen3's per-head norm weight
                raise _Reject  # its gradient would sum this rank's shard only
            continue  # broadcast along the sharded dim: the same on every shard
        producer = _trace_back(a, gm, model)
        if producer is None or producer in seeds:
            raise _Reject
        need.add(producer)
        return None
    return out


def _sdpa(node, states, need, seeds, gm, model) -> State | None:
    bound = sdpa_arguments(node)
    mask = bound.get("attn_mask")
    if isinstance(mask, Node):
        m_shape = _shape(mask)
        if mask in states or (len(m_shape) >= 3 and m_shape[-3] != 1):
            raise _Reject  # a per-head mask would need sharding too
        if needs_grad(gm, mask):
            raise _Reject  # a learned bias shared by heads: its gradient would be partial
    qkv = [bound[k] for k in ("query", "key", "value")]
    if _await_operands(qkv, states, need, seeds, gm, model):
        return None
    found = {states[t] for t in qkv}
    heads_dim = _ndim(qkv[0]) - 3
    if any(dim != heads_dim for dim, _ in found):
        raise _Reject
    return heads_dim, math.gcd(*(u for _, u in found))


def _view(node: Node, state: State) -> State:
    out = _view_of_shard(node, state)
    if _infers_past_the_shard(node, out[0]):
        raise _Reject
    return out


def _view_of_shard(node: Node, state: State) -> State:
    dim, unit = state
    s_in, s_out = _shape(node.args[0]), _shape(node)
    tail = len(s_in) - dim
    if len(s_out) >= tail and s_in[dim:] == s_out[len(s_out) - tail:]:
        return len(s_out) - tail, unit  # dims before the sharded one regrouped
    if s_in[:dim] == s_out[:dim] and len(s_out) == len(s_in) + 1 and \
            s_out[dim] * s_out[dim + 1] == s_in[dim] and s_in[dim + 1:] == s_out[dim + 2:]:
        return dim, math.gcd(unit, s_out[dim])  # split into (heads, head_dim)
    if s_in[:dim] == s_out[:dim] and len(s_out) == len(s_in) - 1 and \
            s_in[dim] * s_in[dim + 1] == s_out[dim] and s_in[dim + 2:] == s_out[dim + 1:]:
        return dim, unit  # merge (heads, head_dim), heads outermost
    raise _Reject


def _infers_past_the_shard(node: Node, sharded: int) -> bool:
    """The view's size gives the sharded output dim as a number and infers another (-1):
    on a shard the inferred dim takes the smaller extent and the view regroups the wrong
    elements, silently. A size read from the tensor (a graph node) follows the shard."""
    args = node.args[1:]
    sizes = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    if len(sizes) != len(_shape(node)):
        return False
    fixed = isinstance(sizes[sharded], int) and sizes[sharded] != -1
    return fixed and any(isinstance(s, int) and s == -1
                         for i, s in enumerate(sizes) if i != sharded)


def _transpose(node: Node, state: State) -> State:
    dim, unit = state
    n = _ndim(node)
    a, b = node.args[1] % n, node.args[2] % n
    return (b if dim == a else a if dim == b else dim), unit


_TRACED = _VIEWS | _UNARY | {"transpose", "permute", "unsqueeze", "expand", "slice", "cat"}
"""Ops a head-sharded tensor is followed back through to its Linear (``_trace_back``)."""


def _trace_back(node: Node, gm, model) -> Node | None:
    """The one Linear a tensor comes from through views and element-wise ops (Hugging
    Face's rotary embedding: q·cos + rotate_half(q)·sin comes from q_proj alone), if
    any. Operands no Linear made (cos, sin, constants) do not count; two Linears do."""
    found: set[Node] = set()
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > 64:
            return None
        if linear_of(gm, model, n) is not None:
            found.add(n)
        elif n.op == "call_module" or (n.op in ("call_function", "call_method")
                                       and op_name(n) in _TRACED):
            todo += _tensor_inputs(n)
    return found.pop() if len(found) == 1 else None


# -- the option -----------------------------------------------------------------------------


def _option(gm, model, group, colwise, rowwise, states, units) -> TPOption:
    prefix = group.name + "." if group.name else ""
    styles: dict[str, str] = {}
    param_bytes = 0
    for node, style in [(n, "colwise") for n in colwise] + [(n, "rowwise") for n in rowwise]:
        path, lin = linear_of(gm, model, node)
        styles[path.removeprefix(prefix)] = style
        node.meta[K.TP_STYLE] = style
        param_bytes += _nbytes(lin.weight) + (_nbytes(lin.bias) if style == "colwise" else 0)
    sharded = set(states) | rowwise
    names = {n.name for n in states}
    saved = sum((part for n in group.nodes if K.SAVED in n.meta
                 for producer, part in n.meta[K.SAVED].parts if producer in names), SavedSplit())
    inputs = list(dict.fromkeys(n.args[0] for n in group.nodes if n in colwise))
    collectives = [Collective(kind="all_reduce", nbytes=_bytes(n), phase="fwd")
                   for n in group.nodes if n in rowwise]
    collectives += [Collective(kind="all_reduce", nbytes=_bytes(x), phase="bwd") for x in inputs]
    order = {n: i for i, n in enumerate(group.nodes)}
    styles = dict(sorted(styles.items(), key=lambda kv: order[_node_of(group, kv[0])]))
    try:
        sp = _SequenceSplit(gm, model, group, colwise, rowwise, states).result(styles)
    except _Reject:
        sp = None
    return TPOption(
        styles=styles,
        divisors=tuple(units),
        sharded_param_bytes=param_bytes,
        sharded_fwd_flops=float(sum(n.meta.get(K.FLOPS, 0.0) for n in sharded)),
        sharded_saved_bytes=saved.floating + saved.fixed,
        sharded_saved=saved,
        sharded_memory_bound_bytes=memory_bound_bytes(sharded),
        collectives=tuple(collectives),
        sp_saved_bytes=sp[1].floating + sp[1].fixed if sp else 0,
        sp_saved=sp[1] if sp else None,
        sp_collectives=sp[2] if sp else None,
        sp_styles=sp[0] if sp else None,
        sp_seq_len=sp[3] if sp else None,
    )


def _node_of(group: LayerGroup, rel: str) -> Node:
    full = f"{group.name}.{rel}" if group.name else rel
    for n in group.nodes:
        if n.meta.get(K.MODULE_PATH) == full and K.TP_STYLE in n.meta:
            return n
    raise AssertionError(rel)


# -- sequence parallelism (see the module docstring) -------------------------------------------

_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
_NORM_MODULES = (nn.LayerNorm, nn.RMSNorm)
_PER_TOKEN = _UNARY | _BINARY | {"native_dropout", "getitem"}
_LAST_DIM_REDUCTIONS = {"mean", "sum", "var", "std", "amax", "amin"}


class _SequenceSplit:
    """Classifies a TP-split block's nodes for sequence parallelism; raises _Reject."""

    def __init__(self, gm: GraphModule, model: nn.Module, group: LayerGroup,
                 colwise: set[Node], rowwise: set[Node], states: dict[Node, State]) -> None:
        self.gm, self.model, self.group, self.root = gm, model, group, group.name
        self.inside = set(group.nodes)
        self.calls = [n for n in group.nodes if n.op != "get_attr"]
        self.colwise, self.rowwise = colwise, rowwise
        self.sharded = set(states) | rowwise
        self.states = set(states)
        self.sharded_names = {n.name for n in states}
        if not self.root or any(not _under(n, self.root) for n in self.calls):
            raise _Reject  # ops of the root joined to the layer: outside its module hooks
        self.stream = self._stream_input()
        self.gathers = self._gather_points()
        self.seq = {self.stream} | rowwise
        """Nodes whose output is a [b, s, ...] tensor held as sequence shards."""

    def result(self, styles: dict[str, str]
               ) -> tuple[dict[str, str], SavedSplit, tuple[Collective, ...], int]:
        for node in self.calls:
            self._classify(node)
        self._check_output()
        runs = [n for n in self.calls if n in self.seq and n not in self.rowwise]
        shard_paths = self._shard_paths(runs)
        prefix = self.root + "."
        sp_styles = dict(styles)
        for path in shard_paths:
            sp_styles[path.removeprefix(prefix)] = "sequence_parallel"
        order = {n: i for i, n in enumerate(self.group.nodes)}
        first = {}
        for n in self.group.nodes:
            for rel in sp_styles:
                if rel not in first and _under(n, f"{prefix}{rel}"):
                    first[rel] = order[n]
        sp_styles = dict(sorted(sp_styles.items(), key=lambda kv: first[kv[0]]))
        return sp_styles, self._saved(runs), self._collectives(), _shape(self.stream)[1]

    # -- facts the classification needs ------------------------------------------------------

    def _stream_input(self) -> Node:
        """The floating [b, s, h] tensor the layer reads from outside and hands on: the one
        outside input shaped like the layer's output. The others are side inputs, the same
        on every rank and whole along the sequence (Hugging Face's rotary cos/sin, masks);
        ``_classify`` and ``_gather_points`` decide where they may be read."""
        outside = list(dict.fromkeys(a for n in self.calls for a in n.all_input_nodes
                                     if a not in self.inside and a.op != "get_attr"))
        outs = [n for n in self.calls if any(u not in self.inside for u in n.users)]
        if len(outs) != 1:
            raise _Reject
        self.output = outs[0]
        streams = [a for a in outside if _is_stream(a) and _shape(a) == _shape(self.output)]
        if len(streams) != 1:
            raise _Reject
        self.side = set(outside) - set(streams)
        if any(needs_grad(self.gm, a) for a in self.side):
            raise _Reject  # its gradient from ops on shards would be partial
        return streams[0]

    def _gather_points(self) -> dict[Node, tuple[str | None, int]]:
        """colwise input -> (module entered with it gathered, or None: gathered at each
        colwise Linear; number of gathers)."""
        parents: dict[Node, set[str]] = {}
        for c in self.colwise:
            path = linear_of(self.gm, self.model, c)[0]
            parents.setdefault(c.args[0], set()).add(path.rpartition(".")[0])
        out: dict[Node, tuple[str | None, int]] = {}
        for x, paths in parents.items():
            if len(paths) != 1:
                raise _Reject
            (parent,) = paths
            users = sum(1 for c in self.colwise if c.args[0] is x)
            if parent == self.root:
                out[x] = (None, users)
                continue
            if any(p == parent for p, _ in out.values()) or _under(x, parent):
                raise _Reject
            for n in self.calls:
                if _under(n, parent) and any(a is not x and a.op != "get_attr" and
                                             a not in self.side and not _under(a, parent)
                                             for a in n.all_input_nodes):
                    raise _Reject  # the module reads a value made on sequence shards
            out[x] = (parent, 1)
        return out

    def _classify(self, node: Node) -> None:
        """Add ``node`` to ``seq`` when it runs on shards; reject what cannot."""
        ins = node.all_input_nodes
        if node in self.sharded:
            on_shards = [a for a in ins if a in self.seq]
            if node in self.colwise and on_shards != [node.args[0]]:
                raise _Reject  # a colwise Linear gathers its input from sequence shards
            if node not in self.colwise and on_shards:
                raise _Reject
            return
        gathered = [a for a in ins if a in self.gathers and self.gathers[a][0] is not None
                    and _under(node, self.gathers[a][0])]
        if not node.meta[K.TENSOR].tensors:
            if node.op == "call_module" and str(node.target) == "_guards_fn":
                return  # torch.export's check of the captured input shapes
            if op_name(node) == "_assert_tensor_metadata":
                return  # export's dtype check at a `.to()`: eager runs none
            if any(a in self.seq and a not in gathered for a in ins):
                raise _Reject  # a shape read of sequence shards
            return
        if gathered or any(a in self.states for a in ins):
            raise _Reject  # the gathered tensor feeds more than colwise Linears
        if not any(a in self.seq for a in ins):
            return  # constant along the sequence (computed alike on every rank)
        self._check_per_token(node)
        self.seq.add(node)

    def _check_per_token(self, node: Node) -> None:
        lead = _lead(self.stream)
        if _lead(node) != lead:
            raise _Reject
        if node.op == "call_module":
            mod = self.model.get_submodule(str(node.target))
            if isinstance(mod, _NORM_MODULES):
                if len(mod.normalized_shape) != 1:
                    raise _Reject
            elif not isinstance(mod, _UNARY_MODULES):
                raise _Reject
            return
        name = op_name(node)
        if name in _NORMS:
            shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            if not isinstance(shape, (list, tuple)) or len(shape) != 1:
                raise _Reject
        elif name in _LAST_DIM_REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            ndim = len(node.args[0].meta[K.TENSOR].tensors[0].shape)
            if any(not isinstance(d, int) or d % ndim != ndim - 1 for d in dims):
                raise _Reject
        elif name not in _PER_TOKEN:
            raise _Reject
        for a in _tensor_inputs(node):
            if a not in self.seq and _varies_along_sequence(a, node):
                raise _Reject

    def _check_output(self) -> None:
        """The one output (shaped like the stream: ``_stream_input``) runs on shards."""
        if self.output not in self.seq:
            raise _Reject

    def _shard_paths(self, runs: list[Node]) -> list[str]:
        """Submodules run wholly on shards; parameters on shards must live in one of them."""
        run_set = set(runs)
        candidates = list(dict.fromkeys(n.meta[K.MODULE_PATH] for n in runs))
        paths = [p for p in candidates if p != self.root and all(
            n in run_set or not n.meta[K.TENSOR].tensors
            for n in self.calls if _under(n, p))]

        def covered(path: str) -> bool:
            return any(path == p or path.startswith(p + ".") for p in paths)

        for n in runs:
            if n.op == "call_module" and any(True for _ in self.model.get_submodule(
                    str(n.target)).parameters()) and not covered(str(n.target)):
                raise _Reject
            for a in n.all_input_nodes:
                if a.op == "get_attr":
                    owner = str(a.target).rpartition(".")[0]
                    if not covered(owner) or not _is_parameter(self.model, str(a.target)):
                        raise _Reject
                elif a not in self.seq and needs_grad(self.gm, a):
                    # a learned value made outside those submodules (``tanh(self.gate) * h``):
                    # its gradient from ops on shards would sum this rank's tokens only
                    raise _Reject
        if not paths:
            raise _Reject
        return paths

    # -- the costs ----------------------------------------------------------------------------

    def _saved(self, runs: list[Node]) -> SavedSplit:
        """What the ops run on shards save. A gathered colwise input is saved by its
        colwise Linears, whole, and counted there (SAVED names the first node saving a
        storage); were it also saved first by an op on shards, it would be counted here
        while the Linears keep the whole copy."""
        return sum((part for n in runs if K.SAVED in n.meta
                    for producer, part in n.meta[K.SAVED].parts
                    if producer not in self.sharded_names), SavedSplit())

    def _collectives(self) -> tuple[Collective, ...]:
        fwd: list[Collective] = []
        bwd: list[Collective] = []
        for node in [self.stream, *self.group.nodes]:
            if node in self.gathers:
                for _ in range(self.gathers[node][1]):
                    fwd.append(Collective(kind="all_gather", nbytes=_bytes(node), phase="fwd"))
                    bwd.append(Collective(kind="reduce_scatter", nbytes=_bytes(node),
                                          phase="bwd"))
            if node in self.rowwise:
                fwd.append(Collective(kind="reduce_scatter", nbytes=_bytes(node), phase="fwd"))
                bwd.append(Collective(kind="all_gather", nbytes=_bytes(node), phase="bwd"))
        return tuple(fwd + bwd)


def _under(node: Node, path: str) -> bool:
    own = node.meta.get(K.MODULE_PATH, "")
    return own == path or own.startswith(path + ".")


def _is_stream(node: Node) -> bool:
    meta: K.TensorMeta = node.meta[K.TENSOR]
    if len(meta.tensors) != 1:
        return False
    spec = meta.tensors[0]
    return len(spec.shape) == 3 and getattr(torch, spec.dtype).is_floating_point


def _lead(node: Node) -> tuple[int, ...]:
    """(batch, seq) of a node's (first) output tensor."""
    tensors = node.meta[K.TENSOR].tensors
    if not tensors or len(tensors[0].shape) < 2:
        raise _Reject
    return tensors[0].shape[:2]


def _varies_along_sequence(a: Node, node: Node) -> bool:
    """Whether ``a``, broadcast against ``node``'s output, has more than one entry on dim 1."""
    shape = a.meta[K.TENSOR].tensors[0].shape
    dim = 1 - (len(node.meta[K.TENSOR].tensors[0].shape) - len(shape))
    return dim >= 0 and shape[dim] != 1


def _is_parameter(model: nn.Module, target: str) -> bool:
    try:
        model.get_parameter(target)
    except AttributeError:
        return False
    return True


# -- node helpers ---------------------------------------------------------------------------


def linear_of(gm: GraphModule, model: nn.Module, node: Node) -> tuple[str, nn.Linear] | None:
    """(module path, Linear) when ``node`` is the one call of an nn.Linear on its weight:
    ``F.linear(x, weight)``, or ``x @ weight.T`` in a Linear subclass without a bias
    (Hugging Face's ``FalconLinear``; with a bias, the add after the product is left out
    of the split)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear) and _called_once(node):
            return str(node.target), mod
        return None
    weight = _transposed_weight(node)
    if weight is None and node.op == "call_function" and node.target in _LINEAR_TARGETS:
        weight = node.args[1] if len(node.args) > 1 else None
    if weight is None:
        return None
    path = node.meta.get(K.MODULE_PATH, "")
    try:
        mod = model.get_submodule(path) if path else None
    except AttributeError:
        return None
    if not isinstance(mod, nn.Linear) or not isinstance(weight, Node):
        return None
    if weight.op != "get_attr" or weight.target != f"{path}.weight" or len(weight.users) != 1:
        return None
    if node.target not in _LINEAR_TARGETS and mod.bias is not None:
        return None
    return path, mod


def _transposed_weight(node: Node) -> Node | None:
    """W of ``x @ W.T`` (a matmul by a 2-D transpose used nowhere else)."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in (
            "matmul", "__matmul__") or len(node.args) != 2 or not isinstance(node.args[1], Node):
        return None
    t = node.args[1]
    if len(t.users) != 1 or not t.args or not isinstance(t.args[0], Node):
        return None
    name, dims = op_name(t), t.args[1:]
    dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
    if name in ("t", "numpy_T") or (name == "permute" and list(dims) == [1, 0]) or \
            (name == "transpose" and sorted(d % 2 for d in dims) == [0, 1]):
        return t.args[0]
    return None


_MODULE_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _called_once(node: Node) -> bool:
    calls = _MODULE_CALLS.get(node.graph)
    if calls is None:
        calls = Counter(n.target for n in node.graph.nodes if n.op == "call_module")
        _MODULE_CALLS[node.graph] = calls
    return calls[node.target] == 1


def _tensor_inputs(node: Node) -> list[Node]:
    """Inputs that are tensors (not shape scalars read from tensors)."""
    return [a for a in node.all_input_nodes if a.meta[K.TENSOR].tensors]


def _shape(node: Node) -> tuple[int, ...]:
    meta: K.TensorMeta = node.meta[K.TENSOR]
    if len(meta.tensors) != 1:
        raise _Reject
    return meta.tensors[0].shape


def _ndim(node: Node) -> int:
    return len(_shape(node))


def _bytes(node: Node) -> int:
    return node.meta[K.TENSOR].nbytes


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


__all__ = ["find_tensor_parallel", "linear_of"]
