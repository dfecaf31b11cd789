"""Tied layers as one decision of the strategy ILP.

Layers sharing a parameter (``LayerGraph.ties``: an embedding and the LM head it is tied
to) run as one FSDP2 unit (runtime/data_parallel.py), so they must take one option. Rather
than add equality rows to the ILP (which the solver-free bounds and the per-class
``least_work`` pass would not know of), each tie becomes one more class of count 1 whose
options are the option labels every member offers, each costing the sum of the members'
costs under it. The program keeps its form, so it stays exact: an assignment of the
joined classes is exactly an assignment of the layers with the tie honoured, at the same
objective and memory. The shared parameter's memory and communication are counted once,
in its owner's costs (``passes.group_layers`` gives each parameter to one layer).

What the sum leaves out: under ``fsdp`` one unit keeps its gathered parameters from the
first member's forward to the last's (FSDP2 reshards a group after all its modules ran),
while each member's cost holds its own only while it runs; the shared parameter is one
row of the vocabulary matrix per token, small beside a block's activations.

Tied layers take no tensor parallelism (it would split the parameter in one module and
untie it; passes/tensor_parallel.py offers none, ``autopar explain`` says why), and a layer
tied to a parameter of the root is 'replicate', as the root is.
"""

from __future__ import annotations

import dataclasses

from autopar.planner.costs import LayerCost
from autopar.planner.ilp import ClassOptions
from passes.records import LayerGraph
from runtime.plan import STRATEGIES, TP_STRATEGIES

MAX_FIELDS = ("buffer_bytes", "loss_buffer_bytes", "collective_buffer_bytes")
"""Transient memory: the plan holds the largest buffer over its layers, not the sum."""
DATA_PARALLEL = tuple(s for s in STRATEGIES if s not in TP_STRATEGIES)
"""What tied layers may take (runtime/tied.py ``check_ties`` refuses TP for them)."""
SAME_FIELDS = ("option", "strategy", "recompute", "offload", "sequence_parallel",
               "microbatches")


def join_ties(graph: LayerGraph, options: list[ClassOptions]) -> list[ClassOptions]:
    """``options`` (one per layer class) with each tie's layers taken out of their classes
    and made one class of count 1, its ``members`` holding each layer's own costs."""
    if not graph.ties:
        return options
    by_name = {o.name: o for o in options}
    class_of = {layer.name: layer.layer_class for layer in graph.layers}
    counts = {o.name: o.count for o in options}
    units = []
    for tie in graph.ties:
        members = [m for m in tie.modules if m]
        parts = {m: by_name[class_of[m]].costs for m in members}
        labels = [o for o in parts[members[0]] if all(o in p for p in parts.values())]
        allowed = ("replicate",) if "" in tie.modules else DATA_PARALLEL
        labels = [o for o in labels if parts[members[0]][o].strategy in allowed]
        for m in members:
            counts[class_of[m]] -= 1
        units.append(ClassOptions(
            name="tie:" + "+".join(members), count=1,
            costs={o: combine([p[o] for p in parts.values()]) for o in labels},
            inflight=by_name[class_of[members[0]]].inflight,
            members={m: {o: parts[m][o] for o in labels} for m in members}))
    kept = [dataclasses.replace(o, count=counts[o.name]) for o in options if counts[o.name]]
    return kept + units


def combine(costs: list[LayerCost]) -> LayerCost:
    """The cost of layers taking one option together: times and resident bytes add up,
    transient buffers take the largest."""
    values = {}
    for f in dataclasses.fields(LayerCost):
        column = [getattr(c, f.name) for c in costs]
        if f.name in SAME_FIELDS:
            assert len(set(column)) == 1, (f.name, column)
            values[f.name] = column[0]
        else:
            values[f.name] = max(column) if f.name in MAX_FIELDS else sum(column)
    return LayerCost(**values)


def tied_costs(choice: dict[str, dict[str, int]], options: list[ClassOptions]
               ) -> dict[str, LayerCost]:
    """Layer name -> its cost under the option its tie's class was given."""
    out = {}
    for o in options:
        if o.members:
            (label,) = choice[o.name]
            out.update((m, costs[label]) for m, costs in o.members.items())
    return out
