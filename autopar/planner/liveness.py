"""Per-rank peak memory by liveness: walk one training step event by event.

The planner's costs (costs.LayerCost) give each layer's parameter, gradient, optimizer,
saved-activation and transient bytes; the ILP (ilp.py) adds them all up, which bounds the
peak from above. What a rank holds depends on when each term is alive. This module replays
a steady-state step (the second and later: optimizer states exist) as the runtime runs it —
the forward of each layer, the backward of each layer in reverse, per micro-batch in the
schedule's order, then the optimizer step — and records the bytes alive at each event. The
peak is the largest total, with its breakdown and the event it is at.

Rules, each what the runtime does (runtime/train.py, runtime/data_parallel.py,
runtime/pipeline.py):

1. Parameters and optimizer states are alive throughout: parameters are resident between
   steps (sharded or not, per strategy), and AdamW keeps the states it makes on step one.
2. FSDP2's gathered copy of parameters that also stay resident (``LayerCost.gathered_bytes``:
   float32 replicate and tp layers; every fsdp-like layer under pipelining) is alive from
   the layer's forward to the end of its backward of the same micro-batch (FSDP2 reshards
   after backward and gathers again for the next micro-batch), under pipelining from its
   first forward of the step to its last backward or W pass (runtime/pipeline.py keeps
   them unsharded through the schedule). Not under DDP (rule 4), which holds one copy.
3. Gradients are alive from the layer's first backward of the step (its weight-gradient
   pass W under a zero-bubble schedule) to the optimizer step: ``Trainer.step`` calls
   ``zero_grad(set_to_none=True)``, so a step's forward runs without gradients, and with
   gradient accumulation or pipeline micro-batches they accumulate from the first
   micro-batch's backward on.
4. Except under DDP (``ddp``: a float32 plan whose layers are all replicate at pp = 1,
   runtime.data_parallel.uses_ddp): ``gradient_as_bucket_view=True`` makes every gradient a
   view into DDP's all-reduce buckets, which are allocated once and never freed.
5. A layer's saved activations of one micro-batch are alive from its forward to its
   backward (to its W pass under a zero-bubble schedule, which needs the saved inputs of
   the weight matmuls); a layer's backward still holds its own while its gradient appears.
   The layer producing the model's output counts the loss's among them: cross-entropy's
   float32 log-probabilities, one copy of the logits (and under pipelining the logits the
   last stage keeps, loss_costs.loss_bytes).
6. A layer's transient buffer (``LayerCost.buffers_bytes``: FSDP's gathered layer with the
   next one prefetched, an unsharded gradient before its reduce-scatter, the activations
   recomputation brings back, ring-attention blocks, the loss's two float32 gradient
   copies on the output layer) is alive only while that layer runs forward, backward or W.
   The cost model gives it as one number, so it is charged in every pass (in forward an
   upper bound: no gradient or recomputation is alive then), except the loss's part
   (``LayerCost.loss_buffer_bytes``). The loss's backward is an event of its own, before
   the output layer's backward: the loss's part, not the layer's (FSDP2 gathers the layer
   for backward, and its gradient appears, only once the logits' gradient reaches it);
   the log-probabilities are freed after it, and the logits' gradient, one copy of the same
   size, is alive through the layer's backward in their place. Under pipelining an FSDP2
   layer's buffer is its one all-gather and one reduce-scatter of the step
   (``LayerCost.collective_buffer_bytes``), charged in its first forward and its last
   backward or W pass only. The prefetched layer in the buffer (``LayerCost.prefetch_bytes``,
   priced at the layer's own parameters) is FSDP2's next unit in the pass's order: the next
   layer with parameters in forward, the previous one in backward (FSDP2's default backward
   prefetch), none past either end. Where that neighbour's parameters are fewer, it is
   charged at theirs: beside the first block's backward FSDP2 gathers an embedding, not a
   block (tests/autopar/planner/test_liveness.py measures it). Where they are more (a large
   vocabulary's embedding), the layer's own stay charged, so this rule never lifts a
   buffer above the one the ILP charges.
7. The optimizer step runs after every backward, with every activation freed.

Every term above is one of the ILP's, alive for part of the step: parameters, gathered
copies, gradients, optimizer states, activations of at most the in-flight micro-batches,
one layer's buffer. So this peak never exceeds the ILP's sum, and a plan the ILP accepts
fits by it. The plan's prediction (engine.plan_memory, pipeline rank memory) is this peak.

What the runtime also holds and LayerCost has no term for (``Uncosted``; measured in
tests/test_liveness.py, where it closes the gap to MemTracker; off in the plan's
prediction, since the ILP cannot charge it):

8. AdamW's temporaries in ``step()``: torch's default takes the foreach kernels for CUDA
   tensors, whose ``_foreach_sqrt`` of the second moments is one float32 copy of every
   local parameter at once; on CPU it steps one parameter at a time, two float32 copies of
   it (sqrt, then its division by the bias correction), charged as the largest layer's.
9. DDP under gradient accumulation: ``no_sync`` micro-batches accumulate into gradients
   autograd allocates itself, next to the buckets, until the last micro-batch's backward
   copies each into its bucket view: a second copy of the gradients.

Not modelled: activation gradients flowing between layers in backward (the logits' is,
rule 6), point-to-point buffers of pipeline stages, and the output a non-last pipeline
stage keeps until the micro-batch's backward (``PipelineStage``'s forward cache).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.planner.costs import LayerCost
from cost_models.hardware import Cluster
from cost_models.memory import MemoryTerms

OPTIMIZER_EVENT = "optimizer step"
FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class Usage(MemoryTerms):
    """Bytes one rank holds at one event of the step (cost_models.memory.MemoryTerms)."""

    event: str
    """E.g. 'forward of h.3', 'backward of lm_head, micro-batch 1', 'optimizer step'."""


@dataclass(frozen=True, kw_only=True)
class RankLiveness:
    """One rank's memory over one step, event by event."""

    timeline: tuple[Usage, ...]

    @property
    def peak(self) -> Usage:
        """The fullest event (the first of equal ones)."""
        return max(self.timeline, key=lambda u: u.total_bytes)


@dataclass(frozen=True, kw_only=True)
class Uncosted:
    """What the runtime holds that LayerCost has no term for (rules 8-9)."""

    optimizer_temp_bytes: float = 0.0
    """AdamW's temporaries during step() (rule 8; ``optimizer_temporary_bytes``)."""


@dataclass(frozen=True)
class _Layer:
    name: str
    cost: LayerCost
    stage: int


def step_liveness(costs: Sequence[LayerCost], names: Sequence[str], *, microbatches: int = 1,
                  ddp: bool = False, uncosted: Uncosted | None = None) -> RankLiveness:
    """A pp = 1 rank: per micro-batch (gradient accumulation), every layer's forward in
    order, then every backward in reverse; then the optimizer step. ``costs`` and ``names``
    are per layer in execution order; ``ddp`` is rule 4 (and 9)."""
    layers = [_Layer(n, c, 0) for n, c in zip(names, costs, strict=True)]
    actions = [(a, 0, mb) for mb in range(microbatches) for a in ("F", "B")]
    return _Walk(layers, split_backward=False, ddp=ddp, microbatches=microbatches,
                 uncosted=uncosted, label_microbatch=microbatches > 1,
                 pipelined=False).run(actions)


def pipeline_liveness(costs: Sequence[LayerCost], names: Sequence[str],
                      stage_of: Sequence[int], owner: Sequence[int], slots, num_ranks: int,
                      *, uncosted: Sequence[Uncosted] = (), peak_only: bool = False
                      ) -> tuple[RankLiveness, ...]:
    """Every pipeline rank: its stages' F / B / W actions in the order of the simulated
    timeline (``slots``: cost_models.schedule.Slot; ``owner``: the rank of each stage),
    each a walk over the stage's layers, then the optimizer step after the flush.
    ``uncosted``: per rank (default none). ``peak_only``: each rank's timeline holds only
    its peak (the same event ``peak`` finds in the whole timeline), for the planner, which
    walks schedules of 100,000 actions and needs nothing else."""
    split = any(s.action == "W" for s in slots)
    microbatches = 1 + max((s.microbatch for s in slots), default=0)
    by_rank: list[list] = [[] for _ in range(num_ranks)]
    for s in slots:
        by_rank[s.rank].append(s)
    out = []
    for rank in range(num_ranks):
        layers = [_Layer(n, c, s) for n, c, s in zip(names, costs, stage_of, strict=True)
                  if owner[s] == rank]
        mine = sorted(by_rank[rank], key=lambda s: (s.start_s, s.end_s))
        walk = _Walk(layers, split_backward=split, ddp=False, microbatches=microbatches,
                     uncosted=uncosted[rank] if uncosted else None, label_microbatch=True,
                     pipelined=True, peak_only=peak_only)
        out.append(walk.run([(s.action, s.stage, s.microbatch) for s in mine]))
    return tuple(out)


class _Walk:
    """One rank's events; the numbered comments are the module docstring's rules."""

    VERBS = {"F": "forward", "B": "backward", "W": "weight gradients"}

    def __init__(self, layers: list[_Layer], *, split_backward: bool, ddp: bool,
                 microbatches: int, uncosted: Uncosted | None, label_microbatch: bool,
                 pipelined: bool, peak_only: bool = False) -> None:
        self.layers, self.split, self.ddp = layers, split_backward, ddp
        self.microbatches, self.label, self.pipelined = microbatches, label_microbatch, pipelined
        self.uncosted = uncosted or Uncosted()
        self.ddp_copies = ddp and uncosted is not None  # rule 9
        self.params = sum(la.cost.params_bytes for la in layers)  # rule 1
        # Per layer, the bytes ``record`` sums over the live sets, looked up by index (sum()
        # over map() adds the same floats in the same order as a generator, at C speed).
        self.grad_bytes = [la.cost.grads_bytes for la in layers]
        self.gathered_bytes = [la.cost.gathered_bytes for la in layers]
        self.members = {}  # stage -> its layers' indices, in order
        for i, la in enumerate(layers):
            self.members.setdefault(la.stage, []).append(i)
        self.optimizer = sum(la.cost.optimizer_bytes for la in layers)
        self.gathered: set[int] = set()  # rule 2
        self.forwarded: set[int] = set()  # rule 6: layers past their first forward
        self.passes_left = {i: microbatches * (2 if split_backward else 1)
                            for i in range(len(layers))}  # B and W passes to come, rules 2, 6
        self.grads: set[int] = set(range(len(layers))) if ddp else set()  # rules 3-4
        self.second: set[int] = set()  # rule 9: autograd's own gradients beside DDP's buckets
        self.saved: dict[tuple[int, int], float] = {}  # (layer, micro-batch) -> bytes, rule 5
        self.timeline: list[Usage] = []
        self.peak_only = peak_only
        self.peak_total = -math.inf
        # Rule 6: what FSDP2 gathers beside each layer, the next layer with parameters in
        # the pass's order (parameter-free layers are no FSDP2 unit and gather nothing).
        self.prefetched = {"F": _next_unit_prefetch(layers[::-1])[::-1],
                           "B": _next_unit_prefetch(layers)}
        self.prefetched["W"] = self.prefetched["B"]

    def record(self, event: str | tuple[str, str, str], buffer: float) -> None:
        """One event's usage; ``event`` as text, or as (verb, layer, suffix) joined only
        when it is kept (peak_only keeps few)."""
        grads = sum(map(self.grad_bytes.__getitem__, self.grads))
        grads += sum(map(self.grad_bytes.__getitem__, self.second))
        gathered = sum(map(self.gathered_bytes.__getitem__, self.gathered))
        params, activations = self.params + gathered, sum(self.saved.values())
        if self.peak_only:  # Usage.total_bytes, summed in its order; the first of equals
            total = params + grads + self.optimizer + activations + buffer
            if not total > self.peak_total:
                return
            self.peak_total = total
            self.timeline[:] = []
        if isinstance(event, tuple):
            event = f"{event[0]} of {event[1]}{event[2]}"
        self.timeline.append(Usage(
            event=event, params_bytes=params, optimizer_bytes=self.optimizer,
            grads_bytes=grads, activations_bytes=activations, buffers_bytes=buffer))

    def run(self, actions: list[tuple[str, int, int]]) -> RankLiveness:
        for action, stage, mb in actions:
            members = self.members.get(stage, [])
            for i in members if action == "F" else members[::-1]:
                self.event(action, i, mb)
        self.grads.update(range(len(self.layers)))
        self.gathered.clear()
        self.second.clear()
        self.saved.clear()
        self.record(OPTIMIZER_EVENT, self.uncosted.optimizer_temp_bytes)  # rules 7, 8
        return RankLiveness(timeline=tuple(self.timeline))

    def event(self, action: str, i: int, mb: int) -> None:
        cost = self.layers[i].cost
        suffix = f", micro-batch {mb}" if self.label else ""
        # Rule 6: the layer's own buffer in every pass (the loss's part is charged below),
        # its step's collectives only in its first forward and last backward pass.
        buffer = cost.buffers_bytes - cost.loss_buffer_bytes
        # Its prefetched neighbour at that neighbour's size, where that is the smaller.
        buffer -= cost.prefetch_bytes - min(cost.prefetch_bytes, self.prefetched[action][i])
        once = i not in self.forwarded if action == "F" else self.passes_left[i] == 1
        if not once:
            buffer -= cost.collective_buffer_bytes
        if action == "F":
            self.forwarded.add(i)
            self.saved[i, mb] = cost.activations_bytes  # rule 5
            if not self.ddp:
                self.gathered.add(i)  # rule 2
        if action == "B" and cost.loss_buffer_bytes:
            # Rule 6: the loss's backward, before the layer's gradient or buffer.
            self.record(f"backward of the loss{suffix}", cost.loss_buffer_bytes)
        if action == "W" or (action == "B" and not self.split):
            self.grads.add(i)
            if self.ddp_copies and mb < self.microbatches - 1:
                self.second.add(i)  # rule 9; the last micro-batch moves it into the bucket
        self.record((self.VERBS[action], self.layers[i].name, suffix), buffer)
        if action != "F" and self.ddp_copies and mb == self.microbatches - 1:
            self.second.discard(i)
        if action == "W" or (action == "B" and not self.split):
            self.saved.pop((i, mb), None)
        if action != "F":
            self.passes_left[i] -= 1
            if not self.pipelined or not self.passes_left[i]:
                self.gathered.discard(i)  # rule 2


def _next_unit_prefetch(layers: Sequence[_Layer]) -> list[float]:
    """Per layer, the ``prefetch_bytes`` of the nearest layer before it in ``layers`` that
    has parameters (0.0 if none): a backward's prefetch in execution order, a forward's in
    reverse."""
    out, last = [], 0.0
    for la in layers:
        out.append(last)
        c = la.cost
        if c.params_bytes or c.gathered_bytes or c.prefetch_bytes or c.host_bytes \
                or c.optimizer_bytes:
            last = c.prefetch_bytes
    return out


def optimizer_temporary_bytes(costs: Sequence[LayerCost], optimizer_bytes_per_param: float,
                              *, foreach: bool) -> float:
    """AdamW's temporaries during ``step()`` on one rank (rule 7). A layer's float32
    parameters are its optimizer bytes × 4 / the optimizer bytes per parameter
    (cost_models.memory.Precision.optimizer_bytes); offloaded layers step on the host."""
    fp32 = [c.optimizer_bytes * FP32_BYTES / optimizer_bytes_per_param for c in costs]
    return sum(fp32) if foreach else 2 * max(fp32, default=0.0)


def uses_foreach(cluster: Cluster) -> bool:
    """Whether the cluster's optimizer takes torch's foreach kernels (``Cluster.optimizer``:
    torch's AdamW does on CUDA tensors, and steps CPU tensors one at a time)."""
    return cluster.optimizer == "adamw-foreach"


def uncosted_terms(costs: Sequence[LayerCost], prec, *, foreach: bool) -> Uncosted:
    """Rule 7 for a rank holding ``costs`` under precision ``prec``
    (cost_models.memory.Precision); rule 8 is ``step_liveness``'s ``ddp`` with any
    ``uncosted``."""
    temp = optimizer_temporary_bytes(costs, prec.optimizer_bytes, foreach=foreach)
    return Uncosted(optimizer_temp_bytes=temp)
