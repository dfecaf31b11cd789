"""Overlap in the layer costs and the schedule simulator, against hand-derived windows.

Each case prices a layer twice, once with every pattern exposed (all communication on the
critical path, the reference) and once overlapped, and checks the difference against one
window of cost_models.overlap written out by hand: with compute P alone beside
communication C and slowdown σ, the exposed time is C − min(C, σP)/σ.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_cases import make_cluster, make_layer

from autopar.planner.costs import layer_cost
from cost_models.comm import Group, all_gather_s, reduce_scatter_s
from cost_models.hardware import OVERLAP_PATTERNS, Overlap
from cost_models.memory import precision
from cost_models.schedule import StageTimes, simulate
from runtime.plan import Mesh

FP32 = precision("float32")
SIGMA = 1.25
EXPOSED = make_cluster(per_node=4, overlap=Overlap(exposed=OVERLAP_PATTERNS))
OVERLAPPED = make_cluster(per_node=4, overlap=Overlap(dp_slowdown=SIGMA, fsdp_slowdown=SIGMA,
                                                      pp_slowdown=SIGMA))


def exposed(window: float, comm: float, sigma: float = SIGMA) -> float:
    return comm - min(comm, sigma * window) / sigma


def layer(params: int, flops: float):
    return make_layer("h.0", "Block", 0, params=params, fwd_flops=flops, saved_bytes=1_000,
                      act_bytes=1_000, tp=False)


# (params, forward FLOPs): reduction-bound (C > σP) and compute-bound (C < σP) layers.
SHAPES = [(50_000_000, 1e10), (1_000_000, 1e12)]


@pytest.mark.parametrize(("params", "flops"), SHAPES)
def test_data_parallel_reduction_hides_behind_the_layers_backward(params, flops):
    mesh = Mesh(dp=4)
    ref = layer_cost(layer(params, flops), "replicate", mesh, EXPOSED, FP32)
    cost = layer_cost(layer(params, flops), "replicate", mesh, OVERLAPPED, FP32)
    reduce, backward = ref.comm_s, ref.bwd_s + ref.wgrad_s  # replicate: only the all-reduce
    assert ref.hidden_comm_s == 0
    assert cost.comm_s == pytest.approx(exposed(backward, reduce))
    assert cost.hidden_comm_s == pytest.approx(reduce - exposed(backward, reduce))
    assert cost.time_s == pytest.approx(ref.time_s - cost.hidden_comm_s)
    assert cost.compute_s == ref.compute_s


@pytest.mark.parametrize(("params", "flops"), SHAPES)
@pytest.mark.parametrize("microbatches", [1, 2])
def test_fsdp_gathers_and_reduce_scatter_hide_behind_forward_and_backward(params, flops,
                                                                          microbatches):
    mesh, m = Mesh(dp=4), microbatches
    ref = layer_cost(layer(params, flops), "fsdp", mesh, EXPOSED, FP32, m)
    cost = layer_cost(layer(params, flops), "fsdp", mesh, OVERLAPPED, FP32, m)
    # Exposed, an fsdp micro-batch is its compute plus a gather in forward and a gather and
    # a reduce-scatter in backward (at pp = 1 nothing is per step).
    gather = all_gather_s(4 * params, Group(4), EXPOSED)
    scatter = reduce_scatter_s(4 * params, Group(4), EXPOSED)
    assert ref.comm_s == pytest.approx(m * (2 * gather + scatter))
    fwd_window, bwd_window = ref.fwd_s - gather, ref.bwd_s + ref.wgrad_s - gather - scatter
    expected = m * (exposed(fwd_window, gather) + exposed(bwd_window, gather + scatter))
    assert cost.comm_s == pytest.approx(expected)
    assert cost.fwd_s == pytest.approx(fwd_window + exposed(fwd_window, gather))


def test_an_exposed_pattern_hides_nothing_and_the_others_still_overlap():
    cluster = replace(OVERLAPPED, overlap=replace(OVERLAPPED.overlap, exposed=("fsdp",)))
    shard = layer_cost(layer(*SHAPES[1]), "fsdp", Mesh(dp=4), cluster, FP32)
    assert shard.hidden_comm_s == 0
    assert shard.comm_s == layer_cost(layer(*SHAPES[1]), "fsdp", Mesh(dp=4), EXPOSED, FP32).comm_s
    # A replicated layer's all-reduce is FSDP2's ('fsdp', exposed here) unless the plan runs
    # on DDP, whose buckets still overlap: that plan saves what DDP hides.
    replicated = layer_cost(layer(*SHAPES[1]), "replicate", Mesh(dp=4), cluster, FP32)
    on_ddp = replace(cluster, overlap=replace(cluster.overlap, exposed=()))
    hidden_by_ddp = layer_cost(layer(*SHAPES[1]), "replicate", Mesh(dp=4), on_ddp, FP32)
    assert replicated.hidden_comm_s == 0 and hidden_by_ddp.hidden_comm_s > 0
    assert replicated.fsdp_wait_s == pytest.approx(hidden_by_ddp.hidden_comm_s)


def test_pipelines_reduce_after_the_schedule_so_nothing_hides():
    cost = layer_cost(layer(*SHAPES[1]), "replicate", Mesh(pp=2, dp=2), OVERLAPPED, FP32)
    assert cost.hidden_comm_s == 0 and cost.comm_s > 0


def test_communication_shorter_than_compute_is_hidden_whole_at_no_slowdown():
    cluster = replace(OVERLAPPED, overlap=Overlap(dp_slowdown=1.0, fsdp_slowdown=1.0))
    cost = layer_cost(layer(*SHAPES[1]), "replicate", Mesh(dp=4), cluster, FP32)
    assert cost.comm_s == 0 and cost.time_s == pytest.approx(cost.compute_s)


def test_a_pipeline_send_slows_the_senders_next_action_or_blocks_it():
    # GPipe, 2 ranks, 2 micro-batches, forward 1 s, transfer 0.5 s, σ = 2: rank 0 runs F0 in
    # [0, 1]; F1 starts at 1 beside the 0.5 s left of F0's send: min(0.5, 2·1)·(1 − 1/2) =
    # 0.25 s longer, ending at 2.25. Blocking, rank 0 waits for the send: F1 in [1.5, 2.5].
    stages = [StageTimes(fwd_s=1.0, bwd_s=1.0), StageTimes(fwd_s=1.0, bwd_s=1.0)]

    def f1_end(**kw) -> float:
        t = simulate("GPipe", 2, 2, stages, p2p_s=0.5, **kw)
        return next(s.end_s for s in t.slots if (s.rank, s.action, s.microbatch) == (0, "F", 1))
    assert f1_end() == pytest.approx(2.0)
    assert f1_end(p2p_slowdown=2.0) == pytest.approx(2.25)
    assert f1_end(p2p_blocking=True) == pytest.approx(2.5)


def test_a_recomputation_that_costs_no_time_is_chosen_only_when_memory_needs_it():
    # Reduction-bound blocks: full recomputation runs under the gradient all-reduce, so
    # 'replicate' and 'replicate+full' are equally fast; the plan recomputes only when the
    # activations do not fit otherwise.
    from autopar.planner.costs import layer_options
    from autopar.planner.ilp import ClassOptions, least_work, solve_strategies

    block = replace(layer(*SHAPES[0]), saved_bytes=400_000_000)
    costs = layer_options(block, None, Mesh(dp=4), OVERLAPPED, FP32)
    plain, full = costs["replicate"], costs["replicate+full"]
    assert full.time_s == pytest.approx(plain.time_s, rel=1e-12)
    assert full.compute_s > plain.compute_s and full.resident_bytes < plain.resident_bytes
    # The recomputing option first: a solver's ties tend to go to the first column.
    classes = [ClassOptions(name="Block", count=4, costs={"replicate+full": full,
                                                          "replicate": plain})]

    def recomputed(capacity: float) -> int:
        result = solve_strategies(classes, capacity, 0.0)
        return sum(n for o, n in result.choice["Block"].items() if "+full" in o)

    assert recomputed(80 * 2**30) == 0
    # Room for two blocks' activations: the other two recompute.
    tight = 2 * (plain.resident_bytes + full.resident_bytes) + full.buffers_bytes + 2**20
    assert recomputed(tight) == 2

    # Whatever the solver's tie went to, all-recompute comes back as the lightest that fits.
    everyone = {"Block": {"replicate+full": 4}}
    assert least_work(classes, everyone, full.buffers_bytes, 80 * 2**30, 0.0) == \
        {"Block": {"replicate": 4}}
    assert least_work(classes, everyone, full.buffers_bytes, tight, 0.0) == \
        {"Block": {"replicate+full": 2, "replicate": 2}}
