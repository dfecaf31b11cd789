"""What the planner shares between configurations, and the shorter scans it runs, give
what it would compute for each alone or by the definition (issue 17, part 7): rank bounds
from a shared hull store, layer options priced once for both recomputation modes and once
for all dp × cp splits of a layer without ring attention, the balanced cut search's
stopped walks, and the least memory of a program by running minima."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.planner.bounds import Hulls, greedy, lower_hull, rank_bound
from autopar.planner.costs import LayerCost
from autopar.planner.ilp import GIB, ClassOptions


def option(time_s: float, states_gib: float, buffer_gib: float, host_gib: float = 0.0
           ) -> LayerCost:
    return LayerCost(option="o", strategy="replicate", recompute="none", offload=False,
                     sequence_parallel=False, microbatches=1, fwd_s=time_s / 2,
                     bwd_s=time_s / 3, wgrad_s=time_s / 6, step_s=time_s / 5,
                     compute_s=time_s, comm_s=0.0, params_bytes=states_gib * GIB,
                     grads_bytes=0.0, optimizer_bytes=0.0,
                     activations_bytes=states_gib * GIB / 4, buffers_bytes=buffer_gib * GIB,
                     output_bytes=0.0, host_bytes=host_gib * GIB)


def plain_rank_bound(classes: list[ClassOptions], capacity: float, margin: float,
                     value) -> float:
    """The least per-cap LP bound, every class's hull built from scratch at every cap (the
    lower bound ignores host memory)."""
    out = math.inf
    for cap in sorted({x.buffers_bytes for c in classes for x in c.costs.values()}):
        hulls = []
        for c in classes:
            allowed = [x for x in c.costs.values() if x.buffers_bytes <= cap]
            if not allowed:
                break
            hulls.append((c.count, lower_hull((x.resident_with(c.inflight), value(x))
                                              for x in allowed)))
        else:
            out = min(out, greedy(hulls, capacity / (1 + margin) - cap)[0])
    return out


options_st = st.lists(
    st.builds(option, st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.floats(0.0, 4.0),
              st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.sampled_from([0.0, 0.0, 300.0])),
    min_size=1, max_size=5)


def value(cost: LayerCost) -> float:
    return 3 * (cost.fwd_s + cost.bwd_s + cost.wgrad_s) + cost.step_s


@settings(max_examples=150, deadline=None)
@given(st.lists(options_st, min_size=1, max_size=3),
       st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.integers(1, 4)),
                         min_size=1, max_size=3), min_size=1, max_size=6),
       st.floats(1.0, 24.0))
def test_rank_bounds_from_a_shared_hull_store_equal_those_built_alone(pool, programs,
                                                                      capacity_gib):
    # Programs draw their classes from a few shared option dicts at various counts and
    # in-flight counts, as a pipeline's ranks do; one store serves them all.
    dicts = [{f"s{j}": x for j, x in enumerate(opts)} for opts in pool]
    store = Hulls(value)
    for program in programs:
        classes = [ClassOptions(name=f"c{i}", count=n, inflight=k,
                                costs=dicts[d % len(dicts)])
                   for i, (d, n, k) in enumerate(program)]
        shared = rank_bound(classes, capacity_gib * GIB, 0.1, value, store)
        assert shared == rank_bound(classes, capacity_gib * GIB, 0.1, value)
        assert shared == plain_rank_bound(classes, capacity_gib * GIB, 0.1, value)


def test_a_store_never_serves_a_dead_dicts_hull_to_a_new_dict_at_its_address():
    store = Hulls(value)
    first = {"a": option(1.0, 1.0, 0.0), "b": option(3.0, 0.5, 0.0)}
    classes = [ClassOptions(name="c", count=2, inflight=1, costs=first)]
    before = rank_bound(classes, 8 * GIB, 0.1, value, store)
    # A new dict at the same id (as after the first is freed): its own options count.
    second = {"a": option(2.0, 1.0, 0.0)}
    store._sorted[id(second)] = store._sorted.pop(id(first))
    for key in [k for k in store._hulls if k[0] == id(first)]:
        store._hulls[(id(second), *key[1:])] = store._hulls.pop(key)
    again = [ClassOptions(name="c", count=2, inflight=1, costs=second)]
    assert rank_bound(again, 8 * GIB, 0.1, value, store) == rank_bound(again, 8 * GIB, 0.1,
                                                                        value)
    assert rank_bound(again, 8 * GIB, 0.1, value) != before


def test_options_priced_once_for_both_recomputation_modes_equal_those_priced_alone():
    from autopar.planner.costs import layer_options
    from autopar.zoo import get_model
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from passes.layer_graph import build_layer_graph
    from runtime.plan import Mesh

    spec = get_model("gpt2-small")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(64, device="meta"),
                              model_name="gpt2-small")
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    prec = precision("bfloat16")
    selective_seen = False
    for mesh, m in [(Mesh(pp=2, dp=4, tp=2), 4), (Mesh(pp=4, dp=4, tp=1), 8),
                    (Mesh(pp=1, dp=4, tp=4), 2)]:
        for layer in {layer.layer_class: layer for layer in graph.layers}.values():
            alone = {s: layer_options(layer, graph.seq_len, mesh, cluster, prec, m,
                                      selective=s) for s in (False, True)}
            for first in (False, True):  # either mode may be asked first
                priced: dict = {}
                shared = {s: layer_options(layer, graph.seq_len, mesh, cluster, prec, m,
                                           selective=s, priced=priced)
                          for s in (first, not first)}
                for s in (False, True):
                    assert list(shared[s]) == list(alone[s])
                    assert shared[s] == alone[s]
            selective_seen |= any("selective" in o for o in alone[True])
    assert selective_seen  # the two modes differ somewhere


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=12),
       st.floats(0.5, 20.0), st.integers(1, 12))
def test_the_balanced_cut_search_stops_each_walk_where_the_full_walk_decides(weights, limit,
                                                                             stages):
    from autopar.planner.stages import _greedy_cuts, _greedy_fits

    assert _greedy_fits(weights, limit, stages) == (len(_greedy_cuts(weights, limit)) + 1
                                                    <= stages)


def plain_min_device_memory(classes: list[ClassOptions], margin: float):
    """The least memory by its definition: every cap, every class its least option under it."""
    best, best_choice = math.inf, {}
    caps = sorted({0.0} | {x.buffers_bytes for c in classes for x in c.costs.values()})
    for cap in caps:
        total, choice = cap, {}
        for c in classes:
            allowed = [(x.resident_with(c.inflight), s) for s, x in c.costs.items()
                       if x.buffers_bytes <= cap]
            if not allowed:
                break
            resident, strategy = min(allowed)
            total += c.count * resident
            choice[c.name] = {strategy: c.count}
        else:
            if total < best:
                best, best_choice = total, choice
    return (1 + margin) * best, best_choice


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), options_st), min_size=1,
                max_size=4))
def test_least_memory_by_running_minima_equals_the_definition(raw):
    from autopar.planner.ilp import _min_device_memory

    classes = [ClassOptions(name=f"c{i}", count=n, inflight=k,
                            costs={f"s{j}": x for j, x in enumerate(opts)})
               for i, (n, k, opts) in enumerate(raw)]
    assert _min_device_memory(classes, 0.1) == plain_min_device_memory(classes, 0.1)


def test_layers_without_ring_attention_cost_on_dp_x_cp_what_they_cost_on_dp_cp_replicas():
    # one_stage.cost_mesh: such layers' options are shared between meshes that split their
    # replicas differently between dp and cp; pricing each mesh gives the same options.
    from autopar.planner.costs import layer_options
    from autopar.planner.estimators import ANALYTIC
    from autopar.planner.one_stage import cost_mesh
    from autopar.zoo import get_model
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from passes.layer_graph import build_layer_graph
    from runtime.plan import Mesh

    spec = get_model("gpt2-small")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(64, device="meta"),
                              model_name="gpt2-small")
    assert graph.context_parallel_problem is None  # the search offers it cp meshes
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)
    shared = attention = 0
    for prec in (precision("float32"), precision("bfloat16")):
        for mesh, m in [(Mesh(dp=16, cp=2, tp=1), 1), (Mesh(dp=4, cp=4, tp=2), 2),
                        (Mesh(dp=1, cp=8, tp=4), 1), (Mesh(dp=8, cp=4, tp=1), 4)]:
            for layer in {layer.layer_class: layer for layer in graph.layers}.values():
                seen = cost_mesh(layer, mesh, ANALYTIC)
                if seen == mesh:
                    attention += 1
                    continue
                shared += 1
                assert seen == Mesh(dp=mesh.replicas, cp=1, tp=mesh.tp)
                as_seen = layer_options(layer, graph.seq_len, seen, cluster, prec, m)
                assert as_seen == layer_options(layer, graph.seq_len, mesh, cluster, prec, m)
                assert list(as_seen) == list(layer_options(layer, graph.seq_len, mesh,
                                                           cluster, prec, m))
    assert shared and attention  # embeddings, norm and head shared; the blocks not


def test_one_stage_programs_with_shared_options_equal_those_priced_per_mesh():
    from autopar.planner.configs import Config, accumulation_steps, candidate_meshes
    from autopar.planner.engine import Engine
    from autopar.planner.one_stage import class_options
    from autopar.zoo import get_model
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from passes.layer_graph import build_layer_graph

    spec = get_model("gpt2-small")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(32, device="meta"),
                              model_name="gpt2-small")
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    prec = precision("bfloat16")
    engine = Engine(graph, cluster, prec)
    meshes = [m for m, reason in candidate_meshes(cluster, 32, seq_len=graph.seq_len,
                                                  context_parallel=True) if not reason]
    assert any(m.cp > 1 for m in meshes)
    for mesh in meshes:
        for k in accumulation_steps(graph, mesh):
            (program,) = engine.programs(Config(mesh=mesh, microbatches=k))
            alone = class_options(graph, mesh, cluster, prec, k)
            assert [(c.name, c.count, c.costs) for c in program] == [
                (c.name, c.count, c.costs) for c in alone]


def test_options_sharing_their_estimates_equal_options_priced_each_alone():
    # costs.layer_cost's ``shared``: a layer's options on one mesh compute each analytic
    # estimate once per key. A copy of ANALYTIC is another set of estimators to
    # layer_cost, which shares nothing with it: every option priced from scratch.
    import dataclasses

    from autopar.planner.costs import layer_options
    from autopar.planner.estimators import ANALYTIC
    from autopar.zoo import get_model
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from passes.layer_graph import build_layer_graph
    from runtime.plan import Mesh

    spec = get_model("gpt2-small")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(64, device="meta"),
                              model_name="gpt2-small")
    alone = dataclasses.replace(ANALYTIC)
    assert alone == ANALYTIC and alone is not ANALYTIC
    seen: set[str] = set()
    for cluster in (Cluster.preset("dgx-h100", nodes=2), Cluster.preset("dgx-a100-80g")):
        for prec in (precision("float32"), precision("bfloat16")):
            # tp with SP and async TP (H100), ring attention (cp), HSDP across 2 nodes,
            # offload, pipelines, micro-batches
            n = cluster.world_size
            for mesh, m in [(Mesh(dp=n // 8, tp=4, cp=2), 2), (Mesh(dp=n // 4, tp=4), 1),
                            (Mesh(dp=n), 4), (Mesh(pp=2, dp=n // 4, tp=2), 4)]:
                for layer in {la.layer_class: la for la in graph.layers}.values():
                    shared = layer_options(layer, graph.seq_len, mesh, cluster, prec, m)
                    each = layer_options(layer, graph.seq_len, mesh, cluster, prec, m,
                                         estimators=alone)
                    assert list(shared) == list(each)
                    assert shared == each
                    seen.update(shared)
    for kind in ("+sp", "+async", "+offload", "+selective", "+full", "hsdp", "tp_fsdp"):
        assert any(kind in o for o in seen), kind  # the options sharing serves
