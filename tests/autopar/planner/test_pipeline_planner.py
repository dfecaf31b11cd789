"""Pipeline planning: exhaustive brute force on tiny instances, exact pruning, and choices."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_cases import GiB, graph_of, make_cluster, make_layer

from autopar.errors import ConfigError, InfeasibleError
from autopar.planner import search
from autopar.planner.configs import Config, pipeline_configs
from autopar.planner.engine import Engine, _Prepared
from autopar.planner.ilp import FEASIBILITY_SLACK_GIB, GIB
from autopar.planner.published import MegatronRow, megatron_graph, megatron_rows
from autopar.planner.stages import balanced_bounds, stage_assignment
from autopar.zoo import GPTConfig, ModelSpec, get_model
from cost_models.hardware import OVERLAP_PATTERNS, Cluster, Overlap
from cost_models.memory import precision
from cost_models.schedule import stage_ranks
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh, Plan

FP32 = precision("float32")


def tiny_instance(seed: int):
    rng = random.Random(seed)
    n = rng.choice([3, 4])
    params = rng.choice([2, 8, 32]) * 1_000_000
    tokens = rng.choice([2048, 8192])
    act = tokens * 512 * 4
    layers = [make_layer(f"h.{i}", "Block" if i else "Embed", i,
                         params=params * (3 if i == 0 else 1), fwd_flops=2 * params * tokens,
                         saved_bytes=act * rng.choice([4, 16]), act_bytes=act,
                         tp=rng.random() < 0.6) for i in range(n)]
    cluster = make_cluster(per_node=rng.choice([2, 4]), nodes=1,
                           memory_bytes=int(rng.choice([0.4, 1.0, 4.0]) * GiB))
    return graph_of(layers, batch=8), cluster


def fits(ctx: Engine, config, stage_of, costs) -> bool:
    pp, v = config.mesh.pp, config.virtual_stages
    owner = stage_ranks(config.schedule, pp, pp * v)
    inflight = ctx.inflight(config)
    cap = ctx.cluster.device.memory_bytes - FEASIBILITY_SLACK_GIB * GIB
    for r in range(pp):
        mine = [(c, s) for c, s in zip(costs, stage_of, strict=True) if owner[s] == r]
        used = sum(c.resident_with(inflight[s]) for c, s in mine)
        used += max(c.buffers_bytes for c, _ in mine)
        if (1 + ctx.cluster.memory_margin_fraction) * used > cap:
            return False
    return True


def brute_force_pipeline(graph, cluster) -> float:
    """Every configuration × every contiguous cut × every per-layer strategy, simulated."""
    ctx = Engine(graph, cluster, FP32, 10.0)
    best = float("inf")
    n = len(graph.layers)
    for config in pipeline_configs(graph, cluster):
        for bounds in itertools.combinations(range(1, n), config.num_stages - 1):
            stage_of = stage_assignment(n, bounds)
            options = [list(ctx.costs(i, config).values()) for i in range(n)]
            for combo in itertools.product(*options):
                if not fits(ctx, config, stage_of, combo):
                    continue
                prepared = _Prepared(config=config, stage_of_layer=stage_of, costs=combo,
                                     lower_bound_s=0.0)
                best = min(best, ctx.finish(prepared).step_time_s)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_pipeline_search_equals_brute_force_on_tiny_instances(seed):
    graph, cluster = tiny_instance(seed)
    expected = brute_force_pipeline(graph, cluster)
    best, _ = Engine(graph, cluster, FP32).pipelines()
    if expected == float("inf"):
        assert best is None
    else:
        assert best is not None
        assert best.step_time_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_bounds_never_exceed_the_simulated_step_and_pruning_loses_nothing(seed):
    graph, cluster = tiny_instance(seed)
    ctx = Engine(graph, cluster, FP32, 10.0)
    unpruned = float("inf")
    for config in pipeline_configs(graph, cluster):
        for cut in ctx.cuts(config):
            optimistic = ctx.bound(config, cut, ctx.fastest(config, cut))
            prepared = ctx.prepare(config, cut)
            if not isinstance(prepared, _Prepared):
                continue
            step = ctx.finish(prepared).step_time_s
            assert optimistic <= prepared.lower_bound_s * (1 + 1e-9)
            assert ctx.memory_bound(config, cut) <= prepared.lower_bound_s
            assert prepared.lower_bound_s <= step * (1 + 1e-9)
            assert ctx.ramp_bound(prepared) <= step
            unpruned = min(unpruned, step)
    best, _ = Engine(graph, cluster, FP32).pipelines()
    assert (best.step_time_s if best else float("inf")) == pytest.approx(unpruned, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_pruning_by_memory_and_ramp_bounds_returns_the_same_plan(seed):
    graph, cluster = tiny_instance(seed)
    pruned, _ = Engine(graph, cluster, FP32).pipelines()
    every, _ = Engine(graph, cluster, FP32, prune=False).pipelines()
    assert (pruned is None) == (every is None)
    if pruned is not None:
        assert (pruned.config, pruned.stage_of_layer, pruned.costs, pruned.step_time_s) == (
            every.config, every.stage_of_layer, every.costs, every.step_time_s)


@pytest.mark.parametrize("seed", range(4))
def test_the_search_answers_the_faster_of_its_one_stage_and_pipeline_bests(seed):
    """What tests of one-stage published plans rely on (test_fsdp_scaling.py): a search
    with pipelines is never slower than the same search on one stage alone. On these
    instances the one stage wins or nothing fits; where a pipeline wins, see
    test_larger_megatron_rows_are_fastest_with_pipeline_parallelism_and_tp_inside_a_node."""
    graph, cluster = tiny_instance(seed)
    try:
        one_stage = search(graph, cluster, pipeline=False).plan.prediction.step_time_s
    except InfeasibleError:
        one_stage = float("inf")  # some instances fit only when pipelined
    pipelines = Engine(graph, cluster, FP32).pipelines()[0]
    fastest = min(one_stage, pipelines.step_time_s if pipelines else float("inf"))
    if fastest == float("inf"):
        with pytest.raises(InfeasibleError):
            search(graph, cluster)
    else:
        assert search(graph, cluster).plan.prediction.step_time_s == fastest


def test_infeasible_configurations_are_reported_with_or_without_pruning():
    graph, cluster = tiny_instance(0)
    cluster = make_cluster(per_node=2, nodes=1, memory_bytes=int(0.05 * GiB))
    pruned = Engine(graph, cluster, FP32).pipelines()
    every = Engine(graph, cluster, FP32, prune=False).pipelines()
    assert pruned[0] is None and every[0] is None
    assert {(o.config, o.min_memory_bytes) for o in pruned[1]} == {
        (o.config, o.min_memory_bytes) for o in every[1]}


def test_plan_carries_stages_schedule_and_bubble_and_fits_each_rank():
    spec = get_model("gpt-tiny")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(8, device="meta"))
    cluster = Cluster.local(2)
    plan = search(graph, cluster, mesh=Mesh(pp=2, dp=1, tp=1)).plan
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp) == (2, 1, 1)
    assert plan.pipeline is not None
    assert plan.num_stages == plan.mesh.pp * plan.pipeline.virtual_stages
    stages = [lp.stage for lp in plan.layers]
    assert stages == sorted(stages) and set(stages) == set(range(plan.num_stages))
    assert 0 < plan.prediction.bubble_fraction < 1
    assert plan.prediction.step_time_s == pytest.approx(
        plan.prediction.compute_s + plan.prediction.comm_s + plan.prediction.bubble_s)
    assert plan.prediction.memory.total_bytes <= cluster.device.memory_bytes
    assert plan.global_batch % (plan.mesh.dp * plan.pipeline.num_microbatches) == 0
    assert Plan.from_json(plan.to_json()) == plan


class WidthScaled(torch.nn.Module):
    """Three layers; a Python int made before the first (the input's width) is read after
    the second, so it would have to cross a cut before ``b`` as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        return self.c(self.b(self.a(x)) * width)


def test_no_stage_starts_where_a_python_value_would_cross():
    graph = build_layer_graph(WidthScaled(), (torch.randn(4, 8),))
    assert graph.uncuttable == frozenset({1})
    ctx = Engine(graph, Cluster.local(2), FP32, 10.0)
    configs = pipeline_configs(graph, Cluster.local(2))
    assert configs
    for config in configs:
        assert ctx.cuts(config) == [(0, 0, 1)], config


def test_a_stage_may_start_where_an_integer_tensor_crosses():
    """The zoo GPT makes its position ids (int64, arange) beside wte and reads them in wpe:
    they are sent, so a stage may start at wpe."""
    spec = get_model("gpt-tiny")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(8, device="meta"))
    assert [layer.name for layer in graph.layers][:2] == ["wte", "wpe"]
    assert graph.uncuttable == frozenset()


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=7), data=st.data())
def test_balanced_cut_is_the_lightest_heaviest_stage_over_the_allowed_cuts(weights, data):
    n = len(weights)
    uncuttable = data.draw(st.frozensets(st.integers(1, n - 1)))
    allowed = [k for k in range(1, n) if k not in uncuttable]
    stages = data.draw(st.integers(1, len(allowed) + 1))
    bounds = balanced_bounds(weights, stages, uncuttable)
    assert len(bounds) == stages - 1 and not set(bounds) & uncuttable
    assert list(bounds) == sorted(set(bounds))

    def heaviest(cut):
        edges = [0, *cut, n]
        return max(sum(weights[a:b]) for a, b in itertools.pairwise(edges))

    best = min(heaviest(c) for c in itertools.combinations(allowed, stages - 1))
    assert heaviest(bounds) == pytest.approx(best)


def large_rows(min_params_b: float) -> list[MegatronRow]:
    return [r for r in megatron_rows() if r.params_b >= min_params_b]


@pytest.mark.parametrize("row", large_rows(39)[:2], ids=lambda r: f"{r.params_b}B")
def test_larger_megatron_rows_are_fastest_with_pipeline_parallelism_and_tp_inside_a_node(row):
    # Same model, cluster and batch as the published run (fp16, DGX A100 80GB).
    cfg = GPTConfig(n_layer=row.layers, n_head=row.heads,
                    n_embd=row.hidden, vocab_size=51200, block_size=2048)
    spec = ModelSpec(name=f"gpt-{row.params_b}b", kind="gpt", config=cfg,
                     default_batch=row.global_batch, default_seq=2048, description="")
    graph = build_layer_graph(spec.build("meta"),
                              spec.example_inputs(spec.default_batch, device="meta"))
    # Communication exposed, as the 2021 software ran it. With FSDP's gathers overlapped
    # (8 network rails per node make them cheap), pp = 1 FSDP wins instead.
    cluster = Cluster.preset("dgx-a100-80g", nodes=row.gpus // 8)
    cluster = replace(cluster, overlap=Overlap(exposed=OVERLAP_PATTERNS))
    # A long time limit: the search's choice is under test, not this machine's speed.
    plan = search(graph, cluster, precision_name="float16", time_limit_s=600).plan
    assert plan.mesh.pp > 1
    assert plan.mesh.tp <= cluster.devices_per_node
    assert plan.prediction.memory.total_bytes <= cluster.device.memory_bytes
    # Without pipelining the model fits only by sharding and recomputing more: slower.
    flat = search(graph, cluster, precision_name="float16", pipeline=False,
                  time_limit_s=600).plan
    assert flat.prediction.step_time_s > plan.prediction.step_time_s


@pytest.mark.parametrize("model, batch, nodes", [("gpt3-1.3b", 256, 8), ("gpt2-small", 64, 2)])
def test_a_pipelined_layers_least_memory_never_grows_with_the_micro_batch_count(model, batch,
                                                                                 nodes):
    # Engine.pipelines takes a mesh's memory floor at its most micro-batches as a floor for
    # every count: states do not depend on it, activations shrink with the micro-batch.
    spec = get_model(model)
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(batch, device="meta"),
                              model_name=model)
    cluster = Cluster.preset("dgx-a100-80g", nodes=nodes)
    engine = Engine(graph, cluster, precision("bfloat16"), 10.0)
    counts: dict = {}
    for config in pipeline_configs(graph, cluster):
        counts.setdefault(config.mesh, set()).add(config.microbatches)
    assert len(counts) > 4
    for mesh, ms in counts.items():
        least = [[engine.summary(options)[4] for options in engine.layer_costs(
            Config(mesh=mesh, schedule="1F1B", microbatches=m))] for m in sorted(ms)]
        for fewer, more in itertools.pairwise(least):
            assert all(b <= a * (1 + 1e-12) for a, b in zip(fewer, more, strict=True)), mesh


def test_a_fixed_pipeline_mesh_is_planned_even_where_another_mesh_is_faster():
    """Asked for pp = 4 × dp = 8 × tp = 2, the search weighs only that mesh's configurations:
    it once searched every pipeline mesh and dropped the others' winners afterwards, so a
    mesh the others' bounds pruned came back as no plan at all, with no reason."""
    row = MegatronRow(params_b=1.7, heads=24, hidden=2304, layers=24, tp=2, pp=4, gpus=64,
                      global_batch=512, tflops_per_gpu=0.0, microbatch=1, interleave=1)
    graph = megatron_graph(row)
    cluster = Cluster.preset("dgx-a100-80g", nodes=8)
    fixed = Mesh(pp=4, dp=8, tp=2)
    result = search(graph, cluster, precision_name="bfloat16", mesh=fixed)
    assert result.plan.mesh == fixed and result.plan.pipeline is not None
    assert {c.mesh for c in result.candidates} == {fixed}
    free = search(graph, cluster, precision_name="bfloat16")
    assert free.plan.mesh != fixed  # the case the old search lost
    assert free.plan.prediction.step_time_s < result.plan.prediction.step_time_s


def test_a_fixed_pipeline_mesh_the_cluster_cannot_hold_is_refused_with_the_rules():
    row = MegatronRow(params_b=1.7, heads=24, hidden=2304, layers=24, tp=2, pp=4, gpus=64,
                      global_batch=512, tflops_per_gpu=0.0, microbatch=1, interleave=1)
    graph = megatron_graph(row)
    cluster = Cluster.preset("dgx-a100-80g", nodes=8)
    with pytest.raises(ConfigError, match=r"pp=32.*not a pipeline layout.*pp at most the 28 places"):
        search(graph, cluster, mesh=Mesh(pp=32, dp=1, tp=2))
