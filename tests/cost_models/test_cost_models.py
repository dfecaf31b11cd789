"""Cost models: clusters and their files, collective formulas, overlap, compute, ZeRO memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cost_models.calibrate import fit_gemm_curve
from cost_models.comm import (
    Group,
    all_gather_s,
    all_reduce_algorithm,
    all_reduce_s,
    all_to_all_s,
    collective_s,
    group_link,
    p2p_s,
    reduce_scatter_s,
)
from cost_models.compute import gemm_efficiency, gemm_s, roofline_s
from cost_models.errors import ConfigError
from cost_models.hardware import Cluster, GiB
from cost_models.memory import precision, zero_model_states
from cost_models.overlap import (
    ddp_num_buckets,
    dp_grad_sync_exposed_s,
    exposed_comm_s,
    fsdp_exposed_s,
    pipeline_p2p_slowdown_s,
)

MINIMAL = """
name = "mine"
nodes = 2
devices_per_node = 4
[device]
name = "gpu"
memory_gib = 24
memory_bandwidth_GBps = 900
[device.peak_tflops]
float32 = 30
[intra_node]
kind = "pcie"
bandwidth_GBps = 20
latency_us = 10
[inter_node]
kind = "network"
bandwidth_GBps = 5
latency_us = 20
"""


@pytest.mark.parametrize("name", ["dgx-a100-80g", "dgx-h100", "pcie-8x-a100"])
def test_presets_load_with_sourced_figures(name):
    cluster = Cluster.preset(name, nodes=4)
    assert cluster.world_size == 32
    assert cluster.device.memory_bytes == 80 * GiB
    assert cluster.source
    assert cluster.intra_node.bandwidth_GBps > cluster.inter_node.bandwidth_GBps


def test_a100_preset_matches_datasheet():
    a100 = Cluster.preset("dgx-a100-80g").device
    assert a100.peak("bfloat16") == 312e12
    assert a100.peak("float32") == 19.5e12
    assert a100.memory_bandwidth_GBps == 2039


def test_local_cluster_is_one_node_of_processes():
    local = Cluster.local(4)
    assert (local.nodes, local.devices_per_node, local.world_size) == (1, 4, 4)
    assert local.device.memory_bytes > 0


def test_cluster_file_round_trips_units(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL)
    cluster = Cluster.from_toml(path)
    assert cluster.world_size == 8
    assert cluster.device.memory_bytes == 24 * GiB
    assert cluster.device.peak("float32") == 30e12
    assert cluster.intra_node.latency_s == pytest.approx(10e-6)
    assert Cluster.load(str(path), nodes=3).world_size == 12


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.replace('kind = "pcie"', 'kind = "infiniband"'),
         "kind = 'infiniband' is not one of nvlink, pcie, network, loopback"),
        (lambda t: t.replace("memory_gib = 24", "memory_gib = 24\nmemroy = 3"),
         "[device]: unknown field 'memroy'"),
        (lambda t: t.replace("bandwidth_GBps = 20", "bandwidth_GBps = -1"),
         "[intra_node]: bandwidth_GBps must be a positive number"),
        (lambda t: t.replace("nodes = 2", "nodes = 0"), "nodes must be a positive integer"),
        (lambda t: t.replace("float32 = 30", "fp8 = 30"), "peak_tflops.fp8 is not a known dtype"),
        (lambda t: t.replace("[inter_node]", "[inter_nodes]"), "unknown field 'inter_nodes'"),
        (lambda t: t.replace('name = "mine"', 'name = "mine'), "not valid TOML"),
        (lambda t: t + "[overlap]\ndp_slowdown = 0.9\n",
         "[overlap]: dp_slowdown must be a number in [1, 10)"),
        (lambda t: t + "[overlap]\nfsdp_slowdwn = 1.2\n",
         "[overlap]: unknown field 'fsdp_slowdwn'; valid fields: ddp_bucket_bytes, "
         "ddp_bucket_mib, dp_slowdown, exposed, fsdp_slowdown, pp_slowdown"),
        (lambda t: t + "[overlap]\nexposed = [\"fsd\"]\n",
         "[overlap]: exposed must be a list of patterns from dp, fsdp, pp, got ['fsd']"),
        (lambda t: t.replace("float32 = 30", "float32 = 30\n[device.matmul_half_dim]\nfp8 = 64"),
         "matmul_half_dim.fp8 is not a known dtype"),
        (lambda t: t.replace("float32 = 30", "float32 = 30\n[device.matmul_half_dim]\nfloat32 = -1"),
         "matmul_half_dim.float32 must be a non-negative number"),
    ],
)
def test_malformed_cluster_file_names_the_field(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(edit(MINIMAL))
    with pytest.raises(ConfigError) as info:
        Cluster.from_toml(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_overlap_factors_and_gemm_curve_are_read_from_the_cluster_file():
    cluster = Cluster.from_toml_text(
        MINIMAL.replace("float32 = 30", "float32 = 30\n[device.matmul_half_dim]\nfloat32 = 64")
        + "[overlap]\ndp_slowdown = 1.2\npp_slowdown = 1\nddp_bucket_mib = 50\n")
    assert cluster.device.half_dim("float32") == 64
    assert cluster.device.half_dim("bfloat16") == 0  # DEFAULT_MATMUL_HALF_DIM
    overlap = cluster.overlap
    assert (overlap.dp_slowdown, overlap.fsdp_slowdown, overlap.pp_slowdown) == (1.2, 1.1, 1)
    assert overlap.ddp_bucket_bytes == 50 * 2**20
    assert Cluster.from_toml_text(MINIMAL).overlap.dp_slowdown == 1.1


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="dgx-a100-80g.*local"):
        Cluster.preset("dgx-b300")


LAUNCH = 8.4e-6  # NCCL's base latency of a collective (tuning.h baseLat, Ring/Simple)


def test_ring_all_reduce_is_2_n_minus_1_over_n_size_over_bandwidth():
    cluster = Cluster.preset("dgx-a100-80g")
    size = 1e9
    ring = 2 * 7 / 8 * size / 300e9 + 2 * 7 * 5e-6
    assert all_reduce_s(size, Group(8), cluster) == pytest.approx(LAUNCH + ring)
    assert all_gather_s(size, Group(8), cluster) == pytest.approx(LAUNCH + ring / 2)
    assert reduce_scatter_s(size, Group(8), cluster) == pytest.approx(LAUNCH + ring / 2)
    assert all_reduce_s(size, Group(1), cluster) == 0.0
    assert all_reduce_algorithm(size, Group(8), cluster) == "ring"  # no NVLink SHARP on A100


def test_group_spanning_nodes_crosses_the_network():
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    assert group_link(cluster, Group(8, 1)).kind == "nvlink"
    assert group_link(cluster, Group(2, 8)).kind == "network"  # a dp group with tp = 8
    assert group_link(cluster, Group(16, 1)).kind == "network"
    assert p2p_s(1e9, cluster.inter_node) == pytest.approx(1e9 / 25e9 + 10e-6)
    assert collective_s("p2p", 1e9, Group(2, 8), cluster) == p2p_s(1e9, cluster.inter_node)
    # One rank per node: a flat ring over 2 nodes on the network.
    assert all_reduce_s(1e9, Group(2, 8), cluster) == pytest.approx(
        LAUNCH + 1e9 / 25e9 + 2 * 10e-6)


def test_ring_across_nodes_moves_in_lockstep_at_the_slowest_hop_with_rails():
    """16 ranks on 2 nodes of 8: each of the 15 steps forwards S/16 per rank; the node's 8
    blocks cross on its 8 NICs at once (min(300, 8·25) = 200 GB/s a rank) and the step waits
    the network's 10 us."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    size = 1e9
    step = 10e-6 + size / 16 / 200e9
    assert all_gather_s(size, Group(16), cluster) == pytest.approx(LAUNCH + 15 * step)
    assert reduce_scatter_s(size, Group(16), cluster) == pytest.approx(LAUNCH + 15 * step)
    assert all_reduce_s(size, Group(16), cluster) == pytest.approx(LAUNCH + 30 * step)
    assert all_reduce_algorithm(size, Group(16), cluster) == "ring"
    # dp groups of a tp = 4 mesh: 2 members a node use 2 NICs, 50 GB/s a rank
    step4 = 10e-6 + size / 16 / 50e9
    assert all_gather_s(size, Group(16, 4), cluster.with_nodes(8)) == pytest.approx(
        LAUNCH + 15 * step4)


def test_ring_latency_grows_with_the_ranks_not_the_nodes():
    """A 3.6 GB all-gather (one GPT-3 175B block in bf16) over 1,536 A100s: 1,535 steps of
    10 us + 2.34 MB / 200 GB/s = 33.3 ms, against 21.8 ms over 384 (the bandwidth term is
    the same 18 ms: it is the latency that grows)."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=192)
    size = 3.6e9
    for n, expected in ((384, 21.79e-3), (1536, 33.35e-3)):
        hand = LAUNCH + (n - 1) * (10e-6 + size / n / 200e9)
        assert hand == pytest.approx(expected, rel=1e-3)
        assert all_gather_s(size, Group(n), cluster) == pytest.approx(hand)


def test_bus_bandwidth_is_half_the_links_where_a_block_is_alpha_times_bandwidth():
    """Across nodes each member's block S/n crosses at B_eff = min(B_intra, L·B_net) after
    α_net: half of B_eff where S/n = α·B_eff (2 MB on DGX A100: 10 us × 200 GB/s)."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=192)
    n = 1536
    size = n * 10e-6 * 200e9
    t = all_gather_s(size, Group(n), cluster) - LAUNCH
    assert (n - 1) / n * size / t == pytest.approx(0.5 * 200e9)
    gather = all_gather_s(3.6e9, Group(n), cluster) - LAUNCH  # one GPT-3 175B block
    assert (n - 1) / n * 3.6e9 / gather / 200e9 == pytest.approx(0.54, abs=0.005)


def test_all_gather_bus_bandwidth_at_256_h100_is_near_the_published_measurement():
    """NVIDIA/nccl#1218: all_gather of 2 GiB over 32 DGX H100 nodes measured 200 GB/s bus
    bandwidth (all_reduce on the same nodes: 340). The lock-step ring gives 289 at the
    preset's 8 us, 240 at NCCL's own 14 us network step; a model that paid the ring's
    latency once (NCCL's tuning model) would give 329."""
    cluster = Cluster.preset("dgx-h100", nodes=32)
    size = 2 * 2**30
    busbw = 255 / 256 * size / all_gather_s(size, Group(256), cluster) / 1e9
    assert busbw == pytest.approx(289.2, rel=1e-3)
    assert 200 < busbw < 1.5 * 200


def test_tree_all_reduce_wins_for_small_messages_over_many_nodes():
    cluster = Cluster.preset("dgx-h100", nodes=64)
    group = Group(64, 8)  # one rank per node
    small, large = 1e6, 1e10
    ring_small = 2 * 63 / 64 * small / 50e9 + 2 * 63 * 8e-6  # 1.047 ms
    tree_small = 2 * small / 50e9 + 2 * 6 * 8e-6  # log2(64) = 6 levels: 136 us
    assert all_reduce_s(small, group, cluster) == pytest.approx(LAUNCH + tree_small)
    assert tree_small < ring_small
    assert all_reduce_algorithm(small, group, cluster) == "tree"
    ring_large = 2 * 63 / 64 * large / 50e9 + 2 * 63 * 8e-6  # 394.8 ms < tree's 400.1 ms
    assert all_reduce_s(large, group, cluster) == pytest.approx(LAUNCH + ring_large)
    assert all_reduce_algorithm(large, group, cluster) == "ring"


def test_nvls_all_reduce_inside_an_h100_node():
    """NVLink SHARP at 476 GB/s bus bandwidth beats the 450 GB/s ring for large messages;
    the ring's 14 steps of 4 us lose to NVLS's 2 at small ones too. A100 has none."""
    h100 = Cluster.preset("dgx-h100")
    size = 1e9
    nvls = 2 * 7 / 8 * size / 476e9 + 2 * 4e-6
    assert all_reduce_s(size, Group(8), h100) == pytest.approx(LAUNCH + nvls)
    assert all_reduce_algorithm(size, Group(8), h100) == "nvls"
    assert all_reduce_algorithm(size, Group(8), Cluster.preset("dgx-a100-80g")) == "ring"
    assert all_reduce_algorithm(size, Group(16), h100.with_nodes(2)) != "nvls"


def test_all_to_all_is_n_minus_1_over_n_size_over_bandwidth():
    one_node = Cluster.preset("dgx-a100-80g")
    size = 1e9
    assert all_to_all_s(size, Group(8), one_node) == pytest.approx(
        7 / 8 * size / 300e9 + 7 * 5e-6)
    two_nodes = one_node.with_nodes(2)  # 8 of 16 peers' shares cross the network
    network = 8 / 16 * size / 25e9 + 8 * 10e-6  # all_to_all keeps its α-β form (no launch)
    assert all_to_all_s(size, Group(16), two_nodes) == pytest.approx(network)
    assert collective_s("all_to_all", size, Group(16), two_nodes) == pytest.approx(network)


@given(st.floats(1, 1e12), st.integers(2, 64), st.integers(1, 8))
def test_collectives_grow_with_size_and_ring_all_reduce_is_two_passes(size, n, stride):
    cluster = Cluster.preset("dgx-h100", nodes=64)
    group = Group(n, stride)
    # one launch for the all_reduce, two for its two passes
    two_passes = reduce_scatter_s(size, group, cluster) + all_gather_s(size, group, cluster)
    if all_reduce_algorithm(size, group, cluster) == "ring":
        assert all_reduce_s(size, group, cluster) == pytest.approx(two_passes - LAUNCH)
    else:
        assert all_reduce_s(size, group, cluster) < two_passes
    assert all_reduce_s(2 * size, group, cluster) > all_reduce_s(size, group, cluster)
    assert all_to_all_s(2 * size, group, cluster) > all_to_all_s(size, group, cluster)


@given(st.floats(1, 1e12), st.integers(2, 8))
def test_groups_inside_one_node_keep_the_flat_ring(size, n):
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)  # no NVLS: the ring is NCCL's choice
    link = cluster.intra_node
    ring = 2 * (n - 1) / n * size / (link.bandwidth_GBps * 1e9) + 2 * (n - 1) * link.latency_s
    assert all_reduce_s(size, Group(n), cluster) == pytest.approx(LAUNCH + ring, rel=1e-12)


# -- overlap ---------------------------------------------------------------------------------

def test_comm_shorter_than_compute_is_hidden_but_slows_compute():
    assert exposed_comm_s(10.0, 4.0) == 0.0
    # σ = 1.1: compute runs at 1/1.1 for the 4 s of communication, losing 4 - 4/1.1 s.
    assert exposed_comm_s(10.0, 4.0, slowdown=1.1) == pytest.approx(4 - 4 / 1.1)


def test_comm_longer_than_compute_is_partly_hidden():
    # 2 s of compute stretch to 2.2 s beside 5 s of communication: 2.8 s not hidden,
    # plus 0.2 s of slowed compute.
    assert exposed_comm_s(2.0, 5.0, slowdown=1.1) == pytest.approx(3.0)
    assert exposed_comm_s(2.0, 5.0) == pytest.approx(3.0)


def test_comm_is_never_hidden_without_compute_or_beyond_its_floor():
    assert exposed_comm_s(0.0, 5.0, slowdown=1.1) == 5.0
    assert exposed_comm_s(10.0, 4.0, exposed_floor_s=1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="slowdown must be >= 1"):
        exposed_comm_s(1.0, 1.0, slowdown=0.9)


def test_ddp_exposes_the_last_bucket_and_whatever_backward_cannot_cover():
    # 4 buckets of 1 s over an 8 s backward: all but the last hidden.
    assert dp_grad_sync_exposed_s(8.0, 4.0, num_buckets=4, slowdown=1.0) == pytest.approx(1.0)
    # A 2 s backward: the first bucket is ready at 0.5 s, the rest run back to back.
    assert dp_grad_sync_exposed_s(2.0, 4.0, num_buckets=4, slowdown=1.0) == pytest.approx(2.5)
    # σ = 1.1 on the 3 s hidden under the 6 s window.
    assert dp_grad_sync_exposed_s(8.0, 4.0, num_buckets=4, slowdown=1.1) == pytest.approx(
        1.0 + 3.0 * (1 - 1 / 1.1))
    assert ddp_num_buckets(100 * 2**20, 25 * 2**20) == 4 and ddp_num_buckets(0, 1) == 1


@given(st.floats(0, 10), st.floats(0, 10), st.integers(1, 16))
def test_ddp_overlap_matches_a_bucket_by_bucket_simulation(backward, reduce, buckets):
    finish = 0.0
    for i in range(1, buckets + 1):  # bucket i is ready at i/B of backward
        finish = max(finish, i * backward / buckets) + reduce / buckets
    assert dp_grad_sync_exposed_s(backward, reduce, num_buckets=buckets, slowdown=1.0) == \
        pytest.approx(finish - backward, abs=1e-9)


def test_fsdp_prefetch_hides_each_gather_behind_the_previous_layer():
    # Forward: gather 0 exposed (2 s); gather 1 (4 s) behind layer 0 (3 s): 1 s; gather 2 hidden.
    assert fsdp_exposed_s([3, 3, 3], [2, 4, 1], slowdown=1.0) == pytest.approx(3.0)
    # Backward adds each layer's reduce-scatter beside the next layer; the last is exposed.
    assert fsdp_exposed_s([3, 3, 3], [2, 4, 1], [1, 1, 1], slowdown=1.0) == pytest.approx(4.0)
    slowed = fsdp_exposed_s([3, 3, 3], [2, 4, 1], slowdown=1.1)
    assert slowed == pytest.approx(2 + (4 - 3.3 / 1.1) + 1 * (1 - 1 / 1.1))


def test_pipeline_send_slows_the_senders_next_action():
    assert pipeline_p2p_slowdown_s(1.0, 0.5, slowdown=1.1) == pytest.approx(0.5 * (1 - 1 / 1.1))
    assert pipeline_p2p_slowdown_s(1.0, 2.0, slowdown=1.1) == pytest.approx(0.1)  # (σ-1)·P
    assert pipeline_p2p_slowdown_s(1.0, 2.0, slowdown=1.0) == 0.0


# -- compute ---------------------------------------------------------------------------------

def test_roofline_is_bound_by_the_slower_resource():
    device = Cluster.preset("dgx-a100-80g").device
    # A large GEMM: 2·8192³ FLOPs in bf16 at 70% of 312 TFLOP/s.
    flops = 2 * 8192**3
    assert roofline_s(flops, 3 * 8192**2 * 2, 1, device, "bfloat16") == pytest.approx(
        flops / (0.7 * 312e12) + 5e-6)
    # An elementwise op over 1 GB: memory-bound at 2,039 GB/s.
    assert roofline_s(1e8, 1e9, 1, device, "bfloat16") == pytest.approx(1e9 / 2039e9 + 5e-6)


def test_gemm_efficiency_rises_with_size_towards_the_asymptote():
    device = with_half_dim(Cluster.preset("dgx-a100-80g").device, 128)  # asymptote 0.7
    dims = [16, 64, 128, 512, 4096, 65536]
    effs = [gemm_efficiency(device, "bfloat16", d) for d in dims]
    assert effs == sorted(effs) and effs[-1] < 0.7
    assert effs[2] == pytest.approx(0.35)  # half of the asymptote at d = 128
    assert effs[-1] == pytest.approx(0.7, rel=2e-3)
    assert gemm_efficiency(device, "bfloat16") == 0.7  # no size given: a large GEMM


def with_half_dim(device, half_dim: float):
    return replace(device, matmul_half_dim={"bfloat16": half_dim})


def test_small_gemm_runs_far_from_peak():
    device = with_half_dim(Cluster.preset("dgx-a100-80g").device, 128)
    # 256³ in bf16: 2·256³ FLOPs at 0.7·256/(256 + 128) of 312 TFLOP/s beats the 0.39 MB
    # of operands at 2,039 GB/s; plus the 5 us floor.
    flops = 2 * 256**3
    expected = flops / (312e12 * 0.7 * 256 / 384) + 5e-6
    assert gemm_s(256, 256, 256, device, "bfloat16") == pytest.approx(expected)
    big = 2 * 8192**3
    assert roofline_s(big, 0, 1, device, "bfloat16", gemm_min_dim=8192) == pytest.approx(
        big / (312e12 * 0.7 * 8192 / (8192 + 128)) + 5e-6)


@given(rate=st.floats(1e9, 1e15), half=st.floats(0, 2048), floor=st.floats(0, 1e-4))
def test_fitted_gemm_curve_recovers_known_parameters(rate, half, floor):
    device = replace(Cluster.local(2).device, peak_flops={"float32": rate / 0.5},
                     matmul_efficiency=0.5, matmul_half_dim={"float32": half},
                     kernel_floor_s=floor)
    sizes = [128, 256, 512, 1024, 2048]
    times = [roofline_s(2 * n**3, 0, 1, device, "float32", gemm_min_dim=n) for n in sizes]
    curve = fit_gemm_curve(sizes, times, floor_s=floor)
    assert curve.asymptote_flops == pytest.approx(rate, rel=1e-6)
    assert curve.half_dim == pytest.approx(half, rel=1e-6, abs=1e-6 * max(sizes))


def test_zero_model_states_match_the_zero_paper():
    # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters, Nd = 64, K = 12.
    prec = precision("bfloat16")
    totals = [zero_model_states(7.5e9, s, 64, prec).total_bytes / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


def test_unknown_precision_and_dtype_are_clear_errors():
    with pytest.raises(ConfigError, match="valid: float32, bfloat16, float16"):
        precision("fp8")
    with pytest.raises(ConfigError, match="no peak FLOP/s for dtype 'bfloat16'"):
        Cluster.from_toml_text(MINIMAL).device.peak("bfloat16")


def test_collective_links_override_the_intra_node_link_for_their_collective():
    text = MINIMAL + '[collective_links.all_gather]\nkind = "pcie"\nbandwidth_GBps = 5\n' \
        'latency_us = 10\n'
    cluster = Cluster.from_toml_text(text)
    base = Cluster.from_toml_text(MINIMAL)
    group = Group(4)  # one node of MINIMAL's 4 devices: 3 ring steps of S/4 each
    assert all_gather_s(4e9, group, cluster) == pytest.approx(
        LAUNCH + 3 * 1e9 / 5e9 + 3 * 10e-6)
    assert all_gather_s(4e9, group, base) == pytest.approx(LAUNCH + 3 * 1e9 / 20e9 + 3 * 10e-6)
    assert all_reduce_s(4e9, group, cluster) == all_reduce_s(4e9, group, base)
    with pytest.raises(ConfigError, match=r"\[collective_links.broadcast\] is not a collective"):
        Cluster.from_toml_text(MINIMAL + '[collective_links.broadcast]\nkind = "pcie"\n'
                               'bandwidth_GBps = 5\nlatency_us = 10\n')
