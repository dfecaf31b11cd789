"""Planner: the ILP against brute force, plan invariants, and choices as memory shrinks."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
from planner_cases import GiB, graph_of, make_cluster, make_layer

from autopar.errors import ConfigError, InfeasibleError
from autopar.planner import search
from autopar.planner.configs import accumulation_steps, candidate_meshes
from autopar.planner.costs import (
    HOST_MEMORY_BYTES,
    allowed_options,
    hsdp_shard_size,
    layer_cost,
    layer_options,
    on_ddp,
)
from autopar.planner.ilp import min_memory
from autopar.planner.one_stage import class_options
from cost_models.hardware import OVERLAP_PATTERNS, Cluster, Host, Link, Overlap
from cost_models.memory import precision
from passes.records import Collective, LayerGraph
from runtime.plan import Mesh, Plan
from runtime.strategies import STRATEGIES, spec

FP32 = precision("float32")


def every_option(layer, mesh, cluster, prec, m: int, *, prune: bool = True) -> list:
    """Every option of one layer, with its cost (dominated ones removed when ``prune``)."""
    if prune:
        return list(layer_options(layer, None, mesh, cluster, prec, m).values())
    hsdp = hsdp_shard_size(cluster)
    return [layer_cost(layer, o, mesh, cluster, prec, m, hsdp_shard_size=hsdp)
            for o in allowed_options(layer, mesh, hsdp_shard_size=hsdp, microbatches=m,
                                     offload=cluster.host.offload)]


def brute_force(graph: LayerGraph, cluster, prec_name: str = "float32", *,
                prune: bool = True) -> float:
    """Best step time over every mesh, gradient accumulation and per-layer option."""
    prec = precision(prec_name)
    best = float("inf")
    for mesh, reason in candidate_meshes(cluster, graph.batch_size, seq_len=graph.seq_len,
                                         context_parallel=graph.context_parallel_problem is None):
        if reason:
            continue
        for m in accumulation_steps(graph, mesh):
            options = [every_option(layer, mesh, cluster, prec, m, prune=prune)
                       for layer in graph.layers]
            # The plan of replicate layers runs on DDP in float32, which pays less.
            ddp = [[on_ddp(c) for c in layer if c.strategy == "replicate"] for layer in options]
            combos = itertools.product(*options)
            if prec.name == "float32" and mesh.pp == 1:
                combos = itertools.chain(combos, itertools.product(*ddp))
            for combo in combos:
                resident = sum(c.resident_bytes for c in combo)
                buffer = max(c.buffers_bytes for c in combo)
                if (1 + cluster.memory_margin_fraction) * (resident + buffer) > \
                        cluster.device.memory_bytes:
                    continue
                if sum(c.host_bytes for c in combo) > HOST_MEMORY_BYTES:
                    continue
                best = min(best, sum(c.time_s for c in combo))
    return best


def random_instance(rng: random.Random, max_layers: int = 4, *,
                    context_parallel: bool = False) -> tuple[LayerGraph, object]:
    """Random layers, cluster and memory; with ``context_parallel`` the layers attend
    (K/V bytes and attention FLOPs) and the graph may split its sequence."""
    n_layers = rng.randint(2, max_layers)
    n_classes = rng.randint(1, min(3, n_layers))
    shapes = [
        dict(params=rng.choice([1, 4, 16, 64]) * 1_000_000,
             tokens=rng.choice([512, 4096, 16384]), hidden=rng.choice([256, 1024]),
             tp=rng.random() < 0.7)
        for _ in range(n_classes)
    ]
    layers = []
    for i in range(n_layers):
        k = rng.randrange(n_classes) if i >= n_classes else i
        s = shapes[k]
        act = s["tokens"] * s["hidden"] * 4
        layer = make_layer(f"l.{i}", f"C{k}", i, params=s["params"],
                           fwd_flops=2 * s["params"] * s["tokens"],
                           saved_bytes=act * 12, act_bytes=act, tp=s["tp"])
        if context_parallel:  # attention: K and V of every token; s²-proportional FLOPs
            layer = replace(layer, attention_kv_bytes=2 * act,
                            attention_fwd_flops=4 * s["tokens"] * s["hidden"] * 2048,
                            fwd_flops=layer.fwd_flops + 4 * s["tokens"] * s["hidden"] * 2048)
        layers.append(layer)
    per_node = rng.choice([1, 2, 4, 8])
    nodes = rng.choice([1, 2]) if per_node * 2 <= 8 else 1
    world = per_node * nodes
    # Context-parallel instances get few samples, so dp alone cannot use every device.
    batch = rng.choice([1, 2]) if context_parallel else world * rng.choice([1, 2])
    sizes = [c.resident_bytes for c in
             (layer_cost(layers[0], "replicate", search_mesh(world), make_cluster(), precision("float32")),)]
    cap = int(sizes[0] * len(layers) * rng.choice([0.3, 0.6, 1.0, 2.0]))
    cluster = make_cluster(nodes=nodes, per_node=per_node, memory_bytes=max(cap, 1))
    graph = graph_of(layers, batch)
    if context_parallel:
        graph = replace(graph, seq_len=2048, context_parallel_problem=None)
    return graph, cluster


def search_mesh(world: int):
    from runtime.plan import Mesh
    return Mesh(dp=world)


def check_against_brute_force(graph: LayerGraph, cluster) -> None:
    expected = brute_force(graph, cluster)
    if expected == float("inf"):
        with pytest.raises(InfeasibleError):
            search(graph, cluster, pipeline=False)
        return
    result = search(graph, cluster, pipeline=False)
    assert result.plan.solver.objective_s == pytest.approx(expected, rel=1e-6)
    assert result.plan.prediction.step_time_s == pytest.approx(expected, rel=1e-6)
    check_invariants(result.plan, graph, cluster)


@pytest.mark.parametrize("seed", range(24))
def test_ilp_objective_equals_brute_force_on_small_instances(seed):
    check_against_brute_force(*random_instance(random.Random(seed)))


@pytest.mark.parametrize("seed", range(8))
def test_ilp_equals_brute_force_with_context_parallel_meshes(seed):
    check_against_brute_force(*random_instance(random.Random(200 + seed), max_layers=3,
                                               context_parallel=True))


@pytest.mark.parametrize("seed", range(6))
def test_removing_dominated_options_loses_nothing(seed):
    graph, cluster = random_instance(random.Random(100 + seed), max_layers=2)
    assert brute_force(graph, cluster) == pytest.approx(
        brute_force(graph, cluster, prune=False), rel=1e-9)


def check_invariants(plan: Plan, graph: LayerGraph, cluster) -> None:
    mesh = plan.mesh
    assert mesh.world_size == cluster.world_size
    assert cluster.devices_per_node % mesh.tp == 0, "tp must stay inside a node"
    assert plan.global_batch % mesh.dp == 0
    assert plan.prediction.memory.total_bytes <= cluster.device.memory_bytes
    assert plan.solver.lower_bound_s <= plan.solver.objective_s * (1 + 1e-9)
    assert 0 <= plan.solver.gap <= 1
    assert [lp.module for lp in plan.layers] == [layer.name for layer in graph.layers]
    for lp, layer in zip(plan.layers, graph.layers, strict=True):
        if lp.is_tp:
            assert layer.tp is not None and all(d % mesh.tp == 0 for d in layer.tp.divisors)
            assert lp.tp_styles == (layer.tp.sp_styles if lp.sequence_parallel else layer.tp.styles)
    # The plan survives its own JSON.
    assert Plan.from_json(plan.to_json()) == plan


def states_model():
    """Four identical blocks whose parameters, not activations, fill memory."""
    layers = [make_layer(f"h.{i}", "Block", i, params=50_000_000, fwd_flops=1e12,
                         saved_bytes=1_000_000, act_bytes=100_000, tp=False) for i in range(4)]
    return graph_of(layers, 4)


def activations_model():
    """Four blocks whose saved activations fill memory; the attention core holds 40% of
    them for 5% of the forward FLOPs (what selective recomputation frees and reruns).
    Batch 4 on 4 devices leaves no room for gradient accumulation."""
    tokens, h = 8192, 1024
    layers = [replace(make_layer(f"h.{i}", "Block", i, params=12 * h * h,
                                 fwd_flops=24 * h * h * tokens, saved_bytes=34 * tokens * h * 4,
                                 act_bytes=tokens * h * 4, tp=False),
                      selective_saved_bytes=14 * tokens * h * 4,
                      selective_fwd_flops=0.05 * 24 * h * h * tokens)
              for i in range(4)]
    return graph_of(layers, 4)


def least_memory_without(graph: LayerGraph, cluster, excluded: str) -> float:
    """The least per-rank memory of any pp = 1 plan whose options avoid ``excluded``."""
    prec = precision("float32")
    best = float("inf")
    for mesh, reason in candidate_meshes(cluster, graph.batch_size, seq_len=graph.seq_len,
                                         context_parallel=graph.context_parallel_problem is None):
        for m in accumulation_steps(graph, mesh) if not reason else ():
            options = [replace(c, costs={k: v for k, v in c.costs.items() if excluded not in k})
                       for c in class_options(graph, mesh, cluster, prec, m)]
            best = min(best, min_memory(options, cluster.memory_margin_fraction)[0])
    return best


ZERO_STAGE = {"replicate": 0, "tp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3,
              "tp_fsdp": 3}


def test_identical_layers_may_take_different_options_when_memory_is_tight():
    graph = states_model()
    need = search(graph, make_cluster(per_node=4), pipeline=False).plan.prediction.memory
    cluster = make_cluster(per_node=4, memory_bytes=int(need.total_bytes * 0.9))
    plan = search(graph, cluster, pipeline=False).plan
    assert len({lp.option for lp in plan.layers}) > 1, [lp.option for lp in plan.layers]
    assert plan.solver.objective_s == pytest.approx(brute_force(graph, cluster), rel=1e-6)


def test_zero_stage_rises_as_memory_shrinks_and_offload_comes_last():
    # With its communication exposed each ZeRO stage costs more time than the one below
    # (overlapped, FSDP's gathers hide behind these blocks' compute and fsdp is fastest).
    graph = states_model()
    exposed = Overlap(exposed=OVERLAP_PATTERNS)
    ample = search(graph, make_cluster(per_node=4, overlap=exposed), pipeline=False).plan
    need = ample.prediction.memory.total_bytes
    stages = []
    for fraction in (1.05, 0.9, 0.8, 0.7, 0.5, 0.4):
        cluster = make_cluster(per_node=4, memory_bytes=int(need * fraction), overlap=exposed)
        plan = search(graph, cluster, pipeline=False).plan
        check_invariants(plan, graph, cluster)
        stages.append(max(4 if lp.offload else ZERO_STAGE[lp.strategy] for lp in plan.layers))
        if any(lp.offload for lp in plan.layers):
            # Offload only when nothing else fits.
            assert least_memory_without(graph, cluster, "offload") > cluster.device.memory_bytes
    assert stages == sorted(stages), stages
    assert stages[0] <= 2 and stages[-1] == 4, stages


def test_a_cluster_without_separate_host_memory_never_offloads():
    """``Cluster.host.offload`` False (CPU processes: the device's memory is the host's): where
    the same cluster with offload must offload to fit, it has no plan; with memory to
    spare, both plan alike; and no layer is offered an offload option."""
    graph = states_model()
    exposed = Overlap(exposed=OVERLAP_PATTERNS)
    need = search(graph, make_cluster(per_node=4, overlap=exposed),
                  pipeline=False).plan.prediction.memory.total_bytes
    tight = make_cluster(per_node=4, memory_bytes=int(need * 0.7), overlap=exposed)
    assert any(lp.offload for lp in search(graph, tight, pipeline=False).plan.layers)
    assert least_memory_without(graph, tight, "offload") > tight.device.memory_bytes
    with pytest.raises(InfeasibleError, match="smallest per-rank memory any plan needs"):
        search(graph, replace(tight, host=Host(offload=False)), pipeline=False)
    ample = make_cluster(per_node=4, memory_bytes=int(need * 1.05), overlap=exposed)
    assert search(graph, replace(ample, host=Host(offload=False)), pipeline=False).plan.layers == \
        search(graph, ample, pipeline=False).plan.layers
    for layer in graph.layers:
        no_host = replace(tight, host=Host(offload=False))
        labels = layer_options(layer, None, Mesh(dp=4), no_host, FP32)
        assert labels and not any("+offload" in o for o in labels)
        assert any("+offload" in o for o in layer_options(layer, None, Mesh(dp=4), tight, FP32))


def test_local_cpu_processes_and_their_calibrated_profiles_do_not_offload():
    assert Cluster.local(2).host.offload is False
    with pytest.raises(ConfigError, match=r"\[host\]: offload must be true or false"):
        Cluster.from_toml_text(_toml('[host]\noffload = "no"\n'))
    assert Cluster.from_toml_text(_toml("[host]\noffload = false\n")).host.offload is False
    assert Cluster.from_toml_text(_toml("")).host == Host()


def _toml(tables: str) -> str:
    return (f'name = "t"\n{tables}[device]\nname = "d"\nmemory_gib = 8\n'
            "memory_bandwidth_GBps = 100\n[device.peak_tflops]\nfloat32 = 1\n"
            '[intra_node]\nkind = "pcie"\nbandwidth_GBps = 10\nlatency_us = 5\n'
            '[inter_node]\nkind = "network"\nbandwidth_GBps = 10\nlatency_us = 5\n')


def test_recompute_turns_on_exactly_when_memory_binds_selective_before_full():
    graph = activations_model()
    ample = search(graph, make_cluster(per_node=4), pipeline=False).plan
    assert {lp.recompute for lp in ample.layers} == {"none"}
    need = ample.prediction.memory.total_bytes
    modes = []
    for fraction in (1.05, 0.9, 0.8, 0.6, 0.5):
        cluster = make_cluster(per_node=4, memory_bytes=int(need * fraction))
        plan = search(graph, cluster, pipeline=False).plan
        check_invariants(plan, graph, cluster)
        used = {lp.recompute for lp in plan.layers} - {"none"}
        if used:  # memory binds: the fastest plan no longer fits
            assert need > cluster.device.memory_bytes
        else:
            assert plan.solver.objective_s == pytest.approx(ample.solver.objective_s)
        modes.append(used)
    first = next(i for i, m in enumerate(modes) if m)
    assert modes[first] == {"selective"}, modes
    assert "full" in modes[-1] and all("full" not in m for m in modes[:first + 1]), modes


def large_vocab_model():
    """8 small blocks and a 262k-vocabulary head on a 4-GPU PCIe box (10 GB/s links)."""
    h, tokens, vocab = 512, 8192, 262144
    params = 12 * h * h
    layers = [
        make_layer(f"h.{i}", "Block", i, params=params, fwd_flops=2 * params * tokens,
                   saved_bytes=tokens * h * 4 * 17, act_bytes=tokens * h * 4)
        for i in range(8)
    ]
    layers = [replace(x, tp=replace(x.tp, sharded_saved_bytes=int(x.saved_bytes * 0.9)))
              for x in layers]
    head_params = vocab * h
    head = make_layer("head", "Head", 8, params=head_params, fwd_flops=2 * head_params * tokens,
                      saved_bytes=tokens * h * 4, act_bytes=tokens * vocab * 4)
    head = replace(head, tp=replace(
        head.tp, sharded_param_bytes=head_params * 4, sharded_saved_bytes=0,
        sharded_fwd_flops=2 * head_params * tokens,
        collectives=(Collective(kind="all_gather", nbytes=tokens * vocab * 4, phase="fwd"),
                     Collective(kind="all_reduce", nbytes=tokens * h * 4, phase="bwd"))))
    return graph_of(layers + [head], 4)


def pcie_cluster(memory_gib: float):
    cluster = make_cluster(per_node=4, memory_bytes=int(memory_gib * GiB))
    return replace(cluster, intra_node=Link(kind="pcie", bandwidth_GBps=10, latency_s=1e-5))


def test_moves_from_data_parallel_to_recompute_to_tp_as_memory_shrinks():
    # Communication exposed: these blocks' backward is bound by their gradient reduction
    # over PCIe, and overlapped there a recomputation would hide under it at no cost.
    graph = large_vocab_model()
    phases = []
    for gib in (4.0, 2.0, 1.5):
        cluster = replace(pcie_cluster(gib), overlap=Overlap(exposed=OVERLAP_PATTERNS))
        plan = search(graph, cluster, pipeline=False).plan
        check_invariants(plan, graph, cluster)
        used = {lp.strategy for lp in plan.layers}
        phases.append("tp" if used & {s for s in STRATEGIES if spec(s).tensor_parallel} else
                      "recompute" if any(lp.recompute != "none" for lp in plan.layers) else "dp")
    assert phases == ["dp", "recompute", "tp"]


def test_infeasible_error_gives_smallest_memory_any_plan_needs():
    graph = large_vocab_model()
    with pytest.raises(InfeasibleError) as info:
        search(graph, pcie_cluster(0.3))
    message = str(info.value)
    assert "smallest per-rank memory any plan needs is" in message
    number, unit = message.split("needs is ")[1].split()[:2]
    needed = float(number) / {"GiB": 1, "MiB": 1024}[unit]
    # Just above that figure a plan exists; just below, none.
    search(graph, pcie_cluster(needed * 1.01))
    with pytest.raises(InfeasibleError):
        search(graph, pcie_cluster(needed * 0.99))


def test_batch_not_divisible_by_any_dp_degree_is_a_clear_error():
    layers = [make_layer("h.0", "Block", 0, params=1000, fwd_flops=1e6, saved_bytes=10,
                         act_bytes=10, tp=False)]
    with pytest.raises(ConfigError, match="not divisible by any data-parallel degree"):
        search(graph_of(layers, 3), make_cluster(nodes=2, per_node=2))


def test_tensor_parallelism_never_crosses_a_node():
    graph = large_vocab_model()
    cluster = replace(pcie_cluster(2.5), devices_per_node=2, nodes=2)
    plan = search(graph, cluster).plan
    assert plan.mesh.tp <= 2


def test_memory_bound_kernels_add_to_the_matmuls_instead_of_hiding_under_them():
    # 1 TFLOP of matmuls on a 100 TFLOP/s device: 10 ms / efficiency. Their 1 GB of traffic
    # hides under that (0.5 ms at 2,000 GB/s); a norm/GELU/dropout moving 4 GB runs alone: 2 ms.
    cluster = make_cluster(per_node=1)
    layer = replace(make_layer("l", "C", 0, params=0, fwd_flops=1e12, saved_bytes=0,
                               act_bytes=0, tp=False),
                    mem_bytes=5 * 10**9, memory_bound_bytes=4 * 10**9, num_ops=0)
    cost = layer_cost(layer, "replicate", search_mesh(1), cluster, precision("float32"))
    matmuls = 10e-3 / cluster.device.matmul_efficiency
    assert cost.fwd_s == pytest.approx(matmuls + 2e-3)
    assert cost.bwd_s + cost.wgrad_s == pytest.approx(2 * (matmuls + 2e-3))
