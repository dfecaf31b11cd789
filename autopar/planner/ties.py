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

Under pipeline parallelism (planner/engine.py) a tie cut by a stage boundary runs as
Megatron's embedding group: every stage holding a tied layer holds a copy of the shared
parameters, and the copies' gradients are all-reduced over their pipeline ranks at the
end of the step (runtime/tied.py ``TiedGradSync``). ``pipeline_roles`` says, per tied
layer and cut, what that adds to its costs (``TieRole``): the copy's states on a stage
without the owning layer, the all-reduce on every stage holding one. The runtime needs
the copies on distinct pipeline ranks (``copies_share_a_rank``) and one strategy for them
(the pipeline search makes it a dimension of the configuration: ``tie_strategies``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.planner.costs import (
    LayerCost,
    allowed_strategies,
    hsdp_shard_size,
    layer_cost,
)
from autopar.planner.estimators import ANALYTIC, Estimators
from autopar.planner.ilp import ClassOptions
from cost_models.comm import Group, all_reduce_s
from cost_models.hardware import Cluster
from cost_models.memory import Precision
from passes.records import LayerGraph, LayerInfo
from runtime.plan import Mesh, Plan, stage_rank
from runtime.strategies import spec
from runtime.tied import Tie, owner

MAX_FIELDS = ("buffers_bytes", "loss_buffer_bytes", "collective_buffer_bytes", "prefetch_bytes")
"""Transient memory: the plan holds the largest buffer over its layers, not the sum."""
SAME_FIELDS = ("option", "strategy", "recompute", "offload", "sequence_parallel",
               "microbatches", "async_tp")


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
        # A tie to the root's parameter stays with the root (replicate); any other takes
        # one data-parallel strategy: runtime/tied.py ``check_ties`` refuses TP for ties.
        labels = [o for o in labels if _tie_may_take(parts[members[0]][o].strategy, tie)]
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


# -- pipelines: Megatron's embedding group -----------------------------------------------


@dataclass(frozen=True)
class TieRole:
    """What a tied layer adds to its own costs on its pipeline stage, under one cut."""

    copy_numel: int = 0
    """Elements of the shared parameters it holds as its stage's copy (no layer of its
    stage owns them): their parameter, gradient and optimizer states as its strategy holds
    them, and their optimizer step."""
    copy_tensors: int = 0
    shared_numel: int = 0
    """Elements of the shared parameters whose gradient it all-reduces (with ``sync``)."""
    sync: Group | None = None
    """The ranks holding copies, when the tie spans several stages: its stage's copy's
    gradient is all-reduced over them once a step, after the flush."""


def pipeline_roles(graph: LayerGraph, stage_of: tuple[int, ...], stage_rank: list[int],
                   ranks_per_stage: int) -> dict[int, TieRole]:
    """Per tied layer (by index), its role under this cut. One layer per stage holding a
    tie speaks for the stage: the owner of the shared parameters where it is there, else
    the stage's first tied layer (which holds the copy); the others add nothing.

    Pipeline ranks are ``ranks_per_stage`` (dp · tp) global ranks apart; the all-reduce's
    group spreads its k members evenly over the span of their pipeline ranks (exact for
    two copies, the embedding and the head)."""
    index = {layer.name: i for i, layer in enumerate(graph.layers)}
    out: dict[int, TieRole] = {}
    for tie in graph.ties:
        members = [index[m] for m in tie.modules if m]
        first = index.get(owner(tie.params[0], index), members[0])
        holders: dict[int, int] = {}
        for i in sorted(members, key=lambda i: (i != first, i)):
            holders.setdefault(stage_of[i], i)
        ranks = sorted(stage_rank[s] for s in holders)
        sync = None
        if len(ranks) > 1:
            gap = math.ceil((ranks[-1] - ranks[0]) / (len(ranks) - 1))
            sync = Group(len(ranks), gap * ranks_per_stage)
        numel = sum(tie.numels)
        for i in members:
            holds = holders[stage_of[i]] == i
            copy = holds and i != first
            out[i] = TieRole(copy_numel=numel if copy else 0,
                             copy_tensors=len(tie.numels) if copy else 0,
                             shared_numel=numel if holds and sync else 0,
                             sync=sync if holds else None)
    return out


def copies_share_a_rank(graph: LayerGraph, stage_of: tuple[int, ...], stage_rank: list[int]
                        ) -> bool:
    """Whether a tie has copies on two stages of one pipeline rank (a looped or V schedule
    folding the first and last stages together), which the runtime refuses: a rank holds
    one copy per stage and ``TiedGradSync`` sums one per rank."""
    index = {layer.name: i for i, layer in enumerate(graph.layers)}
    for tie in graph.ties:
        stages = {stage_of[index[m]] for m in tie.modules if m}
        if len({stage_rank[s] for s in stages}) < len(stages):
            return True
    return False


def tie_strategies(graph: LayerGraph, mesh: Mesh, microbatches: int,
                   hsdp_shard_size: int | None) -> tuple[str, ...]:
    """The data-parallel strategies every tied layer can take on this pipeline mesh: the
    tie's one strategy, chosen per configuration so that the ranks' ILPs, solved apart,
    agree on it. A model with several ties gives them all this one strategy (simpler than
    a product over the ties; models tie one embedding, or T5's one shared matrix).
    Offloading is left out: the copies' gradients are all-reduced where they live, and an
    offloaded gradient lives on the host, out of NCCL's reach."""
    layers = [layer for layer in graph.layers if graph.tie_of(layer.name)]
    tie = graph.tie_of(layers[0].name)
    common = list(allowed_strategies(layers[0], mesh, hsdp_shard_size=hsdp_shard_size,
                                     microbatches=microbatches, tie=tie.describe()))
    for layer in layers[1:]:
        mine = allowed_strategies(layer, mesh, hsdp_shard_size=hsdp_shard_size,
                                  microbatches=microbatches, tie=tie.describe())
        common = [s for s in common if s in mine]
    return tuple(common)


def _tie_may_take(strategy: str, tie: Tie) -> bool:
    return strategy == "replicate" if "" in tie.modules else not spec(strategy).tensor_parallel


def with_copy(layer: LayerInfo, role: TieRole) -> LayerInfo:
    """The layer as its stage runs it: with the copy of the shared parameters it holds
    (same element size as its owner's, the model's parameter dtype)."""
    if not role.copy_numel:
        return layer
    element = layer.param_bytes / layer.param_count if layer.param_count else 4
    return dataclasses.replace(
        layer, param_count=layer.param_count + role.copy_numel,
        param_bytes=int(layer.param_bytes + role.copy_numel * element),
        param_tensors=layer.param_tensors + role.copy_tensors)


def with_sync(cost: LayerCost, role: TieRole, mesh: Mesh, cluster: Cluster, prec: Precision,
              hsdp_shard_size: int | None) -> LayerCost:
    """``cost`` plus its copy's gradient all-reduce across the pipeline ranks (the gradient
    as the optimizer holds it: this rank's shard, ``Precision.held_grad_bytes`` an element),
    once a step after the flush, not overlapped."""
    if role.sync is None:
        return cost
    shards = spec(cost.strategy).shard_ranks(mesh.replicas, mesh.tp, hsdp_shard_size)
    seconds = all_reduce_s(role.shared_numel / shards * prec.held_grad_bytes, role.sync,
                           cluster)
    return dataclasses.replace(cost, step_s=cost.step_s + seconds,
                               comm_s=cost.comm_s + seconds)


def describe_tie(tie: Tie, plan: Plan) -> str:
    """The tie as a plan's report states it: who shares what, and under a pipeline which
    stages hold a copy and where their gradients are summed."""
    text = tie.describe()
    stages = sorted({la.stage for la in plan.layers if la.module in tie.modules})
    if plan.pipeline is None or len(stages) < 2:
        return text
    ranks = [stage_rank(s, plan.mesh.pp, plan.pipeline) for s in stages]
    return (f"{text}; stages {', '.join(map(str, stages))} each hold a copy, whose gradients "
            f"are all-reduced across pipeline ranks {', '.join(map(str, ranks))} every step")


def with_tied_choices(options: list[ClassOptions], graph: LayerGraph, plan: Plan,
                      cluster: Cluster, prec: Precision, estimators: Estimators = ANALYTIC
                      ) -> list[ClassOptions]:
    """``options`` (per class, pruned as if each layer chose alone) with the option each
    tied layer of a pipeline plan was given, where it was pruned: the tie's strategy may
    be one its class alone would never take (the head owns no parameter of its own, so
    every strategy costs it the same and the first is kept)."""
    if plan.pipeline is None or not graph.ties:
        return options
    info = {layer.name: layer for layer in graph.layers}
    out = []
    for o in options:
        costs = dict(o.costs)
        for la in plan.layers:
            if la.layer_class == o.name and la.option not in costs and graph.tie_of(la.module):
                costs[la.option] = layer_cost(
                    info[la.module], la.option, plan.mesh, cluster, prec,
                    plan.pipeline.num_microbatches,
                    hsdp_shard_size=hsdp_shard_size(cluster, plan.mesh.pp),
                    estimators=estimators)
        out.append(dataclasses.replace(o, costs=costs))
    return out
