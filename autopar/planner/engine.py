"""The planner's engine: one candidate configuration in, one outcome out, one plan built.

A configuration (``Config``) is a mesh, micro-batches per step, and for pp > 1 a schedule
with its virtual stages and the strategy of tied layers. pp = 1 is the one-stage case:
its micro-batches are gradient accumulation and it has no schedule. ``Engine`` holds
what configurations share (layer costs, in-flight counts, rank ILPs and their bounds),
evaluates each configuration into an ``Outcome`` (the chosen option of every layer, its
stage, the step time, the memory of every rank), and builds the Plan of an outcome
(``Engine.plan``); autopar/planner/search.py drives it over every configuration.

One stage (pp = 1): the rank program is every layer class, tied layers joined into one
option (planner/ties.py), plus the program of the plan the runtime would run on DDP;
the ILP picks the fastest that fits; the step is the sum of the layers' times and the
memory the liveness walk's peak.

Pipelines (pp > 1), for every (tp, pp, dp, schedule, virtual stages v, micro-batches m):

1. cut the layers into pp·v contiguous stages — every cut when there are few (small
   models), else the cut that minimises the slowest stage (binary search on the bound);
2. take, per stage, the micro-batches it holds at once under the schedule, counted along
   the order each rank runs (``runtime_orders``: torch's own schedule table where it has
   one, so what is simulated is what runs; GPipe m, 1F1B p - r, ...);
3. per pipeline rank, solve the strategy ILP (ilp.py) over that rank's stages, with each
   layer's activations counted once per micro-batch in flight, under the device memory;
4. simulate the schedule with the chosen per-stage F / B / W times and point-to-point
   transfers on the link between neighbouring stages, then add the data-parallel gradient
   sync and optimizer step, which follow the pipeline flush.

Tied layers (planner/ties.py): a tie cut by a stage boundary runs as Megatron's
embedding group, each stage holding a tied layer holds a copy of the shared parameters and
the copies' gradients are all-reduced at the end of the step; both are in the tied layers'
costs under each cut (``ties.pipeline_roles``). The tie's one strategy is a dimension of
the configuration (every tied layer takes it, so the ranks' ILPs agree), and cuts that
put two copies on one rank (V and looped schedules) are not offered.

Pipeline configurations are evaluated in order of a lower bound (the busiest rank's work
plus the slowest rank's sync) and skipped once the bound reaches the best step found, so
the search is exact with respect to steps 1-3 while simulating few configurations.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace

from autopar.planner.bounds import Hulls, rank_bound
from autopar.planner.configs import Config, pipeline_configs
from autopar.planner.costs import (
    LayerCost,
    allowed_options,
    async_tp_offered,
    hsdp_shard_size,
    layer_cost,
    layer_options,
    on_ddp,
    prune_dominated,
)
from autopar.planner.estimators import ANALYTIC, Estimators
from autopar.planner.ilp import (
    FEASIBILITY_SLACK_GIB,
    GIB,
    ClassOptions,
    ILPResult,
    expand_counts,
    min_memory,
    solve_by_buffer_cap,
    solve_strategies,
)
from autopar.planner.liveness import pipeline_liveness
from autopar.planner.one_stage import (
    assign_layers,
    class_options,
    ddp_programs,
    memory_breakdown,
    plan_memory,
    runs_on_ddp,
)
from autopar.planner.stage_boundaries import gather_s, send_s
from autopar.planner.stages import (
    SATURATION_MICROBATCHES_PER_RANK,
    balanced_bounds,
    stage_assignment,
    unit_peaks,
)
from autopar.planner.ties import (
    TieRole,
    copies_share_a_rank,
    join_ties,
    pipeline_roles,
    with_copy,
    with_sync,
)
from cost_models.comm import Group, group_link
from cost_models.hardware import Cluster
from cost_models.memory import Precision
from cost_models.schedule import (
    SCHEDULES,
    StageTimes,
    Timeline,
    simulate,
    stage_ranks,
)
from passes.records import LayerGraph, LayerInfo
from runtime.plan import (
    SPLIT_BACKWARD_SCHEDULES,
    LayerPlan,
    MemoryBreakdown,
    Mesh,
    PipelineSpec,
    Plan,
    Prediction,
    SolverReport,
)
from runtime.schedule_orders import runtime_orders
from runtime.strategies import spec

EXHAUSTIVE_CUTS = 64
"""Enumerate every contiguous cut of models with at most EXHAUSTIVE_LAYERS layers when
there are at most this many cuts; larger models take the balanced cut."""
EXHAUSTIVE_LAYERS = 8
STEP_BOUND_TOLERANCE = 1e-9
"""memory_bound is shrunk by this much: it and prepare's bound sum the same seconds in a
different order, and skipping must not hinge on the last bit."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one configuration achieves: every layer's chosen option and stage, the step
    time, and the memory of every pipeline rank."""

    config: Config
    step_time_s: float
    lower_bound_s: float
    """No plan of this configuration is faster (an LP bound at pp = 1)."""
    stage_of_layer: tuple[int, ...]
    costs: tuple[LayerCost, ...]
    """Per layer, the cost of the option chosen for it (as DDP pays it, on DDP)."""
    compute_s: float
    comm_s: float
    """The busiest rank's compute and exposed communication (the whole step's at pp = 1)."""
    rank_memory: tuple[MemoryBreakdown, ...]
    """Per pipeline rank (one at pp = 1): the peak by liveness, allocator margin added."""
    timeline: Timeline | None = None
    """The simulated schedule (pipelines)."""
    sync_s: float = 0.0
    """Pipelines: gradient reduction and optimizer step after the flush (slowest rank)."""
    choice: dict[str, dict[str, int]] = field(default_factory=dict)
    """pp = 1: layer class -> {option: number of its layers}."""
    scatter_sends: bool = False
    """Pipelines: stage sends scattered over tp (``PipelineSpec.scatter_sends``)."""

    def peak_bytes(self) -> float:
        """The fullest rank's memory, allocator margin included."""
        return max(m.total_bytes for m in self.rank_memory)


@dataclass(frozen=True, kw_only=True)
class Infeasible:
    config: Config
    min_memory_bytes: float
    exact: bool = True
    """False: ``min_memory_bytes`` is a floor (the least is at least that)."""


class TimeLimitReached(Exception):  # noqa: N818 (a signal to the caller, not an error)
    """``Engine.pipelines`` passed its deadline: the best outcome found so far (or None)
    and the outcomes so far."""

    def __init__(self, best: Outcome | None,
                 results: list[Outcome | Infeasible]) -> None:
        super().__init__("the pipeline search reached its time limit")
        self.best, self.results = best, results


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    config: Config
    stage_of_layer: tuple[int, ...]
    costs: tuple[LayerCost, ...]
    lower_bound_s: float
    scatter_sends: bool | None = None
    """What a given plan says (``PipelineSpec.scatter_sends``); None: whichever is faster."""


class Engine:
    """Evaluates configurations of one model on one cluster, with what they share cached:
    layer costs, in-flight counts, rank ILPs and their bounds.

    ``time_limit_s`` bounds each ILP; ``prune`` (pipelines) skips configurations by a
    memory-aware bound before their ILPs (the answer is the same without it);
    ``estimators`` price every option (autopar/planner/estimators.py)."""

    def __init__(self, graph: LayerGraph, cluster: Cluster, prec: Precision,
                 time_limit_s: float = 10.0, *, prune: bool = True,
                 estimators: Estimators = ANALYTIC) -> None:
        self.graph, self.cluster, self.prec = graph, cluster, prec
        self.estimators = estimators
        self.time_limit_s = time_limit_s
        self.prune = prune
        self._costs: dict[tuple, dict[str, LayerCost]] = {}
        self._priced: dict[tuple, dict[str, LayerCost]] = {}  # every option, unpruned
        self._one_stage_priced: dict[tuple, dict[str, LayerCost]] = {}  # one_stage.cost_mesh
        self._inflight: dict[tuple, tuple[int, ...]] = {}
        self._ilp: dict[tuple, object] = {}
        self._bounds: dict[tuple, float] = {}
        self._ramp: dict[tuple, list[tuple[int, list[int], int, int]]] = {}
        self._roles: dict[tuple, dict[int, TieRole]] = {}
        self._layer_costs: dict[tuple, list[dict[str, LayerCost]]] = {}
        self._summaries: dict[int, tuple[LayerCost, float, float, float, float]] = {}
        self._least: dict[tuple[int, int], tuple[float, float]] = {}
        self._balanced: dict[tuple, tuple[int, ...]] = {}
        self._weight_lists: dict[int, tuple[list, tuple[float, ...]]] = {}
        self._shapes: dict[tuple, list[tuple[list[int], list[tuple[str, int, int]]]]] = {}
        self._hulls: dict[int, Hulls] = {}  # per micro-batch count: the rank bounds' hulls

    # -- one stage (pp = 1) ---------------------------------------------------------------

    def programs(self, config: Config) -> list[list[ClassOptions]]:
        """The one rank's programs: every layer class's options, tied layers joined into
        one option, and the program of the plan the runtime would run on DDP (where one
        can be, ``ddp_programs``)."""
        options = class_options(self.graph, config.mesh, self.cluster, self.prec,
                                config.microbatches, self.estimators, self._one_stage_priced)
        return [join_ties(self.graph, p)
                for p in [options, *ddp_programs(options, self.prec, config.mesh)]]

    def programs_bound(self, programs: list[list[ClassOptions]]) -> float:
        """The LP bound of the rank's knapsack (memory-aware, no solver): no plan with these
        programs is faster; inf when nothing fits."""
        return min(rank_bound(p, self.cluster.device.memory_bytes,
                              self.cluster.memory_margin_fraction) for p in programs)

    def least_memory(self, programs: list[list[ClassOptions]]) -> float:
        """The least per-rank memory (margin included) any plan of these programs needs."""
        return min_memory(programs[0], self.cluster.memory_margin_fraction)[0]

    def solve(self, config: Config, programs: list[list[ClassOptions]]) -> Outcome | Infeasible:
        """The fastest answer of the programs (the later on a tie: DDP's), as an outcome."""
        best: tuple[ILPResult, list[ClassOptions]] | None = None
        for options in programs:
            result = solve_strategies(options, self.cluster.device.memory_bytes,
                                      self.cluster.memory_margin_fraction, self.time_limit_s)
            if best is None or (result.status == "optimal" and (
                    best[0].status != "optimal" or result.objective_s <= best[0].objective_s)):
                best = (result, options)
        assert best is not None
        result, options = best
        margin = self.cluster.memory_margin_fraction
        if result.status != "optimal":
            return Infeasible(config=config, min_memory_bytes=min_memory(options, margin)[0])
        costs = assign_layers(self.graph, result.choice, options)
        ddp = runs_on_ddp(costs, self.prec, config.mesh)
        return self._one_stage(config, costs, ddp, result.lower_bound_s, result.choice)

    def _one_stage(self, config: Config, costs: list[LayerCost], ddp: bool,
                   lower_bound_s: float, choice: dict[str, dict[str, int]]) -> Outcome:
        """The outcome of one stage running ``costs`` (in layer order); ``ddp``: the
        runtime runs it on DDP."""
        if ddp:  # priced as FSDP2 runs replicate layers, unless they came from ddp_programs
            costs = [on_ddp(c) for c in costs]
        memory = plan_memory(costs, self.cluster.memory_margin_fraction,
                             names=[layer.name for layer in self.graph.layers], ddp=ddp)
        compute, comm = sum(c.compute_s for c in costs), sum(c.comm_s for c in costs)
        return Outcome(config=config, step_time_s=compute + comm, lower_bound_s=lower_bound_s,
                       stage_of_layer=(0,) * len(costs), costs=tuple(costs), compute_s=compute,
                       comm_s=comm, rank_memory=(memory,), choice=choice)

    def evaluate(self, plan: Plan) -> Outcome:
        """The outcome of a given plan (a hand-written, published or imported one): its
        layers' options, stages and schedule, priced as the search prices them."""
        by_name = {layer.module: layer for layer in plan.layers}
        missing = [layer.name for layer in self.graph.layers if layer.name not in by_name]
        if missing:
            raise ValueError(f"the plan does not place layer(s) {missing}")
        if plan.pipeline is None:
            config = Config(mesh=plan.mesh, microbatches=plan.gradient_accumulation)
            stage_of = (0,) * len(self.graph.layers)
        else:
            tied = [by_name[m].strategy for tie in self.graph.ties for m in tie.modules if m]
            config = Config(mesh=plan.mesh, schedule=plan.pipeline.schedule,
                            virtual_stages=plan.pipeline.virtual_stages,
                            microbatches=plan.pipeline.num_microbatches,
                            tie_strategy=tied[0] if tied else "")
            stage_of = tuple(by_name[layer.name].stage for layer in self.graph.layers)
        costs = [self._given(i, by_name[layer.name].option, config, stage_of)
                 for i, layer in enumerate(self.graph.layers)]
        if plan.pipeline is None:
            choice: dict[str, dict[str, int]] = {}
            for layer, cost in zip(self.graph.layers, costs, strict=True):
                counts = choice.setdefault(layer.layer_class, {})
                counts[cost.option] = counts.get(cost.option, 0) + 1
            return self._one_stage(config, costs, runs_on_ddp(costs, self.prec, config.mesh),
                                   0.0, choice)
        prepared = _Prepared(config=config, stage_of_layer=stage_of, costs=tuple(costs),
                             lower_bound_s=self.bound(config, stage_of, costs),
                             scatter_sends=plan.pipeline.scatter_sends)
        return self.finish(prepared)

    def _given(self, index: int, option: str, config: Config, stage_of: tuple[int, ...]
               ) -> LayerCost:
        """One layer's cost under an option a plan gave it (one the search would have
        pruned as dominated included), refused when this mesh cannot run it."""
        layer = self.graph.layers[index]
        options = self.costs(index, config, stage_of if config.schedule else None)
        if option in options:
            return options[option]
        hsdp = hsdp_shard_size(self.cluster, config.mesh.pp)
        if option not in allowed_options(layer, config.mesh, seq_len=self.graph.seq_len,
                                         hsdp_shard_size=hsdp,
                                         microbatches=config.microbatches,
                                         offload=self.cluster.host.offload,
                                         async_tp=async_tp_offered(self.cluster, config.mesh)):
            raise ValueError(f"layer {layer.name!r}: option {option!r} is not possible on "
                             f"this mesh (options: {', '.join(options)})")
        role = self.role(index, config, stage_of) if config.schedule else None
        if role is None:
            return layer_cost(layer, option, config.mesh, self.cluster, self.prec,
                              config.microbatches, hsdp_shard_size=hsdp,
                              estimators=self.estimators)
        return self.tied_cost(layer, option, config, role[1])

    # -- the plan -------------------------------------------------------------------------

    def plan(self, outcome: Outcome, report: SolverReport) -> Plan:
        """The Plan document of an outcome: one LayerPlan per layer with its option and
        stage, the mesh, the schedule, the prediction."""
        config, cluster, prec = outcome.config, self.cluster, self.prec
        memory = max(outcome.rank_memory, key=lambda m: m.total_bytes)
        assert memory.total_bytes <= cluster.device.memory_bytes, "a rank overflows"
        pipelined = outcome.timeline is not None
        extra = {}
        if outcome.timeline is not None:
            extra = dict(bubble_s=max(0.0, outcome.step_time_s - outcome.compute_s
                                      - outcome.comm_s),
                         bubble_fraction=outcome.timeline.bubble_fraction,
                         rank_memory=outcome.rank_memory)
        prediction = Prediction(step_time_s=outcome.step_time_s, compute_s=outcome.compute_s,
                                comm_s=outcome.comm_s, memory=memory,
                                capacity_bytes=cluster.device.memory_bytes,
                                source=cluster.provenance, **extra)
        layers = tuple(
            LayerPlan(module=layer.name, strategy=cost.strategy, tp_styles=_tp_styles(layer, cost),
                      stage=stage, layer_class=layer.layer_class,
                      memory_bytes=int(cost.resident_bytes), time_s=cost.time_s,
                      recompute=cost.recompute, offload=cost.offload,
                      sequence_parallel=cost.sequence_parallel,
                      expert_parallel=cost.expert_parallel, async_tp=cost.async_tp)
            for layer, cost, stage in zip(self.graph.layers, outcome.costs,
                                          outcome.stage_of_layer, strict=True))
        uses_hsdp = any(spec(cost.strategy).hybrid for cost in outcome.costs)
        return Plan(
            model=self.graph.model_name,
            cluster=f"{cluster.name} ({cluster.nodes} node(s) × {cluster.devices_per_node})",
            global_batch=self.graph.batch_size, seq_len=self.graph.seq_len, mesh=config.mesh,
            layers=layers, param_dtype=prec.name,
            reduce_dtype="float32" if prec.grad_bytes == 4 else prec.name,
            loss_scaling="dynamic" if prec.name == "float16" else "none",
            gradient_accumulation=1 if pipelined else config.microbatches,
            hsdp_shard_size=hsdp_shard_size(cluster, config.mesh.pp) if uses_hsdp else None,
            prediction=prediction, solver=report,
            pipeline=PipelineSpec(schedule=config.schedule, num_microbatches=config.microbatches,
                                  virtual_stages=config.virtual_stages,
                                  scatter_sends=outcome.scatter_sends)
            if pipelined and config.schedule is not None else None)

    # -- pipelines (pp > 1) ---------------------------------------------------------------

    def pipelines(self, best_known_s: float = math.inf, *, deadline: float = math.inf,
                  mesh: Mesh | None = None) -> tuple[Outcome | None, list[Outcome | Infeasible]]:
        """The fastest pipeline outcome (or None), and every configuration's outcome; only
        the configurations on ``mesh`` when one is given.

        ``deadline`` (a ``time.perf_counter()`` value): every loop stops once it has passed
        and raises TimeLimitReached with what it has (each step between checks is one
        configuration, its ILPs each bounded by ``time_limit_s``).

        Every (configuration, cut) has a position in the order of a bound that needs no
        ILP (each layer on its fastest strategy, memory ignored), and the answer is the
        fastest simulated step, ties to the earliest position. ``prune`` adds a
        memory-aware bound (memory_bound: the rank ILPs' LP bounds) that skips
        configurations before their ILPs and evaluates the most promising first."""
        queue = []
        results: list[Outcome | Infeasible] = []
        too_big: set[tuple[Mesh, int]] = set()  # (mesh, micro-batches) no rank can hold
        configs = [c for c in pipeline_configs(self.graph, self.cluster)
                   if mesh is None or c.mesh == mesh]
        most: dict[Mesh, int] = {}  # the most micro-batches searched on each mesh
        for config in configs:
            most[config.mesh] = max(most.get(config.mesh, 0), config.microbatches)
        for i, config in enumerate(configs):
            if time.perf_counter() > deadline:
                raise TimeLimitReached(None, [])
            shape = (config.mesh, config.microbatches)
            if shape in too_big:
                continue
            # Under pipelining a layer's states do not depend on the micro-batch count
            # (costs.py's table) and its activations shrink with the micro-batch: the floor
            # at the most micro-batches is below every other count's, and costs one set of
            # options for the whole mesh.
            floor = self._fullest_rank_floor(replace(config, microbatches=most[config.mesh]))
            if floor <= self.cluster.device.memory_bytes:
                floor = self._fullest_rank_floor(config)
            if floor > self.cluster.device.memory_bytes:
                too_big.add(shape)  # whatever the schedule, stages and tie: said once
                results.append(Infeasible(config=config, min_memory_bytes=floor, exact=False))
                continue
            queue += [(self.bound(config, cut, self.fastest(config, cut)), i, config, cut)
                      for cut in self.cuts(config)]
        queue.sort(key=lambda item: item[:2])
        # A heap of (bound, position, refined, configuration, cut). ``prune`` refines an
        # entry's bound by memory (memory_bound) only when it reaches the top, and pushes
        # it back: what is evaluated, and in which order, is what sorting every entry by
        # its refined bound would give (a refined bound is never below the unrefined one),
        # while entries the best step outruns are never refined at all.
        heap = [(optimistic, p, not self.prune, config, cut)
                for p, (optimistic, _, config, cut) in enumerate(queue)
                if optimistic < best_known_s]  # memory can only slow a plan down
        best: Outcome | None = None
        best_key = (best_known_s, -1)  # a tie with the plan without pipelining does not win
        while heap:
            bound, p, refined, config, cut = heapq.heappop(heap)
            if (bound, p) >= best_key:
                break  # the heap's least (bound, position): nothing left can win
            if time.perf_counter() > deadline:
                raise TimeLimitReached(best, results)
            if not refined:
                memory = self.memory_bound(config, cut)
                if math.isinf(memory):  # the LP already shows a rank that cannot fit
                    results.append(self.infeasible(config, cut))
                else:
                    heapq.heappush(heap, (max(bound, memory), p, True, config, cut))
                continue
            prepared = self.prepare(config, cut)
            if isinstance(prepared, Infeasible):
                results.append(prepared)
                continue
            if (prepared.lower_bound_s, p) >= best_key:
                continue
            if self.prune and (self.ramp_bound(prepared), p) >= best_key:
                continue  # simulating it cannot win either
            outcome = self.finish(prepared)
            results.append(outcome)
            if (outcome.step_time_s, p) < best_key:
                best, best_key = outcome, (outcome.step_time_s, p)
        return best, results

    def layer_costs(self, config: Config, stage_of: tuple[int, ...] | None = None
                    ) -> list[dict[str, LayerCost]]:
        """Every layer's ``costs``; for a model without ties one list per (dp, tp, m,
        recomputation modes), whatever the cut, so the bounds of hundreds of
        configurations do not look each layer up again."""
        n = len(self.graph.layers)
        if config.tie_strategy:
            return [self.costs(i, config, stage_of) for i in range(n)]
        key = (config.mesh.pp > 1, config.mesh.dp, config.mesh.cp, config.mesh.tp,
               config.microbatches,
               config.schedule not in SPLIT_BACKWARD_SCHEDULES)
        if key not in self._layer_costs:
            self._layer_costs[key] = [self.costs(i, config) for i in range(n)]
        return self._layer_costs[key]

    def summary(self, options: dict[str, LayerCost]
                ) -> tuple[LayerCost, float, float, float, float]:
        """Of one layer's options (a dict ``costs`` keeps, so its id is stable): the
        fastest (the first of equals), the least F + B + W, F and B, and the least memory
        with one micro-batch in flight."""
        key = id(options)
        if key not in self._summaries:
            values = options.values()
            self._summaries[key] = (min(values, key=lambda c: c.time_s),
                                    min(c.fwd_s + c.bwd_s + c.wgrad_s for c in values),
                                    min(c.fwd_s for c in values), min(c.bwd_s for c in values),
                                    min(c.resident_with(1) for c in values))
        return self._summaries[key]

    def costs(self, layer_index: int, config: Config,
              stage_of: tuple[int, ...] | None = None) -> dict[str, LayerCost]:
        """The layer's options and their costs; a tied layer's on the tie's strategy, with
        its role under the cut ``stage_of`` (none without one: the least it can cost)."""
        layer = self.graph.layers[layer_index]
        mesh, m = config.mesh, config.microbatches
        selective = config.schedule not in SPLIT_BACKWARD_SCHEDULES
        role = self.role(layer_index, config, stage_of)
        key = (layer.layer_class, mesh.pp > 1, mesh.dp, mesh.cp, mesh.tp, m, selective, role)
        if key not in self._costs:
            if role is None:  # both recomputation modes' options priced once
                priced = self._priced.setdefault(key[:-2], {})
                self._costs[key] = layer_options(layer, self.graph.seq_len, mesh,
                                                 self.cluster, self.prec, m,
                                                 selective=selective,
                                                 estimators=self.estimators, priced=priced)
            else:
                self._costs[key] = self._tied_costs(layer, config, role, selective)
        return self._costs[key]

    def role(self, layer_index: int, config: Config,
             stage_of: tuple[int, ...] | None) -> tuple[str, TieRole] | None:
        """A tied layer's strategy and role under the cut (None for untied layers)."""
        if not config.tie_strategy or self.graph.tie_of(self.graph.layers[layer_index].name) \
                is None:
            return None
        if stage_of is None:
            return config.tie_strategy, TieRole()
        pp, v = config.mesh.pp, config.virtual_stages
        key = (config.schedule, pp, v, config.mesh.dp * config.mesh.tp, stage_of)
        if key not in self._roles:
            self._roles[key] = pipeline_roles(self.graph, stage_of,
                                              _stage_ranks(config.schedule, pp, pp * v),
                                              config.mesh.dp * config.mesh.tp)
        return config.tie_strategy, self._roles[key][layer_index]

    def _tied_costs(self, layer: LayerInfo, config: Config, role: tuple[str, TieRole],
                    selective: bool) -> dict[str, LayerCost]:
        """A tied layer's options on its tie's strategy, with the copy it holds and the
        all-reduce it joins. Pruned among themselves only: the layer's options on other
        strategies (which ``layer_options`` may prefer) are not its to take."""
        strategy, tie_role = role
        labels = [o for o in allowed_options(
            layer, config.mesh, seq_len=self.graph.seq_len,
            hsdp_shard_size=hsdp_shard_size(self.cluster, config.mesh.pp),
            microbatches=config.microbatches, selective=selective, offload=False)
            if o.split("+")[0] == strategy]
        return prune_dominated({o: self.tied_cost(layer, o, config, tie_role) for o in labels})

    def tied_cost(self, layer: LayerInfo, option: str, config: Config,
                  role: TieRole) -> LayerCost:
        """One option of a tied layer, with the copy it holds and the all-reduce it joins."""
        mesh, hsdp = config.mesh, hsdp_shard_size(self.cluster, config.mesh.pp)
        cost = layer_cost(with_copy(layer, role), option, mesh, self.cluster, self.prec,
                          config.microbatches, hsdp_shard_size=hsdp,
                          estimators=self.estimators)
        return with_sync(cost, role, mesh, self.cluster, self.prec, hsdp)

    def cuts(self, config: Config) -> list[tuple[int, ...]]:
        """Candidate stage-of-layer assignments (contiguous, every stage non-empty, no stage
        starting at a layer of ``LayerGraph.uncuttable``)."""
        n, stages = len(self.graph.layers), config.num_stages
        allowed = [k for k in range(1, n) if k not in self.graph.uncuttable]
        if len(allowed) < stages - 1:
            return []
        if n <= EXHAUSTIVE_LAYERS and math.comb(len(allowed), stages - 1) <= EXHAUSTIVE_CUTS:
            cuts = [stage_assignment(n, bounds)
                    for bounds in itertools.combinations(allowed, stages - 1)]
        else:
            weights = self._weights(self.layer_costs(config))
            key = (weights, stages)  # schedules and micro-batch counts often share both
            if key not in self._balanced:
                self._balanced[key] = stage_assignment(
                    n, balanced_bounds(list(weights), stages, self.graph.uncuttable))
            cuts = [self._balanced[key]]
        owner = _stage_ranks(config.schedule, config.mesh.pp, stages)
        return [c for c in cuts if not copies_share_a_rank(self.graph, c, owner)]

    def _weights(self, options: list[dict[str, LayerCost]]) -> tuple[float, ...]:
        """Each layer's least F + B + W, the balanced cut's weights; per list of options
        (``layer_costs`` keeps one per mesh, micro-batch count and recomputation modes,
        kept here too so that its id is not reused)."""
        entry = self._weight_lists.get(id(options))
        if entry is None or entry[0] is not options:
            entry = (options, tuple(self.summary(o)[1] for o in options))
            self._weight_lists[id(options)] = entry
        return entry[1]

    def fastest(self, config: Config, stage_of: tuple[int, ...]) -> list[LayerCost]:
        return [self.summary(options)[0] for options in self.layer_costs(config, stage_of)]

    def bound(self, config: Config, stage_of: tuple[int, ...],
              costs: list[LayerCost]) -> float:
        """A step-time lower bound for these per-layer costs on this schedule: a rank
        cannot start before micro-batch 0 has run the forwards of the stages ahead of its
        first stage, nor (unless weight gradients are deferred past it) finish before the
        last backward has run back through them; the gradient sync follows the flush."""
        pp, v, m = config.mesh.pp, config.virtual_stages, config.microbatches
        owner = _stage_ranks(config.schedule, pp, pp * v)
        busy, sync = [0.0] * pp, [0.0] * pp
        fwd, bwd = [0.0] * (pp * v), [0.0] * (pp * v)
        for cost, s in zip(costs, stage_of, strict=True):
            busy[owner[s]] += m * (cost.fwd_s + cost.bwd_s + cost.wgrad_s)
            sync[owner[s]] += cost.step_s
            fwd[s] += cost.fwd_s
            bwd[s] += cost.bwd_s
        split_w = SCHEDULES[config.schedule].split_backward
        first = [owner.index(r) for r in range(pp)]  # each rank's first stage
        return max(sum(fwd[:first[r]]) + busy[r] + (0.0 if split_w else sum(bwd[:first[r]]))
                   for r in range(pp)) + max(sync)

    def ramp_bound(self, prepared: _Prepared) -> float:
        """A step-time lower bound that counts the pipeline's ramp: a rank's first backward
        waits until its micro-batch has run forward through every stage and backward down
        to it, and meanwhile the rank can only run the forwards its order puts first;
        everything else follows that backward."""
        config = prepared.config
        pp, num_stages, m = config.mesh.pp, config.num_stages, config.microbatches
        owner = _stage_ranks(config.schedule, pp, num_stages)
        split_w = SCHEDULES[config.schedule].split_backward
        fwd, bwd, busy, sync = [0.0] * num_stages, [0.0] * num_stages, [0.0] * pp, [0.0] * pp
        for cost, s in zip(prepared.costs, prepared.stage_of_layer, strict=True):
            fwd[s] += cost.fwd_s
            bwd[s] += cost.bwd_s + (0.0 if split_w else cost.wgrad_s)  # B's duration
            busy[owner[s]] += m * (cost.fwd_s + cost.bwd_s + cost.wgrad_s)
            sync[owner[s]] += cost.step_s
        out = 0.0
        for rank, (first_f, ahead, first_b, last_b) in enumerate(self._ramps(config)):
            work = sum(fwd[s] for s in ahead)
            start = max(sum(fwd[:first_f]) + work, sum(fwd) + sum(bwd[first_b + 1:]))
            tail = 0.0 if split_w else sum(bwd[:last_b])  # the last backward runs on down
            out = max(out, start + busy[rank] - work + tail)
        return (out + max(sync)) * (1 - STEP_BOUND_TOLERANCE)

    def _ramps(self, config: Config) -> list[tuple[int, list[int], int, int]]:
        """Per rank: its first forward's stage, the stages of the forwards before its first
        backward, that backward's stage, and its last backward's stage."""
        key = (config.schedule, config.mesh.pp, config.virtual_stages, config.microbatches)
        if key not in self._ramp:
            out = []
            for order in runtime_orders(*key):
                k = next(i for i, (action, *_) in enumerate(order) if action == "B")
                last_b = next(st for action, st, _ in reversed(order) if action == "B")
                out.append((order[0][1], [s for _, s, _ in order[:k]], order[k][1], last_b))
            self._ramp[key] = out
        return self._ramp[key]

    def inflight(self, config: Config) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations it holds at once."""
        if config.schedule == "GPipe":
            return (config.microbatches,) * config.num_stages
        # Peaks stop growing by m = 2p (SATURATION_MICROBATCHES_PER_RANK) when m is a
        # multiple of p, as every searched m of a multi-stage schedule is; other counts (a
        # given plan's) are counted as they are: InterleavedZeroBubble's peaks at m = 10,
        # p = 4 exceed those at 8.
        m, pp = config.microbatches, config.mesh.pp
        if m % pp == 0:
            m = min(m, SATURATION_MICROBATCHES_PER_RANK * pp)
        key = (config.schedule, config.mesh.pp, config.virtual_stages, m)
        if key not in self._inflight:
            self._inflight[key] = unit_peaks(*key)
        return self._inflight[key]

    def memory_bound(self, config: Config, stage_of: tuple[int, ...]) -> float:
        """A step-time lower bound that counts memory, with no solver: per rank, the
        forwards (and backwards) of the stages ahead, fastest per layer, plus the LP bound
        (bounds.py) of its layers' per-step time m (F + B + W) + step under its memory.
        prepare's bound is never below it (the ranks' ILP answers lie inside the LPs), so
        skipping on it loses nothing; inf when a rank cannot fit at all."""
        pp, v = config.mesh.pp, config.virtual_stages
        owner = _stage_ranks(config.schedule, pp, pp * v)
        fwd, bwd = [0.0] * (pp * v), [0.0] * (pp * v)
        for options, s in zip(self.layer_costs(config, stage_of), stage_of, strict=True):
            _, _, least_fwd, least_bwd, _ = self.summary(options)
            fwd[s] += least_fwd
            bwd[s] += least_bwd
        split_w = SCHEDULES[config.schedule].split_backward
        out = 0.0
        if self._fullest_stage_floor(config, stage_of) > self.cluster.device.memory_bytes:
            return math.inf  # no need to ask the LP: a rank cannot fit at all
        for rank, (_, options) in enumerate(self._ranks(config, stage_of)):
            first = owner.index(rank)
            ahead = sum(fwd[:first]) + (0.0 if split_w else sum(bwd[:first]))
            out = max(out, ahead + self._rank_bound(config, options))
        return out * (1 - STEP_BOUND_TOLERANCE)

    def _fullest_rank_floor(self, config: Config) -> float:
        """Memory the fullest pipeline rank needs at least, for any schedule, cut and tie
        strategy on this mesh and micro-batch count: some rank holds ceil(n / pp) of the n
        layers, each at no less than its least resident option with one micro-batch in
        flight (a tied layer's options hold a copy more and are fewer, a split-backward
        schedule's lack selective recomputation: never less), so at least the sum of the
        ceil(n / pp) smallest such layers, margin included."""
        key = ("fullest rank", config.mesh, config.microbatches)
        if key not in self._bounds:
            any_schedule = Config(mesh=config.mesh, schedule="1F1B",
                                  microbatches=config.microbatches)
            least = sorted(self.summary(options)[4] for options in self.layer_costs(any_schedule))
            held = -(-len(least) // config.mesh.pp)
            self._bounds[key] = (1 + self.cluster.memory_margin_fraction) * sum(least[:held])
        return self._bounds[key]

    def _memory_floor(self, options: list[ClassOptions]) -> float:
        """Memory no assignment of these options goes below, margin included: each class
        at its least resident option, and the largest of the classes' least buffers
        (min_memory, without the search over buffer caps that makes it exact)."""
        least = [self._least_memory(o.costs, o.inflight) for o in options]
        resident = sum(o.count * r for o, (r, _) in zip(options, least, strict=True))
        buffer = max(b for _, b in least)
        return (1 + self.cluster.memory_margin_fraction) * (resident + buffer)

    def _least_memory(self, options: dict[str, LayerCost], inflight: int
                      ) -> tuple[float, float]:
        """Of one layer's options (a dict ``costs`` keeps, as for ``summary``): the least
        resident memory at ``inflight`` micro-batches, and the least buffer."""
        key = (id(options), inflight)
        if key not in self._least:
            values = options.values()
            self._least[key] = (min(c.resident_with(inflight) for c in values),
                                min(c.buffers_bytes for c in values))
        return self._least[key]

    def _fullest_stage_floor(self, config: Config, stage_of: tuple[int, ...]) -> float:
        """The memory floor of the fullest rank under this cut at one micro-batch in flight
        per stage (no schedule's in-flight counts needed), margin included."""
        ones = (1,) * config.num_stages
        return max(self._memory_floor(options)
                   for _, options in self._ranks(config, stage_of, ones))

    def infeasible(self, config: Config, stage_of: tuple[int, ...]) -> Infeasible:
        """The configuration needs what its fullest rank needs at the least: exactly
        (min_memory), or a floor already above the device, which is cheaper to know."""
        floor = self._fullest_stage_floor(config, stage_of)
        if floor > self.cluster.device.memory_bytes:
            return Infeasible(config=config, min_memory_bytes=floor, exact=False)
        need = 0.0
        for _, options in self._ranks(config, stage_of):
            key = ("min memory", *_rank_key(config, options))
            if key not in self._bounds:
                self._bounds[key] = min_memory(options, self.cluster.memory_margin_fraction)[0]
            need = max(need, self._bounds[key])
        return Infeasible(config=config, min_memory_bytes=need)

    def prepare(self, config: Config, stage_of: tuple[int, ...]
                ) -> _Prepared | Infeasible:
        """Per rank, the fastest strategies that fit (the rank ILP), or why none fit."""
        per_rank = [(members, options, self._solve(config, options))
                    for members, options in self._ranks(config, stage_of)]
        if any(result is None for *_, result in per_rank):
            return self.infeasible(config, stage_of)
        chosen: list[LayerCost | None] = [None] * len(stage_of)
        for members, options, result in per_rank:
            queues = {name: expand_counts(counts) for name, counts in result.items()}
            by_name = {o.name: o for o in options}
            for i in members:
                name = self._class_key(i, config, stage_of)
                chosen[i] = by_name[name].costs[queues[name].pop(0)]
        costs = [c for c in chosen if c is not None]
        return _Prepared(config=config, stage_of_layer=stage_of, costs=tuple(costs),
                         lower_bound_s=self.bound(config, stage_of, costs))

    def _ranks(self, config: Config, stage_of: tuple[int, ...],
               inflight: tuple[int, ...] | None = None
               ) -> list[tuple[list[int], list[ClassOptions]]]:
        """Per pipeline rank, its layers and their classes' options."""
        inflight = inflight or self.inflight(config)
        return [(mine, [ClassOptions(name=name, count=count,
                                     costs=self.costs(first, config, stage_of),
                                     inflight=inflight[stage_of[first]])
                        for name, count, first in classes])
                for mine, classes in self._rank_classes(config, stage_of)]

    def _rank_classes(self, config: Config, stage_of: tuple[int, ...]
                      ) -> list[tuple[list[int], list[tuple[str, int, int]]]]:
        """Per pipeline rank, its layers (in order) and its classes: (ILP name, number of
        layers, first layer). Without ties they depend on the cut and the stages' placement
        alone, so configurations on other meshes and micro-batch counts share them."""
        pp, v = config.mesh.pp, config.virtual_stages
        key = (config.schedule, pp, v, stage_of)
        if config.tie_strategy or key not in self._shapes:
            owner = _stage_ranks(config.schedule, pp, pp * v)
            members: list[list[int]] = [[] for _ in range(pp)]
            for i, s in enumerate(stage_of):  # one pass, each rank's layers in order
                members[owner[s]].append(i)
            out = []
            for mine in members:
                counts: dict[str, int] = {}
                first: dict[str, int] = {}
                for i in mine:
                    name = self._class_key(i, config, stage_of)
                    counts[name] = counts.get(name, 0) + 1
                    first.setdefault(name, i)
                out.append((mine, [(name, counts[name], first[name]) for name in counts]))
            if config.tie_strategy:
                return out  # the names carry the tie's roles under this configuration
            self._shapes[key] = out
        return self._shapes[key]

    def _class_key(self, layer_index: int, config: Config,
                   stage_of: tuple[int, ...]) -> str:
        """Layers of one class on one stage share ILP variables, unless their tie roles
        (and so their costs) differ."""
        key = _class_key(stage_of[layer_index], self.graph.layers[layer_index].layer_class)
        role = self.role(layer_index, config, stage_of)
        return key if role is None else f"{key}|tie {role[0]} {role[1]}"

    def _solve(self, config: Config, options: list[ClassOptions]
               ) -> dict[str, dict[str, int]] | None:
        """One rank's strategies (class -> {strategy: count}), or None if nothing fits."""
        key = _rank_key(config, options)
        if key not in self._ilp:
            self._ilp[key] = self._fastest_if_it_fits(options) or self._ilp_counts(options)
        counts = self._ilp[key]
        return None if counts is None else {
            o.name: c for o, c in zip(options, counts, strict=True)}

    def _rank_bound(self, config: Config, options: list[ClassOptions]) -> float:
        key = _rank_key(config, options)
        if key not in self._bounds:
            m = config.microbatches
            if m not in self._hulls:  # the ranks' options are the dicts ``costs`` keeps
                self._hulls[m] = Hulls(lambda c: m * (c.fwd_s + c.bwd_s + c.wgrad_s) + c.step_s)
            self._bounds[key] = rank_bound(
                options, self.cluster.device.memory_bytes, self.cluster.memory_margin_fraction,
                self._hulls[m].value, self._hulls[m])
        return self._bounds[key]

    def _fastest_if_it_fits(self, options: list[ClassOptions]) -> list[dict[str, int]] | None:
        """Every class on its fastest strategy, when that fits: then it is optimal."""
        fastest = [min(o.costs, key=lambda s, o=o: o.costs[s].time_s) for o in options]
        resident = sum(o.count * o.costs[s].resident_with(o.inflight)
                       for o, s in zip(options, fastest, strict=True))
        buffer = max(o.costs[s].buffers_bytes for o, s in zip(options, fastest, strict=True))
        need = (1 + self.cluster.memory_margin_fraction) * (resident + buffer)
        if need > self.cluster.device.memory_bytes - FEASIBILITY_SLACK_GIB * GIB:
            return None
        return [{s: o.count} for o, s in zip(options, fastest, strict=True)]

    def _ilp_counts(self, options: list[ClassOptions]) -> list[dict[str, int]] | None:
        result = solve_by_buffer_cap(options, self.cluster.device.memory_bytes,
                                     self.cluster.memory_margin_fraction, self.time_limit_s,
                                     prune=self.prune)
        if result.status != "optimal":
            return None
        return [result.choice[o.name] for o in options]

    def finish(self, prepared: _Prepared) -> Outcome:
        config = prepared.config
        pp, stages = config.mesh.pp, config.num_stages
        owner = _stage_ranks(config.schedule, pp, stages)
        times = self._stage_times(prepared)
        overlap = self.cluster.overlap
        p2p, scatter = self._p2p_s(prepared)
        timeline = simulate(config.schedule, pp, config.microbatches, times,
                            orders=runtime_orders(config.schedule, pp, config.virtual_stages,
                                                  config.microbatches),
                            p2p_s=p2p, p2p_slowdown=overlap.pp_slowdown,
                            p2p_blocking="pp" in overlap.exposed)
        sync = [0.0] * pp
        for cost, s in zip(prepared.costs, prepared.stage_of_layer, strict=True):
            sync[owner[s]] += cost.step_s
        # Memory: each rank's peak by liveness over the simulated schedule, never above the
        # sum its ILP constrained (each stage's own in-flight peak times its activations).
        peaks = [r.peak for r in pipeline_liveness(
            prepared.costs, [layer.name for layer in self.graph.layers],
            prepared.stage_of_layer, owner, timeline.slots, pp, peak_only=True)]
        busy = [0.0] * pp  # each rank's slots summed in timeline order, in one pass
        for slot in timeline.slots:
            busy[slot.rank] += slot.end_s - slot.start_s
        busiest = max(range(pp), key=busy.__getitem__)
        mine = [c for c, st in zip(prepared.costs, prepared.stage_of_layer, strict=True)
                if owner[st] == busiest]
        margin = self.cluster.memory_margin_fraction
        return Outcome(config=config, step_time_s=timeline.step_time_s + max(sync),
                       lower_bound_s=prepared.lower_bound_s,
                       stage_of_layer=prepared.stage_of_layer, costs=prepared.costs,
                       compute_s=sum(c.compute_s for c in mine),
                       comm_s=sum(c.comm_s for c in mine),
                       rank_memory=tuple(memory_breakdown(p, margin) for p in peaks),
                       timeline=timeline, sync_s=max(sync), scatter_sends=scatter)

    def _stage_times(self, prepared: _Prepared) -> list[StageTimes]:
        """Each stage's per-micro-batch times: its layers', and the all-gather a
        sequence-parallel layer facing a layer that is not across a boundary runs on its
        stage (autopar/planner/stage_boundaries.py)."""
        times = []
        for s in range(prepared.config.num_stages):
            members = [c for c, st in zip(prepared.costs, prepared.stage_of_layer, strict=True)
                       if st == s]
            times.append(StageTimes(fwd_s=sum(c.fwd_s for c in members),
                                    bwd_s=sum(c.bwd_s for c in members),
                                    wgrad_s=sum(c.wgrad_s for c in members),
                                    activation_bytes=sum(c.activations_bytes for c in members)))
        for i, s in self._boundaries(prepared):
            fwd, bwd = gather_s(prepared.costs[i], prepared.costs[i + 1],
                                prepared.config.mesh.tp, self.cluster)
            times[s] = replace(times[s], fwd_s=times[s].fwd_s + fwd)
            times[s + 1] = replace(times[s + 1], bwd_s=times[s + 1].bwd_s + bwd)
        return times

    def _p2p_s(self, prepared: _Prepared) -> tuple[float, bool]:
        """The slowest transfer across a boundary between pipeline ranks (neighbouring ones
        are dp·tp apart), as the runtime makes it (autopar/planner/stage_boundaries.py), and
        whether the plan scatters sends over tp (runtime/pipeline_sends.py): as the plan
        says, else where the last dim of every floating tensor that may cross divides by tp
        and scattering is faster (over the network, not where pp stays inside a node)."""
        config = prepared.config
        mesh = config.mesh
        link = group_link(self.cluster, Group(2, mesh.dp * mesh.tp))
        owner = _stage_ranks(config.schedule, mesh.pp, config.num_stages)
        pairs = [(prepared.costs[i], prepared.costs[i + 1], self._crossing(i))
                 for i, s in self._boundaries(prepared) if owner[s] != owner[s + 1]]

        def slowest(scatter: bool) -> float:
            return max((send_s(a, b, mesh.tp, link, self.cluster, scatter, crossing=c)
                        for a, b, c in pairs), default=0.0)

        whole = slowest(False)
        if mesh.tp == 1 or prepared.scatter_sends is False:
            return whole, False
        scattered = slowest(True)
        if prepared.scatter_sends:
            return scattered, True
        last = prepared.stage_of_layer[-1]
        splits = all(d % mesh.tp == 0 for layer, s in zip(
            self.graph.layers, prepared.stage_of_layer, strict=True) if s != last
            for d in layer.output_last_dims)
        return (scattered, True) if splits and scattered < whole else (whole, False)

    def _crossing(self, i: int) -> float:
        """What crosses the cut after layer ``i``, as a multiple of its output: more where
        values made earlier cross it too (``LayerGraph.boundary_bytes``)."""
        out = self.graph.layers[i].output_bytes
        if not self.graph.boundary_bytes or out <= 0:
            return 1.0
        return self.graph.boundary_bytes[i] / out

    @staticmethod
    def _boundaries(prepared: _Prepared) -> list[tuple[int, int]]:
        """(index of the last layer of stage s, s) for every stage boundary."""
        stage_of = prepared.stage_of_layer
        return [(i, stage_of[i]) for i in range(len(stage_of) - 1)
                if stage_of[i + 1] != stage_of[i]]


@functools.lru_cache(maxsize=1024)
def _stage_ranks(schedule: str, num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """``stage_ranks``, asked thousands of times for a few dozen shapes."""
    return tuple(stage_ranks(schedule, num_ranks, num_stages))


def _rank_key(config: Config, options: list[ClassOptions]) -> tuple:
    """Ranks holding the same classes in the same stage positions share ILPs and bounds."""
    stages = sorted({o.name.split(":", 1)[0] for o in options}, key=int)
    shape = tuple((stages.index(o.name.split(":", 1)[0]), o.name.split(":", 1)[1],
                   o.count, o.inflight) for o in options)
    selective = config.schedule not in SPLIT_BACKWARD_SCHEDULES  # the options differ
    return (config.mesh.dp, config.mesh.tp, config.microbatches, selective, shape)


def _class_key(stage: int, layer_class: str) -> str:
    return f"{stage}:{layer_class}"


def evaluate_plan(graph: LayerGraph, cluster: Cluster, prec: Precision, plan: Plan, *,
                  estimators: Estimators = ANALYTIC) -> Outcome:
    """The outcome of a given plan (``Engine.evaluate``)."""
    return Engine(graph, cluster, prec, estimators=estimators).evaluate(plan)


def _tp_styles(layer: LayerInfo, cost: LayerCost) -> dict[str, str]:
    if not spec(cost.strategy).tensor_parallel or layer.tp is None:
        return {}
    sp_styles = layer.tp.sp_styles
    if cost.sequence_parallel and sp_styles:
        return dict(sp_styles)
    return dict(layer.tp.styles)
