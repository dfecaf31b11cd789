"""One stage (pp = 1): the rank's option programs, and the plan's layers, time and memory.

The rank program is every layer class's options, tied layers joined into one option
(planner/ties.py), plus the program of the plan the runtime would run on DDP; the step is
the sum of the layers' times and the memory the liveness walk's peak
(autopar/planner/liveness.py)."""

from __future__ import annotations

from dataclasses import replace

from autopar.planner.costs import LayerCost, layer_options, on_ddp
from autopar.planner.estimators import ANALYTIC, Estimators
from autopar.planner.ilp import ClassOptions, expand_counts
from autopar.planner.liveness import Usage, step_liveness
from autopar.planner.ties import tied_costs
from cost_models.hardware import Cluster
from cost_models.memory import Precision
from passes.records import LayerGraph, LayerInfo
from runtime.plan import MemoryBreakdown, Mesh
from runtime.strategies import spec


def class_options(graph: LayerGraph, mesh: Mesh, cluster: Cluster, prec: Precision,
                  microbatches: int = 1, estimators: Estimators = ANALYTIC,
                  priced: dict[tuple, dict[str, LayerCost]] | None = None
                  ) -> list[ClassOptions]:
    """Every layer class's options. ``priced``: a store of option sets shared with other
    meshes, by (class, the mesh as its costs see it, micro-batches); see ``cost_mesh``."""
    store = {} if priced is None else priced
    out = []
    for name, members in graph.classes.items():
        seen = cost_mesh(members[0], mesh, estimators)
        key = (name, seen, microbatches)
        if key not in store:
            store[key] = layer_options(members[0], graph.seq_len, seen, cluster, prec,
                                       microbatches, estimators=estimators)
        out.append(ClassOptions(name=name, count=len(members), costs=store[key]))
    return out


def cost_mesh(layer: LayerInfo, mesh: Mesh, estimators: Estimators) -> Mesh:
    """The mesh as the analytic costs of this layer see it. By costs.py's conventions a
    context-parallel rank's share of a sample is a batch split, and its parameters are
    replicated and reduced over all dp × cp replicas: only ring attention
    (``LayerInfo.attention_kv_bytes``), expert parallelism (over dp) and BatchNorm's
    statistics (over dp) tell cp from dp. A layer with none of them costs on dp × cp
    what it costs on dp·cp data-parallel replicas, so meshes that differ only in how their
    replicas split between dp and cp share its options (tested against pricing each mesh:
    tests/autopar/planner/test_search_sharing.py). Other estimators see the mesh as is."""
    if (mesh.cp == 1 or estimators is not ANALYTIC or layer.attention_kv_bytes
            or layer.moe or layer.batch_norm_channels):
        return mesh
    return replace(mesh, dp=mesh.replicas, cp=1)


def ddp_programs(options: list[ClassOptions], prec: Precision, mesh: Mesh
                 ) -> list[list[ClassOptions]]:
    """The rank program of a plan the runtime runs on DDP (runtime.data_parallel.uses_ddp:
    float32, pp = 1, every layer replicate), its costs as DDP pays them (``on_ddp``);
    none where that plan cannot be. The layer costs price a replicate layer as FSDP2 runs
    it, in every other plan: more host time and memory, so the all-replicate plan gets its
    own program rather than the ILP's over-priced corner."""
    if prec.name != "float32" or mesh.pp != 1:
        return []
    ddp = [ClassOptions(name=c.name, count=c.count, inflight=c.inflight,
                        costs={o: on_ddp(x) for o, x in c.costs.items()
                               if spec(x.strategy).ddp and x.expert_parallel == 1})
           for c in options]
    return [ddp] if all(c.costs for c in ddp) else []


def assign_layers(graph: LayerGraph, choice: dict[str, dict[str, int]],
                  options: list[ClassOptions]) -> list[LayerCost]:
    """Per layer, in execution order, the cost of the strategy the ILP gave it.

    Within a class the layers are interchangeable; earlier layers take strategies in the
    order of runtime.strategies.STRATEGIES. Tied layers take their tie's
    option (``options`` joined by planner/ties.py).
    """
    by_class = {o.name: o for o in options}
    tied = tied_costs(choice, options)
    queues = {name: expand_counts(counts) for name, counts in choice.items()}
    out = []
    for layer in graph.layers:
        if layer.name in tied:
            out.append(tied[layer.name])
            continue
        strategy = queues[layer.layer_class].pop(0)
        out.append(by_class[layer.layer_class].costs[strategy])
    return out


def plan_memory(costs: list[LayerCost], margin_fraction: float, *,
                names: list[str] | None = None, ddp: bool = False) -> MemoryBreakdown:
    """Per-rank memory of a pp = 1 plan (layers in execution order): the peak over the
    step by liveness (autopar.planner.liveness: forward, backward in reverse per micro-batch
    of ``LayerCost.microbatches``, optimizer step), with the allocator margin on top.
    Never above the ILP's sum of resident states, activations and the largest buffer.
    ``ddp``: the plan runs on DDP, whose gradient buckets live throughout (runs_on_ddp)."""
    names = names or [f"layer {i}" for i in range(len(costs))]
    m = costs[0].microbatches if costs else 1
    return memory_breakdown(step_liveness(costs, names, microbatches=m, ddp=ddp).peak,
                            margin_fraction)


def memory_breakdown(peak: Usage, margin_fraction: float) -> MemoryBreakdown:
    """A liveness peak as the plan's MemoryBreakdown, allocator margin added."""
    return MemoryBreakdown(params_bytes=int(peak.params_bytes), grads_bytes=int(peak.grads_bytes),
                           optimizer_bytes=int(peak.optimizer_bytes),
                           activations_bytes=int(peak.activations_bytes),
                           buffers_bytes=int(peak.buffers_bytes),
                           margin_bytes=int(margin_fraction * peak.total_bytes),
                           peak_at=peak.event)


def runs_on_ddp(costs: list[LayerCost], prec: Precision, mesh: Mesh) -> bool:
    """Whether the runtime wraps this plan in DDP (runtime.data_parallel.uses_ddp): pp = 1,
    float32, every layer replicate, no layer expert-parallel."""
    return (mesh.pp == 1 and prec.name == "float32"
            and all(spec(c.strategy).ddp and c.expert_parallel == 1 for c in costs))
