"""Expert parallelism in the planner: which degrees a MoE layer is offered, what each costs
(against hand calculations), and that the search picks EP where it wins and not where it
loses. Synthetic layers here; HF Mixtral and the zoo MoE in tests/autopar/test_moe_real_plans.py.

The MoE layer throughout: E = 8 experts, top_k = 2, H = 1024, I = 2048, gated, so an
expert holds 1024·4096 + 2048·1024 = 6,291,456 weights and the block 50,331,648; its
dense part holds 4,194,304 weights. The capture counted no FLOPs in the experts (grouped
GEMMs), as for Hugging Face's Mixtral. The test cluster (planner_cases.make_cluster):
NVLink 200 GB/s, 5 µs; network 20 GB/s, 10 µs; no collective skew.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_cases import graph_of, make_cluster, make_layer

from autopar.planner import moe_costs
from autopar.planner.costs import allowed_options, layer_cost, layer_options
from autopar.planner.estimators import ANALYTIC
from autopar.planner.ilp import ClassOptions
from autopar.planner.one_stage import ddp_programs, runs_on_ddp
from autopar.planner.search import search
from cost_models.hardware import GiB, Link
from cost_models.memory import precision
from cost_models.moe import ExpertShape
from passes.records import MoEInfo
from runtime.plan import Mesh, parse_option

BF16 = precision("bfloat16")
SHAPE = ExpertShape(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=2048)
EXPERT_PARAMS = 8 * 6_291_456
DENSE_PARAMS = 4_194_304


def moe_layer(name: str = "layers.0", index: int = 0, *, shape: ExpertShape = SHAPE,
              tokens: int = 8192, dense_flops: float = 1e11) -> MoEInfo:
    experts = shape.num_experts * shape.params_per_expert
    layer = make_layer(name, "moe", index, params=DENSE_PARAMS + experts,
                       fwd_flops=dense_flops, saved_bytes=tokens * 1024 * 4 * 6,
                       act_bytes=tokens * 1024 * 4, tp=False)
    block = MoEInfo(block="mlp", experts="mlp.experts", shape=shape, tokens=tokens,
                    param_count=experts, param_tensors=2, saved_bytes=tokens * 1024 * 4,
                    mem_bytes=tokens * 1024 * 8, memory_bound_bytes=tokens * 1024 * 8,
                    num_ops=6)
    return replace(layer, moe=(block,), param_tensors=12)


def test_degrees_are_the_divisors_of_dp_that_divide_the_experts():
    layer = moe_layer()
    assert moe_costs.ep_degrees(layer, Mesh(dp=4)) == (2, 4)
    assert moe_costs.ep_degrees(layer, Mesh(dp=8)) == (2, 4, 8)
    assert moe_costs.ep_degrees(layer, Mesh(dp=6)) == (2,)
    six = moe_layer(shape=replace(SHAPE, num_experts=6))
    assert moe_costs.ep_degrees(six, Mesh(dp=4)) == (2,)
    three = moe_layer(shape=replace(SHAPE, num_experts=3))
    assert moe_costs.ep_degrees(three, Mesh(dp=4)) == ()
    assert "no divisor of mesh.dp=4 above 1 divides the experts' count (3)" in \
        moe_costs.ep_problem(three, Mesh(dp=4))
    assert "mesh.dp is 1" in moe_costs.ep_problem(layer, Mesh(dp=1, tp=4))
    dense = make_layer("fc", "dense", 0, params=10, fwd_flops=1.0, saved_bytes=1, act_bytes=1)
    assert moe_costs.ep_problem(dense, Mesh(dp=4)) == "no mixture-of-experts block in this layer"
    assert moe_costs.ep_problem(layer, Mesh(dp=4)) is None


def test_options_add_ep_to_every_strategy_but_hsdp():
    labels = allowed_options(moe_layer(), Mesh(dp=4), hsdp_shard_size=2, recompute=False,
                             offload=False)
    assert set(labels) == {"replicate", "zero2", "fsdp", "hsdp",
                           "replicate+ep2", "zero2+ep2", "fsdp+ep2",
                           "replicate+ep4", "zero2+ep4", "fsdp+ep4"}
    dense = make_layer("fc", "dense", 0, params=10, fwd_flops=1.0, saved_bytes=1, act_bytes=1)
    assert not any("+ep" in o for o in allowed_options(dense, Mesh(dp=4)))


def test_the_dense_part_is_the_layer_less_its_captured_experts():
    layer = moe_layer()
    dense = moe_costs.dense_part(layer)
    assert dense.moe == ()
    assert dense.param_count == DENSE_PARAMS
    assert dense.param_bytes == DENSE_PARAMS * 4
    assert dense.param_tensors == 10
    assert dense.saved_bytes == layer.saved_bytes - 8192 * 1024 * 4
    assert dense.mem_bytes == layer.mem_bytes - 8192 * 1024 * 8
    assert dense.num_ops == 4
    assert dense.fwd_flops == layer.fwd_flops  # the capture counted none in the experts


@pytest.mark.parametrize(("ep", "a2a_s"), [(2, 25.97152e-6), (4, 46.45728e-6)])
def test_ep_adds_four_all_to_alls_per_micro_batch(ep, a2a_s):
    """8192 tokens over dp = 4: T = 2048 a rank, 4096 routed rows of H = 1024 in bf16:
    S = 8,388,608 bytes. Inside a node of 4, ep = 2: ½·S/200e9 + 5 µs = 25.97152 µs;
    ep = 4: ¾·S/200e9 + 3·5 µs = 46.45728 µs. The option costs the dense part (fsdp on
    dp = 4) plus the experts (on dp/ep), plus dispatch and combine forward and backward;
    with full recomputation the forward's two again. At m = 2 micro-batches each moves
    S/2: ep = 2, 2·4·(¼·S/200e9 + 5 µs)."""
    cluster, mesh, layer = make_cluster(per_node=4), Mesh(dp=4), moe_layer()

    def parts(option: str, m: int = 1) -> float:
        dense = layer_cost(moe_costs.dense_part(layer), option, mesh, cluster, BF16, m)
        experts = layer_cost(moe_costs.expert_layer(layer, ep, mesh, m),
                             moe_costs.expert_option("fsdp", dense.recompute, False,
                                                     replace(mesh, dp=4 // ep)),
                             replace(mesh, dp=4 // ep), cluster, BF16, m)
        return dense.comm_s + experts.comm_s

    cost = layer_cost(layer, f"fsdp+ep{ep}", mesh, cluster, BF16)
    assert cost.expert_parallel == ep and cost.option == f"fsdp+ep{ep}"
    assert cost.comm_s - parts("fsdp") == pytest.approx(4 * a2a_s)
    full = layer_cost(layer, f"fsdp+ep{ep}+full", mesh, cluster, BF16)
    assert full.comm_s - parts("fsdp+full") == pytest.approx(6 * a2a_s)
    if ep == 2:
        two = layer_cost(layer, "fsdp+ep2", mesh, cluster, BF16, 2)
        half = 0.25 * 8_388_608 / 200e9 + 5e-6
        assert two.comm_s - parts("fsdp", 2) == pytest.approx(2 * 4 * half)


def test_expert_states_shard_over_ep_then_over_the_ranks_left():
    """bf16 keeps 2 + 4 (float32 reduced gradient) + 12 = 18 bytes a weight. dp = 4:
    replicate holds every weight: (4,194,304 + 50,331,648)·18. replicate+ep4 holds 2 of
    the 8 experts: (4,194,304 + 12,582,912)·18. fsdp+ep2 holds 4 experts sharded over the
    dp/ep = 2 ranks left, as fsdp shards all 8 over 4: (4,194,304 + 50,331,648)/4 of each
    state (FSDP2's gathered copy aside)."""
    cluster, mesh, layer = make_cluster(per_node=4), Mesh(dp=4), moe_layer()
    states = {o: layer_cost(layer, o, mesh, cluster, BF16)
              for o in ("replicate", "replicate+ep4", "fsdp", "fsdp+ep2")}
    assert states["replicate"].states_bytes == pytest.approx(
        (DENSE_PARAMS + EXPERT_PARAMS) * 18)
    assert states["replicate+ep4"].states_bytes == pytest.approx(
        (DENSE_PARAMS + EXPERT_PARAMS // 4) * 18)
    for o in ("fsdp", "fsdp+ep2"):
        c = states[o]
        assert c.params_bytes + c.grads_bytes + c.optimizer_bytes == pytest.approx(
            (DENSE_PARAMS + EXPERT_PARAMS) / 4 * 18)


def test_an_unavailable_degree_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="fsdp\\+ep2.*not available: no divisor"):
        layer_cost(moe_layer(shape=replace(SHAPE, num_experts=3)), "fsdp+ep2", Mesh(dp=4),
                   make_cluster(per_node=4), BF16)
    with pytest.raises(ValueError, match="not available: mesh.dp is 1"):
        layer_cost(moe_layer(), "replicate+ep2", Mesh(dp=1), make_cluster(), BF16)


def stack(n: int = 4, **kw) -> list:
    head = make_layer("head", "head", n, params=1_000_000, fwd_flops=1e9, saved_bytes=1 << 20,
                      act_bytes=1 << 20, tp=False)
    return [moe_layer(f"layers.{i}", i, **kw) for i in range(n)] + [head]


def test_finds_ep_when_memory_binds_on_fast_links():
    """4 ranks in one node, 3 GiB each, float32 (the runtime's EP runs in float32 only):
    4 bytes a weight, 4 its gradient, 8 Adam's, 4 FSDP2's gathered copy. Every expert on
    every rank (replicate) needs 4 · 54.5M · 20 bytes = 4.4 GB: it does not fit. FSDP
    fits but gathers all 8 experts (201 MB) twice a micro-batch and reduce-scatters their
    gradients: 3 · ¾ · 201 MB / 200 GB/s = 2.26 ms a layer, partly hidden behind compute.
    Under ep = 4 a rank holds 2 experts and moves only tokens: 4 all-to-alls of
    ¾·16.8 MB/200 GB/s + 3·5 µs = 78 µs. EP on every MoE layer, none on the dense head, and
    faster than the same option without it."""
    fp32 = precision("float32")
    cluster = make_cluster(per_node=4, memory_bytes=3 * GiB)
    graph = graph_of(stack(), batch=8)
    plan = search(graph, cluster, precision_name="float32", mesh=Mesh(dp=4),
                  pipeline=False).plan
    degrees = {x.module: x.expert_parallel for x in plan.layers}
    assert degrees["head"] == 1
    assert all(degrees[f"layers.{i}"] > 1 for i in range(4)), degrees
    chosen = layer_cost(graph.layers[0], plan.layers[0].option, plan.mesh, cluster, fp32)
    same = layer_cost(graph.layers[0], plan.layers[0].option.replace(
        f"+ep{chosen.expert_parallel}", ""), plan.mesh, cluster, fp32)
    assert chosen.time_s < same.time_s
    whole = layer_cost(graph.layers[0], "replicate", plan.mesh, cluster, fp32)
    assert whole.states_bytes == pytest.approx((DENSE_PARAMS + EXPERT_PARAMS) * 20)
    assert 4 * whole.states_bytes > 3 * GiB


def test_offers_ep_only_where_the_runtime_runs_it():
    """Today the runtime runs EP on a data-parallel mesh in float32, without gradient
    accumulation, offload or recomputation, with replicate, zero1, zero2 or fsdp."""
    layer, cluster = moe_layer(), make_cluster(per_node=4)
    fp32 = layer_options(layer, None, Mesh(dp=4), cluster, precision("float32"))
    assert {parse_option(o)["strategy"] for o in fp32 if "+ep" in o} <= set(
        moe_costs.EP_STRATEGIES)
    assert all(parse_option(o)["recompute"] == "none" and not parse_option(o)["offload"]
               for o in fp32 if "+ep" in o)
    assert any("+ep" in o for o in fp32)
    assert not any("+ep" in o for o in layer_options(layer, None, Mesh(dp=4), cluster, BF16))
    assert not any("+ep" in o for o in allowed_options(layer, Mesh(dp=4), microbatches=2))
    assert not any("+ep" in o for o in allowed_options(layer, Mesh(dp=2, tp=2)))
    assert "float32 only, not bfloat16" in moe_costs.ep_problem(layer, Mesh(dp=4),
                                                                precision="bfloat16")
    assert "data-parallel mesh only" in moe_costs.ep_problem(layer, Mesh(dp=2, tp=2))


def test_keeps_experts_whole_when_ep_crosses_a_slow_network():
    """4 nodes of one rank on a 1 GB/s, 50 µs network; small experts (H = 256, I = 512:
    393,216 weights each, 3,145,728 the block) and many tokens (16,384 a rank, routing
    32,768 rows of 256 float32 values: S = 33.6 MB). At ep = 2 every all-to-all sends
    ½·S over the network: 16.8 ms + 50 µs, 4 of them: 67.2 ms a layer. The most EP can
    save is the experts' gradient all-reduce across the 4 nodes (2·¾·12.6 MB / 1 GB/s
    = 18.9 ms) and some GEMM efficiency: EP loses, on every layer."""
    slow = replace(make_cluster(nodes=4, per_node=1),
                   inter_node=Link(kind="network", bandwidth_GBps=1.0, latency_s=50e-6))
    shape = ExpertShape(num_experts=8, top_k=2, hidden_size=256, intermediate_size=512)
    graph = graph_of(stack(shape=shape, tokens=4 * 16384), batch=64)
    fp32 = precision("float32")
    plan = search(graph, slow, precision_name="float32", mesh=Mesh(dp=4),
                  pipeline=False).plan
    assert all(x.expert_parallel == 1 for x in plan.layers), [x.option for x in plan.layers]
    options = layer_options(graph.layers[0], None, plan.mesh, slow, fp32)
    assert any("+ep" in o for o in options)  # offered, and lost
    a2a = 0.5 * 32768 * 256 * 4 / 1e9 + 50e-6
    all_reduce = 2 * 0.75 * 3_145_728 * 4 / 1e9
    assert 4 * a2a > 3 * all_reduce
    ep2 = layer_cost(graph.layers[0], "replicate+ep2", plan.mesh, slow, fp32)
    whole = layer_cost(graph.layers[0], "replicate", plan.mesh, slow, fp32)
    assert ep2.comm_s - whole.comm_s > 4 * a2a - all_reduce


def test_ddp_never_runs_an_expert_parallel_layer():
    """DDP would all-reduce every rank's expert shard with the others' (different experts):
    a replicate+ep option is no option of the all-DDP program, and a plan holding one is
    not priced as DDP runs it."""
    fp32, mesh, cluster = precision("float32"), Mesh(dp=4), make_cluster(per_node=4)
    layer = moe_layer()
    costs = {o: layer_cost(layer, o, mesh, cluster, fp32) for o in ("replicate", "replicate+ep2")}
    (program,) = ddp_programs([ClassOptions(name="moe", count=1, costs=costs)], fp32, mesh)
    assert list(program[0].costs) == ["replicate"]
    only_ep = {"replicate+ep2": costs["replicate+ep2"]}
    assert ddp_programs([ClassOptions(name="moe", count=1, costs=only_ep)], fp32, mesh) == []
    assert not runs_on_ddp([costs["replicate+ep2"]], fp32, mesh)
    assert runs_on_ddp([costs["replicate"]], fp32, mesh)


def test_the_all_to_all_estimator_can_be_replaced():
    """Estimators.expert_all_to_all prices dispatch and combine: one of 1 ms instead of
    the analytic 25.97152 µs (test_ep_adds_four_all_to_alls_per_micro_batch) adds
    4·(1 ms − 25.97152 µs) to the layer's communication, and nothing at ep = 1."""
    cluster, mesh, layer = make_cluster(per_node=4), Mesh(dp=4), moe_layer()
    slow = replace(ANALYTIC, expert_all_to_all=lambda *args: (1e-3, 0.0))
    base = layer_cost(layer, "fsdp+ep2", mesh, cluster, BF16)
    mine = layer_cost(layer, "fsdp+ep2", mesh, cluster, BF16, estimators=slow)
    assert mine.comm_s - base.comm_s == pytest.approx(4 * (1e-3 - 25.97152e-6))
    assert layer_cost(layer, "fsdp", mesh, cluster, BF16, estimators=slow).comm_s == \
        pytest.approx(layer_cost(layer, "fsdp", mesh, cluster, BF16).comm_s)
