"""Values of a captured graph made from buffers and literals alone, without randomness: a
causal mask, rotary cos/sin made from a buffer, ``arange`` positions.

A pipeline stage recomputes such a value instead of receiving it (``passes.split_export``),
so it crosses no cut, and the planner does not price it as a send
(``passes.layer_graph.boundary_bytes``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

_RANDOM_NAMES = ("rand", "dropout", "bernoulli", "normal", "multinomial", "poisson",
                 "uniform", "exponential", "geometric", "cauchy")
"""Parts of the names of random functions and methods in a symbolically traced graph, whose
targets carry no ``nondeterministic_seeded`` tag (an exported graph's ops do)."""


def constant_nodes(gm: GraphModule) -> set[Node]:
    """The nodes of ``gm`` computable from its buffers and literals alone."""
    out: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and not _is_parameter(gm, node):
            out.add(node)
        elif node.op in ("call_function", "call_method") and not _random(node) and \
                all(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _is_parameter(gm: GraphModule, node: Node) -> bool:
    return isinstance(operator.attrgetter(str(node.target))(gm), nn.Parameter)


def _random(node: Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return any(part in name for part in _RANDOM_NAMES)
