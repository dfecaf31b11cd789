"""What a pipeline stage module's graphs say, and rewrites of them.

A stage split by symbolic tracing is a ``GraphModule``; one split from ``torch.export`` is
an unflattened tree of ``InterpreterModule``s, each with a graph of its own (and a graph
module holding the same graph). Both are walked through ``graphs``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn


def graphs(stage: nn.Module) -> Iterator[tuple[nn.Module, torch.fx.Graph]]:
    """Each graph of ``stage`` once, with the module that runs it."""
    seen: set[int] = set()
    for module in stage.modules():
        for holder in (module, getattr(module, "graph_module", None)):
            graph = getattr(holder, "graph", None)
            if isinstance(graph, torch.fx.Graph) and id(graph) not in seen:
                seen.add(id(graph))
                yield holder, graph


_STATE_ALIASES = "_autopar_state_aliases"


@dataclass(frozen=True)
class StateAlias:
    """A name the model saves a tensor of a stage under, that the stage has no module for."""

    source: str
    """The tensor's name in the stage."""
    first: bool
    """The model names the tensor so before ``source``: DCP keys optimizer state by a
    parameter's first name, so the checkpoint's view must have the model's order."""


def state_aliases(stage: nn.Module) -> dict[str, StateAlias]:
    """``stage``'s aliases by the model's name, set by ``passes.split_export``; the
    checkpoint's view of the stage (``runtime.checkpoint.merged_view``) adds them."""
    return dict(getattr(stage, _STATE_ALIASES, {}))


def set_state_aliases(stage: nn.Module, aliases: dict[str, StateAlias]) -> None:
    setattr(stage, _STATE_ALIASES, dict(aliases))


_TENSOR_NAMES = "_autopar_tensor_names"


def tensor_names(stage: nn.Module) -> dict[str, tuple[str, ...]]:
    """For each parameter of ``stage`` the model holds under several names (a tied weight,
    whose copies other stages hold under the others), every one of them in the model's
    order, set by ``passes.split_export``: a checkpoint saved by one process keys the
    optimizer state by the first only (``runtime.checkpoint.load``)."""
    return dict(getattr(stage, _TENSOR_NAMES, {}))


def set_tensor_names(stage: nn.Module, names: dict[str, tuple[str, ...]]) -> None:
    setattr(stage, _TENSOR_NAMES, dict(names))


def on_rank_device(stage: nn.Module, device: torch.device) -> None:
    """A stage split from a capture names the capture's device (CPU: a model on meta is
    captured on fake CPU tensors) in its ops, as a keyword (``arange(..., device=cpu)``) or
    an argument (``aten.to.device(x, cpu)``, as Llama's rotary embedding does); run them on
    ``device``. torch's ``_modify_graph_op_device`` rewrites keywords only."""
    def move(arg: object) -> object:
        return device if isinstance(arg, torch.device) and arg != device else arg

    for holder, graph in graphs(stage):
        changed = False
        for node in graph.nodes:
            args = torch.fx.node.map_aggregate(node.args, move)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, move)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed and isinstance(holder, torch.fx.GraphModule):
            holder.recompile()


def uses_a_weight_twice(stage: nn.Module) -> bool:
    """Whether some parameter of ``stage`` is used more than once in its forward: read by
    two ops, or held by a module the stage calls twice (ALBERT's one layer at every depth,
    which an export unflattens into one module per call, all holding its parameters)."""
    parameters = {id(p) for p in stage.parameters()}
    uses: Counter[int] = Counter()
    for holder, graph in graphs(stage):
        uses += weight_uses(holder, graph.nodes, parameters)
    return any(n > 1 for n in uses.values())


def weight_uses(holder: nn.Module, nodes: Iterable[torch.fx.Node], parameters: set[int]
                ) -> Counter[int]:
    """How often ``nodes`` (of a graph ``holder`` runs) use each of ``parameters`` (by
    ``id``): every op reading one, and every call of a leaf module (one running its own
    forward, not a graph) holding one."""
    uses: Counter[int] = Counter()
    for node in nodes:
        if node.op == "get_attr":
            t = _attr(holder, str(node.target))
            if id(t) in parameters:
                uses[id(t)] += len(node.users)
        elif node.op == "call_module":
            called = holder.get_submodule(str(node.target))
            if not any(True for _ in graphs(called)):
                uses.update(id(p) for p in called.parameters() if id(p) in parameters)
    return uses


def _attr(holder: nn.Module, target: str) -> object:
    path, _, name = target.rpartition(".")
    return getattr(holder.get_submodule(path) if path else holder, name)
