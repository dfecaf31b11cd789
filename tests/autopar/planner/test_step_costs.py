"""Cost terms beside the matmuls: the optimizer step, the loss, fused attention's rate, and
the host time and skew that CPU ranks add (autopar/planner/costs.py, cost_models/).

Each is checked against a hand count or against what torch actually runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from planner_cases import graph_of, make_cluster, make_layer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.planner import search
from autopar.planner.costs import layer_cost, on_ddp
from autopar.planner.engine import Engine
from autopar.planner.engine_costs import all_reduce_wait_s, back_to_back_skew_s
from autopar.planner.loss_costs import LOSS_BWD_PASSES, LOSS_FWD_PASSES, LOSS_KERNELS
from cost_models.comm import Group, all_gather_s, reduce_scatter_s
from cost_models.errors import ConfigError
from cost_models.hardware import Cluster, Host, Link, Overlap
from cost_models.memory import precision
from cost_models.optimizer import ADAM_KERNELS, optimizer_step_s
from runtime.plan import LayerPlan, Mesh, Plan, SolverReport, option_label
from runtime.strategies import spec

FP32, BF16 = precision("float32"), precision("bfloat16")


# -- the optimizer: what torch's AdamW runs -------------------------------------------------

class _Census(TorchDispatchMode):
    """Per aten op on tensors of ``numel`` elements: kernels, and operands read or written
    (a tensor passed twice to one op is read once)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.kernels, self.passes = numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sized = {id(t): t for t in tree_leaves((args, kwargs or {}))
                 if isinstance(t, torch.Tensor) and t.numel() == self.numel}
        if sized:
            self.kernels += 1
            inplace = func._schema.name.endswith("_")
            written = tree_leaves(args[0]) if inplace else tree_leaves(out)
            self.passes += len(sized) + sum(isinstance(t, torch.Tensor) for t in written)
        return out


@pytest.mark.parametrize("name, foreach", [("adamw-for-loop", False), ("adamw-foreach", True)])
def test_torch_adamw_runs_the_passes_and_kernels_the_optimizer_model_charges(name, foreach):
    tensors, numel = 6, 1000
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    for p in params:
        p.grad = torch.randn(numel)
    opt.step()  # creates the moments
    with _Census(numel) as census:
        opt.step()
    kernels = ADAM_KERNELS[name]
    assert census.passes == kernels.fp32_passes * tensors
    per_tensor_kernels = census.kernels / (tensors if kernels.per_tensor else 1)
    # The for-loop also bumps and reads each tensor's step count (two ops on a scalar).
    extra = 2 if kernels.per_tensor else 0
    assert per_tensor_kernels + extra == kernels.kernels


def test_optimizer_step_is_its_passes_at_memory_bandwidth_plus_its_launches():
    device = make_cluster().device  # 2000 GB/s, 5 us floor
    # 1e8 parameters: 20 float32 passes of 400 MB = 8 GB -> 4 ms; 10 kernels x 7 tensors.
    t = optimizer_step_s(1e8, 7, ADAM_KERNELS["adamw-for-loop"], device)
    assert t == pytest.approx(8e9 / 2000e9 + 70 * 5e-6)
    fused = optimizer_step_s(1e8, 7, ADAM_KERNELS["fused-adam"], device)
    assert fused == pytest.approx(7 * 4e8 / 2000e9 + 5e-6)
    assert optimizer_step_s(0, 0, ADAM_KERNELS["adamw-foreach"], device) == 0.0


def test_layer_cost_charges_the_clusters_optimizer():
    layer = replace(make_layer("h.0", "B", 0, params=10**7, fwd_flops=1e9, saved_bytes=0,
                               act_bytes=0), param_tensors=4)
    fused = replace(make_cluster(), optimizer="fused-adam")
    torch_adam = make_cluster()  # the default: adamw-foreach
    a = layer_cost(layer, "replicate", Mesh(dp=4), torch_adam, FP32).step_s
    b = layer_cost(layer, "replicate", Mesh(dp=4), fused, FP32).step_s
    # 4e7 bytes of float32 parameters: 20 passes in 8 launches against 7 passes in one.
    assert a - b == pytest.approx((20 - 7) * 4e7 / 2000e9 + (8 - 1) * 5e-6)


def test_a_cluster_file_names_an_optimizer_the_model_knows():
    text = _cluster_toml("optimizer = \"sgd\"\n")
    with pytest.raises(ConfigError, match="optimizer = 'sgd' is not one of adamw-for-loop"):
        Cluster.from_toml_text(text)
    assert Cluster.from_toml_text(_cluster_toml('optimizer = "fused-adam"\n')).optimizer == \
        "fused-adam"


# -- the loss -------------------------------------------------------------------------------

def test_the_output_layer_pays_cross_entropys_passes_over_the_logits():
    cluster = make_cluster()
    head = make_layer("lm_head", "H", 0, params=0, fwd_flops=0.0, saved_bytes=0, act_bytes=0,
                      tp=False)
    with_loss = replace(head, loss_bytes=8 * 2**30)  # float32 logits of the global batch
    base = layer_cost(head, "replicate", Mesh(dp=4), cluster, FP32, 2)
    cost = layer_cost(with_loss, "replicate", Mesh(dp=4), cluster, FP32, 2)
    logits = 8 * 2**30 / 8  # per micro-batch: dp 4 x 2 micro-batches
    floor = LOSS_KERNELS * 5e-6
    assert cost.fwd_s - base.fwd_s == pytest.approx(LOSS_FWD_PASSES * logits / 2000e9 + floor)
    backward = (cost.bwd_s + cost.wgrad_s) - (base.bwd_s + base.wgrad_s)
    assert backward == pytest.approx(LOSS_BWD_PASSES * logits / 2000e9 + floor)
    # In bfloat16 the logits are cast up for the loss and the gradient back down: read 2
    # bytes and write 4 per element each way.
    low = layer_cost(with_loss, "replicate", Mesh(dp=4), cluster, BF16, 2)
    low_base = layer_cost(head, "replicate", Mesh(dp=4), cluster, BF16, 2)
    assert low.fwd_s - low_base.fwd_s == pytest.approx(
        (LOSS_FWD_PASSES + 1.5) * logits / 2000e9 + floor)


def test_cross_entropy_runs_at_its_calibrated_share_of_the_bandwidth():
    """``Device.loss_efficiency`` slows the passes over the float32 logits, not the casts
    around them (those run as the memory-bound mix does)."""
    cluster = make_cluster()
    slow = replace(cluster, device=replace(cluster.device, loss_efficiency=0.25))
    head = make_layer("lm_head", "H", 0, params=0, fwd_flops=0.0, saved_bytes=0, act_bytes=0,
                      tp=False)
    with_loss = replace(head, loss_bytes=8 * 2**30)
    logits = 8 * 2**30 / 8
    for prec, cast in ((FP32, 0.0), (BF16, 1.5 * logits)):
        fast = layer_cost(with_loss, "replicate", Mesh(dp=4), cluster, prec, 2)
        cost = layer_cost(with_loss, "replicate", Mesh(dp=4), slow, prec, 2)
        # The passes take 4x as long; everything else in the layer is unchanged.
        assert cost.fwd_s - fast.fwd_s == pytest.approx(3 * LOSS_FWD_PASSES * logits / 2000e9)
        assert (cost.bwd_s + cost.wgrad_s) - (fast.bwd_s + fast.wgrad_s) == pytest.approx(
            3 * LOSS_BWD_PASSES * logits / 2000e9)
        base = layer_cost(head, "replicate", Mesh(dp=4), slow, prec, 2)
        assert cost.fwd_s - base.fwd_s == pytest.approx(
            (4 * LOSS_FWD_PASSES * logits + cast) / 2000e9 + LOSS_KERNELS * 5e-6)


# -- offload: the cluster's host ---------------------------------------------------------------

def test_offloaded_layers_copy_over_the_hosts_link_and_step_at_its_bandwidth():
    """An offloaded fsdp layer (dp 4, 2 micro-batches): its float32 shard P/4 is copied to
    the device before each of the two gathers per micro-batch and its gradient shard back
    once per step, over ``Cluster.host.link``; AdamW steps the shard on the host, one tensor
    at a time, at ``Cluster.host.memory_bandwidth_GBps``. Hand-derived for two hosts."""
    params = 64 * 2**20
    layer = make_layer("h.0", "B", 0, params=params, fwd_flops=1e12, saved_bytes=2**20,
                       act_bytes=2**20)
    shard = params / 4 * 4  # bytes of the float32 parameter (and gradient) shard

    def host(bandwidth, latency, dram):
        return Host(link=Link(kind="pcie", bandwidth_GBps=bandwidth, latency_s=latency),
                    memory_bandwidth_GBps=dram)

    def time_s(h):
        cluster = replace(make_cluster(), host=h)
        return layer_cost(layer, "fsdp+offload", Mesh(dp=4), cluster, FP32, 2).time_s

    def by_hand(bandwidth, latency, dram):
        copies = 2 * 2 * (shard / (bandwidth * 1e9) + latency) + shard / (bandwidth * 1e9)
        adam = optimizer_step_s(params / 4, layer.param_tensors, ADAM_KERNELS["adamw-for-loop"],
                                make_cluster().device, bandwidth_GBps=dram)
        return copies + adam

    a, b = (25.0, 10e-6, 50.0), (50.0, 10e-6, 77.0)  # a DGX A100's share, then an H100's
    assert time_s(host(*a)) - time_s(host(*b)) == pytest.approx(by_hand(*a) - by_hand(*b),
                                                                  rel=1e-9)
    for preset, figures in (("dgx-h100", b), ("dgx-a100-80g", a)):
        h = Cluster.preset(preset).host
        assert h.offload and (h.link.bandwidth_GBps, h.link.latency_s,
                              h.memory_bandwidth_GBps) == pytest.approx(figures)


def test_a_malformed_host_table_names_the_field():
    with pytest.raises(ConfigError, match=r"\[host.link\]: missing field 'latency_s'"):
        Cluster.from_toml_text(_cluster_toml(tables='[host.link]\nkind = "pcie"\n'
                                                    "bandwidth_GBps = 50\n"))
    with pytest.raises(ConfigError, match=r"\[host\]: unknown field 'bandwidth_GBps'"):
        Cluster.from_toml_text(_cluster_toml(tables="[host]\nbandwidth_GBps = 50\n"))
    with pytest.raises(ConfigError, match=r"\[host\]: memory_bandwidth_GBps must be a positive"):
        Cluster.from_toml_text(_cluster_toml(tables="[host]\nmemory_bandwidth_GBps = 0\n"))


# -- fused attention's rate -------------------------------------------------------------------

def test_fused_attention_runs_at_its_own_rate():
    cluster = make_cluster()
    attention = 4e12  # forward FLOPs of the layer's scaled_dot_product_attention
    layer = replace(make_layer("h.0", "B", 0, params=0, fwd_flops=attention + 6e12,
                               saved_bytes=0, act_bytes=0), attention_fwd_flops=attention)
    slow = replace(cluster, device=replace(cluster.device, attention_efficiency=0.25))
    base = layer_cost(layer, "replicate", Mesh(dp=2), cluster, FP32)
    cost = layer_cost(layer, "replicate", Mesh(dp=2), slow, FP32)
    rate = 100e12 * 0.7  # peak x the device's GEMM efficiency
    # 2e12 attention FLOPs on this rank take 4x as long: 3 x 2e12 more at the GEMM rate.
    assert cost.fwd_s - base.fwd_s == pytest.approx(3 * 2e12 / rate)
    assert cost.compute_s - base.compute_s == pytest.approx(3 * 3 * 2e12 / rate)
    # Under TP the heads split: a quarter of the heads, a quarter of the loss.
    tp = option_label("tp", "none", False, False)
    split = layer_cost(layer, tp, Mesh(dp=2, tp=4), slow, FP32).fwd_s
    assert split - layer_cost(layer, tp, Mesh(dp=2, tp=4), cluster, FP32).fwd_s == \
        pytest.approx(3 * 2e12 / 4 / rate)


# -- CPU ranks: host overheads and collective skew --------------------------------------------

def _cpu_like() -> Cluster:
    """make_cluster() with the host overheads and FSDP2's exposure of CPU ranks."""
    cluster = make_cluster(overlap=Overlap(exposed=("fsdp",)))
    return replace(cluster, optimizer="adamw-for-loop", device=replace(
        cluster.device, fsdp_overhead_s=1e-3, tp_overhead_s=2e-3, dtensor_op_overhead_s=5e-5,
        collective_skew_s=3e-3))


def test_fsdp2_host_time_per_micro_batch_and_per_optimizer_op():
    layer = replace(make_layer("h.0", "B", 0, params=10**6, fwd_flops=1e9, saved_bytes=0,
                               act_bytes=0), param_tensors=4)
    cpu = _cpu_like()
    cpu = replace(cpu, device=replace(cpu.device, collective_skew_s=0.0))
    plain = replace(cpu, device=make_cluster().device)
    cost = layer_cost(layer, "fsdp", Mesh(dp=4), cpu, FP32, 3)
    base = layer_cost(layer, "fsdp", Mesh(dp=4), plain, FP32, 3)
    hooks, optimizer_ops = 3 * 1e-3, 10 * 4 * 5e-5  # 10 ops on each of 4 DTensors
    assert cost.compute_s - base.compute_s == pytest.approx(hooks + optimizer_ops)
    assert cost.fsdp_only_s == pytest.approx(hooks + optimizer_ops + 3 * fsdp_copies(4e6, 4))
    assert cost.fwd_s - base.fwd_s == pytest.approx(0.5e-3)


def fsdp_copies(param_bytes: float, shards: int) -> float:
    """One micro-batch of a float32 fsdp layer's FSDP2 copies on make_cluster()'s device,
    by hand: two all-gathers (2P/N into the buffer, 2P out of it) and one reduce-scatter
    (2G in, 2G/N out), each two kernels at 5 us."""
    gather = (2 * param_bytes / shards + 2 * param_bytes) / 2000e9 + 2 * 5e-6
    scatter = (2 * param_bytes + 2 * param_bytes / shards) / 2000e9 + 2 * 5e-6
    return 2 * gather + scatter


def test_fsdp2_copies_its_collectives_buffers_as_often_as_the_runtime_gathers():
    layer = make_layer("h.0", "B", 0, params=10**6, fwd_flops=1e9, saved_bytes=0, act_bytes=0)
    cluster = make_cluster()
    for m in (1, 3):
        cost = layer_cost(layer, "fsdp", Mesh(dp=4), cluster, FP32, m)
        assert cost.fsdp_only_s == pytest.approx(m * fsdp_copies(4e6, 4))
    # Pipelined, every layer stays gathered: one gather and one reduce-scatter a step.
    piped = layer_cost(layer, "fsdp", Mesh(pp=2, dp=2), cluster, FP32, 4)
    once = (2 * 4e6 / 2 + 2 * 4e6 + 2 * 4e6 + 2 * 4e6 / 2) / 2000e9 + 4 * 5e-6
    assert piped.fsdp_only_s == pytest.approx(once)


def test_tensor_parallel_modules_add_their_host_time():
    layer = make_layer("h.0", "B", 0, params=10**6, fwd_flops=1e9, saved_bytes=0, act_bytes=0)
    tp = option_label("tp", "none", False, False)
    cpu = _cpu_like()
    no_tp_host = replace(cpu, device=replace(cpu.device, tp_overhead_s=0.0))
    extra = (layer_cost(layer, tp, Mesh(dp=2, tp=2), cpu, FP32).compute_s
             - layer_cost(layer, tp, Mesh(dp=2, tp=2), no_tp_host, FP32).compute_s)
    assert extra == pytest.approx(len(layer.tp.styles) * 2e-3)


def test_every_blocking_collective_waits_out_the_skew():
    layer = make_layer("h.0", "B", 0, params=10**6, fwd_flops=1e9, saved_bytes=0,
                       act_bytes=2**20)
    cpu = _cpu_like()
    no_skew = replace(cpu, device=replace(cpu.device, collective_skew_s=0.0))
    mesh = Mesh(dp=2, tp=2)
    tp = option_label("tp", "none", False, False)
    # One TP all-reduce in forward and one in backward, per micro-batch.
    skewed, base = (layer_cost(layer, tp, mesh, c, FP32, 2) for c in (cpu, no_skew))
    assert skewed.fwd_s - base.fwd_s == pytest.approx(3e-3)
    assert skewed.bwd_s - base.bwd_s == pytest.approx(3e-3)
    # FSDP: two gathers and one reduce-scatter per micro-batch, none overlapped here.
    exposed = replace(cpu, overlap=replace(cpu.overlap, exposed=("fsdp",)))
    exposed_no_skew = replace(no_skew, overlap=exposed.overlap)
    fsdp = (layer_cost(layer, "fsdp", Mesh(dp=4), exposed, FP32, 2).comm_s
            - layer_cost(layer, "fsdp", Mesh(dp=4), exposed_no_skew, FP32, 2).comm_s)
    assert fsdp == pytest.approx(2 * 3 * 3e-3)
    # A replicated layer's gradient all-reduce: once per step, whatever the micro-batches.
    replicate = (layer_cost(layer, "replicate", Mesh(dp=4), cpu, FP32, 2).comm_s
                 - layer_cost(layer, "replicate", Mesh(dp=4), no_skew, FP32, 2).comm_s)
    assert replicate == pytest.approx(3e-3)
    assert all_gather_s(4e6, Group(4), cpu) == all_gather_s(4e6, Group(4), no_skew)
    assert reduce_scatter_s(4e6, Group(4), cpu) == reduce_scatter_s(4e6, Group(4), no_skew)


def test_the_skew_grows_with_the_message_between_calibrated_points():
    """``Device.collective_skew_at``: linear in the message size between points, from
    (0, ``collective_skew_s``), flat past the last; each collective waits the skew of its
    own size (TP: the activation per micro-batch; FSDP: the layer's parameters, gradients)."""
    points = ((2.0**18, 5e-3), (2.0**22, 9e-3))
    device = replace(_cpu_like().device, collective_skew_at=points)
    assert device.skew_s(0) == pytest.approx(3e-3)
    assert device.skew_s(2**17) == pytest.approx(4e-3)
    assert device.skew_s(2**18) == pytest.approx(5e-3)
    assert device.skew_s((2**18 + 2**22) / 2) == pytest.approx(7e-3)
    assert device.skew_s(2**30) == pytest.approx(9e-3)

    layer = make_layer("h.0", "B", 0, params=10**6, fwd_flops=1e9, saved_bytes=0,
                       act_bytes=2**20)
    cpu = replace(_cpu_like(), device=device)
    no_skew = replace(cpu, device=replace(device, collective_skew_s=0.0, collective_skew_at=()))
    tp = option_label("tp", "none", False, False)
    # dp 2 x 2 micro-batches: each TP all-reduce moves 2^20 / 4 = 2^18 bytes.
    skewed, base = (layer_cost(layer, tp, Mesh(dp=2, tp=2), c, FP32, 2) for c in (cpu, no_skew))
    assert skewed.fwd_s - base.fwd_s == pytest.approx(5e-3)
    exposed, exposed_no_skew = (replace(c, overlap=replace(c.overlap, exposed=("fsdp",)))
                                for c in (cpu, no_skew))
    fsdp = (layer_cost(layer, "fsdp", Mesh(dp=4), exposed, FP32, 2).comm_s
            - layer_cost(layer, "fsdp", Mesh(dp=4), exposed_no_skew, FP32, 2).comm_s)
    at_4e6 = 5e-3 + 4e-3 * (4e6 - 2**18) / (2**22 - 2**18)  # gathers and reduce-scatters
    assert fsdp == pytest.approx(2 * 3 * at_4e6)
    # Back to back, after the last micro-batch (a pipeline's reductions), the ranks come
    # apart once: a layer waits its share of one 25 MiB bucket's skew (9 ms, past the last
    # point), as under DDP.
    share = 4e6 / cpu.overlap.ddp_bucket_bytes * 9e-3
    assert back_to_back_skew_s(4e6, cpu) == pytest.approx(share)
    assert all_reduce_wait_s(spec("replicate"), Mesh(pp=2, dp=2), cpu, FP32, 10**6) == \
        pytest.approx((share, 0.0))
    assert all_reduce_wait_s(spec("replicate"), Mesh(dp=4), cpu, FP32, 10**6) == \
        pytest.approx((at_4e6, at_4e6 - share))


@pytest.mark.parametrize("table, message", [
    ("bytes = [1048576]\nus = [4000, 5000]\n", "lists of equal length"),
    ("bytes = [4194304, 1048576]\nus = [4000, 5000]\n", "ascending"),
    ("bytes = [1048576]\nus = [-1]\n", "us non-negative"),
    ("sizes = [1048576]\n", "unknown field 'sizes'"),
])
def test_a_malformed_skew_curve_names_the_field(table, message):
    text = _cluster_toml(device_extra="[device.collective_skew_at]\n" + table)
    with pytest.raises(ConfigError, match=message):
        Cluster.from_toml_text(text)
    good = _cluster_toml(device_extra="collective_skew_us = 2000\n[device.collective_skew_at]\n"
                                      "bytes = [1048576, 4194304]\nus = [4000, 5000]\n")
    assert Cluster.from_toml_text(good).device.skew_s(2**21) == pytest.approx(4e-3 + 1e-3 / 3)


def test_a_plan_that_runs_on_ddp_does_not_pay_fsdp2s_host_time_and_waits():
    # Both engines' all-reduce overlapping alike ('dp' and 'fsdp' at one slowdown), so
    # what DDP saves is FSDP2's host time, copies and per-layer skew.
    cpu = replace(_cpu_like(), overlap=Overlap())
    layers = [replace(make_layer(f"h.{i}", "B", i, params=10**6, fwd_flops=1e9, saved_bytes=0,
                                 act_bytes=0), param_tensors=2) for i in range(2)]
    graph = graph_of(layers, batch=8)
    report = SolverReport(solver="fixed", status="optimal", objective_s=0.0,
                          lower_bound_s=0.0, gap=0.0, solve_time_s=0.0)

    def predicted(strategy: str, prec) -> tuple[float, float]:
        cost = layer_cost(layers[0], strategy, Mesh(dp=4), cpu, prec)
        draft = Plan(model="two-layers", global_batch=8, mesh=Mesh(dp=4), layers=tuple(
            LayerPlan(module=layer.name, strategy=strategy) for layer in layers))
        engine = Engine(graph, cpu, prec)
        plan = engine.plan(engine.evaluate(draft), report)
        return plan.prediction.step_time_s, 2 * cost.time_s

    ddp, layer_sum = predicted("replicate", FP32)  # float32, all replicate: DDP
    # Per layer: FSDP2's hooks and 10 DTensor ops on each of 2 tensors; and its all-reduce
    # waits for the other ranks once per 25 MiB DDP bucket (4 MB of gradients: a share
    # of one skew), not once per layer as under FSDP2.
    # FSDP2's copies: one gather per micro-batch and one reduce-scatter, over one rank.
    share = 4e6 / 25 / 2**20
    copies = (2 * 4e6 + 2 * 4e6 + 2 * 4e6 + 2 * 4e6) / 2000e9 + 4 * 5e-6
    assert ddp == pytest.approx(
        layer_sum - 2 * (1e-3 + 10 * 2 * 5e-5 + (1 - share) * 3e-3 + copies))
    fsdp2, layer_sum = predicted("replicate", BF16)  # mixed precision runs on FSDP2
    assert fsdp2 == pytest.approx(layer_sum)


@pytest.mark.parametrize("field", ["collective_skew_us", "fsdp_overhead_us", "tp_overhead_us",
                                   "dtensor_op_overhead_us"])
def test_a_negative_host_overhead_names_the_field(field):
    with pytest.raises(ConfigError, match=f"{field} must be a finite non-negative number"):
        Cluster.from_toml_text(_cluster_toml(device_extra=f"{field} = -1\n"))


@pytest.mark.parametrize("field", ["attention_efficiency", "loss_efficiency"])
@pytest.mark.parametrize("value", ["0", "-0.5", "11", "true"])
def test_a_rate_efficiency_out_of_range_is_refused(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be in"):
        Cluster.from_toml_text(_cluster_toml(device_extra=f"{field} = {value}\n"))


def _cluster_toml(top: str = "", device_extra: str = "", tables: str = "") -> str:
    return (f'name = "t"\n{top}\n[device]\nname = "d"\nmemory_gib = 8\n'
            f"memory_bandwidth_GBps = 100\n{device_extra}\n[device.peak_tflops]\nfloat32 = 1\n"
            '[intra_node]\nkind = "pcie"\nbandwidth_GBps = 10\nlatency_us = 5\n'
            '[inter_node]\nkind = "network"\nbandwidth_GBps = 10\nlatency_us = 5\n' + tables)


def test_the_search_prices_a_plan_of_replicate_layers_as_ddp_runs_it():
    # CPU ranks: FSDP2's host time and per-layer waits make every FSDP2 plan slower than
    # DDP, and a replicate layer under FSDP2 holds its parameters twice. With memory for
    # DDP's one copy but not FSDP2's two, the plan is DDP's, priced and fitted as DDP runs.
    cpu = _cpu_like()
    layers = [replace(make_layer(f"h.{i}", "B", i, params=10**7, fwd_flops=1e12,
                                 saved_bytes=10**6, act_bytes=10**5, tp=False), param_tensors=2)
              for i in range(2)]
    graph = graph_of(layers, batch=8)
    ddp_cost = on_ddp(layer_cost(layers[0], "replicate", Mesh(dp=4), cpu, FP32))
    fsdp2_cost = layer_cost(layers[0], "replicate", Mesh(dp=4), cpu, FP32)
    need = 2 * ddp_cost.resident_bytes + ddp_cost.buffers_bytes
    assert 2 * fsdp2_cost.resident_bytes + fsdp2_cost.buffers_bytes > 1.2 * need
    cluster = replace(cpu, devices_per_node=4, device=replace(
        cpu.device, memory_bytes=int(1.1 * need * (1 + cpu.memory_margin_fraction))))
    plan = search(graph, cluster, mesh=Mesh(dp=4), pipeline=False).plan
    assert {lp.strategy for lp in plan.layers} == {"replicate"}
    assert plan.prediction.step_time_s == pytest.approx(plan.solver.objective_s)
    assert plan.prediction.step_time_s == pytest.approx(2 * ddp_cost.time_s)
    assert plan.prediction.memory.total_bytes <= cluster.device.memory_bytes
