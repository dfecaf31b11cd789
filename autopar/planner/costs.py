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
  costs C·(1 − 1/σ). A ZeRO-1/2 layer's (``zero1``, ``zero2``, ``tp_zero1``, ``tp_zero2``)
  once-per-step all-gather runs in the step's first forward (FSDP2 reshards it after the
  last backward, so the optimizer steps the shard and the next step gathers the update)
  and hides behind one layer's forward there; ZeRO-1's once-per-step reduce-scatter runs
  in the last micro-batch's backward and hides behind one layer's backward, as Megatron-LM's
  distributed optimizer overlaps them (``--overlap-param-gather``, ``--overlap-grad-reduce``).
  Not overlapped: TP collectives (the next op needs their result) but under async TP,
  which overlaps sequence parallelism's with the layer's own matmuls
  (``estimators.async_tp_comm_s``), pipelines' step-end
  reductions and, under pipelining, the step's gathers (priced once per step, exposed),
  host copies, and patterns in ``Overlap.exposed``. Ring attention overlaps its own steps
  (``_ring_attention``).

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
    fsdp/hsdp  (P + G + K)/N                     2P + G (gathered layer, next one prefetched:
                                                 priced as P, the walk takes the real one)
    +offload   nothing on the device             2P + G + P/N (the staged shard)

    pipelined (pp > 1), every strategy but replicate and tp:
    zero1/2    P + P/N + G + K/N                 max(P, G + G/N), collectives only
    fsdp/hsdp  P/N + G + K/N  (+ P gathered)     max(P, G + G/N), collectives only
    +offload   G  (+ P gathered)                 max(P, G + G/N) + P/N

``fsdp_modules`` shards a layer as several FSDP2 units (``unit_shares``): in the transient
column P and G are then its largest unit's (one gathered, the next prefetched, one
unsharded gradient), and each unit's collectives are priced apart, each with its latency.

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

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from autopar.planner.engine_costs import (
    all_reduce_wait_s,
    engine_host_s,
    fsdp_copies_s,
)
from autopar.planner.estimators import (
    ANALYTIC,
    CostContext,
    DPComm,
    Estimators,
    Offload,
    batch_norm_sync_s,
)
from autopar.planner.loss_costs import loss_bytes
from autopar.planner.moe_costs import moe_layer_cost, runnable, with_expert_parallel
from cost_models.compute import roofline_s
from cost_models.hardware import Cluster, Overlap
from cost_models.memory import MemoryTerms, Precision
from cost_models.optimizer import optimizer_step_s
from cost_models.overlap import exposed_comm_s
from passes.records import LayerInfo
from runtime import async_tp
from runtime.plan import RECOMPUTE, Mesh, option_label, parse_option
from runtime.strategies import STRATEGY_SPECS, StrategySpec, spec

WGRAD_FRACTION = 0.5
"""Share of backward compute that computes weight gradients: a matmul's backward is two
matmuls of the forward's size, one for the input gradient and one for the weight gradient.
Zero-bubble schedules run it as a separate W pass."""

HOST_MEMORY_BYTES = 256 * 1024**3
"""Host memory one device may fill with offloaded states: a DGX A100 or H100 has 2 TB of
DRAM for 8 GPUs. (The copies' link and the host's bandwidth are the cluster's,
``Cluster.host``.)"""


@dataclass(frozen=True, kw_only=True)
class LayerCost(MemoryTerms):
    """One option of one layer: time terms, the memory terms (cost_models.memory.MemoryTerms,
    restated here because every one must be given), and what the engines add to them."""

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
    buffers_bytes: float
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
    (``engine_costs.fsdp_copies_s``). A plan the runtime runs on DDP (engine.runs_on_ddp) does neither."""
    fsdp_wait_s: float = 0.0
    """Per step, the part of comm_s a replicated layer's gradient all-reduce waits under
    FSDP2 and would not under DDP: FSDP2 issues it per layer and blocks on it (a whole
    skew each, ``engine_costs.all_reduce_wait_s``; exposed where ``Overlap.exposed`` has 'fsdp'), DDP
    waits once per bucket and overlaps its buckets by the 'dp' pattern. A plan run on DDP
    does not pay it (negative where DDP would hide less)."""
    loss_buffer_bytes: float = 0.0
    """Part of buffers_bytes that is the loss's backward (``loss_costs.loss_bytes``), on the layer
    producing the model's output: alive in its backward only (planner/liveness.py)."""
    gathered_bytes: float = 0.0
    """FSDP2's unsharded copy of parameters that also stay resident, alive from the layer's
    forward to the end of its backward (module docstring); in ``states_bytes``, so the
    ILP charges it."""
    collective_buffer_bytes: float = 0.0
    """Under pipelining, the part of buffers_bytes that is FSDP2's one all-gather and one
    reduce-scatter of the step: alive in the layer's first forward and last backward only
    (planner/liveness.py). 0 at pp = 1, where FSDP2 gathers in every pass."""
    prefetch_bytes: float = 0.0
    """The part of buffers_bytes that stands for the next layer's parameters, which FSDP2
    gathers while this one runs, priced at this layer's own gathered size P (fsdp-like
    layers at pp = 1; 0 otherwise). A layer prices alone, so it cannot know its neighbour;
    the liveness walk can, and charges the neighbour's where that is smaller (rule 6)."""
    expert_parallel: int = 1
    """The expert-parallel degree of the layer's MoE blocks (autopar/planner/moe_costs.py)."""
    async_tp: bool = False
    """Its sequence-parallel collectives overlap its matmuls (PyTorch's async TP)."""

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
    assert spec(cost.strategy).ddp, cost.option
    return replace(cost, compute_s=cost.compute_s - cost.fsdp_only_s,
                   comm_s=cost.comm_s - cost.fsdp_wait_s, gathered_bytes=0.0,
                   fsdp_only_s=0.0, fsdp_wait_s=0.0)


def allowed_strategies(layer: LayerInfo, mesh: Mesh, *, hsdp_shard_size: int | None = None,
                       microbatches: int = 1, tie: str | None = None) -> tuple[str, ...]:
    """Strategies this layer can take on this mesh (each spec's ``unavailable``); ``tie``
    describes the tied weights the layer shares, if any."""
    tp_split = layer.tp is not None and all(d % mesh.tp == 0 for d in layer.tp.divisors)
    return tuple(name for name, s in STRATEGY_SPECS.items()
                 if s.unavailable(replicas=mesh.replicas, tp=mesh.tp, microbatches=microbatches,
                                  hsdp_shard_size=hsdp_shard_size, tp_split=tp_split,
                                  tie=tie, module_units=module_unit_count(layer)) is None)


def module_unit_count(layer: LayerInfo) -> int | None:
    """The layer's module units ``fsdp_modules`` may shard it as; None for a
    mixture-of-experts layer, whose experts the planner prices apart (moe_costs)."""
    return None if layer.moe else len(layer.module_units)


def allowed_options(layer: LayerInfo, mesh: Mesh, *, seq_len: int | None = None,
                    hsdp_shard_size: int | None = None, microbatches: int = 1,
                    recompute: bool = True, offload: bool = True,
                    sequence_parallel: bool = True, selective: bool = True,
                    async_tp: bool = False) -> tuple[str, ...]:
    """Every option label this layer can take: strategies × SP (× async TP) × offload ×
    recompute (``selective`` False: not selective recomputation, e.g. under a split-backward
    pipeline schedule, runtime.plan.SPLIT_BACKWARD_SCHEDULES; ``async_tp``: the cluster can
    run async TP, ``async_tp_offered``)."""
    modes = [r for r in RECOMPUTE if recompute or r == "none"]
    if not selective or layer.selective_saved_bytes + layer.selective_fixed_bytes <= 0:
        modes = [r for r in modes if r != "selective"]
    can_sp = (sequence_parallel and layer.tp is not None and layer.tp.sp_collectives is not None
              and seq_len is not None and seq_len % mesh.tp == 0
              and (layer.tp.sp_seq_len or seq_len) % mesh.tp == 0)
    out = []
    for strategy in allowed_strategies(layer, mesh, hsdp_shard_size=hsdp_shard_size,
                                       microbatches=microbatches):
        s = spec(strategy)
        for sp in (False, True) if s.tensor_parallel and can_sp else (False,):
            for overlap in (False, True) if sp and async_tp else (False,):
                for off in (False, True) if offload and s.offloadable else (False,):
                    out += [option_label(strategy, r, off, sp, async_tp=overlap)
                            for r in modes]
    return with_expert_parallel(layer, mesh, tuple(out), microbatches=microbatches)


def async_tp_offered(cluster: Cluster, mesh: Mesh) -> bool:
    """The cluster's tp groups on this mesh can run PyTorch's async TP
    (``runtime.async_tp.cluster_problem``), so SP options come with and without it."""
    return mesh.tp > 1 and async_tp.cluster_problem(cluster, mesh.tp) is None


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
                                         c.states_bytes, c.activations_bytes, c.buffers_bytes,
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
    estimators: Estimators = ANALYTIC,
    shared: dict | None = None,
) -> LayerCost:
    """One layer's time and memory under one option, composed from ``estimators``.

    ``shared``: the parts of this layer's cost that its options on this mesh and micro-batch
    count have in common, filled as they are priced (``layer_options`` passes one per layer,
    mesh and micro-batch count). A layer's ~40 options share a handful of compute times and
    collectives: the analytic estimators' results depend on the option only through the
    fields ``_once``'s keys name, so each is computed once per key. Other estimators may
    read any field of the option: with them nothing is shared."""
    if layer.moe:  # its experts priced apart, at the option's expert-parallel degree
        return moe_layer_cost(layer, option, mesh, cluster, prec, microbatches,
                              hsdp_shard_size=hsdp_shard_size,
                              layer_cost=functools.partial(layer_cost, estimators=estimators),
                              all_to_all=estimators.expert_all_to_all)
    choice = parse_option(option)
    strategy, recompute = choice["strategy"], choice["recompute"]
    offload, sp, overlap = choice["offload"], choice["sequence_parallel"], choice["async_tp"]
    if overlap and (problem := async_tp.cluster_problem(cluster, mesh.tp)):
        raise ValueError(f"layer {layer.name!r}: option {option!r} asks for async TP, but "
                         f"{problem}")
    s = spec(strategy)
    shares = unit_shares(layer, s)
    ctx = CostContext(mesh=mesh, cluster=cluster, prec=prec, microbatches=microbatches,
                      strategy=s, recompute=recompute, offload=offload, sequence_parallel=sp,
                      hsdp_shard_size=hsdp_shard_size, async_tp=overlap, unit_shares=shares)
    dp, tp, m = mesh.replicas, mesh.tp, microbatches
    is_tp, act_scale, device = s.tensor_parallel, ctx.act_scale, cluster.device

    # Parameters this rank holds before any data-parallel sharding.
    if is_tp:
        assert layer.tp is not None
        frac = layer.tp.sharded_param_bytes / layer.param_bytes if layer.param_bytes else 0.0
        tp_params = layer.param_count * (1 - frac + frac / tp)
    else:
        tp_params = float(layer.param_count)
    shards = s.shard_ranks(dp, tp, hsdp_shard_size)
    local_params = tp_params / shards
    once = _Once(shared if estimators is ANALYTIC else None)

    compute = once(("compute", is_tp, sp), estimators.compute, layer, ctx)
    # Recomputing a layer that modifies its inputs in place copies them before its forward
    # and again for the rerun (runtime/recompute.py); each copy reads and writes them.
    inplace = (0.0 if recompute == "none" else
               layer.inplace_input_bytes * act_scale / (dp * m) / (tp if sp else 1))
    copy_s = roofline_s(0.0, 2 * inplace, 0, device, prec.compute_dtype) if inplace else 0.0
    fwd_compute = compute.fwd_s + copy_s
    bwd_compute = compute.bwd_s

    tp_fwd, tp_bwd = once(("tp_comm", is_tp, sp, overlap), estimators.tp_comm, layer, ctx)
    tp_hidden = (_async_tp_hidden_s(layer, ctx, estimators, tp_fwd, tp_bwd, once)
                 if overlap else 0.0)
    ring = once(("ring", is_tp, fwd_compute), estimators.ring_attention, layer, ctx, fwd_compute)
    tp_fwd, tp_bwd = tp_fwd + ring.fwd_s, tp_bwd + ring.bwd_s
    batch_norm = batch_norm_sync_s(layer, mesh, cluster)
    tp_fwd, tp_bwd = tp_fwd + batch_norm, tp_bwd + batch_norm
    rerun = once(("recompute", recompute, is_tp, sp, tp_fwd), estimators.recompute, layer, ctx,
                 compute, tp_fwd)
    activations, rematerialized = rerun.kept_bytes, rerun.rematerialized_bytes
    recompute_s, recompute_comm = rerun.compute_s, rerun.comm_s
    if inplace:  # the copy is the layer's alone, held to backward; the rerun copies it again
        activations, rematerialized = max(activations, inplace), rematerialized + inplace
        recompute_s += copy_s
    loss_kept, loss_transient = loss_bytes(layer, dp * m, pipelined=mesh.pp > 1)
    dp_comm = once(("dp_comm", strategy), estimators.dp_comm, ctx, tp_params, shards)
    host = estimators.offload(layer, ctx, local_params) if offload else Offload(0.0, 0.0, 0.0)
    if offload:
        optimizer = host.optimizer_s
    else:
        optimizer = optimizer_step_s(local_params, layer.param_tensors, cluster.adam_kernels,
                                     device)
    units = len(shares)
    engine_micro, engine_step = engine_host_s(layer, is_tp, sp, cluster, units)
    copies_micro, copies_step = fsdp_copies_s(s, m, mesh.pp > 1, tp_params, shards,
                                               prec, device, units)
    engine_micro += copies_micro
    optimizer += engine_step + copies_step
    states = _states_bytes(s, offload, tp_params, shards, m, prec,
                           pipelined=mesh.pp > 1, largest_unit=max(shares))
    # FSDP2's copies and hooks run on the compute stream between the layer's kernels.
    windows = dict(fwd_window=fwd_compute + engine_micro / 2,
                   bwd_window=bwd_compute + recompute_s + engine_micro / 2)
    hidden = _hidden_comm_s(s, mesh, cluster.overlap, dp_comm, **windows)
    per_micro_comm = (tp_fwd + tp_bwd + recompute_comm + 2 * dp_comm.gather_per_micro
                      + dp_comm.reduce_per_micro + host.per_micro_s - hidden.fwd - hidden.bwd)
    wait, ddp_saving = all_reduce_wait_s(s, mesh, cluster, prec, tp_params)
    if s.ddp:  # DDP's buckets may hide more than FSDP2's reduction
        ddp_saving += _hidden_comm_s(s, mesh, cluster.overlap, dp_comm, ddp=True,
                                     **windows).step - hidden.step
    per_step_comm = dp_comm.per_step + host.per_step_s - hidden.step + wait
    # The part of the backward a split-backward schedule may defer (its W pass).
    deferrable = 0.0 if layer.reuses_weights else WGRAD_FRACTION
    return LayerCost(
        option=option_label(strategy, recompute, offload, sp, async_tp=overlap),
        strategy=strategy, recompute=recompute, offload=offload, sequence_parallel=sp,
        async_tp=overlap,
        microbatches=m,
        fwd_s=(fwd_compute + tp_fwd + dp_comm.gather_per_micro - hidden.fwd
               + host.per_micro_s / 2 + engine_micro / 2),
        bwd_s=((1 - deferrable) * bwd_compute + recompute_s + recompute_comm + tp_bwd
               + dp_comm.gather_per_micro + dp_comm.reduce_per_micro - hidden.bwd
               + host.per_micro_s / 2 + engine_micro / 2),
        wgrad_s=deferrable * bwd_compute,
        step_s=per_step_comm + optimizer,
        compute_s=m * (fwd_compute + bwd_compute + recompute_s + engine_micro) + optimizer,
        comm_s=m * per_micro_comm + per_step_comm,
        params_bytes=states[0],
        grads_bytes=states[1],
        optimizer_bytes=states[2],
        activations_bytes=activations + loss_kept,
        buffers_bytes=states[3] + rematerialized + ring.buffers_bytes + loss_transient,
        output_bytes=layer.output_bytes * act_scale / (dp * m) / (tp if sp else 1),
        host_bytes=local_params * prec.state_bytes if offload else 0.0,
        hidden_comm_s=m * (hidden.fwd + hidden.bwd + tp_hidden) + hidden.step,
        loss_buffer_bytes=loss_transient,
        fsdp_only_s=(m * (cluster.device.fsdp_overhead_s * units + copies_micro)
                     + engine_step + copies_step),
        fsdp_wait_s=ddp_saving,
        gathered_bytes=states[4],
        collective_buffer_bytes=states[3] if mesh.pp > 1 else 0.0,
        prefetch_bytes=states[5],
    )


def layer_costs(layers: Sequence[LayerInfo], option_of: Callable[[LayerInfo], str],
                mesh: Mesh, cluster: Cluster, prec: Precision, microbatches: int = 1
                ) -> list[LayerCost]:
    """Each layer's cost under the option ``option_of`` gives it, priced once per layer
    class and option: a class's layers are identical (``passes.layer_graph``), so the
    search prices a class once too (``engine.costs``). A published plan's 80 blocks cost
    one block's pricing, not 80."""
    priced: dict[tuple[str, str], LayerCost] = {}
    costs = []
    for layer in layers:
        key = (layer.layer_class, option_of(layer))
        if key not in priced:
            priced[key] = layer_cost(layer, key[1], mesh, cluster, prec, microbatches)
        costs.append(priced[key])
    return costs


class _Once:
    """Calls of the estimators a layer's options share (``layer_cost``'s ``shared``), by key:
    what in the option the analytic estimator reads (the layer, mesh, cluster, precision
    and micro-batches are the store's own). Without a store every call is made."""

    def __init__(self, store: dict | None) -> None:
        self.store = store

    def __call__(self, key: tuple, estimator: Callable, *args):
        if self.store is None:
            return estimator(*args)
        if key not in self.store:
            self.store[key] = estimator(*args)
        return self.store[key]


def _async_tp_hidden_s(layer: LayerInfo, ctx: CostContext, estimators: Estimators,
                       fwd: float, bwd: float, once: _Once) -> float:
    """Per micro-batch, the TP collectives async TP hides (net of what splitting costs): the
    plain collectives' time less the exposed ``fwd`` and ``bwd``, the forward's twice under
    full recomputation (its rerun repeats them)."""
    plain = ("tp_comm", ctx.tensor_parallel, ctx.sequence_parallel, False)
    plain_fwd, plain_bwd = once(plain, estimators.tp_comm, layer, replace(ctx, async_tp=False))
    reruns = 2 if ctx.recompute == "full" else 1
    return reruns * (plain_fwd - fwd) + (plain_bwd - bwd)


@dataclass(frozen=True)
class _Hidden:
    """Communication hidden behind compute, net of the slowdown (seconds)."""

    fwd: float = 0.0
    """Per micro-batch, in forward."""
    bwd: float = 0.0
    """Per micro-batch, in backward."""
    step: float = 0.0
    """Per step: of the once-per-step gradient reduction."""


def _hidden_comm_s(s: StrategySpec, mesh: Mesh, overlap: Overlap, comm: DPComm, *,
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
    # FSDP2 issues per-micro-batch gathers and reduce-scatters around each layer's compute
    # (zero1 gathers and reduces once per step, around the optimizer).
    if s.reduce == "per_microbatch":
        sigma = overlap.fsdp_slowdown
        fwd = hidden(fwd_window, comm.gather_per_micro, "fsdp", sigma)
        fsdp_bwd = comm.gather_per_micro + comm.reduce_per_micro
        bwd = hidden(bwd_window, fsdp_bwd, "fsdp", sigma)
    step = 0.0
    # The once-per-step all-reduce (DDP's buckets; HSDP's across groups) runs beside the last
    # micro-batch's backward at pp = 1; pipelines reduce after their schedule ends.
    if mesh.pp == 1 and s.all_reduces and comm.per_step > 0:
        pattern = "dp" if ddp and s.ddp else "fsdp"
        sigma = overlap.dp_slowdown if pattern == "dp" else overlap.fsdp_slowdown
        both = hidden(bwd_window, fsdp_bwd + comm.per_step, pattern, sigma)
        step = max(0.0, both - bwd)
    # ZeRO-1/2 (the distributed optimizer among them): FSDP2 issues the once-per-step
    # all-gather in the step's first forward, prefetched beside one layer's forward as a
    # per-use gather is, and ZeRO-1's reduce-scatter in the last micro-batch's backward,
    # beside one layer's backward after what that window already hides (estimators.DPComm).
    if comm.gather_per_step > 0 or comm.reduce_per_step > 0:
        sigma = overlap.fsdp_slowdown
        step = (hidden(fwd_window, comm.gather_per_step + comm.gather_per_micro, "fsdp", sigma)
                - fwd)
        if comm.reduce_per_step > 0:
            both = hidden(bwd_window, fsdp_bwd + comm.reduce_per_step, "fsdp", sigma)
            step += max(0.0, both - bwd)
    return _Hidden(fwd=fwd, bwd=bwd, step=step)


def unit_shares(layer: LayerInfo, s: StrategySpec) -> tuple[float, ...]:
    """Each FSDP2 unit's share of the layer's parameters: (1.0,) for one unit; under
    ``units == "modules"``, each module unit's (``LayerInfo.module_units``) and the rest's."""
    if s.units == "layer" or not layer.module_units or not layer.param_count:
        return (1.0,)
    rest = layer.param_count - sum(layer.module_units)
    counts = layer.module_units + ((rest,) if rest > 0 else ())
    return tuple(n / layer.param_count for n in counts)


def _states_bytes(s: StrategySpec, offload: bool, tp_params: float, shards: int, m: int,
                  prec: Precision, *, pipelined: bool = False, largest_unit: float = 1.0
                  ) -> tuple[float, float, float, float, float, float]:
    """(params, grads, optimizer, transient, gathered, prefetched) bytes on the device; see
    the module table. ``pipelined``: pp > 1. ``prefetched``: the part of the transient that
    stands for the next layer's gathered parameters (``LayerCost.prefetch_bytes``).
    ``largest_unit``: the largest FSDP2 unit's share of the layer's parameters, what one
    gather, reduce-scatter or unsharded gradient of the layer's holds (``unit_shares``)."""
    p = tp_params * prec.param_bytes
    g = tp_params * prec.grad_bytes  # an unsharded gradient, as backward computes it
    pu, gu = p * largest_unit, g * largest_unit  # the largest unit's
    held = tp_params * prec.held_grad_bytes  # the reduced gradient the optimizer steps
    k = tp_params * prec.optimizer_bytes
    n = shards
    once = s.gather == "per_step"  # ZeRO-1/2: the gathered copy stays beside the shard
    if not s.sharded:
        return p, held, k, 0.0, (p if prec.name == "float32" else 0.0), 0.0
    if pipelined:
        collectives = max(pu, gu + gu / n)
        if once:
            return p + p / n, g, k / n, collectives, 0.0, 0.0
        if offload:
            return 0.0, g, 0.0, collectives + pu / n, p, 0.0
        return p / n, g, k / n, collectives, p, 0.0
    if once and s.reduce == "per_step":  # gradients accumulate unsharded (ZeRO-1)
        return p + p / n, (g if m > 1 else held / n), k / n, (0.0 if m > 1 else g), 0.0, 0.0
    if once:
        return p + p / n, held / n, k / n, g, 0.0, 0.0
    if offload:
        return 0.0, 0.0, 0.0, 2 * pu + gu + pu / n, 0.0, pu
    return p / n, held / n, k / n, 2 * pu + gu, 0.0, pu


def hsdp_shard_size(cluster: Cluster, pp: int = 1) -> int | None:
    """HSDP shards inside a node and replicates across nodes: the shard group is a node,
    when a stage spans more than one."""
    per_stage = cluster.world_size // pp
    size = cluster.devices_per_node
    return size if 1 < size < per_stage and per_stage % size == 0 else None


def layer_options(layer: LayerInfo, seq_len: int | None, mesh: Mesh, cluster: Cluster,
                  prec: Precision, microbatches: int = 1, *, selective: bool = True,
                  estimators: Estimators = ANALYTIC,
                  priced: dict[str, LayerCost] | None = None) -> dict[str, LayerCost]:
    """Every option of one layer with its cost (composed from ``estimators``), dominated
    options removed. ``priced``: costs of this layer's options on this mesh and micro-batch
    count already known, filled with those priced here (so the options of both
    recomputation modes are priced once)."""
    hsdp = hsdp_shard_size(cluster, mesh.pp)
    labels = runnable(allowed_options(
        layer, mesh, seq_len=seq_len, hsdp_shard_size=hsdp, microbatches=microbatches,
        selective=selective, offload=cluster.host.offload,
        async_tp=async_tp_offered(cluster, mesh)), prec.name)
    priced = {} if priced is None else priced
    shared: dict = {}
    for o in labels:
        if o not in priced:
            priced[o] = layer_cost(layer, o, mesh, cluster, prec, microbatches,
                                   hsdp_shard_size=hsdp, estimators=estimators, shared=shared)
    return prune_dominated({o: priced[o] for o in labels})
