"""Pipeline-parallel candidates: stage cuts, micro-batches and schedules around per-rank ILPs.

For every configuration (tp, pp, dp, schedule, virtual stages v, micro-batches m):

1. cut the layers into pp·v contiguous stages — every cut when there are few (small
   models), else the cut that minimises the slowest stage (binary search on the bound);
2. take, per stage, the micro-batches it holds at once under the schedule (the simulator
   run on unit times: GPipe m, 1F1B p - r, ...);
3. per pipeline rank, solve the strategy ILP (ilp.py) over that rank's stages, with each
   layer's activations counted once per micro-batch in flight, under the device memory;
4. simulate the schedule with the chosen per-stage F / B / W times and point-to-point
   transfers on the link between neighbouring stages, then add the data-parallel gradient
   sync and optimizer step, which follow the pipeline flush.

Configurations are evaluated in order of a lower bound (the busiest rank's work plus the
slowest rank's sync) and skipped once the bound reaches the best simulated step, so the
search is exact with respect to steps 1-3 while simulating few configurations.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from autopar.planner.costs import (
    LayerCost,
    allowed_options,
    hsdp_shard_size,
    layer_cost,
    layer_options,
)
from autopar.planner.ilp import (
    FEASIBILITY_SLACK_GIB,
    GIB,
    ClassOptions,
    expand_counts,
    min_memory,
    solve_by_buffer_cap,
)
from cost_models.comm import Group, group_link, p2p_s
from cost_models.hardware import Cluster
from cost_models.memory import Precision
from cost_models.schedule import StageTimes, Timeline, simulate, stage_ranks
from passes.records import LayerGraph
from runtime.plan import Mesh, schedule_microbatch_problem

PIPELINE_SCHEDULES = (  # (schedule, virtual stages per rank)
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("InterleavedZeroBubble", 2),
    ("ZBVZeroBubble", 2),
)
MAX_MICROBATCHES_PER_STAGE = 8
"""m is searched among divisors of the per-replica batch in [pp, 8·pp]: beyond 8·pp the
bubble is under (p-1)/(9p-1) < 11% and smaller micro-batches only lose GEMM efficiency."""
SATURATION_MICROBATCHES_PER_RANK = 4
EXHAUSTIVE_CUTS = 64
"""Enumerate every contiguous cut of models with at most EXHAUSTIVE_LAYERS layers when
there are at most this many cuts; larger models take the balanced cut."""
EXHAUSTIVE_LAYERS = 8


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    mesh: Mesh
    schedule: str
    virtual_stages: int
    microbatches: int

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * self.virtual_stages


@dataclass(frozen=True, kw_only=True)
class PipelineOutcome:
    config: PipelineConfig
    step_time_s: float
    lower_bound_s: float
    stage_of_layer: tuple[int, ...]
    costs: tuple[LayerCost, ...]
    """Per layer, the cost of the strategy chosen for it."""
    timeline: Timeline
    rank_memory: tuple[dict[str, float], ...]
    """Per pipeline rank: params, grads, optimizer, activations, buffers (bytes)."""
    sync_s: float
    """Data-parallel gradient reduction and optimizer step after the flush (slowest rank)."""

    def peak_bytes(self, margin_fraction: float) -> float:
        """The fullest rank's memory, allocator margin included."""
        return max((1 + margin_fraction) * sum(mem.values()) for mem in self.rank_memory)


@dataclass(frozen=True, kw_only=True)
class Infeasible:
    config: PipelineConfig
    min_memory_bytes: float


def pipeline_configs(graph: LayerGraph, cluster: Cluster) -> list[PipelineConfig]:
    world, batch, layers = cluster.world_size, graph.batch_size, len(graph.layers)
    out = []
    for tp in _divisors(math.gcd(cluster.devices_per_node, world)):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if pp < 2 or pp > layers or batch % dp:
                continue
            per_replica = batch // dp
            ms = [d for d in _divisors(per_replica) if pp <= d <= MAX_MICROBATCHES_PER_STAGE * pp]
            for m in ms or [per_replica]:
                for schedule, v in PIPELINE_SCHEDULES:
                    if pp * v > layers or (v > 1 and m % pp):
                        continue  # interleaving advances micro-batches in groups of pp
                    if schedule_microbatch_problem(schedule, pp, m):
                        continue  # torch's schedule would refuse it
                    out.append(PipelineConfig(mesh=Mesh(pp=pp, dp=dp, tp=tp), schedule=schedule,
                                              virtual_stages=v, microbatches=m))
    return out


def search_pipeline(
    graph: LayerGraph, cluster: Cluster, prec: Precision, time_limit_s: float = 10.0,
    best_known_s: float = math.inf,
) -> tuple[PipelineOutcome | None, list[PipelineOutcome | Infeasible]]:
    """The fastest pipeline plan (or None), and every configuration's outcome."""
    ctx = _Context(graph, cluster, prec, time_limit_s)
    # Order every (configuration, cut) by a bound that needs no ILP (each layer on its
    # fastest strategy, memory ignored): memory can only slow a plan down, so once that
    # bound reaches the best simulated step, nothing later can win.
    queue = sorted(
        ((ctx.bound(config, cut, ctx.fastest(config, cut)), i, config, cut)
         for i, config in enumerate(pipeline_configs(graph, cluster))
         for cut in ctx.cuts(config)),
        key=lambda item: item[:2])
    results: list[PipelineOutcome | Infeasible] = []
    best: PipelineOutcome | None = None
    limit = best_known_s
    for optimistic, _, config, cut in queue:
        if optimistic >= limit:
            break
        prepared = ctx.prepare(config, cut)
        if isinstance(prepared, Infeasible):
            results.append(prepared)
            continue
        if prepared.lower_bound_s >= limit:
            continue
        outcome = ctx.finish(prepared)
        results.append(outcome)
        if outcome.step_time_s < limit:
            best, limit = outcome, outcome.step_time_s
    return best, results


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    config: PipelineConfig
    stage_of_layer: tuple[int, ...]
    costs: tuple[LayerCost, ...]
    lower_bound_s: float


class _Context:
    """Caches shared across configurations: layer costs, in-flight profiles, rank ILPs."""

    def __init__(self, graph: LayerGraph, cluster: Cluster, prec: Precision,
                 time_limit_s: float) -> None:
        self.graph, self.cluster, self.prec = graph, cluster, prec
        self.time_limit_s = time_limit_s
        self._costs: dict[tuple, dict[str, LayerCost]] = {}
        self._inflight: dict[tuple, tuple[int, ...]] = {}
        self._ilp: dict[tuple, object] = {}

    def costs(self, layer_index: int, config: PipelineConfig) -> dict[str, LayerCost]:
        layer = self.graph.layers[layer_index]
        mesh, m = config.mesh, config.microbatches
        key = (layer.layer_class, mesh.dp, mesh.tp, m)
        if key not in self._costs:
            self._costs[key] = layer_options(layer, self.graph.seq_len, mesh, self.cluster,
                                             self.prec, m)
        return self._costs[key]

    def cuts(self, config: PipelineConfig) -> list[tuple[int, ...]]:
        """Candidate stage-of-layer assignments (contiguous, every stage non-empty)."""
        n, stages = len(self.graph.layers), config.num_stages
        if n <= EXHAUSTIVE_LAYERS and math.comb(n - 1, stages - 1) <= EXHAUSTIVE_CUTS:
            return [_assignment(n, bounds)
                    for bounds in itertools.combinations(range(1, n), stages - 1)]
        weights = [min(c.fwd_s + c.bwd_s + c.wgrad_s for c in self.costs(i, config).values())
                   for i in range(n)]
        return [_assignment(n, balanced_bounds(weights, stages))]

    def fastest(self, config: PipelineConfig, stage_of: tuple[int, ...]) -> list[LayerCost]:
        return [min(self.costs(i, config).values(), key=lambda c: c.time_s)
                for i in range(len(stage_of))]

    def bound(self, config: PipelineConfig, stage_of: tuple[int, ...],
              costs: list[LayerCost]) -> float:
        """A step-time lower bound for these per-layer costs on this schedule: a rank
        cannot start before micro-batch 0 has run the forwards of the stages ahead of its
        first stage, nor (unless weight gradients are deferred past it) finish before the
        last backward has run back through them; the gradient sync follows the flush."""
        pp, v, m = config.mesh.pp, config.virtual_stages, config.microbatches
        owner = stage_ranks(config.schedule, pp, pp * v)
        busy, sync = [0.0] * pp, [0.0] * pp
        fwd, bwd = [0.0] * (pp * v), [0.0] * (pp * v)
        for cost, s in zip(costs, stage_of, strict=True):
            busy[owner[s]] += m * (cost.fwd_s + cost.bwd_s + cost.wgrad_s)
            sync[owner[s]] += cost.step_s
            fwd[s] += cost.fwd_s
            bwd[s] += cost.bwd_s
        split_w = "ZeroBubble" in config.schedule
        first = [min(s for s in range(pp * v) if owner[s] == r) for r in range(pp)]
        return max(sum(fwd[:first[r]]) + busy[r] + (0.0 if split_w else sum(bwd[:first[r]]))
                   for r in range(pp)) + max(sync)

    def inflight(self, config: PipelineConfig) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations it holds at once."""
        if config.schedule == "GPipe":
            return (config.microbatches,) * config.num_stages
        # Peaks stop growing by m = 4p (tests/test_schedule.py checks it), so a shorter
        # unit-time run gives them.
        m = min(config.microbatches, SATURATION_MICROBATCHES_PER_RANK * config.mesh.pp)
        key = (config.schedule, config.mesh.pp, config.virtual_stages, m)
        if key not in self._inflight:
            unit = [StageTimes(fwd_s=1.0, bwd_s=1.0, wgrad_s=1.0)] * config.num_stages
            timeline = simulate(config.schedule, config.mesh.pp, m, unit)
            self._inflight[key] = stage_peaks(timeline, config.num_stages)
        return self._inflight[key]

    def prepare(self, config: PipelineConfig, stage_of: tuple[int, ...]
                ) -> _Prepared | Infeasible:
        """Per rank, the fastest strategies that fit (the rank ILP), or why none fit."""
        pp, v = config.mesh.pp, config.virtual_stages
        owner = stage_ranks(config.schedule, pp, pp * v)
        inflight = self.inflight(config)
        per_rank = []
        for rank in range(pp):
            members = [i for i, s in enumerate(stage_of) if owner[s] == rank]
            options = self._rank_options(config, members, stage_of, inflight)
            per_rank.append((members, options, self._solve(config, options)))
        if any(result is None for *_, result in per_rank):
            # The configuration needs what its fullest rank needs at the least.
            need = max(min_memory(options, self.cluster.memory_margin_fraction)[0]
                       for _, options, _ in per_rank)
            return Infeasible(config=config, min_memory_bytes=need)
        chosen: list[LayerCost | None] = [None] * len(stage_of)
        for members, options, result in per_rank:
            queues = {name: expand_counts(counts) for name, counts in result.items()}
            by_name = {o.name: o for o in options}
            for i in members:
                name = _class_key(stage_of[i], self.graph.layers[i].layer_class)
                chosen[i] = by_name[name].costs[queues[name].pop(0)]
        costs = [c for c in chosen if c is not None]
        return _Prepared(config=config, stage_of_layer=stage_of, costs=tuple(costs),
                         lower_bound_s=self.bound(config, stage_of, costs))

    def _rank_options(self, config: PipelineConfig, members: list[int],
                      stage_of: tuple[int, ...], inflight: tuple[int, ...]) -> list[ClassOptions]:
        counts: dict[str, int] = {}
        first: dict[str, int] = {}
        for i in members:
            name = _class_key(stage_of[i], self.graph.layers[i].layer_class)
            counts[name] = counts.get(name, 0) + 1
            first.setdefault(name, i)
        return [ClassOptions(name=name, count=counts[name], costs=self.costs(first[name], config),
                             inflight=inflight[stage_of[first[name]]])
                for name in counts]

    def _solve(self, config: PipelineConfig, options: list[ClassOptions]
               ) -> dict[str, dict[str, int]] | None:
        """One rank's strategies (class -> {strategy: count}), or None if nothing fits."""
        # Ranks holding the same classes in the same stage positions share the answer.
        stages = sorted({o.name.split(":", 1)[0] for o in options}, key=int)
        shape = tuple((stages.index(o.name.split(":", 1)[0]), o.name.split(":", 1)[1],
                       o.count, o.inflight) for o in options)
        key = (config.mesh.dp, config.mesh.tp, config.microbatches, shape)
        if key not in self._ilp:
            self._ilp[key] = self._fastest_if_it_fits(options) or self._ilp_counts(options)
        counts = self._ilp[key]
        return None if counts is None else {
            o.name: c for o, c in zip(options, counts, strict=True)}

    def _fastest_if_it_fits(self, options: list[ClassOptions]) -> list[dict[str, int]] | None:
        """Every class on its fastest strategy, when that fits: then it is optimal."""
        fastest = [min(o.costs, key=lambda s, o=o: o.costs[s].time_s) for o in options]
        resident = sum(o.count * o.costs[s].resident_with(o.inflight)
                       for o, s in zip(options, fastest, strict=True))
        buffer = max(o.costs[s].buffer_bytes for o, s in zip(options, fastest, strict=True))
        need = (1 + self.cluster.memory_margin_fraction) * (resident + buffer)
        if need > self.cluster.device.memory_bytes - FEASIBILITY_SLACK_GIB * GIB:
            return None
        return [{s: o.count} for o, s in zip(options, fastest, strict=True)]

    def _ilp_counts(self, options: list[ClassOptions]) -> list[dict[str, int]] | None:
        result = solve_by_buffer_cap(options, self.cluster.device.memory_bytes,
                                     self.cluster.memory_margin_fraction, self.time_limit_s)
        if result.status != "optimal":
            return None
        return [result.choice[o.name] for o in options]

    def finish(self, prepared: _Prepared) -> PipelineOutcome:
        config = prepared.config
        pp, stages = config.mesh.pp, config.num_stages
        owner = stage_ranks(config.schedule, pp, stages)
        times = []
        for s in range(stages):
            members = [c for c, st in zip(prepared.costs, prepared.stage_of_layer, strict=True)
                       if st == s]
            times.append(StageTimes(fwd_s=sum(c.fwd_s for c in members),
                                    bwd_s=sum(c.bwd_s for c in members),
                                    wgrad_s=sum(c.wgrad_s for c in members),
                                    activation_bytes=sum(c.activations_bytes for c in members)))
        timeline = simulate(config.schedule, pp, config.microbatches, times,
                            p2p_s=self._p2p_s(prepared))
        sync = [0.0] * pp
        memory = [dict(params=0.0, grads=0.0, optimizer=0.0, activations=0.0, buffers=0.0)
                  for _ in range(pp)]
        for cost, s in zip(prepared.costs, prepared.stage_of_layer, strict=True):
            r = owner[s]
            sync[r] += cost.step_s
            memory[r]["params"] += cost.params_bytes
            memory[r]["grads"] += cost.grads_bytes
            memory[r]["optimizer"] += cost.optimizer_bytes
            memory[r]["buffers"] = max(memory[r]["buffers"], cost.buffer_bytes)
        # Activations: each stage's own peak, summed per rank (what the ILP constrained). The
        # simulated joint peak (timeline.peak_activation_bytes) is never larger.
        inflight = self.inflight(config)
        for cost, s in zip(prepared.costs, prepared.stage_of_layer, strict=True):
            memory[owner[s]]["activations"] += inflight[s] * cost.activations_bytes
        return PipelineOutcome(config=config, step_time_s=timeline.step_time_s + max(sync),
                               lower_bound_s=prepared.lower_bound_s,
                               stage_of_layer=prepared.stage_of_layer, costs=prepared.costs,
                               timeline=timeline, rank_memory=tuple(memory), sync_s=max(sync))

    def _p2p_s(self, prepared: _Prepared) -> float:
        """The slowest stage-boundary transfer: neighbouring pipeline ranks are dp·tp apart."""
        mesh = prepared.config.mesh
        link = group_link(self.cluster, Group(2, mesh.dp * mesh.tp))
        boundary = [c.output_bytes for c, s, nxt in zip(
            prepared.costs, prepared.stage_of_layer, prepared.stage_of_layer[1:] + (-1,),
            strict=True) if nxt != s and nxt != -1]
        return p2p_s(max(boundary, default=0.0), link)


def stage_peaks(timeline: Timeline, num_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches held between F and the backward that frees them."""
    releases = "W" if any(s.action == "W" for s in timeline.slots) else "B"
    peak = [0] * num_stages
    held = [0] * num_stages
    for slot in sorted(timeline.slots, key=lambda s: (s.start_s, s.action != releases)):
        if slot.action == "F":
            held[slot.stage] += 1
            peak[slot.stage] = max(peak[slot.stage], held[slot.stage])
        elif slot.action == releases:
            held[slot.stage] -= 1
    return tuple(peak)


def balanced_bounds(weights: list[float], stages: int) -> tuple[int, ...]:
    """Cut points splitting ``weights`` into ``stages`` contiguous non-empty runs so that
    the heaviest run is as light as possible (binary search on that bound, greedy fill)."""
    n = len(weights)
    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(_greedy_cuts(weights, mid)) + 1 <= stages:
            hi = mid
        else:
            lo = mid
    cuts = _greedy_cuts(weights, hi)
    # Fewer runs than stages: split the heaviest runs further (never raises the maximum).
    while len(cuts) + 1 < stages:
        bounds = [0, *cuts, n]
        runs = [(sum(weights[a:b]), a, b) for a, b in itertools.pairwise(bounds) if b - a > 1]
        _, a, b = max(runs)
        half, acc, split = sum(weights[a:b]) / 2, 0.0, a + 1
        for i in range(a, b - 1):
            acc += weights[i]
            split = i + 1
            if acc >= half:
                break
        cuts = sorted([*cuts, split])
    return tuple(cuts)


def _greedy_cuts(weights: list[float], limit: float) -> list[int]:
    cuts, acc = [], 0.0
    for i, w in enumerate(weights):
        if acc + w > limit * (1 + 1e-12) and acc > 0:
            cuts.append(i)
            acc = 0.0
        acc += w
    return cuts


def _assignment(n: int, bounds: tuple[int, ...]) -> tuple[int, ...]:
    out, stage = [], 0
    cuts = set(bounds)
    for i in range(n):
        if i in cuts:
            stage += 1
        out.append(stage)
    return tuple(out)


def _class_key(stage: int, layer_class: str) -> str:
    return f"{stage}:{layer_class}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate_plan(graph: LayerGraph, cluster: Cluster, prec: Precision, plan) -> PipelineOutcome:
    """The simulated step of a given pipeline plan: its stages, strategies and schedule
    (e.g. a hand-written plan, to set its prediction next to a measurement)."""
    if plan.pipeline is None:
        raise ValueError("evaluate_plan takes a pipeline plan (mesh.pp > 1)")
    config = PipelineConfig(mesh=plan.mesh, schedule=plan.pipeline.schedule,
                            virtual_stages=plan.pipeline.virtual_stages,
                            microbatches=plan.pipeline.num_microbatches)
    ctx = _Context(graph, cluster, prec, 10.0)
    by_name = {layer.module: layer for layer in plan.layers}
    missing = [layer.name for layer in graph.layers if layer.name not in by_name]
    if missing:
        raise ValueError(f"the plan does not place layer(s) {missing}")
    stage_of = tuple(by_name[layer.name].stage for layer in graph.layers)
    costs = []
    for i, layer in enumerate(graph.layers):
        options = ctx.costs(i, config)
        option = by_name[layer.name].option
        if option not in options:  # a dominated option, or one this mesh cannot run
            hsdp = hsdp_shard_size(cluster, config.mesh.pp)
            if option not in allowed_options(layer, config.mesh, seq_len=graph.seq_len,
                                             hsdp_shard_size=hsdp,
                                             microbatches=config.microbatches):
                raise ValueError(f"layer {layer.name!r}: option {option!r} is not possible on "
                                 f"this mesh (options: {', '.join(options)})")
            options = {option: layer_cost(layer, option, config.mesh, cluster, prec,
                                          config.microbatches, hsdp_shard_size=hsdp)}
        costs.append(options[option])
    prepared = _Prepared(config=config, stage_of_layer=stage_of, costs=tuple(costs),
                         lower_bound_s=ctx.bound(config, stage_of, costs))
    return ctx.finish(prepared)
