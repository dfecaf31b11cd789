"""The search: every configuration through the engine (autopar/planner/engine.py), the
fastest feasible plan kept.

pp = 1 first: every mesh dp × cp × tp with tp inside a node (tp divides the devices per
node), dp dividing the global batch and cp a power of two whose 2·cp chunks divide the
sequence (only for models that can run context-parallel, see passes/context_parallel.py),
and every gradient accumulation m (a divisor of the per-replica batch, up to 64). Before
each ILP, the LP bound of its knapsack (autopar.planner.bounds, no solver) skips it when it
cannot beat the mesh's outcome (more accumulation only trades time for activation memory)
or the best outcome found. Then the pipelines (``Engine.pipelines``), in the order of their
bounds, which must beat the best pp = 1 outcome. The reported lower bound is the smallest
bound over all evaluated candidates, so it bounds every plan the search space holds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from autopar.errors import ConfigError, InfeasibleError, TimeLimitError
from autopar.planner.configs import (
    Config,
    accumulation_steps,
    batch_norm_layers,
    candidate_meshes,
    pipeline_configs,
    pipeline_problem,
)
from autopar.planner.engine import Engine, Infeasible, Outcome, TimeLimitReached
from autopar.planner.estimators import ANALYTIC, Estimators
from autopar.planner.ilp import make_solver
from autopar.report import human_bytes
from cost_models.hardware import Cluster
from cost_models.memory import precision
from cost_models.schedule import Timeline
from passes.records import LayerGraph
from runtime.plan import Mesh, Plan, SolverReport


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
    min_memory_exact: bool = True
    """False: ``min_memory_bytes`` is a floor of that least memory."""
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
        if pipeline and not any(c.mesh == mesh for c in pipeline_configs(graph, cluster)):
            raise ConfigError(
                f"mesh {mesh.describe()} is not a pipeline layout of {cluster.name} with "
                f"{cluster.world_size} devices for this model and batch: pp × dp × tp must "
                "equal the device count with tp dividing the devices per node, pp at most "
                f"the {len(graph.layers) - len(graph.uncuttable)} places a stage may start, "
                f"and dp dividing the global batch {graph.batch_size}")
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

    engine = Engine(graph, cluster, prec, time_limit_s, estimators=estimators)
    candidates: list[Candidate] = []
    best: Outcome | None = None
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
        found = _one_stage(engine, m, best, check)
        candidates.append(found.candidate)
        if found.best is not None and (best is None or found.best.step_time_s < best.step_time_s):
            best = found.best
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
            pipe_best, outcomes = engine.pipelines(
                best.step_time_s if best else float("inf"),
                deadline=start if cut_short else deadline, mesh=mesh)
        except TimeLimitReached as stop:
            cut_short = True
            pipe_best, outcomes = stop.best, stop.results
        if check is not None:
            pipe_best, outcomes = _checked(engine, outcomes, check)
        candidates += [_candidate(o) for o in outcomes]
        _tell(progress, candidates, len(candidates))
    if pipe_best is not None and (best is None or pipe_best.step_time_s < best.step_time_s):
        best = pipe_best
    if best is None and cut_short:
        raise TimeLimitError(
            f"no plan found for {graph.model_name or 'the model'} on {cluster.world_size} "
            f"devices within the time limit of {time_limit_s:g} s: allow more time "
            "(--time-limit, or time_limit_s=)")
    if best is None:
        raise _infeasible(graph, cluster, candidates)
    # A search cut short certifies nothing about what it did not evaluate.
    lower = 0.0 if cut_short else min([c.lower_bound_s for c in candidates
                                       if c.status == "optimal"] + [best.step_time_s])
    report = SolverReport(
        solver=make_solver(time_limit_s).name, status="time limit" if cut_short else "optimal",
        objective_s=best.step_time_s, lower_bound_s=lower,
        gap=(best.step_time_s - lower) / best.step_time_s if best.step_time_s else 0.0,
        solve_time_s=time.perf_counter() - start, candidates=len(candidates))
    return SearchResult(plan=engine.plan(best, report), candidates=tuple(candidates),
                        search_time_s=time.perf_counter() - start, timeline=best.timeline)


@dataclass(frozen=True)
class _MeshResult:
    candidate: Candidate
    best: Outcome | None


def _one_stage(engine: Engine, mesh: Mesh, best: Outcome | None, check: PlanCheck | None
               ) -> _MeshResult:
    """The fastest pp = 1 outcome of one mesh over its gradient accumulations, and the
    mesh's candidate record. The LP bound of each accumulation's programs skips it when it
    cannot beat the mesh's outcome so far (more accumulation only trades time for
    activation memory) or ``best``, the best found on any mesh."""
    mesh_best: Outcome | None = None
    refusal = None  # what the runtime refused in this mesh's best plan, if anything
    least_need = float("inf")
    outclassed = float("inf")  # the least bound of accumulations the best plan beats
    for k in accumulation_steps(engine.graph, mesh):
        config = Config(mesh=mesh, microbatches=k)
        programs = engine.programs(config)
        bound = engine.programs_bound(programs)
        if bound == float("inf"):
            least_need = min(least_need, engine.least_memory(programs))
            continue
        if mesh_best is not None and mesh_best.step_time_s <= bound:
            continue  # more accumulation cannot beat this mesh's plan
        if best is not None and best.step_time_s < bound:
            outclassed = min(outclassed, bound)
            continue  # nothing here can beat the best plan found
        outcome = engine.solve(config, programs)
        if isinstance(outcome, Infeasible):
            least_need = min(least_need, outcome.min_memory_bytes)
            continue
        if check is not None:
            refused = check(engine.plan(outcome, _UNSOLVED))
            if refused is not None:
                refusal = refused
                continue
        if mesh_best is None or outcome.step_time_s < mesh_best.step_time_s:
            mesh_best = outcome
    if mesh_best is not None:
        return _MeshResult(_candidate(mesh_best), mesh_best)
    if refusal is not None:
        return _MeshResult(Candidate(mesh=mesh, status="refused",
                                     reason=f"the runtime refuses its plan: {refusal}"), None)
    # An accumulation the best plan outclasses may fit where smaller ones do not: the mesh
    # cannot beat the best plan, which is not the same as nothing fitting on it.
    if outclassed < float("inf"):
        return _MeshResult(Candidate(
            mesh=mesh, status="skipped", lower_bound_s=outclassed,
            reason=f"cannot beat the best plan: no plan on it takes less than "
                   f"{outclassed:.3g} s per step (LP bound)"), None)
    return _MeshResult(Candidate(mesh=mesh, status="infeasible", min_memory_bytes=least_need,
                                 reason=f"needs at least {human_bytes(least_need)} per rank"),
                       None)


def _tell(progress: ProgressFn | None, candidates: list[Candidate], total: int) -> None:
    """Report the latest candidate and the best step time so far to the progress callback."""
    if progress is not None and candidates:
        done = [c.objective_s for c in candidates if c.status == "optimal"]
        progress(evaluated=len(candidates), total=total,
                 best_s=min(done) if done else None, candidate=candidates[-1])


PlanCheck = Callable[[Plan], "str | None"]
"""Why the runtime would refuse a plan, or None (``runtime.validate.plan_problem``)."""

_OUT_OF_TIME = "not searched: the time limit (--time-limit) ran out first"

_UNSOLVED = SolverReport(solver="", status="optimal", objective_s=0.0, lower_bound_s=0.0,
                         gap=0.0, solve_time_s=0.0)
"""The report of a plan built only to be checked."""


@dataclass(frozen=True)
class Refused:
    """A configuration whose best plan the runtime refuses."""

    config: Config
    reason: str


def _checked(engine: Engine, outcomes: list, check: PlanCheck
             ) -> tuple[Outcome | None, list]:
    """Every feasible outcome's plan checked; the fastest one the runtime runs."""
    checked: list = []
    for o in outcomes:
        if isinstance(o, Outcome):
            problem = check(engine.plan(o, _UNSOLVED))
            o = o if problem is None else Refused(o.config, problem)
        checked.append(o)
    runs = [o for o in checked if isinstance(o, Outcome)]
    return min(runs, key=lambda o: o.step_time_s, default=None), checked


def _candidate(outcome: Outcome | Infeasible | Refused) -> Candidate:
    """An outcome as the search reports it."""
    c = outcome.config
    common = dict(mesh=c.mesh, schedule=c.schedule, virtual_stages=c.virtual_stages,
                  microbatches=c.microbatches)
    if isinstance(outcome, Refused):
        return Candidate(status="refused", reason=f"the runtime refuses its plan: "
                         f"{outcome.reason}", **common)
    if isinstance(outcome, Infeasible):
        return Candidate(status="infeasible", min_memory_bytes=outcome.min_memory_bytes,
                         min_memory_exact=outcome.exact,
                         reason=f"needs at least {human_bytes(outcome.min_memory_bytes)} per rank",
                         **common)
    return Candidate(status="optimal", objective_s=outcome.step_time_s,
                     lower_bound_s=outcome.lower_bound_s, choice=outcome.choice, **common)


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
        f"per-rank memory any plan needs is {'' if least.min_memory_exact else 'at least '}"
        f"{human_bytes(least.min_memory_bytes)} "
        f"(mesh {least.mesh.describe()}, allocator margin "
        "included). "
        "Try more devices or nodes, a smaller batch, or a lower precision (--dtype bfloat16)."
        + also
    )
