"""The outer search: mesh shapes and gradient accumulation around the inner ILP.

For every mesh dp × cp × tp with tp inside a node (tp divides the devices per node), dp
dividing the global batch and cp a power of two whose 2·cp chunks divide the sequence
(only for models that can run context-parallel, see passes/context_parallel.py), and every
gradient accumulation m (a power of two dividing the per-replica batch), solve the option
ILP; keep the fastest feasible plan. Before each ILP, the LP bound of its knapsack
(autopar.planner.bounds, no solver) skips it when it cannot beat the mesh's plan (more
accumulation only trades time for activation memory) or the best plan found. The reported lower bound is the smallest LP-relaxation value over
all candidates, so it bounds every plan the search space holds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from autopar.errors import ConfigError, InfeasibleError, TimeLimitError
from autopar.planner.bounds import rank_bound
from autopar.planner.costs import LayerCost, hsdp_shard_size, layer_options, on_ddp
from autopar.planner.estimators import ANALYTIC, Estimators
from autopar.planner.ilp import (
    ClassOptions,
    ILPResult,
    expand_counts,
    make_solver,
    min_memory,
    solve_strategies,
)
from autopar.planner.liveness import Usage, step_liveness
from autopar.planner.pipeline import (
    Infeasible,
    PipelineConfig,
    PipelineOutcome,
    TimeLimitReached,
    divisors,
    pipeline_configs,
    pipeline_problem,
    search_pipeline,
)
from autopar.planner.ties import join_ties, tied_costs
from autopar.report import human_bytes
from cost_models.hardware import Cluster
from cost_models.memory import Precision, precision
from cost_models.schedule import Timeline
from passes.records import LayerGraph, LayerInfo
from runtime.plan import (
    LayerPlan,
    MemoryBreakdown,
    Mesh,
    PipelineSpec,
    Plan,
    Prediction,
    SolverReport,
)
from runtime.strategies import spec


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One mesh the search considered, and how it fared."""

    mesh: Mesh
    status: str
    """'optimal', 'infeasible' (nothing fits), 'refused' (the runtime would not run its
    plan; with the runtime's reason), or 'skipped' (with reason)."""
    reason: str = ""
    objective_s: float = float("inf")
    lower_bound_s: float = float("inf")
    choice: dict[str, dict[str, int]] = field(default_factory=dict)
    """Layer class -> {strategy: number of its layers}."""
    min_memory_bytes: float | None = None
    """For infeasible meshes: the least per-rank memory any plan on this mesh needs."""
    schedule: str | None = None
    """Pipeline candidates: the schedule, virtual stages per rank and micro-batches."""
    virtual_stages: int = 1
    microbatches: int = 1
    """Pipeline micro-batches, or the gradient accumulation of a pp = 1 candidate."""


class ProgressFn(Protocol):
    def __call__(self, *, evaluated: int, total: int, best_s: float | None,
                 candidate: Candidate) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    plan: Plan
    candidates: tuple[Candidate, ...]
    search_time_s: float
    timeline: Timeline | None = None
    """The simulated schedule of a pipeline plan."""


def candidate_meshes(cluster: Cluster, global_batch: int, *, seq_len: int | None = None,
                     context_parallel: bool = False) -> list[tuple[Mesh, str]]:
    """Every (dp, cp, tp) mesh of the cluster, with a reason when it cannot be used;
    cp > 1 only when ``context_parallel`` and the sequence splits into 2·cp chunks."""
    world = cluster.world_size
    out = []
    for tp in divisors(math.gcd(cluster.devices_per_node, world)):  # tp inside a node
        for cp in context_degrees(world // tp, seq_len if context_parallel else None):
            mesh = Mesh(dp=world // (tp * cp), cp=cp, tp=tp)
            reason = ""
            if global_batch % mesh.dp:
                reason = f"global batch {global_batch} is not divisible by dp={mesh.dp}"
            out.append((mesh, reason))
    return out


def context_degrees(ranks: int, seq_len: int | None) -> list[int]:
    """cp = 1, and the powers of two dividing ``ranks`` whose 2·cp chunks divide seq_len."""
    if seq_len is None:
        return [1]
    return [cp for cp in (2**i for i in range(ranks.bit_length()))
            if cp == 1 or (ranks % cp == 0 and seq_len % (2 * cp) == 0)]


MAX_ACCUMULATION = 64
"""Largest gradient accumulation searched for pp = 1 meshes."""


def class_options(graph: LayerGraph, mesh: Mesh, cluster: Cluster, prec: Precision,
                  microbatches: int = 1, estimators: Estimators = ANALYTIC
                  ) -> list[ClassOptions]:
    return [ClassOptions(name=name, count=len(members),
                         costs=layer_options(members[0], graph.seq_len, mesh, cluster, prec,
                                             microbatches, estimators=estimators))
            for name, members in graph.classes.items()]


def accumulation_steps(graph: LayerGraph, mesh: Mesh) -> list[int]:
    """Gradient accumulation candidates: powers of two dividing the per-replica batch; none
    for models whose BatchNorm uses batch statistics (a micro-batch's would differ)."""
    if batch_norm_layers(graph):
        return [1]
    local = graph.batch_size // mesh.dp
    return [m for m in (2**i for i in range(7)) if m <= min(local, MAX_ACCUMULATION)
            and local % m == 0]


def batch_norm_layers(graph: LayerGraph) -> list[str]:
    """Layers with BatchNorm in training mode (``LayerInfo.batch_norm_channels``)."""
    return [layer.name for layer in graph.layers if layer.batch_norm_channels]


def search(
    graph: LayerGraph,
    cluster: Cluster,
    *,
    precision_name: str = "float32",
    mesh: Mesh | None = None,
    time_limit_s: float = 60.0,
    progress: ProgressFn | None = None,
    pipeline: bool = True,
    check: PlanCheck | None = None,
    estimators: Estimators = ANALYTIC,
) -> SearchResult:
    """The fastest feasible plan for ``graph`` on ``cluster`` (optionally on a fixed mesh),
    with pipeline-parallel candidates unless ``pipeline`` is False.

    ``progress``, if given, is called after each candidate is evaluated (for a terminal
    display; see ``autopar.progress``). ``check``, if given, is asked about the plan of
    every candidate the search finds feasible before it counts as one (``autopar.api``
    passes the runtime's ``runtime.validate.plan_problem``): a plan it refuses becomes a
    'refused' candidate with its reason, so the search never returns such a plan.
    ``estimators``: the cost estimators every option is priced with (a calibrated or a
    user's estimator replaces one of ``ANALYTIC``'s, autopar/planner/estimators.py)."""
    start = time.perf_counter()
    if not time_limit_s > 0 or math.isinf(time_limit_s):
        raise ConfigError(f"time limit {time_limit_s!r} s: give a positive number of seconds "
                          "(--time-limit)")
    deadline = start + time_limit_s  # every loop below stops once it has passed
    prec = precision(precision_name)
    cluster.device.peak(prec.compute_dtype)  # a clear error if the device lacks the dtype
    meshes = candidate_meshes(cluster, graph.batch_size, seq_len=graph.seq_len,
                              context_parallel=graph.context_parallel_problem is None
                              and not batch_norm_layers(graph))
    if mesh is not None:
        if mesh.cp > 1 and graph.context_parallel_problem is not None:
            raise ConfigError(f"mesh cp={mesh.cp}: {graph.model_name or 'the model'} cannot "
                              f"run context-parallel: {graph.context_parallel_problem}")
        if (mesh.pp > 1 or mesh.cp > 1) and batch_norm_layers(graph):
            raise ConfigError(f"mesh {mesh.describe()}: BatchNorm in training mode "
                              f"({batch_norm_layers(graph)[0]} first) needs whole batches on "
                              "pp = 1 and cp = 1 (runtime/batch_norm.py); use pp=1, cp=1")
        if mesh.pp > 1 and pipeline_problem(graph) is not None:
            raise ConfigError(f"mesh {mesh.describe()}: {graph.model_name or 'the model'} "
                              f"cannot be pipelined: {pipeline_problem(graph)}; use pp=1")
        meshes = [(m, r) for m, r in meshes if m == mesh]
        pipeline = pipeline and mesh.pp > 1
        if not meshes and mesh.pp == 1:
            raise ConfigError(
                f"mesh {mesh.describe()} does not fit {cluster.name} with "
                f"{cluster.world_size} devices ({cluster.devices_per_node} per node; tp must "
                "divide the devices per node, dp × cp × tp equal the device count, and the "
                "sequence split into 2·cp equal chunks)"
            )
    usable = [m for m, reason in meshes if not reason]
    pipeline = pipeline and bool(pipeline_configs(graph, cluster))
    if not usable and not pipeline:
        dps = sorted({m.dp for m, _ in meshes})
        raise ConfigError(
            f"global batch {graph.batch_size} is not divisible by any data-parallel degree "
            f"possible on {cluster.world_size} devices (dp ∈ {dps}); choose a batch that is a "
            f"multiple of {min(dps)}"
        )

    candidates: list[Candidate] = []
    best: tuple[Candidate, list[ClassOptions]] | None = None
    cut_short = False  # the deadline stopped a loop: the plan is the best found in time
    for index, (m, reason) in enumerate(meshes):
        _tell(progress, candidates, len(meshes))
        if time.perf_counter() > deadline:
            cut_short = True
            candidates += [Candidate(mesh=left, status="skipped", reason=_OUT_OF_TIME)
                           for left, _ in meshes[index:]]
            break
        if reason:
            candidates.append(Candidate(mesh=m, status="skipped", reason=reason))
            continue
        mesh_best = None
        refusal = None  # what the runtime refused in this mesh's best plan, if anything
        least_need = float("inf")
        outclassed = float("inf")  # the least bound of accumulations the best plan beats
        for k in accumulation_steps(graph, m):
            options = class_options(graph, m, cluster, prec, k, estimators)
            programs = [join_ties(graph, p) for p in [options, *ddp_programs(options, prec, m)]]
            # The LP bound of the rank's knapsack (memory-aware, no solver): no plan with
            # these options is faster; inf when nothing fits.
            bound = min(rank_bound(p, cluster.device.memory_bytes,
                                   cluster.memory_margin_fraction) for p in programs)
            if bound == float("inf"):
                least_need = min(least_need,
                                 min_memory(programs[0], cluster.memory_margin_fraction)[0])
                continue
            if mesh_best is not None and mesh_best[0].objective_s <= bound:
                continue  # more accumulation cannot beat this mesh's plan
            if best is not None and best[0].objective_s < bound:
                outclassed = min(outclassed, bound)
                continue  # nothing here can beat the best plan found
            result, options = _solve_programs(programs, cluster, time_limit_s)
            solver_name = result.solver
            if result.status != "optimal":
                least_need = min(least_need, min_memory(options, cluster.memory_margin_fraction)[0])
                continue
            cand = Candidate(mesh=m, status="optimal", objective_s=result.objective_s,
                             lower_bound_s=result.lower_bound_s, choice=result.choice,
                             microbatches=k)
            if check is not None:
                refused = check(_make_plan(graph, cluster, prec, cand, options, _UNSOLVED))
                if refused is not None:
                    refusal = refused
                    continue
            if mesh_best is None or cand.objective_s < mesh_best[0].objective_s:
                mesh_best = (cand, options)
        if mesh_best is None and refusal is not None:
            candidates.append(Candidate(mesh=m, status="refused",
                                        reason=f"the runtime refuses its plan: {refusal}"))
            continue
        if mesh_best is None and least_need == float("inf") and outclassed < float("inf"):
            candidates.append(Candidate(
                mesh=m, status="skipped", lower_bound_s=outclassed,
                reason=f"cannot beat the best plan: no plan on it takes less than "
                       f"{outclassed:.3g} s per step (LP bound)"))
            continue
        if mesh_best is None:
            candidates.append(Candidate(mesh=m, status="infeasible", min_memory_bytes=least_need,
                                        reason=f"needs at least {human_bytes(least_need)} per rank"))
            continue
        candidates.append(mesh_best[0])
        if best is None or mesh_best[0].objective_s < best[0].objective_s:
            best = mesh_best
    _tell(progress, candidates, len(meshes))

    pipe_best = None
    if pipeline and batch_norm_layers(graph):
        pipeline = False
        first = pipeline_configs(graph, cluster)[0].mesh
        candidates.append(Candidate(
            mesh=first, status="skipped",
            reason=f"no pipeline: BatchNorm in training mode ({batch_norm_layers(graph)[0]} "
                   "first) would see one micro-batch's statistics, not the batch's"))
    if pipeline:
        try:
            pipe_best, outcomes = search_pipeline(
                graph, cluster, prec, time_limit_s,
                best_known_s=best[0].objective_s if best else float("inf"),
                estimators=estimators,
                deadline=start if cut_short else deadline)
        except TimeLimitReached as stop:
            cut_short = True
            pipe_best, outcomes = stop.best, stop.results
        if check is not None:
            pipe_best, outcomes = _check_pipelines(graph, cluster, prec, outcomes, check)
        candidates += [_pipeline_candidate(o) for o in outcomes
                       if mesh is None or o.config.mesh == mesh]
        if mesh is not None and pipe_best is not None and pipe_best.config.mesh != mesh:
            pipe_best = None  # a fixed mesh was asked for
        solver_name = make_solver(time_limit_s).name
        _tell(progress, candidates, len(candidates))
    if best is None and pipe_best is None and cut_short:
        raise TimeLimitError(
            f"no plan found for {graph.model_name or 'the model'} on {cluster.world_size} "
            f"devices within the time limit of {time_limit_s:g} s: allow more time "
            "(--time-limit, or time_limit_s=)")
    if best is None and pipe_best is None:
        raise _infeasible(graph, cluster, candidates)
    # A search cut short certifies nothing about what it did not evaluate.
    lower = 0.0 if cut_short else min(c.lower_bound_s for c in candidates
                                      if c.status == "optimal")
    status = "time limit" if cut_short else "optimal"
    if pipe_best is not None and (best is None or pipe_best.step_time_s < best[0].objective_s):
        bound = min(lower, pipe_best.step_time_s)
        report = SolverReport(
            solver=solver_name, status=status, objective_s=pipe_best.step_time_s,
            lower_bound_s=bound, gap=(pipe_best.step_time_s - bound) / pipe_best.step_time_s,
            solve_time_s=time.perf_counter() - start, candidates=len(candidates))
        plan = _make_pipeline_plan(graph, cluster, prec, pipe_best, report)
        return SearchResult(plan=plan, candidates=tuple(candidates),
                            search_time_s=time.perf_counter() - start, timeline=pipe_best.timeline)
    assert best is not None
    cand, options = best
    report = SolverReport(
        solver=solver_name,
        status=status,
        objective_s=cand.objective_s,
        lower_bound_s=lower,
        gap=(cand.objective_s - lower) / cand.objective_s if cand.objective_s else 0.0,
        solve_time_s=time.perf_counter() - start,
        candidates=len(candidates),
    )
    plan = _make_plan(graph, cluster, prec, cand, options, report)
    return SearchResult(plan=plan, candidates=tuple(candidates),
                        search_time_s=time.perf_counter() - start)


def ddp_programs(options: list[ClassOptions], prec: Precision, mesh: Mesh
                 ) -> list[list[ClassOptions]]:
    """The rank program of a plan the runtime runs on DDP (runtime.data_parallel.uses_ddp:
    float32, pp = 1, every layer replicate), its costs as DDP pays them (``on_ddp``);
    none where that plan cannot be. The layer costs price a replicate layer as FSDP2 runs
    it, in every other plan: more host time and memory, so the all-replicate plan gets its
    own program rather than the ILP's over-priced corner."""
    if prec.name != "float32" or mesh.pp != 1:
        return []
    ddp = [ClassOptions(name=c.name, count=c.count, inflight=c.inflight,
                        costs={o: on_ddp(x) for o, x in c.costs.items()
                               if spec(x.strategy).ddp and x.expert_parallel == 1})
           for c in options]
    return [ddp] if all(c.costs for c in ddp) else []


def _solve_programs(programs: list[list[ClassOptions]], cluster: Cluster, time_limit_s: float
                    ) -> tuple[ILPResult, list[ClassOptions]]:
    """The fastest answer of the rank programs (the later on a tie: DDP's), with its
    options; the first program's answer when none is feasible."""
    best = None
    for options in programs:
        result = solve_strategies(options, cluster.device.memory_bytes,
                                  cluster.memory_margin_fraction, time_limit_s)
        if best is None or (result.status == "optimal" and (
                best[0].status != "optimal" or result.objective_s <= best[0].objective_s)):
            best = (result, options)
    assert best is not None
    return best


def _tell(progress: ProgressFn | None, candidates: list[Candidate], total: int) -> None:
    """Report the latest candidate and the best step time so far to the progress callback."""
    if progress is not None and candidates:
        done = [c.objective_s for c in candidates if c.status == "optimal"]
        progress(evaluated=len(candidates), total=total,
                 best_s=min(done) if done else None, candidate=candidates[-1])


def _make_plan(graph: LayerGraph, cluster: Cluster, prec: Precision, cand: Candidate,
               options: list[ClassOptions], report: SolverReport) -> Plan:
    costs = assign_layers(graph, cand.choice, options)
    ddp = runs_on_ddp(costs, prec, cand.mesh)
    if ddp:  # priced as FSDP2 runs replicate layers, unless they came from ddp_programs
        costs = [on_ddp(c) for c in costs]
    memory = plan_memory(costs, cluster.memory_margin_fraction,
                         names=[layer.name for layer in graph.layers], ddp=ddp)
    assert memory.total_bytes <= cluster.device.memory_bytes, "the ILP's memory row was violated"
    compute = sum(c.compute_s for c in costs)
    comm = sum(c.comm_s for c in costs)
    prediction = Prediction(step_time_s=compute + comm, compute_s=compute, comm_s=comm,
                            memory=memory, capacity_bytes=cluster.device.memory_bytes,
                            source=cluster.provenance)
    return _build_plan(graph, cluster, prec, cand.mesh, costs, (0,) * len(costs), prediction,
                       report, accumulation=cand.microbatches)


def _build_plan(graph: LayerGraph, cluster: Cluster, prec: Precision, mesh: Mesh,
                costs: list[LayerCost] | tuple[LayerCost, ...], stages: tuple[int, ...],
                prediction: Prediction, report: SolverReport,
                pipeline: PipelineSpec | None = None, accumulation: int = 1) -> Plan:
    """The Plan document: one LayerPlan per layer with its chosen option and stage."""
    layers = []
    for layer, cost, stage in zip(graph.layers, costs, stages, strict=True):
        layers.append(LayerPlan(
            module=layer.name, strategy=cost.strategy, tp_styles=_tp_styles(layer, cost),
            stage=stage, layer_class=layer.layer_class, memory_bytes=int(cost.resident_bytes),
            time_s=cost.time_s, recompute=cost.recompute, offload=cost.offload,
            sequence_parallel=cost.sequence_parallel, expert_parallel=cost.expert_parallel))
    uses_hsdp = any(spec(cost.strategy).hybrid for cost in costs)
    return Plan(model=graph.model_name, cluster=f"{cluster.name} ({cluster.nodes} node(s) × "
                f"{cluster.devices_per_node})", global_batch=graph.batch_size,
                seq_len=graph.seq_len, mesh=mesh, layers=tuple(layers), param_dtype=prec.name,
                reduce_dtype="float32" if prec.grad_bytes == 4 else prec.name,
                loss_scaling="dynamic" if prec.name == "float16" else "none",
                gradient_accumulation=accumulation,
                hsdp_shard_size=hsdp_shard_size(cluster, mesh.pp) if uses_hsdp else None,
                prediction=prediction, solver=report, pipeline=pipeline)


def _tp_styles(layer: LayerInfo, cost: LayerCost) -> dict[str, str]:
    if not spec(cost.strategy).tensor_parallel or layer.tp is None:
        return {}
    sp_styles = layer.tp.sp_styles
    if cost.sequence_parallel and sp_styles:
        return dict(sp_styles)
    return dict(layer.tp.styles)


def assign_layers(graph: LayerGraph, choice: dict[str, dict[str, int]],
                  options: list[ClassOptions]) -> list[LayerCost]:
    """Per layer, in execution order, the cost of the strategy the ILP gave it.

    Within a class the layers are interchangeable; earlier layers take strategies in the
    order of STRATEGIES (replicate, fsdp, tp, tp_fsdp). Tied layers take their tie's
    option (``options`` joined by planner/ties.py).
    """
    by_class = {o.name: o for o in options}
    tied = tied_costs(choice, options)
    queues = {name: expand_counts(counts) for name, counts in choice.items()}
    out = []
    for layer in graph.layers:
        if layer.name in tied:
            out.append(tied[layer.name])
            continue
        strategy = queues[layer.layer_class].pop(0)
        out.append(by_class[layer.layer_class].costs[strategy])
    return out


def plan_memory(costs: list[LayerCost], margin_fraction: float, *,
                names: list[str] | None = None, ddp: bool = False) -> MemoryBreakdown:
    """Per-rank memory of a pp = 1 plan (layers in execution order): the peak over the
    step by liveness (autopar.planner.liveness: forward, backward in reverse per micro-batch
    of ``LayerCost.microbatches``, optimizer step), with the allocator margin on top.
    Never above the ILP's sum of resident states, activations and the largest buffer.
    ``ddp``: the plan runs on DDP, whose gradient buckets live throughout (runs_on_ddp)."""
    names = names or [f"layer {i}" for i in range(len(costs))]
    m = costs[0].microbatches if costs else 1
    return memory_breakdown(step_liveness(costs, names, microbatches=m, ddp=ddp).peak,
                            margin_fraction)


def memory_breakdown(peak: Usage, margin_fraction: float) -> MemoryBreakdown:
    """A liveness peak as the plan's MemoryBreakdown, allocator margin added."""
    return MemoryBreakdown(params_bytes=int(peak.params_bytes), grads_bytes=int(peak.grads_bytes),
                           optimizer_bytes=int(peak.optimizer_bytes),
                           activations_bytes=int(peak.activations_bytes),
                           buffers_bytes=int(peak.buffers_bytes),
                           margin_bytes=int(margin_fraction * peak.total_bytes),
                           peak_at=peak.event)


def runs_on_ddp(costs: list[LayerCost], prec: Precision, mesh: Mesh) -> bool:
    """Whether the runtime wraps this plan in DDP (runtime.data_parallel.uses_ddp): pp = 1,
    float32, every layer replicate, no layer expert-parallel."""
    return (mesh.pp == 1 and prec.name == "float32"
            and all(spec(c.strategy).ddp and c.expert_parallel == 1 for c in costs))


PlanCheck = Callable[[Plan], "str | None"]
"""Why the runtime would refuse a plan, or None (``runtime.validate.plan_problem``)."""

_OUT_OF_TIME = "not searched: the time limit (--time-limit) ran out first"

_UNSOLVED = SolverReport(solver="", status="optimal", objective_s=0.0, lower_bound_s=0.0,
                         gap=0.0, solve_time_s=0.0)
"""The report of a plan built only to be checked."""


@dataclass(frozen=True)
class Refused:
    """A pipeline configuration whose best plan the runtime refuses."""

    config: PipelineConfig
    reason: str


def _check_pipelines(graph: LayerGraph, cluster: Cluster, prec: Precision,
                     outcomes: list, check: PlanCheck) -> tuple[PipelineOutcome | None, list]:
    """Every feasible pipeline outcome's plan checked; the fastest one the runtime runs."""
    checked: list = []
    for o in outcomes:
        if isinstance(o, PipelineOutcome):
            problem = check(_make_pipeline_plan(graph, cluster, prec, o, _UNSOLVED))
            o = o if problem is None else Refused(o.config, problem)
        checked.append(o)
    runs = [o for o in checked if isinstance(o, PipelineOutcome)]
    return min(runs, key=lambda o: o.step_time_s, default=None), checked


def _pipeline_candidate(outcome: PipelineOutcome | Infeasible | Refused) -> Candidate:
    c = outcome.config
    common = dict(mesh=c.mesh, schedule=c.schedule, virtual_stages=c.virtual_stages,
                  microbatches=c.microbatches)
    if isinstance(outcome, Refused):
        return Candidate(status="refused", reason=f"the runtime refuses its plan: "
                         f"{outcome.reason}", **common)
    if isinstance(outcome, Infeasible):
        return Candidate(status="infeasible", min_memory_bytes=outcome.min_memory_bytes,
                         reason=f"needs at least {human_bytes(outcome.min_memory_bytes)} per rank",
                         **common)
    return Candidate(status="optimal", objective_s=outcome.step_time_s,
                     lower_bound_s=outcome.lower_bound_s, **common)


def _make_pipeline_plan(graph: LayerGraph, cluster: Cluster, prec: Precision,
                        outcome: PipelineOutcome, report: SolverReport) -> Plan:
    c = outcome.config
    peaks = outcome.rank_peak_at or ("",) * len(outcome.rank_memory)
    ranks = tuple(
        MemoryBreakdown(
            params_bytes=int(mem["params"]), grads_bytes=int(mem["grads"]),
            optimizer_bytes=int(mem["optimizer"]), activations_bytes=int(mem["activations"]),
            buffers_bytes=int(mem["buffers"]),
            margin_bytes=int(cluster.memory_margin_fraction * sum(mem.values())), peak_at=at)
        for mem, at in zip(outcome.rank_memory, peaks, strict=True))
    memory = max(ranks, key=lambda m: m.total_bytes)
    assert memory.total_bytes <= cluster.device.memory_bytes, "a pipeline rank overflows"
    owner = {s.stage: s.rank for s in outcome.timeline.slots}
    busiest = max(range(c.mesh.pp), key=lambda r: sum(
        s.end_s - s.start_s for s in outcome.timeline.slots if s.rank == r))
    mine = [cost for cost, st in zip(outcome.costs, outcome.stage_of_layer, strict=True)
            if owner[st] == busiest]
    compute = sum(cost.compute_s for cost in mine)
    comm = sum(cost.comm_s for cost in mine)
    bubble = max(0.0, outcome.step_time_s - compute - comm)
    prediction = Prediction(
        step_time_s=outcome.step_time_s, compute_s=compute, comm_s=comm, memory=memory,
        capacity_bytes=cluster.device.memory_bytes, source=cluster.provenance,
        bubble_s=bubble, bubble_fraction=outcome.timeline.bubble_fraction, rank_memory=ranks)
    pipeline = PipelineSpec(schedule=c.schedule, num_microbatches=c.microbatches,
                            virtual_stages=c.virtual_stages)
    return _build_plan(graph, cluster, prec, c.mesh, outcome.costs, outcome.stage_of_layer,
                       prediction, report, pipeline)


def _infeasible(graph: LayerGraph, cluster: Cluster, candidates: list[Candidate]
                ) -> InfeasibleError:
    tried = [c for c in candidates if c.status == "infeasible"]
    if not tried:
        raise ConfigError(
            f"no parallel layout of {cluster.world_size} devices suits batch {graph.batch_size}: "
            + "; ".join(f"{c.mesh.describe()}: {c.reason}" for c in candidates))
    least = min(tried, key=lambda c: c.min_memory_bytes or float("inf"))
    cap = cluster.device.memory_bytes
    refused = [c for c in candidates if c.status == "refused"]
    also = (f" {len(refused)} shape(s) fit but the runtime refuses their plans (first: "
            f"{refused[0].mesh.describe()}: {refused[0].reason})." if refused else "")
    return InfeasibleError(
        f"no plan fits {graph.model_name or 'the model'} (batch {graph.batch_size}) on "
        f"{cluster.world_size} × {cluster.device.name} ({human_bytes(cap)} each): the smallest "
        f"per-rank memory any plan needs is {human_bytes(least.min_memory_bytes)} "
        f"(mesh {least.mesh.describe()}, allocator margin "
        "included). "
        "Try more devices or nodes, a smaller batch, or a lower precision (--dtype bfloat16)."
        + also
    )
