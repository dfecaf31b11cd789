"""cost_models.moe against hand calculations.

The block throughout: E = 8 experts, top_k = 2, H = 1024, I = 4096, gated (SwiGLU), so one
expert holds H·2I + I·H = 8,388,608 + 4,194,304 = 12,582,912 weights. The test cluster
(tests/planner_cases.make_cluster): NVLink 200 GB/s and 5 µs inside a node, the network
20 GB/s and 10 µs between nodes; bf16 peak 400 TFLOP/s, E∞ = 0.7, HBM 2000 GB/s, 5 µs a
kernel.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_cases import make_cluster

from cost_models import moe
from cost_models.comm import Group

SHAPE = moe.ExpertShape(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=4096)


def test_parameters_of_the_rank_and_of_its_shard():
    """E/ep experts per rank; FSDP over the 2 ranks left beside ep = 4 of dp = 8 halves them."""
    assert SHAPE.params_per_expert == 12_582_912
    assert moe.expert_params(SHAPE) == 8 * 12_582_912
    assert moe.expert_params(SHAPE, 4) == 2 * 12_582_912
    assert moe.expert_shard_params(SHAPE, 4, 2) == 12_582_912
    ungated = replace(SHAPE, gated=False)
    assert ungated.params_per_expert == 1024 * 4096 * 2


def test_routed_rows_take_the_imbalance_only_when_experts_are_split():
    """T = 1024 tokens route R = T·top_k = 2048 rows. ep = 4: 2 experts a rank, 1024 rows
    each; the busiest rank at imbalance 1.25 gets 2560 rows (1280 an expert). ep = 1: all
    experts on the rank, 2048 rows whatever the routing, 256 an expert."""
    assert moe.routed_rows(1024, SHAPE, 4) == 2048
    assert moe.rows_per_expert(1024, SHAPE, 4) == 1024
    assert moe.routed_rows(1024, SHAPE, 4, imbalance=1.25) == 2560
    assert moe.rows_per_expert(1024, SHAPE, 4, imbalance=1.25) == 1280
    assert moe.routed_rows(1024, SHAPE, 1, imbalance=1.25) == 2048
    assert moe.rows_per_expert(1024, SHAPE, 1) == 256


def test_dispatch_inside_one_node():
    """T = 4096, ep = 4 in a node of 8: S = 4096·2·1024·2 bytes = 16,777,216 (bf16);
    all-to-all = (ep-1)/ep · S/B + (ep-1)·α = 0.75·16,777,216/200e9 + 3·5e-6
    = 62.91456 µs + 15 µs = 77.91456 µs. Four of them per micro-batch."""
    cluster = make_cluster(per_node=8)
    assert moe.dispatch_bytes(4096, SHAPE, 4, 2) == 16_777_216
    got = moe.all_to_all_step_s(4096, SHAPE, 4, Group(4, 1), cluster, 2)
    assert got == pytest.approx(77.91456e-6)


def test_dispatch_across_nodes_is_bound_by_the_network():
    """Nodes of 2: the ep = 4 group spans L = 2 ranks in each of 2 nodes. Intra:
    (L-1)/n·S/B + (L-1)·α = 0.25·16,777,216/200e9 + 5e-6 = 25.97 µs; network:
    (n-L)/n·S/B_net + (n-L)·α_net = 0.5·16,777,216/20e9 + 2·10e-6 = 439.4304 µs; they run
    at once, so 439.4304 µs: 5.6 times the same all-to-all inside a node."""
    cluster = make_cluster(per_node=2, nodes=2)
    got = moe.all_to_all_step_s(4096, SHAPE, 4, Group(4, 1), cluster, 2)
    assert got == pytest.approx(439.4304e-6)


def test_no_all_to_all_without_expert_parallelism():
    assert moe.all_to_all_step_s(4096, SHAPE, 1, Group(1, 1), make_cluster(), 2) == 0.0
    assert moe.all_to_all_buffer_bytes(4096, SHAPE, 1, 2) == 0.0
    with pytest.raises(ValueError, match="group has 2 ranks, ep is 4"):
        moe.all_to_all_step_s(4096, SHAPE, 4, Group(2, 1), make_cluster(), 2)


def test_expert_gemms_at_their_shapes():
    """T = 1024, bf16, d½ = 128; each projection is one grouped GEMM over the local experts.
    ep = 4: 2 experts of m = 1024 rows. gate_up (1024 × 1024)·(1024 × 8192) is
    2·1024·8192·1024 = 17,179,869,184 FLOPs at efficiency 0.7·1024/(1024+128) = 0.62222:
    69.027 µs an expert (its bytes, (1024·1024 + 1024·8192 + 1024·8192)·2 = 35.65 MB,
    take 17.8 µs at 2000 GB/s: compute bound); down (1024 × 4096)·(4096 × 1024) is
    8,589,934,592 FLOPs, 34.513 µs an expert. Forward 2·69.027 + 5 + 2·34.513 + 5
    = 217.08 µs, backward twice that.
    ep = 1: 8 experts of m = 256, the same FLOPs (each rank routes T·top_k rows either
    way) at efficiency 0.7·256/384 = 0.46667: gate_up 2·256·8192·1024/(400e12·0.46667)
    = 23.009 µs an expert, down 11.504 µs; forward 8·23.009 + 5 + 8·11.504 + 5
    = 286.1 µs."""
    cluster = make_cluster()
    device = replace(cluster.device, matmul_half_dim={"bfloat16": 128.0})
    eff4 = 0.7 * 1024 / (1024 + 128)
    gate_up4 = 17_179_869_184 / (400e12 * eff4)
    down4 = 8_589_934_592 / (400e12 * eff4)
    fwd, bwd = moe.expert_gemms_s(1024, SHAPE, 4, device, "bfloat16", 2)
    assert fwd == pytest.approx(2 * gate_up4 + 2 * down4 + 2 * 5e-6)
    assert fwd == pytest.approx(217.08e-6, rel=1e-4)
    assert bwd == pytest.approx(2 * fwd)
    eff1 = 0.7 * 256 / (256 + 128)
    gate_up1 = 2 * 256 * 8192 * 1024 / (400e12 * eff1)
    down1 = 2 * 256 * 1024 * 4096 / (400e12 * eff1)
    fwd1, _ = moe.expert_gemms_s(1024, SHAPE, 1, device, "bfloat16", 2)
    assert fwd1 == pytest.approx(8 * gate_up1 + 8 * down1 + 2 * 5e-6)
    assert fwd1 == pytest.approx(286.1e-6, rel=1e-4)
    assert moe.expert_fwd_flops(1024, SHAPE, 1) == moe.expert_fwd_flops(1024, SHAPE, 4)
    assert moe.expert_fwd_flops(1024, SHAPE, 4) == 2 * (17_179_869_184 + 8_589_934_592)
    assert fwd < fwd1  # the same work per rank, in larger GEMMs


def test_imbalance_slows_the_busiest_rank():
    """At imbalance 1.5 the busiest rank's experts get 1.5× the rows: 1.5× the FLOPs and
    1.5× the bytes in each all-to-all."""
    base = moe.expert_fwd_flops(1024, SHAPE, 4)
    assert moe.expert_fwd_flops(1024, SHAPE, 4, imbalance=1.5) == pytest.approx(1.5 * base)
    assert moe.dispatch_bytes(1024, SHAPE, 4, 2, imbalance=1.5) == 1.5 * 2048 * 1024 * 2


def test_dispatched_activations():
    """Per routed row a gated expert keeps H + 2I + I + I + H = 18,432 elements; T = 1024
    at ep = 4 routes 2048 rows: 2048·18,432·2 = 75,497,472 bytes in bf16. The all-to-all's
    send and receive buffers: 2·2048·1024·2 = 8,388,608 bytes."""
    assert moe.saved_elements_per_row(SHAPE) == 18_432
    assert moe.dispatched_activation_bytes(1024, SHAPE, 4, 2) == 75_497_472
    assert moe.all_to_all_buffer_bytes(1024, SHAPE, 4, 2) == 8_388_608
    assert moe.saved_elements_per_row(replace(SHAPE, gated=False)) == 1024 + 4096 + 4096 + 1024


@pytest.mark.parametrize("bad", [3, 0, 16])
def test_a_degree_that_does_not_divide_the_experts_is_refused(bad):
    with pytest.raises(ValueError, match="divisor of num_experts=8"):
        moe.routed_rows(1024, SHAPE, bad)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        moe.ExpertShape(num_experts=8, top_k=9, hidden_size=4, intermediate_size=4)
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        moe.ExpertShape(num_experts=8, top_k=2, hidden_size=0, intermediate_size=4)
    with pytest.raises(ValueError, match="imbalance"):
        moe.routed_rows(1024, SHAPE, 4, imbalance=0.5)
