"""Time and memory of one layer under one option on one mesh.

The bridge between the layer records (passes.records) and the machine estimators
(cost_models): every number the ILP sees is made here, in seconds or bytes.

An *option* is a strategy (runtime/plan.py) with its per-layer choices of sequence
parallelism, offload and recomputation, written as one label (``runtime.plan.option_label``,
e.g. ``tp_fsdp+sp+full``).

Conventions:
- A layer that is not tensor-parallel computes redundantly inside its tp group, on the
  batch slice of its dp replica; its replicas span all ``dp * cp * tp`` ranks.
- Context parallelism splits every sample's sequence over ``cp`` ranks: per-token work and
  activations divide by cp like a batch split, parameters are replicated over cp like over
  dp (so data-parallel traffic and sharding run over ``dp * cp`` ranks), and attention runs
  as a ring: cp − 1 steps, each passing one K/V block to the next rank while attending to
  the block in hand, so a step costs the slower of the two (backward passes K/V and their
  gradients and computes twice as much).
- A TP layer splits its sharded FLOPs, parameters and saved activations by ``tp``; with
  sequence parallelism also the saved activations outside the TP regions.
- Data-parallel traffic follows the runtime (runtime/data_parallel.py): parameters are
  gathered in the compute dtype, gradients reduced in ``Precision.grad_bytes`` per element.
- Overlap (cost_models.overlap, factors from ``Cluster.overlap``), linearised per layer so
  the ILP stays linear: a layer's FSDP all-gather hides behind one layer's forward, and its
  backward gather and gradient reduce-scatter behind one layer's backward (FSDP2 prefetches
  the next layer's gather and reduces the previous layer's gradient while a layer
  computes); at pp = 1 its once-per-step gradient all-reduce (DDP buckets, HSDP across
  groups) hides behind one layer's backward of the last micro-batch, after what that
  window already hides. In a stack of identical layers "one layer" is the neighbour, whose
  compute equals this layer's; the stack's ends (the first gather, the last reduction) are
  not charged separately. Overlap slows the compute by σ, so hidden communication still
  costs C·(1 − 1/σ). Not overlapped: TP collectives (the next op needs their result),
  ZeRO-1's step-end collectives, pipelines' step-end reductions, host copies, and patterns
  in ``Overlap.exposed``. Ring attention overlaps its own steps (``_ring_attention``).

Memory per strategy, over the N ranks that shard it (P, G, K: the layer's parameter,
gradient and optimizer bytes on one rank before sharding; m micro-batches per step). G is
the gradient as backward computes it (the compute dtype); a reduced gradient held for the
optimizer (G in the resident column, but for zero1's and pipelines' unsharded
accumulation) is float32 in every precision (``Precision.held_grad_bytes``):

    strategy   resident                          transient (largest over the layers)
    replicate  P + G + K  (+ P gathered, float32)
    tp         P + G + K  (+ P gathered, float32)
    zero1      P + P/N + (G if m > 1 else G/N) + K/N   G if m = 1 (one layer's unsharded grad)
    zero2      P + P/N + G/N + K/N               G
    fsdp/hsdp  (P + G + K)/N                     2P + G (gathered layer, next one prefetched)
    +offload   nothing on the device             2P + G + P/N (the staged shard)

    pipelined (pp > 1), every strategy but replicate and tp:
    zero1/2    P + P/N + G + K/N                 max(P, G + G/N), collectives only
    fsdp/hsdp  P/N + G + K/N  (+ P gathered)     max(P, G + G/N), collectives only
    +offload   G  (+ P gathered)                 max(P, G + G/N) + P/N

Gathered (``LayerCost.gathered_bytes``): unsharded parameters FSDP2 holds beside the
resident ones from the layer's forward to the end of its backward (the liveness walk keeps
it for that long, autopar/planner/liveness.py). ``replicate`` and ``tp`` layers run on FSDP2
with a shard group of one rank (runtime/data_parallel.py) and ``reshard_after_forward=False``;
FSDP2 still copies each parameter into a separate unsharded tensor, in float32 a second P
(in low precision that copy is the P above, and the resident float32 shard is the master
copy inside K). A pure float32 DDP plan (runtime.data_parallel.uses_ddp) holds no such
copy, but that is a property of the whole plan, so the cost charges it and the walk drops
it under DDP. Under pipelining (runtime/pipeline.py) the schedule keeps every FSDP2 layer
gathered from the step's first forward to its last backward and accumulates its gradient
unsharded, reduced once after the last micro-batch (zero1 and zero2 already hold P). Its
transient is then only the collectives' flat buffers (``LayerCost.collective_buffer_bytes``):
the one all-gather's output (P; offloaded, with the shard staged on the device) in the
layer's first forward, the one reduce-scatter's input and output (G + G/N) after its last
backward.

Recomputation (Korthikanti et al. 2022): ``selective`` keeps the layer's inputs and the
outputs of runtime.plan.SELECTIVE_SAVE_OPS (weight matmuls, TP collectives) and runs the
rest again in backward (attention products, norms, activations, dropout); ``full`` keeps only
the layer's input and runs the whole forward (TP collectives included) again in backward.
Either way the freed activations come back, one layer at a time, during that layer's
backward: a transient.
A layer that modifies its inputs in place (``LayerInfo.inplace_input_bytes``) is recomputed
from a copy of them made before its forward, which nothing else holds: it keeps at least
that copy, made in its forward, and copies them once more for the rerun.

The loss is charged to the layer producing the model's output: one float32 copy of the
logits kept per micro-batch, two more as a transient in its backward (``loss_costs.loss_bytes``),
and its memory-bound passes over them in forward and backward (``loss_costs.loss_s``).

The optimizer step is Adam's passes over the parameters a rank holds, in the kernels the
cluster's software runs (``Cluster.optimizer``, cost_models/optimizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from autopar.planner.engine_costs import (
    all_reduce_wait_s,
    back_to_back_skew_s,
    engine_host_s,
    fsdp_copies_s,
)
from autopar.planner.loss_costs import loss_bytes, loss_s
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
from cost_models.hardware import Cluster, Device, Overlap
from cost_models.memory import Precision
from cost_models.optimizer import ADAM_KERNELS, optimizer_step_s
from cost_models.overlap import exposed_comm_s
from passes.records import CAPTURE_ACTIVATION_BYTES, Collective, LayerInfo, SavedSplit, TPOption
from runtime.plan import (
    OFFLOAD_STRATEGIES,
    RECOMPUTE,
    TP_STRATEGIES,
    Mesh,
    option_label,
    parse_option,
)

WGRAD_FRACTION = 0.5
"""Share of backward compute that computes weight gradients: a matmul's backward is two
matmuls of the forward's size, one for the input gradient and one for the weight gradient.
Zero-bubble schedules run it as a separate W pass."""

HOST_MEMORY_BYTES = 256 * 1024**3
"""Host memory one device may fill with offloaded states: a DGX A100 or H100 has 2 TB of
DRAM for 8 GPUs. (The copies' link and the host's bandwidth are the cluster's,
``Cluster.host``.)"""


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    option: str
    """The label of the option (strategy + SP / offload / recompute), e.g. 'fsdp+full'."""
    strategy: str
    recompute: str
    offload: bool
    sequence_parallel: bool
    microbatches: int
    fwd_s: float
    """Per micro-batch: forward compute, TP collectives, FSDP all-gather."""
    bwd_s: float
    """Per micro-batch: input-gradient compute, recomputation, TP collectives, FSDP
    all-gather, per-micro-batch gradient reduce-scatter (zero2)."""
    wgrad_s: float
    """Per micro-batch: weight-gradient compute."""
    step_s: float
    """Per step: data-parallel gradient reduction, once-per-step gathers and the optimizer."""
    compute_s: float
    """Per step, all compute (micro-batches, recomputation and optimizer)."""
    comm_s: float
    """Per step, communication not hidden behind compute, with the compute slowdown that
    overlapping causes (host copies of offloaded layers included)."""
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    """Saved activations of one micro-batch."""
    buffer_bytes: float
    """Transient memory while this layer runs (gathered parameters, an unsharded gradient,
    recomputed activations); the plan holds the largest over its layers, not the sum."""
    output_bytes: float
    """The layer's output for one micro-batch (what crosses a pipeline stage boundary)."""
    host_bytes: float = 0.0
    """States kept in host memory (offloaded parameters, gradients, optimizer states)."""
    hidden_comm_s: float = 0.0
    """Per step, communication hidden behind compute (net of the slowdown): comm_s plus
    this is all the communication the layer issues."""
    fsdp_only_s: float = 0.0
    """Per step, the part of compute_s that only FSDP2 does: its host time
    (``engine_costs.engine_host_s``) and its copies into and out of its collectives' buffers
    (``engine_costs.fsdp_copies_s``). A plan the runtime runs on DDP (search.runs_on_ddp) does neither."""
    fsdp_wait_s: float = 0.0
    """Per step, the part of comm_s a replicated layer's gradient all-reduce waits under
    FSDP2 and would not under DDP: FSDP2 issues it per layer and blocks on it (a whole
    skew each, ``engine_costs.all_reduce_wait_s``; exposed where ``Overlap.exposed`` has 'fsdp'), DDP
    waits once per bucket and overlaps its buckets by the 'dp' pattern. A plan run on DDP
    does not pay it (negative where DDP would hide less)."""
    loss_buffer_bytes: float = 0.0
    """Part of buffer_bytes that is the loss's backward (``loss_costs.loss_bytes``), on the layer
    producing the model's output: alive in its backward only (planner/liveness.py)."""
    gathered_bytes: float = 0.0
    """FSDP2's unsharded copy of parameters that also stay resident, alive from the layer's
    forward to the end of its backward (module docstring); in ``states_bytes``, so the
    ILP charges it."""
    collective_buffer_bytes: float = 0.0
    """Under pipelining, the part of buffer_bytes that is FSDP2's one all-gather and one
    reduce-scatter of the step: alive in the layer's first forward and last backward only
    (planner/liveness.py). 0 at pp = 1, where FSDP2 gathers in every pass."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def states_bytes(self) -> float:
        """Parameters (with FSDP2's gathered copy), gradients and optimizer states."""
        return self.params_bytes + self.gathered_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def resident_bytes(self) -> float:
        """States plus the activations of one micro-batch in flight."""
        return self.states_bytes + self.activations_bytes

    def resident_with(self, inflight: int) -> float:
        return self.states_bytes + inflight * self.activations_bytes


def on_ddp(cost: LayerCost) -> LayerCost:
    """A ``replicate`` layer's cost in a plan the runtime runs on DDP (a float32 plan of
    replicate layers at pp = 1, runtime.data_parallel.uses_ddp): none of FSDP2's host time,
    copies and per-layer waits, and one copy of the parameters, not FSDP2's two."""
    assert cost.strategy == "replicate", cost.option
    return replace(cost, compute_s=cost.compute_s - cost.fsdp_only_s,
                   comm_s=cost.comm_s - cost.fsdp_wait_s, gathered_bytes=0.0,
                   fsdp_only_s=0.0, fsdp_wait_s=0.0)


def allowed_strategies(layer: LayerInfo, mesh: Mesh, *, hsdp_shard_size: int | None = None,
                       microbatches: int = 1) -> tuple[str, ...]:
    """Strategies this layer can take on this mesh. ZeRO-1 differs from ZeRO-2 only when
    gradients accumulate over micro-batches (FSDP2 reduce-scatters each layer's gradient
    as soon as its last backward ends), so it is offered only then."""
    world = mesh.replicas * mesh.tp
    options = ["replicate"]
    if world > 1:
        options += ["zero1", "zero2"] if microbatches > 1 else ["zero2"]
    options.append("fsdp")
    if hsdp_shard_size and 1 < hsdp_shard_size < world and world % hsdp_shard_size == 0:
        options.append("hsdp")
    if mesh.tp > 1 and layer.tp is not None and all(d % mesh.tp == 0 for d in layer.tp.divisors):
        options += ["tp", "tp_fsdp"] if mesh.replicas > 1 else ["tp"]
    return tuple(options)


def allowed_options(layer: LayerInfo, mesh: Mesh, *, seq_len: int | None = None,
                    hsdp_shard_size: int | None = None, microbatches: int = 1,
                    recompute: bool = True, offload: bool = True,
                    sequence_parallel: bool = True, selective: bool = True
                    ) -> tuple[str, ...]:
    """Every option label this layer can take: strategies × SP × offload × recompute
    (``selective`` False: not selective recomputation, e.g. under a split-backward pipeline
    schedule, runtime.plan.SPLIT_BACKWARD_SCHEDULES)."""
    modes = [r for r in RECOMPUTE if recompute or r == "none"]
    if not selective or layer.selective_saved_bytes + layer.selective_fixed_bytes <= 0:
        modes = [r for r in modes if r != "selective"]
    can_sp = (sequence_parallel and layer.tp is not None and layer.tp.sp_collectives is not None
              and seq_len is not None and seq_len % mesh.tp == 0)
    out = []
    for strategy in allowed_strategies(layer, mesh, hsdp_shard_size=hsdp_shard_size,
                                       microbatches=microbatches):
        for sp in (False, True) if strategy in TP_STRATEGIES and can_sp else (False,):
            for off in (False, True) if offload and strategy in OFFLOAD_STRATEGIES else (False,):
                out += [option_label(strategy, r, off, sp) for r in modes]
    return tuple(out)


def undominated(costs: dict[str, LayerCost], terms) -> dict[str, LayerCost]:
    """The options no other option matches or beats in every one of ``terms(cost)``
    (smaller is better), keeping the first of exact ties."""
    keys = list(costs)
    if len(keys) < 2:
        return dict(costs)
    # All pairs at once (the planner prunes ~20 options per layer thousands of times):
    # no_worse[j, i]: option j matches or beats option i in every term.
    values = np.array([terms(costs[k]) for k in keys], dtype=float)
    no_worse = (values[:, None, :] <= values[None, :, :]).all(axis=2)
    same = (values[:, None, :] == values[None, :, :]).all(axis=2)
    earlier = ~np.tri(len(keys), dtype=bool)  # earlier[j, i]: j < i
    beaten = no_worse & (~same | earlier)
    np.fill_diagonal(beaten, False)
    return {k: costs[k] for k, out in zip(keys, beaten.any(axis=0), strict=True) if not out}


def prune_dominated(costs: dict[str, LayerCost]) -> dict[str, LayerCost]:
    """Drop options no better than another in every time and memory term (the ILP and the
    pipeline simulator could never prefer them), or in compute: of two equally fast options
    the one computing less is kept (ilp.least_work prefers it when memory allows)."""
    return undominated(costs, lambda c: (c.fwd_s, c.bwd_s, c.wgrad_s, c.step_s, c.time_s,
                                         c.states_bytes, c.activations_bytes, c.buffer_bytes,
                                         c.host_bytes, c.compute_s))


def layer_cost(
    layer: LayerInfo,
    option: str,
    mesh: Mesh,
    cluster: Cluster,
    prec: Precision,
    microbatches: int = 1,
    *,
    hsdp_shard_size: int | None = None,
) -> LayerCost:
    choice = parse_option(option)
    strategy, recompute = choice["strategy"], choice["recompute"]
    offload, sp = choice["offload"], choice["sequence_parallel"]
    # Context parallelism splits samples like data parallelism splits the batch: both are
    # replicas of the parameters, each on 1 / (dp · cp) of the tokens.
    dp, tp, m = mesh.replicas, mesh.tp, microbatches
    is_tp = strategy in TP_STRATEGIES
    act_scale = prec.activation_bytes / CAPTURE_ACTIVATION_BYTES

    # Parameters this rank holds before any data-parallel sharding.
    if is_tp:
        assert layer.tp is not None
        frac = layer.tp.sharded_param_bytes / layer.param_bytes if layer.param_bytes else 0.0
        tp_params = layer.param_count * (1 - frac + frac / tp)
    else:
        tp_params = float(layer.param_count)
    shards = shard_ranks(strategy, dp, tp, hsdp_shard_size)
    local_params = tp_params / shards

    # One micro-batch is 1 / (dp · m) of the captured global batch.
    fwd_flops = _local_flops(layer, is_tp, dp * m, tp)
    ratio = fwd_flops / layer.fwd_flops if layer.fwd_flops else 1.0 / (dp * m)
    device, dtype = cluster.device, prec.compute_dtype
    # Matmul traffic hides under their compute (one roofline); memory-bound kernels (norms,
    # activations, dropout) run alone at memory bandwidth (passes/memory_bound.py).
    mem = (layer.mem_bytes - layer.memory_bound_bytes) * ratio * act_scale
    alone = _memory_bound_bytes(layer, is_tp, sp, tp) * act_scale / (dp * m)
    # Small GEMMs run below the large-GEMM rate: their shortfall in asymptote FLOPs, the
    # same share of backward (two GEMMs over the same dims per forward GEMM).
    short = (_gemm_shortfall(layer, is_tp, fwd_flops, dp * m, tp, device, dtype)
             + _attention_shortfall(layer, is_tp, dp * m, tp, device))
    bwd_short = short * layer.bwd_flops / layer.fwd_flops if layer.fwd_flops else 0.0
    fwd_matmul = roofline_s(fwd_flops + short, mem, layer.num_ops, device, dtype)
    fwd_alone = roofline_s(0.0, alone, 0, device, dtype)
    loss_fwd, loss_bwd = loss_s(layer, dp * m, prec, device)
    # Recomputing a layer that modifies its inputs in place copies them before its forward
    # and again for the rerun (runtime/recompute.py); each copy reads and writes them.
    inplace = (0.0 if recompute == "none" else
               layer.inplace_input_bytes * act_scale / (dp * m) / (tp if sp else 1))
    copy_s = roofline_s(0.0, 2 * inplace, 0, device, dtype) if inplace else 0.0
    fwd_compute = fwd_matmul + fwd_alone + loss_fwd + copy_s
    bwd_compute = (roofline_s(layer.bwd_flops * ratio + bwd_short, 2 * mem, 2 * layer.num_ops,
                              device, dtype)
                   + roofline_s(0.0, 2 * alone, 0, device, dtype) + loss_bwd)

    tp_fwd, tp_bwd = _tp_comm_s(layer, is_tp, sp, mesh, cluster, act_scale / (dp * m))
    ring = _ring_attention(layer, is_tp, mesh, cluster, act_scale / (dp * m), fwd_compute)
    tp_fwd, tp_bwd = tp_fwd + ring.fwd_s, tp_bwd + ring.bwd_s
    batch_norm = batch_norm_sync_s(layer, mesh, cluster)
    tp_fwd, tp_bwd = tp_fwd + batch_norm, tp_bwd + batch_norm
    activations, rematerialized, recompute_s, recompute_comm = _activations(
        layer, recompute, is_tp, sp, tp, dp * m, act_scale, fwd_matmul, fwd_alone, tp_fwd)
    if inplace:  # the copy is the layer's alone, held to backward; the rerun copies it again
        activations, rematerialized = max(activations, inplace), rematerialized + inplace
        recompute_s += copy_s
    loss_kept, loss_transient = loss_bytes(layer, dp * m, pipelined=mesh.pp > 1)
    dp_comm = _dp_comm_s(strategy, mesh, cluster, prec, tp_params, shards)
    host = _offload_s(local_params, layer.param_tensors, prec, cluster) if offload else (
        0.0, 0.0, 0.0)
    host_per_micro, host_per_step, host_optimizer = host
    if offload:
        optimizer = host_optimizer
    else:
        optimizer = optimizer_step_s(local_params, layer.param_tensors, cluster.adam_kernels,
                                     device)
    engine_micro, engine_step = engine_host_s(layer, is_tp, sp, cluster)
    copies_micro, copies_step = fsdp_copies_s(strategy, m, mesh.pp > 1, tp_params, shards,
                                               prec, device)
    engine_micro += copies_micro
    optimizer += engine_step + copies_step
    states = _states_bytes(strategy, offload, tp_params, shards, m, prec,
                           pipelined=mesh.pp > 1)
    # FSDP2's copies and hooks run on the compute stream between the layer's kernels.
    windows = dict(fwd_window=fwd_compute + engine_micro / 2,
                   bwd_window=bwd_compute + recompute_s + engine_micro / 2)
    hidden = _hidden_comm_s(strategy, mesh, cluster.overlap, dp_comm, **windows)
    per_micro_comm = (tp_fwd + tp_bwd + recompute_comm + 2 * dp_comm.gather_per_micro
                      + dp_comm.reduce_per_micro + host_per_micro - hidden.fwd - hidden.bwd)
    wait, ddp_saving = all_reduce_wait_s(strategy, mesh, cluster, prec, tp_params)
    if strategy == "replicate":  # DDP's buckets may hide more than FSDP2's reduction
        ddp_saving += _hidden_comm_s(strategy, mesh, cluster.overlap, dp_comm, ddp=True,
                                     **windows).step - hidden.step
    per_step_comm = dp_comm.per_step + host_per_step - hidden.step + wait
    return LayerCost(
        option=option_label(strategy, recompute, offload, sp),
        strategy=strategy, recompute=recompute, offload=offload, sequence_parallel=sp,
        microbatches=m,
        fwd_s=(fwd_compute + tp_fwd + dp_comm.gather_per_micro - hidden.fwd + host_per_micro / 2
               + engine_micro / 2),
        bwd_s=((1 - WGRAD_FRACTION) * bwd_compute + recompute_s + recompute_comm + tp_bwd
               + dp_comm.gather_per_micro + dp_comm.reduce_per_micro - hidden.bwd
               + host_per_micro / 2 + engine_micro / 2),
        wgrad_s=WGRAD_FRACTION * bwd_compute,
        step_s=per_step_comm + optimizer,
        compute_s=m * (fwd_compute + bwd_compute + recompute_s + engine_micro) + optimizer,
        comm_s=m * per_micro_comm + per_step_comm,
        params_bytes=states[0],
        grads_bytes=states[1],
        optimizer_bytes=states[2],
        activations_bytes=activations + loss_kept,
        buffer_bytes=states[3] + rematerialized + ring.buffer_bytes + loss_transient,
        output_bytes=layer.output_bytes * act_scale / (dp * m) / (tp if sp else 1),
        host_bytes=local_params * prec.state_bytes if offload else 0.0,
        hidden_comm_s=m * (hidden.fwd + hidden.bwd) + hidden.step,
        loss_buffer_bytes=loss_transient,
        fsdp_only_s=(m * (cluster.device.fsdp_overhead_s + copies_micro) + engine_step
                     + copies_step),
        fsdp_wait_s=ddp_saving,
        gathered_bytes=states[4],
        collective_buffer_bytes=states[3] if mesh.pp > 1 else 0.0,
    )


def shard_ranks(strategy: str, dp: int, tp: int, hsdp_shard_size: int | None) -> int:
    if strategy == "hsdp":
        if not hsdp_shard_size:
            raise ValueError("strategy 'hsdp' needs hsdp_shard_size")
        return hsdp_shard_size
    return {"replicate": 1, "tp": 1, "tp_fsdp": dp}.get(strategy, dp * tp)


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
    dtype, masks do not; the TP-sharded part divides by tp, and with SP so does the part
    run on sequence shards. Selective recomputation frees its share of each part and reruns
    the ops outside SELECTIVE_SAVE_OPS: the attention products (their share of the matmul
    time) and every memory-bound kernel (``alone_s``).
    """
    def on_rank(split: SavedSplit, divisor: int) -> tuple[float, float]:
        kept = (split.floating * act_scale + split.fixed) / (batch_shards * divisor)
        freed = (split.freed * act_scale + split.freed_fixed) / (batch_shards * divisor)
        return kept, freed

    parts = [(layer.saved, 1)]
    if is_tp:
        assert layer.tp is not None
        sharded = [(_sharded_saved(layer.tp), tp)]
        if sp:
            sharded.append((_sp_saved(layer.tp), tp))
        parts = [(layer.saved - sum((s for s, _ in sharded), SavedSplit()), 1), *sharded]
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


@dataclass(frozen=True)
class _Ring:
    fwd_s: float = 0.0
    """Exposed transfer time of the forward ring (per micro-batch)."""
    bwd_s: float = 0.0
    buffer_bytes: float = 0.0
    """K/V blocks in hand and arriving, with their gradients in backward: 4 blocks."""


def _ring_attention(layer: LayerInfo, is_tp: bool, mesh: Mesh, cluster: Cluster,
                    scale: float, fwd_compute: float) -> _Ring:
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
        return _Ring()
    block = layer.attention_kv_bytes * scale / (mesh.tp if is_tp else 1)  # TP splits heads
    share = layer.attention_fwd_flops / layer.fwd_flops if layer.fwd_flops else 0.0
    step_compute = share * fwd_compute / cp
    link = group_link(cluster, Group(cp, mesh.tp))
    out = block / 2  # the output (and query) block: one of K and V's shape
    device, dtype = cluster.device, "float32"  # the merge runs in fp32 (as flash attention)
    merge = roofline_s(0.0, 3 * out, RING_MERGE_KERNELS, device, dtype)
    fwd = (cp - 1) * (max(0.0, p2p_s(block, link) - step_compute) + merge)
    bwd = (cp - 1) * (max(0.0, p2p_s(2 * block, link) - 2 * step_compute) + merge)
    return _Ring(fwd_s=fwd, bwd_s=bwd, buffer_bytes=4 * block)


@dataclass(frozen=True)
class _DPComm:
    gather_per_micro: float
    """One parameter all-gather, issued before forward and again before backward."""
    reduce_per_micro: float
    per_step: float


def _dp_comm_s(strategy: str, mesh: Mesh, cluster: Cluster, prec: Precision,
               tp_params: float, shards: int) -> _DPComm:
    """Each gather and reduce-scatter with its skew (``Device.skew_s`` of its size): every
    rank waits for the others at each. A replicated gradient's all-reduce waits once per
    layer (``engine_costs.all_reduce_wait_s``)."""
    dp, tp = mesh.replicas, mesh.tp
    group = Group(dp, tp) if strategy in TP_STRATEGIES else Group(dp * tp, 1)
    params = tp_params * prec.param_bytes
    grads = tp_params * prec.grad_bytes
    def skew(nbytes: float, *, at_step: bool = False) -> float:
        """Per micro-batch a collective sits between layers' compute; once per step, the
        layers' run back to back (``engine_costs.back_to_back_skew_s``)."""
        return back_to_back_skew_s(nbytes, cluster) if at_step else \
            cluster.device.skew_s(nbytes)

    def gather(group: Group, at_step: bool = False) -> float:
        t = all_gather_s(params, group, cluster)
        return t + skew(params, at_step=at_step) if t else 0.0

    def scatter(group: Group, at_step: bool = False) -> float:
        t = reduce_scatter_s(grads, group, cluster)
        return t + skew(grads, at_step=at_step) if t else 0.0

    if strategy in ("replicate", "tp"):
        # Overlapped with backward; its wait for the other ranks is layer_cost's (it
        # cannot hide behind compute).
        return _DPComm(0.0, 0.0, all_reduce_s(grads, group, cluster))
    if strategy == "zero1":
        return _DPComm(0.0, 0.0, gather(group, True) + scatter(group, True))
    if strategy == "zero2":
        return _DPComm(0.0, scatter(group), gather(group, True))
    if strategy == "hsdp":
        shard = Group(shards, 1)
        replicas = Group(dp * tp // shards, shards)
        # Reduce-scattered in the shard group every micro-batch (once in a pipeline, as
        # fsdp below), all-reduced across groups once (runtime/data_parallel.py).
        across = all_reduce_s(grads / shards, replicas, cluster)
        across += skew(grads / shards, at_step=True) if across else 0.0
        if mesh.pp > 1:
            return _DPComm(gather(shard), 0.0, scatter(shard, True) + across)
        return _DPComm(gather(shard), scatter(shard), across)
    # fsdp / tp_fsdp (FSDP2 default): gather for forward, reshard, gather again for
    # backward; gradients are reduce-scattered every micro-batch and accumulated sharded.
    # Pipeline schedules reduce once, after the last micro-batch (their REDUCE_GRAD step).
    if mesh.pp > 1:
        return _DPComm(gather(group), 0.0, scatter(group, True))
    return _DPComm(gather(group), scatter(group), 0.0)


@dataclass(frozen=True)
class _Hidden:
    """Communication hidden behind compute, net of the slowdown (seconds)."""

    fwd: float = 0.0
    """Per micro-batch, in forward."""
    bwd: float = 0.0
    """Per micro-batch, in backward."""
    step: float = 0.0
    """Per step: of the once-per-step gradient reduction."""


FSDP_RUN = ("zero2", "fsdp", "hsdp", "tp_fsdp")
"""Strategies whose per-micro-batch gathers and reduce-scatters FSDP2 issues around each
layer's compute (zero1 gathers and reduces once per step, around the optimizer)."""


def _hidden_comm_s(strategy: str, mesh: Mesh, overlap: Overlap, comm: _DPComm, *,
                   fwd_window: float, bwd_window: float, ddp: bool = False) -> _Hidden:
    """What of the layer's data-parallel communication hides behind one layer's compute
    (the module docstring's linearisation; cost_models.overlap for one window).

    The all-reduce of a replicated layer's gradients overlaps as its engine runs it: DDP's
    buckets (``ddp``: the 'dp' pattern), or FSDP2's per-layer reduction (the 'fsdp'
    pattern: FSDP2 runs tp layers, and replicate ones in every plan but DDP's)."""
    def hidden(window: float, c: float, pattern: str, sigma: float) -> float:
        if c <= 0 or pattern in overlap.exposed:
            return 0.0
        return c - exposed_comm_s(window, c, slowdown=sigma)

    fwd = bwd = 0.0
    fsdp_bwd = 0.0
    if strategy in FSDP_RUN:
        sigma = overlap.fsdp_slowdown
        fwd = hidden(fwd_window, comm.gather_per_micro, "fsdp", sigma)
        fsdp_bwd = comm.gather_per_micro + comm.reduce_per_micro
        bwd = hidden(bwd_window, fsdp_bwd, "fsdp", sigma)
    step = 0.0
    # The once-per-step all-reduce (DDP's buckets; HSDP's across groups) runs beside the last
    # micro-batch's backward at pp = 1; pipelines reduce after their schedule ends.
    if mesh.pp == 1 and strategy in ("replicate", "tp", "hsdp") and comm.per_step > 0:
        pattern = "dp" if ddp and strategy == "replicate" else "fsdp"
        sigma = overlap.dp_slowdown if pattern == "dp" else overlap.fsdp_slowdown
        both = hidden(bwd_window, fsdp_bwd + comm.per_step, pattern, sigma)
        step = max(0.0, both - bwd)
    return _Hidden(fwd=fwd, bwd=bwd, step=step)


def _states_bytes(strategy: str, offload: bool, tp_params: float, shards: int, m: int,
                  prec: Precision, *, pipelined: bool = False
                  ) -> tuple[float, float, float, float, float]:
    """(params, grads, optimizer, transient, gathered) bytes on the device; see the module
    table. ``pipelined``: pp > 1."""
    p = tp_params * prec.param_bytes
    g = tp_params * prec.grad_bytes  # an unsharded gradient, as backward computes it
    held = tp_params * prec.held_grad_bytes  # the reduced gradient the optimizer steps
    k = tp_params * prec.optimizer_bytes
    n = shards
    if strategy in ("replicate", "tp"):
        return p, held, k, 0.0, (p if prec.name == "float32" else 0.0)
    if pipelined:
        collectives = max(p, g + g / n)
        if strategy in ("zero1", "zero2"):
            return p + p / n, g, k / n, collectives, 0.0
        if offload:
            return 0.0, g, 0.0, collectives + p / n, p
        return p / n, g, k / n, collectives, p
    if strategy == "zero1":
        return p + p / n, (g if m > 1 else held / n), k / n, (0.0 if m > 1 else g), 0.0
    if strategy == "zero2":
        return p + p / n, held / n, k / n, g, 0.0
    if offload:
        return 0.0, 0.0, 0.0, 2 * p + g + p / n, 0.0
    return p / n, held / n, k / n, 2 * p + g, 0.0


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


def hsdp_shard_size(cluster: Cluster, pp: int = 1) -> int | None:
    """HSDP shards inside a node and replicates across nodes: the shard group is a node,
    when a stage spans more than one."""
    per_stage = cluster.world_size // pp
    size = cluster.devices_per_node
    return size if 1 < size < per_stage and per_stage % size == 0 else None


def layer_options(layer: LayerInfo, seq_len: int | None, mesh: Mesh, cluster: Cluster,
                  prec: Precision, microbatches: int = 1, *, selective: bool = True
                  ) -> dict[str, LayerCost]:
    """Every option of one layer with its cost, dominated options removed."""
    hsdp = hsdp_shard_size(cluster, mesh.pp)
    labels = allowed_options(layer, mesh, seq_len=seq_len, hsdp_shard_size=hsdp,
                             microbatches=microbatches, selective=selective,
                             offload=cluster.host.offload)
    return prune_dominated({
        o: layer_cost(layer, o, mesh, cluster, prec, microbatches, hsdp_shard_size=hsdp)
        for o in labels})
