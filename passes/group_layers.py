"""Group a captured graph's nodes into layers and recognise identical layers.

A layer is a module of the user's model, named by its fully-qualified name:

- each element of an ``nn.ModuleList``, or of an ``nn.Sequential`` of repeated blocks (two or
  more modules of one class that have submodules), e.g. ``h.3`` or ``transformer.h.3``;
- every other child of the root, or of a "trunk" module that itself holds such a container
  (e.g. Hugging Face's ``transformer`` holding ``h``): ``wte``, ``transformer.ln_f``;
- every ``opaque`` module.

Nodes run by no layer (the root's or a trunk's own ops: adds, ``arange``, mask building)
join the previous layer in execution order (the next one if none ran yet), so each layer
still is a contiguous stretch of the program in the common case.

Layers are identical (one ``layer_class``) when they have the same module class, the same
parameter names/shapes/dtypes, the same op sequence with the same output shapes, dtypes and
constant arguments, and the same data flow between their ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from passes import meta_keys as K
from passes.annotate import fail
from runtime.tied import Tie, tie_groups

CALL_OPS = ("call_function", "call_method", "call_module")


@dataclass(kw_only=True)
class LayerGroup:
    name: str
    index: int
    nodes: list[Node]
    """The layer's nodes in graph order (get_attr nodes of its parameters included)."""
    layer_class: str = ""
    signature: tuple = ()
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """Parameters this layer owns (each parameter of the model belongs to one layer)."""
    tied: bool = False
    """Some parameter of this layer is also used under another layer's name."""


def layer_names(model: nn.Module, opaque: tuple[str, ...] = ()) -> list[str]:
    """Layer module names in module-definition order (see the module docstring)."""
    names: list[str] = []

    def expand(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = prefix + name
            if fqn in opaque:
                names.append(fqn)
            elif _is_block_list(child):
                names.extend(f"{fqn}.{n}" for n, _ in child.named_children())
            elif _holds_block_list(child):
                expand(child, fqn + ".")
            else:
                names.append(fqn)

    expand(model, "")
    return names or [""]  # a model without children is one layer: the root itself


def _is_block_list(module: nn.Module) -> bool:
    # A ModuleList has no forward of its own: its elements are called one by one.
    if isinstance(module, nn.ModuleList):
        return len(module) > 0
    if not isinstance(module, nn.Sequential):
        return False
    kinds = [type(c) for c in module.children() if next(c.children(), None) is not None]
    return any(kinds.count(k) >= 2 for k in kinds)


def _holds_block_list(module: nn.Module) -> bool:
    return any(_is_block_list(m) for m in module.modules())


def owning_layer(path: str, layers: set[str]) -> str | None:
    """The layer whose module is ``path`` or contains it."""
    while True:
        if path in layers:
            return path
        if not path:
            return None
        path = path.rpartition(".")[0]


def stateless_layers(model: nn.Module, layers: set[str] | list[str]) -> set[str]:
    """The layers holding no parameter and no buffer (a stack's shared ``Dropout``, an
    activation module). Such a layer may run on several pipeline stages: each call computes
    from its inputs alone, so a stage can call it again where the layers around the call
    run (T5's stacks call one dropout before their first block and after their last)."""
    out = set()
    for name in layers:
        module = model.get_submodule(name)
        if next(module.parameters(), None) is None and next(module.buffers(), None) is None:
            out.add(name)
    return out


def group_layers(gm: GraphModule, model: nn.Module, opaque: tuple[str, ...] = ()
                 ) -> list[LayerGroup]:
    """LAYER on every node of a layer; returns the layers in execution order, with classes.

    Needs MODULE_PATH and TENSOR (``annotate_module_paths``, ``propagate_shapes``).
    """
    names = layer_names(model, opaque)
    name_set = set(names)
    if names == [""]:
        name_set = {""}
    by_name: dict[str, list[Node]] = {}
    pending: list[Node] = []  # orphans before any layer ran
    last: str | None = None
    for node in gm.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        layer = owning_layer(node.meta[K.MODULE_PATH], name_set)
        if layer is None or (layer == "" and names != [""]):
            layer = last
        if layer is None:
            pending.append(node)
            continue
        by_name.setdefault(layer, []).extend(pending)
        pending = []
        by_name.setdefault(layer, []).append(node)
        last = layer
    if pending:
        raise fail("group_layers", pending[0], ValueError("no layer ran any op"))
    _attach_attrs(gm, by_name, name_set)
    order = list(by_name)
    groups = [LayerGroup(name=n, index=i, nodes=_in_graph_order(by_name[n]))
              for i, n in enumerate(order)]
    _assign_params(model, groups, name_set)
    classify_layers(gm, model, groups)
    for g in groups:
        for node in g.nodes:
            node.meta[K.LAYER] = K.LayerRef(name=g.name, index=g.index,
                                            layer_class=g.layer_class)
    return groups


def _attach_attrs(gm: GraphModule, by_name: dict[str, list[Node]], layers: set[str]) -> None:
    """get_attr nodes join the layer owning the attribute, else the layer of their first user."""
    node_layer = {n: name for name, nodes in by_name.items() for n in nodes}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        layer = owning_layer(str(node.target).rpartition(".")[0], layers)
        if layer is None or layer not in by_name:
            users = [node_layer[u] for u in node.users if u in node_layer]
            layer = users[0] if users else None
        if layer is not None:
            by_name[layer].append(node)


def _in_graph_order(nodes: list[Node]) -> list[Node]:
    position = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return sorted(set(nodes), key=position.__getitem__)


def _assign_params(model: nn.Module, groups: list[LayerGroup], layers: set[str]) -> None:
    """Each parameter (deduplicated, as ``model.parameters()``) to exactly one layer."""
    by_name = {g.name: g for g in groups}
    owners: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        layer = owning_layer(name.rpartition(".")[0], layers)
        owners.setdefault(id(p), set()).add(layer or "")
    for name, p in model.named_parameters():
        layer = owning_layer(name.rpartition(".")[0], layers)
        group = by_name.get(layer) if layer is not None else None
        if group is None:  # a root/trunk parameter, or a layer that ran no op
            group = _first_user(groups, name) or groups[0]
        group.params.append((name, p))
        if len(owners[id(p)]) > 1:
            for other in owners[id(p)]:
                if other in by_name:
                    by_name[other].tied = True


def find_ties(model: nn.Module, groups: list[LayerGroup]) -> tuple[Tie, ...]:
    """The layers sharing parameters (``LayerGraph.ties``): every parameter the model
    reaches under names in more than one layer (``runtime.tied.tie_groups``, the check the
    runtime makes, so planner and runtime agree on what is tied)."""
    return tuple(tie_groups(model, [g.name for g in groups]))


def read_by_others(gm: GraphModule, model: nn.Module, groups: list[LayerGroup]
                   ) -> frozenset[str]:
    """``LayerGraph.read_by_others``: parameters an op reads in a layer whose module does not
    hold them (an op of the root's own forward counts in the layer that ran before it)."""
    group_of = {n: g for g in groups for n in g.nodes}
    held: dict[str, set[int]] = {}
    out: set[str] = set()
    for node in gm.graph.find_nodes(op="get_attr"):
        try:
            param = model.get_parameter(str(node.target))
        except AttributeError:
            continue  # a buffer
        for user in node.users:
            group = group_of.get(user)
            if group is not None and group.name not in held:
                held[group.name] = {id(p) for p in model.get_submodule(group.name).parameters()}
            if group is None or id(param) not in held[group.name]:
                out.add(str(node.target))
    return frozenset(out)


def _first_user(groups: list[LayerGroup], param_name: str) -> LayerGroup | None:
    for g in groups:
        if any(n.op == "get_attr" and n.target == param_name for n in g.nodes):
            return g
    return None


# -- identical layers --------------------------------------------------------------------------


def classify_layers(gm: GraphModule, model: nn.Module, groups: list[LayerGroup]) -> None:
    """Set ``signature`` and ``layer_class`` ("Block#0") of each group."""
    seen: dict[tuple, str] = {}
    per_class_name: dict[str, int] = {}
    for g in groups:
        module = model.get_submodule(g.name)
        g.signature = _signature(g, module)
        if g.signature not in seen:
            cls = type(module).__name__
            seen[g.signature] = f"{cls}#{per_class_name.get(cls, 0)}"
            per_class_name[cls] = per_class_name.get(cls, 0) + 1
        g.layer_class = seen[g.signature]


def _signature(g: LayerGroup, module: nn.Module) -> tuple:
    prefix = g.name + "." if g.name else ""
    params = tuple(
        (n.removeprefix(prefix), tuple(p.shape), str(p.dtype), p.requires_grad)
        for n, p in g.params
    )
    local = {n: i for i, n in enumerate(n for n in g.nodes if n.op in CALL_OPS)}

    def rel(path: str) -> str:
        if path == g.name:
            return "."
        return path.removeprefix(prefix) if path.startswith(prefix) else "^" + path

    def arg_key(a: object) -> object:
        if isinstance(a, Node):
            if a in local:
                return ("n", local[a])
            if a.op == "get_attr":
                return ("attr", rel(str(a.target)))
            return ("in", _shapes(a))
        if isinstance(a, (list, tuple)):
            return tuple(arg_key(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, arg_key(v)) for k, v in a.items()))
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device,
                                       torch.memory_format, torch.layout)):
            return a
        if isinstance(a, slice):
            # A traced bound (a mask cut to the sequence length) is a node: key it like one.
            return ("slice", arg_key(a.start), arg_key(a.stop), arg_key(a.step))
        return type(a).__name__

    ops = tuple(
        (n.op, rel(str(n.target)) if n.op == "call_module" else str(n.target),
         rel(n.meta[K.MODULE_PATH]), _shapes(n), arg_key(n.args), arg_key(n.kwargs))
        for n in local
    )
    return (type(module).__qualname__, type(module).__module__, params, g.tied, ops)


def _shapes(node: Node) -> tuple:
    meta: K.TensorMeta | None = node.meta.get(K.TENSOR)
    if meta is None:
        return ()
    return tuple((t.shape, t.dtype) for t in meta.tensors)
