"""The pure estimators a layer's cost is composed of, and the set the planner is given.

``costs.layer_cost`` adds up one layer's time and memory under one option from these
estimators; each is a pure function of the layer's record (passes.records.LayerInfo) and
a ``CostContext`` (the option, the mesh, the cluster, the precision), returning seconds or
bytes. ``Estimators`` names one of each; ``search``, ``autopar.plan`` and the cost functions
take one, so a calibrated or a user's estimator replaces the analytic one:

    mine = dataclasses.replace(ANALYTIC, tp_comm=my_tp_comm_s)
    autopar.plan(model, cluster, inputs, estimators=mine)

The analytic estimators (``ANALYTIC``) follow the conventions in costs.py's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.planner.engine_costs import back_to_back_skew_s
from autopar.planner.loss_costs import loss_s
from autopar.planner.moe_costs import all_to_all_s as expert_all_to_all_s
from cost_models.comm import (
    Group,
    all_gather_s,
    all_reduce_s,
    collective_s,
    group_link,
    p2p_s,
    reduce_scatter_s,
)
from cost_models.compute import gemm_shortfall_flops, roofline_s
from cost_models.hardware import Cluster, Device
from cost_models.memory import Precision
from cost_models.optimizer import ADAM_KERNELS, optimizer_step_s
from passes.records import CAPTURE_ACTIVATION_BYTES, Collective, LayerInfo, SavedSplit, TPOption
from runtime.plan import Mesh
from runtime.strategies import StrategySpec


@dataclass(frozen=True, kw_only=True)
class CostContext:
    """Where and how a layer runs under one option: what every estimator is given."""

    mesh: Mesh
    cluster: Cluster
    prec: Precision
    microbatches: int
    strategy: StrategySpec
    recompute: str = "none"
    offload: bool = False
    sequence_parallel: bool = False
    hsdp_shard_size: int | None = None
    async_tp: bool = False
    """PyTorch's async TP overlaps the layer's sequence-parallel collectives with its
    matmuls (``async_tp_comm_s``)."""
    unit_shares: tuple[float, ...] = (1.0,)
    """Each of the layer's FSDP2 units' share of its parameters: one unit, or
    ``fsdp_modules``'s one per module and the rest (``costs.unit_shares``)."""

    @property
    def tensor_parallel(self) -> bool:
        return self.strategy.tensor_parallel

    @property
    def batch_shards(self) -> int:
        """Ranks' shares of the captured batch one micro-batch is: dp · cp · m (context
        parallelism splits samples as data parallelism splits the batch)."""
        return self.mesh.replicas * self.microbatches

    @property
    def act_scale(self) -> float:
        """Activation bytes at the plan's dtype per captured (float32) byte."""
        return self.prec.activation_bytes / CAPTURE_ACTIVATION_BYTES


@dataclass(frozen=True, kw_only=True)
class ComputeTimes:
    """One micro-batch's compute on one rank, seconds."""

    fwd_matmul_s: float
    """Forward at the roofline of its FLOPs and the traffic that hides under them."""
    fwd_alone_s: float
    """Forward memory-bound kernels (norms, activations, dropout) at memory bandwidth."""
    loss_fwd_s: float
    bwd_s: float
    """The whole backward, the loss's included."""

    @property
    def fwd_s(self) -> float:
        return self.fwd_matmul_s + self.fwd_alone_s + self.loss_fwd_s


@dataclass(frozen=True, kw_only=True)
class Recompute:
    """What the recompute mode keeps and reruns, for one micro-batch."""

    kept_bytes: float
    """Activations saved for backward."""
    rematerialized_bytes: float
    """Freed in forward, back during the layer's backward (a transient)."""
    compute_s: float
    comm_s: float
    """TP collectives the rerun forward repeats."""


@dataclass(frozen=True)
class Ring:
    fwd_s: float = 0.0
    """Exposed transfer time of the forward ring (per micro-batch)."""
    bwd_s: float = 0.0
    buffers_bytes: float = 0.0
    """K/V blocks in hand and arriving, with their gradients in backward: 4 blocks."""


@dataclass(frozen=True)
class DPComm:
    gather_per_micro: float
    """One parameter all-gather, issued before forward and again before backward."""
    reduce_per_micro: float
    per_step: float
    gather_per_step: float = 0.0
    """Part of ``per_step``: a ZeRO-1/2 layer's once-per-step parameter all-gather, which
    FSDP2 issues in the step's first forward at pp = 1 (``costs._hidden_comm_s``)."""
    reduce_per_step: float = 0.0
    """Part of ``per_step``: a ZeRO-1 layer's once-per-step gradient reduce-scatter, which
    FSDP2 issues in the last micro-batch's backward at pp = 1."""


@dataclass(frozen=True)
class Offload:
    per_micro_s: float
    """Host copies per micro-batch."""
    per_step_s: float
    optimizer_s: float
    """The optimizer step, run on the host."""


def compute_s(layer: LayerInfo, ctx: CostContext) -> ComputeTimes:
    """Roofline compute of one micro-batch: matmuls with the traffic that hides under them,
    small GEMMs and fused attention at their measured shortfall (the same share again in
    backward, two GEMMs over the same dims per forward GEMM), memory-bound kernels alone
    (passes/memory_bound.py), and the loss's passes."""
    is_tp, sp, tp = ctx.tensor_parallel, ctx.sequence_parallel, ctx.mesh.tp
    shards, device, dtype = ctx.batch_shards, ctx.cluster.device, ctx.prec.compute_dtype
    fwd_flops = _local_flops(layer, is_tp, shards, tp)
    ratio = fwd_flops / layer.fwd_flops if layer.fwd_flops else 1.0 / shards
    mem = (layer.mem_bytes - layer.memory_bound_bytes) * ratio * ctx.act_scale
    alone = _memory_bound_bytes(layer, is_tp, sp, tp) * ctx.act_scale / shards
    short = (_gemm_shortfall(layer, is_tp, fwd_flops, shards, tp, device, dtype)
             + _attention_shortfall(layer, is_tp, shards, tp, device))
    bwd_short = short * layer.bwd_flops / layer.fwd_flops if layer.fwd_flops else 0.0
    loss_fwd, loss_bwd = loss_s(layer, shards, ctx.prec, device)
    bwd = (roofline_s(layer.bwd_flops * ratio + bwd_short, 2 * mem, 2 * layer.num_ops,
                      device, dtype)
           + roofline_s(0.0, 2 * alone, 0, device, dtype) + loss_bwd)
    return ComputeTimes(fwd_matmul_s=roofline_s(fwd_flops + short, mem, layer.num_ops, device,
                                                dtype),
                        fwd_alone_s=roofline_s(0.0, alone, 0, device, dtype),
                        loss_fwd_s=loss_fwd, bwd_s=bwd)


def tp_comm_s(layer: LayerInfo, ctx: CostContext) -> tuple[float, float]:
    """Forward and backward tensor-parallel collectives of one micro-batch, exposed: each
    blocks the op after it, except what async TP hides (``async_tp_comm_s``)."""
    if ctx.async_tp:
        return async_tp_comm_s(layer, ctx)
    return _tp_comm_s(layer, ctx.tensor_parallel, ctx.sequence_parallel, ctx.mesh,
                      ctx.cluster, ctx.act_scale / ctx.batch_shards)


def async_tp_comm_s(layer: LayerInfo, ctx: CostContext) -> tuple[float, float]:
    """Forward and backward sequence-parallel collectives of one micro-batch under PyTorch's
    async TP (runtime/async_tp.py), exposed (``_async_tp_s``)."""
    return _async_tp_s(layer, ctx.mesh, ctx.cluster, ctx.prec.compute_dtype,
                       ctx.batch_shards, ctx.act_scale / ctx.batch_shards)


def ring_attention_s(layer: LayerInfo, ctx: CostContext, fwd_compute_s: float) -> Ring:
    """Ring attention of one micro-batch over the cp group (``_ring_attention``)."""
    return _ring_attention(layer, ctx.tensor_parallel, ctx.mesh, ctx.cluster,
                           ctx.act_scale / ctx.batch_shards, fwd_compute_s)


def recompute_cost(layer: LayerInfo, ctx: CostContext, compute: ComputeTimes, tp_fwd_s: float
                   ) -> Recompute:
    """What the option's recompute mode keeps and reruns (``_activations``)."""
    kept, remat, seconds, comm = _activations(
        layer, ctx.recompute, ctx.tensor_parallel, ctx.sequence_parallel, ctx.mesh.tp,
        ctx.batch_shards, ctx.act_scale, compute.fwd_matmul_s, compute.fwd_alone_s, tp_fwd_s)
    return Recompute(kept_bytes=kept, rematerialized_bytes=remat, compute_s=seconds,
                     comm_s=comm)


def dp_comm_s(ctx: CostContext, tp_params: float, shards: int) -> DPComm:
    """The layer's data-parallel collectives (``_dp_comm_s``)."""
    return _dp_comm_s(ctx.strategy, ctx.mesh, ctx.cluster, ctx.prec, tp_params, shards,
                      ctx.unit_shares)


def offload_s(layer: LayerInfo, ctx: CostContext, local_params: float) -> Offload:
    """Host copies and the host's optimizer step of an offloaded layer (``_offload_s``)."""
    return Offload(*_offload_s(local_params, layer.param_tensors, ctx.prec, ctx.cluster))


@dataclass(frozen=True, kw_only=True)
class Estimators:
    """One estimator of each kind; ``ANALYTIC`` is autopar's own."""

    compute: Callable[[LayerInfo, CostContext], ComputeTimes] = compute_s
    tp_comm: Callable[[LayerInfo, CostContext], tuple[float, float]] = tp_comm_s
    ring_attention: Callable[[LayerInfo, CostContext, float], Ring] = ring_attention_s
    recompute: Callable[[LayerInfo, CostContext, ComputeTimes, float], Recompute] = \
        recompute_cost
    dp_comm: Callable[[CostContext, float, int], DPComm] = dp_comm_s
    offload: Callable[[LayerInfo, CostContext, float], Offload] = offload_s
    expert_all_to_all: Callable[[LayerInfo, int, Mesh, Cluster, Precision, int],
                                tuple[float, float]] = expert_all_to_all_s
    """A MoE layer's dispatch (or combine) at an expert-parallel degree, per micro-batch,
    and its buffers (autopar/planner/moe_costs.py)."""


ANALYTIC = Estimators()


# -- the analytic models ------------------------------------------------------------------

def _memory_bound_bytes(layer: LayerInfo, is_tp: bool, sp: bool, tp: int) -> float:
    """Memory-bound bytes of the layer on one rank of its tp group, at the captured batch:
    ops on sharded activations divide by tp, and with SP the rest run on sequence shards."""
    total = float(layer.memory_bound_bytes)
    if not is_tp:
        return total
    assert layer.tp is not None
    if sp:
        return total / tp
    sharded = layer.tp.sharded_memory_bound_bytes
    return total - sharded + sharded / tp


def _local_flops(layer: LayerInfo, is_tp: bool, batch_shards: int, tp: int) -> float:
    if not is_tp:
        return layer.fwd_flops / batch_shards
    assert layer.tp is not None
    sharded = layer.tp.sharded_fwd_flops
    return (layer.fwd_flops - sharded) / batch_shards + sharded / (batch_shards * tp)


def _gemm_shortfall(layer: LayerInfo, is_tp: bool, local_flops: float, batch_shards: int,
                    tp: int, device: Device, dtype: str) -> float:
    """``gemm_shortfall_flops`` of one micro-batch's forward GEMMs on one rank, at the sizes
    this option runs them (``local_flops``: the forward FLOPs of ``_local_flops``).

    A Linear's m (tokens) divides by the batch shards. Under TP a 'colwise' or
    'colwise_gather' Linear keeps n / tp of its out features, a 'rowwise' one k / tp of its
    in features; with SP they still multiply the whole sequence of the micro-batch (colwise
    inputs are gathered first, rowwise outputs reduce-scattered after), and SP admits no
    other Linear on the sequence shards. A Linear TP does not split runs whole on every
    rank. Batched products keep m, n, k: the batch and TP split their count (samples,
    heads). Which of them TP shards the record does not say, so they take the share of the
    layer's FLOPs outside the Linears that ``_local_flops`` gives this rank: exact when TP
    shards all of that (attention split by heads) or none of it.
    """
    styles = layer.tp.styles if is_tp and layer.tp is not None else {}
    linear: list[tuple[float, float]] = []
    for g in layer.gemms:
        if g.batched:
            continue
        style = styles.get(g.module)
        split = tp if style in ("colwise", "colwise_gather", "rowwise") else 1
        n, k = (g.n, g.k / split) if style == "rowwise" else (g.n / split, g.k)
        linear.append((g.flops / (batch_shards * split), min(g.m / batch_shards, n, k)))
    outside = layer.fwd_flops - sum(g.flops for g in layer.gemms if not g.batched)
    share = (local_flops - sum(f for f, _ in linear)) / outside if outside > 0 else 0.0
    batched = [(g.flops * share, min(g.m, g.n, g.k)) for g in layer.gemms if g.batched]
    return gemm_shortfall_flops(linear + batched, device, dtype)


def _attention_shortfall(layer: LayerInfo, is_tp: bool, batch_shards: int, tp: int,
                         device: Device) -> float:
    """FLOPs fused attention loses (or gains) against the large-GEMM rate, counted at that
    rate: its forward FLOPs on this rank f (heads split by TP) take as long as
    f / ``Device.attention_efficiency`` FLOPs do at the GEMM rate. Backward loses the same
    share (``layer_cost`` scales the forward's shortfall by bwd/fwd FLOPs)."""
    local = layer.attention_fwd_flops / (batch_shards * (tp if is_tp else 1))
    return local * (1 / device.attention_efficiency - 1)


def _activations(layer: LayerInfo, recompute: str, is_tp: bool, sp: bool, tp: int,
                 batch_shards: int, act_scale: float, matmul_s: float, alone_s: float,
                 tp_fwd: float) -> tuple[float, float, float, float]:
    """(saved bytes of one micro-batch, bytes rematerialized in backward, recompute compute
    seconds, recompute communication seconds).

    Saved bytes by kind (records.SavedSplit): floating ones scale with the activation
    dtype (at 16 bits, the capture's 16-bit run where it has one: ``LayerInfo.saved_low``),
    masks do not; the TP-sharded part divides by tp, and with SP so does the part run on
    sequence shards. Selective recomputation frees its share of each part and reruns
    the ops outside SELECTIVE_SAVE_OPS: the attention products (their share of the matmul
    time) and every memory-bound kernel (``alone_s``).
    """
    def on_rank(split: SavedSplit, divisor: int) -> tuple[float, float]:
        kept = (split.floating + split.fixed) / (batch_shards * divisor)
        freed = (split.freed + split.freed_fixed) / (batch_shards * divisor)
        return kept, freed

    # At 16 bits, the 16-bit run's bytes where the capture has them (casts up included);
    # the TP-sharded parts are the float32 capture's, scaled.
    low = act_scale < 1 and layer.saved_low is not None
    whole = layer.saved_low if low else layer.saved.at_dtype(act_scale)
    parts = [(whole, 1)]
    if is_tp:
        assert layer.tp is not None
        sharded = [(_sharded_saved(layer.tp).at_dtype(act_scale), tp)]
        if sp:
            sharded.append((_sp_saved(layer.tp).at_dtype(act_scale), tp))
        parts = [(whole - sum((s for s, _ in sharded), SavedSplit()), 1), *sharded]
    kept, freed = (sum(v) for v in zip(*(on_rank(s, d) for s, d in parts), strict=True))
    if recompute == "none":
        return kept, 0.0, 0.0, 0.0
    if recompute == "selective":
        freed = min(freed, kept)
        share = layer.selective_fwd_flops / layer.fwd_flops if layer.fwd_flops else 0.0
        return kept - freed, freed, share * matmul_s + alone_s, 0.0
    checkpoint = (layer.input_bytes * act_scale / batch_shards) / (tp if sp else 1)
    return min(checkpoint, kept), kept, matmul_s + alone_s, tp_fwd


def _sharded_saved(option: TPOption) -> SavedSplit:
    """The TP-sharded saved bytes by kind (all floating when the capture did not split them)."""
    return option.sharded_saved or SavedSplit(floating=option.sharded_saved_bytes)


def _sp_saved(option: TPOption) -> SavedSplit:
    return option.sp_saved or SavedSplit(floating=option.sp_saved_bytes)


def _tp_comm_s(layer: LayerInfo, is_tp: bool, sp: bool, mesh: Mesh, cluster: Cluster,
               scale: float) -> tuple[float, float]:
    """Forward and backward tensor-parallel collectives of one micro-batch."""
    if not is_tp:
        return 0.0, 0.0
    assert layer.tp is not None
    collectives: tuple[Collective, ...] = layer.tp.collectives
    if sp:
        assert layer.tp.sp_collectives is not None
        collectives = layer.tp.sp_collectives
    group = Group(mesh.tp, 1)
    times = {"fwd": 0.0, "bwd": 0.0}
    for c in collectives:  # each blocks the op after it, and waits its skew
        nbytes = c.nbytes * scale
        times[c.phase] += collective_s(c.kind, nbytes, group, cluster) + \
            cluster.device.skew_s(nbytes)
    return times["fwd"], times["bwd"]


def _async_tp_s(layer: LayerInfo, mesh: Mesh, cluster: Cluster, dtype: str,
                batch_shards: int, scale: float) -> tuple[float, float]:
    """Exposed forward and backward sequence-parallel collectives of one micro-batch under
    async TP: Inductor's micro-pipeline pass (torch/_inductor/fx_passes/micro_pipeline_tp.py)
    fuses an all-gather into the matmuls that read its output and a matmul into the
    reduce-scatter of its output, splitting each matmul into tp chunks along the tokens:

    - forward: each all-gather (one per gathered input: the colwise Linears of one parent,
      or one colwise Linear in the layer) beside those Linears; each reduce-scatter beside
      its rowwise Linear;
    - backward: each all-gather of a rowwise Linear's output gradient beside that Linear's
      input-gradient matmul; the reduce-scatter of a gathered input's gradient beside the
      input-gradient matmul of its colwise Linear when it has one. With several (q/k/v,
      SwiGLU's two) autograd sums their gradients first, no matmul feeds the reduce-scatter,
      and it stays exposed.

    A fused collective moves tp − 1 chunks while tp chunk-matmuls run, so (tp − 1)/tp of the
    matmuls' time hides it: exposed = max(0, comm − (tp − 1)/tp · matmuls). It also costs
    what splitting adds: the chunks' matmuls at their size (``cost_models.compute``'s
    size-dependent efficiency, m / tp tokens each) and their extra kernels, the copies
    through symmetric memory (an all-gather copies its shard into the shared workspace and
    into its output; a reduce-scatter sums the tp partial chunks it receives), and two
    barriers over the link. The chunks travel at the ring's bandwidth, as the plain
    collective does. Where the layer's collectives do not pair with its Linears as above,
    none is taken as hidden.
    """
    plain = _tp_comm_s(layer, True, True, mesh, cluster, scale)
    pairs = _sp_pairs(layer)
    assert layer.tp is not None and layer.tp.sp_collectives is not None, layer.name
    found = {(c.phase, c.kind): [x for x in layer.tp.sp_collectives
                                 if (x.phase, x.kind) == (c.phase, c.kind)]
             for c in layer.tp.sp_collectives}
    if pairs is None or any(len(found.get(key, ())) != len(want) for key, want in (
            (("fwd", "all_gather"), pairs[0]), (("fwd", "reduce_scatter"), pairs[1]),
            (("bwd", "reduce_scatter"), pairs[0]), (("bwd", "all_gather"), pairs[1]))):
        return plain
    groups, rows = pairs
    styles = layer.tp.styles
    gemms = {g.module: g for g in layer.gemms if not g.batched}
    tp, device, group = mesh.tp, cluster.device, Group(mesh.tp, 1)

    def seconds(c: Collective, modules: tuple[str, ...], fused: bool = True) -> float:
        nbytes = c.nbytes * scale
        comm = collective_s(c.kind, nbytes, group, cluster) + device.skew_s(nbytes)
        if not fused:
            return comm
        whole = chunked = 0.0
        for module in modules:
            g = gemms[module]
            m = g.m / batch_shards
            n, k = (g.n, g.k / tp) if styles.get(module) == "rowwise" else (g.n / tp, g.k)
            flops = g.flops / (batch_shards * tp)
            whole += roofline_s(flops, 0.0, 1, device, dtype, gemm_min_dim=min(m, n, k))
            chunked += roofline_s(flops, 0.0, tp, device, dtype,
                                  gemm_min_dim=min(m / tp, n, k))
        copied = 4 * nbytes / tp if c.kind == "all_gather" else nbytes + nbytes / tp
        staging = roofline_s(0.0, copied, 0, device, dtype) + 2 * cluster.intra_node.latency_s
        return max(0.0, comm - (tp - 1) / tp * chunked) + (chunked - whole) + staging

    fwd = (sum(seconds(c, g) for c, g in zip(found["fwd", "all_gather"], groups, strict=True))
           + sum(seconds(c, (r,)) for c, r in zip(found["fwd", "reduce_scatter"], rows,
                                                  strict=True)))
    bwd = (sum(seconds(c, g, fused=len(g) == 1) for c, g in zip(
        found["bwd", "reduce_scatter"], reversed(groups), strict=True))
           + sum(seconds(c, (r,)) for c, r in zip(found["bwd", "all_gather"],
                                                  reversed(rows), strict=True)))
    return fwd, bwd


def _sp_pairs(layer: LayerInfo) -> tuple[list[tuple[str, ...]], list[str]] | None:
    """A sequence-parallel layer's gathered inputs (each as the colwise Linears reading it)
    and its rowwise Linears, in the order its forward runs them (``runtime.tensor_parallel``
    gathers once per parent of colwise Linears, or at a colwise Linear in the layer itself);
    None when a TP Linear ran no matmul the capture recorded."""
    assert layer.tp is not None
    order = {g.module: i for i, g in reversed(list(enumerate(layer.gemms)))}
    groups: dict[str, list[str]] = {}
    rows: list[str] = []
    for module, style in sorted(layer.tp.styles.items(), key=lambda s: order.get(s[0], -1)):
        if style not in ("colwise", "rowwise"):
            continue
        if module not in order:
            return None
        if style == "rowwise":
            rows.append(module)
        else:
            groups.setdefault(module.rpartition(".")[0] or module, []).append(module)
    return [tuple(g) for g in groups.values()], rows


BATCH_NORM_STAT_BYTES = 4
"""BatchNorm statistics are all-reduced in float32 whatever the compute dtype."""


def batch_norm_sync_s(layer: LayerInfo, mesh: Mesh, cluster: Cluster) -> float:
    """BatchNorm's statistics all-reduces over the dp replicas in one direction of one
    micro-batch (runtime/batch_norm.py): per module, the channel sums with the sample
    count, then the channel sums of squared deviations; backward all-reduces their
    gradients, of the same sizes. Each blocks the op after it and waits its skew."""
    if mesh.dp == 1:
        return 0.0
    group = Group(mesh.dp, mesh.tp)
    total = 0.0
    for channels in layer.batch_norm_channels:
        for nbytes in ((channels + 1) * BATCH_NORM_STAT_BYTES, channels * BATCH_NORM_STAT_BYTES):
            total += all_reduce_s(nbytes, group, cluster) + cluster.device.skew_s(nbytes)
    return total


RING_MERGE_KERNELS = 4
"""Kernels of one ring step's log-sum-exp merge: the running max, two rescales, the sum."""


def _ring_attention(layer: LayerInfo, is_tp: bool, mesh: Mesh, cluster: Cluster,
                    scale: float, fwd_compute: float) -> Ring:
    """Ring attention of one micro-batch over the cp group (ranks tp apart in the mesh).

    Each of the cp − 1 steps sends this rank's current K/V block on while attending to it;
    the block's attention is 1 / cp of the rank's attention compute, which is the
    layer's roofline time scaled by attention's share of the FLOPs. What local attention
    does not pay: each step merges its partial output into the running one by log-sum-exp
    (memory-bound: read both, write one; RING_MERGE_KERNELS kernels), and in backward
    adds its query gradient into the running one.
    """
    cp = mesh.cp
    if cp == 1 or not layer.attention_kv_bytes:
        return Ring()
    block = layer.attention_kv_bytes * scale / (mesh.tp if is_tp else 1)  # TP splits heads
    share = layer.attention_fwd_flops / layer.fwd_flops if layer.fwd_flops else 0.0
    step_compute = share * fwd_compute / cp
    link = group_link(cluster, Group(cp, mesh.tp))
    out = block / 2  # the output (and query) block: one of K and V's shape
    device, dtype = cluster.device, "float32"  # the merge runs in fp32 (as flash attention)
    merge = roofline_s(0.0, 3 * out, RING_MERGE_KERNELS, device, dtype)
    fwd = (cp - 1) * (max(0.0, p2p_s(block, link) - step_compute) + merge)
    bwd = (cp - 1) * (max(0.0, p2p_s(2 * block, link) - 2 * step_compute) + merge)
    return Ring(fwd_s=fwd, bwd_s=bwd, buffers_bytes=4 * block)


def _dp_comm_s(s: StrategySpec, mesh: Mesh, cluster: Cluster, prec: Precision,
               tp_params: float, shards: int, unit_shares: tuple[float, ...] = (1.0,)
               ) -> DPComm:
    """Each gather and reduce-scatter with its skew (``Device.skew_s`` of its size): every
    rank waits for the others at each. A replicated gradient's all-reduce waits once per
    layer (``engine_costs.all_reduce_wait_s``). When each runs is the spec's ``gather`` and
    ``reduce`` (runtime.strategies). A layer in several FSDP2 units (``unit_shares``)
    gathers and reduces each unit's share apart, each collective with its latency."""
    dp, tp = mesh.replicas, mesh.tp
    group = Group(dp, tp) if s.tensor_parallel else Group(dp * tp, 1)
    links = cluster.fsdp_links()  # what the software's sharded collectives reach
    params = tp_params * prec.param_bytes
    grads = tp_params * prec.grad_bytes
    def skew(nbytes: float, *, at_step: bool = False) -> float:
        """Per micro-batch a collective sits between layers' compute; once per step, the
        layers' run back to back (``engine_costs.back_to_back_skew_s``)."""
        return back_to_back_skew_s(nbytes, cluster) if at_step else \
            cluster.device.skew_s(nbytes)

    def per_unit(collective, nbytes: float, group: Group, at_step: bool) -> float:
        total = 0.0
        for share in unit_shares:
            t = collective(nbytes * share, group, links)
            total += t + skew(nbytes * share, at_step=at_step) if t else 0.0
        return total

    def gather(group: Group, at_step: bool = False) -> float:
        return per_unit(all_gather_s, params, group, at_step)

    def scatter(group: Group, at_step: bool = False) -> float:
        return per_unit(reduce_scatter_s, grads, group, at_step)

    if not s.sharded:
        # Overlapped with backward; its wait for the other ranks is layer_cost's (it
        # cannot hide behind compute).
        return DPComm(0.0, 0.0, all_reduce_s(grads, group, cluster))
    if s.gather == "per_step":  # ZeRO-1/2: gathered once, kept through the micro-batches
        if mesh.pp > 1:
            # The schedule gathers every layer in the step's first forward and reduces it
            # once after the last micro-batch, whatever the ZeRO stage (runtime/pipeline.py).
            return DPComm(0.0, 0.0, gather(group, True) + scatter(group, True))
        # FSDP2 gathers in the step's first forward and, for ZeRO-1, reduce-scatters in the
        # last micro-batch's backward, each between two layers' compute.
        g = gather(group)
        if s.reduce == "per_step":
            r = scatter(group)
            return DPComm(0.0, 0.0, g + r, gather_per_step=g, reduce_per_step=r)
        return DPComm(0.0, scatter(group), g, gather_per_step=g)
    if s.hybrid:
        shard = Group(shards, 1)
        replicas = Group(dp * tp // shards, shards)
        # Reduce-scattered in the shard group every micro-batch (once in a pipeline, as
        # below), all-reduced across groups once (runtime/data_parallel.py).
        across = all_reduce_s(grads / shards, replicas, links)
        across += skew(grads / shards, at_step=True) if across else 0.0
        if mesh.pp > 1:
            return DPComm(gather(shard), 0.0, scatter(shard, True) + across)
        return DPComm(gather(shard), scatter(shard), across)
    # Gathered per use (FSDP2's default): for forward, resharded, gathered again for
    # backward; gradients are reduce-scattered every micro-batch and accumulated sharded.
    # Pipeline schedules reduce once, after the last micro-batch (their REDUCE_GRAD step).
    if mesh.pp > 1:
        return DPComm(gather(group), 0.0, scatter(group, True))
    return DPComm(gather(group), scatter(group), 0.0)


def _offload_s(local_params: float, param_tensors: int, prec: Precision, cluster: Cluster
               ) -> tuple[float, float, float]:
    """(host copies per micro-batch, per step, optimizer step on the host) of an offloaded
    layer: its parameter shard is copied to the device before each of the two gathers,
    its gradient shard back once per step, and Adam runs at host memory bandwidth, one
    tensor at a time (torch's AdamW on CPU tensors); link and bandwidth: ``Cluster.host``."""
    link, shard = cluster.host.link, local_params * prec.param_bytes
    per_micro = 2 * (shard / (link.bandwidth_GBps * 1e9) + link.latency_s)
    per_step = local_params * prec.grad_bytes / (link.bandwidth_GBps * 1e9)
    optimizer = optimizer_step_s(local_params, param_tensors, ADAM_KERNELS["adamw-for-loop"],
                                 cluster.device,
                                 bandwidth_GBps=cluster.host.memory_bandwidth_GBps)
    return per_micro, per_step, optimizer
