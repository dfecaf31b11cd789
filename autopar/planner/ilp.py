r"""The inner integer linear program: strategies for classes of layers on a fixed mesh.

Given a mesh (dp × tp), classes c of identical layers with n_c members, and for each
allowed strategy s of class c its time t_{c,s} (seconds), resident memory m_{c,s} and
transient buffer β_{c,s} (bytes per rank):

    variables   y_{c,s} ∈ {0, …, n_c}   how many layers of class c use strategy s
                u_{c,s} ∈ {0, 1}        some layer of class c uses s (only where β_{c,s} > 0)
                b ≥ 0                   the largest transient buffer over the plan's layers

    minimise    Σ_c Σ_s t_{c,s} y_{c,s}                               (step time, seconds)

    subject to  count_layers[c]:  Σ_s y_{c,s} = n_c                                  ∀ c
                uses[c,s]:        y_{c,s} ≤ n_c u_{c,s}                      ∀ c, s: β > 0
                buffer[c,s]:      b ≥ β_{c,s} u_{c,s}                        ∀ c, s: β > 0
                memory_fits:      (1 + μ) (Σ_c Σ_s m_{c,s} y_{c,s} + b) ≤ C
                host_fits:        Σ_c Σ_s h_{c,s} y_{c,s} ≤ H      (offloaded states, bytes)

where C is the device's memory, μ the allocator margin and H the host memory one device
may fill. A strategy s here is an option: a strategy with its sequence-parallel, offload
and recompute choices (runtime.plan.option_label). Identical layers are
interchangeable in this objective, so counting them loses nothing against choosing per
layer, and the program grows with the number of layer classes, not with depth. The LP
relaxation (y, u continuous) gives the lower bound reported with the plan.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import pulp

from autopar.planner.bounds import CapBounds, time_value
from autopar.planner.costs import HOST_MEMORY_BYTES, LayerCost, undominated

GIB = 1024**3
MS = 1e3
# Solvers accept rows violated by their feasibility tolerance (HiGHS: 1e-7, i.e. ~100 bytes
# in GiB units), so the memory row keeps 1 KiB of slack: a plan never exceeds the device.
FEASIBILITY_SLACK_GIB = 1024 / GIB
BOUND_TOLERANCE = 1e-5
"""Relative slack between a solver-free lower bound (bounds.py) and HiGHS's objective,
which it computes from integers accepted within 1e-6 (mip_feasibility_tolerance), summed
over a few options."""
HIGHS_GAP_MARGIN = 1e-3
"""HiGHS stops within mip_rel_gap = 1e-4 (its default) of its own bound, so its answer for
a sub-program is at most 1e-4 above that sub-program's best integer point; ten times that
keeps pruning against an integer point found by bounds.py safe."""


@dataclass(frozen=True, kw_only=True)
class ClassOptions:
    """One class of identical layers and the cost of each strategy it may take."""

    name: str
    count: int
    costs: dict[str, LayerCost]
    inflight: int = 1
    """Micro-batches whose activations this class holds at once (pipeline schedules)."""
    members: dict[str, dict[str, LayerCost]] = field(default_factory=dict)
    """For tied layers joined into one class (planner/ties.py): each layer's own costs by
    option; empty for a class of identical layers."""


@dataclass(frozen=True, kw_only=True)
class ILPResult:
    status: str
    """'optimal', 'infeasible' or 'not solved' (time limit without a solution)."""
    objective_s: float
    lower_bound_s: float
    choice: dict[str, dict[str, int]]
    """Class name -> {strategy: number of its layers}."""
    solver: str
    solve_time_s: float


def expand_counts(counts: dict[str, int]) -> list[str]:
    """{option: number of layers} -> one option per layer, in the order of the class's
    options (identical layers are interchangeable, so any fixed order is as good)."""
    return [s for s, n in counts.items() for _ in range(n)]


def make_solver(time_limit_s: float) -> pulp.LpSolver:
    """HiGHS in-process when highspy is installed (no subprocess per solve), else CBC.

    HiGHS on one thread: its default (half the machine's threads) starts workers that our
    programs, a few dozen columns each, leave waiting; over the 1T-parameter Megatron
    row's 600 solves that cost 15% of the search's CPU time on 2 cores. HiGHS runs little
    of a MIP in parallel (symmetry detection; its docs, "Parallelism"), and the plans are
    the same (tests/autopar/planner/test_plans_unchanged.py)."""
    if pulp.HiGHS(msg=False).available():
        _silence_highs_banner()
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)


@functools.cache
def _silence_highs_banner() -> None:
    """highspy (1.16) prints its banner to the C stdout when a process makes its first
    ``Highs()``, before PuLP can turn ``output_flag`` off (ERGO-Code/HiGHS#2749), so
    ``autopar plan``'s output began with two lines of it. Make that first instance here,
    with file descriptor 1 pointed at /dev/null and C's stdout flushed before it comes
    back (POSIX; elsewhere the banner stays)."""
    import highspy

    if os.name != "posix":
        return
    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
            libc.fflush(None)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def ilp_relevant(c: ClassOptions) -> ClassOptions:
    """The class with only the options the program could prefer: an option no faster, no
    smaller (resident at the class's in-flight count) and with no smaller buffer or host
    use than another is never needed. Fewer near-identical columns keep HiGHS's branching
    short."""
    kept = undominated(c.costs, lambda x: (x.time_s, x.resident_with(c.inflight),
                                           x.buffers_bytes, x.host_bytes, x.compute_s))
    return ClassOptions(name=c.name, count=c.count, costs=kept, inflight=c.inflight)


def _linear(terms: Iterable[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """Σ coefficient · variable, built as one expression: ``lpSum`` of products builds an
    expression per term and merges them, the larger part of the time a pipeline search
    spends in PuLP. Each variable appears once and zero terms are dropped, as ``lpSum``
    drops them, so HiGHS gets the same program."""
    return pulp.LpAffineExpression([(v, c) for v, c in terms if c != 0])


class StrategyILP:
    """Builds and solves the program above; one method per constraint category."""

    def __init__(
        self,
        classes: list[ClassOptions],
        capacity_bytes: float,
        margin_fraction: float,
        *,
        minimise: str = "time",
        relax: bool = False,
        host_capacity_bytes: float = HOST_MEMORY_BYTES,
        fixed_buffer_bytes: float | None = None,
    ) -> None:
        self.host_capacity_bytes = host_capacity_bytes
        self.fixed_buffer = fixed_buffer_bytes
        if minimise == "time":
            classes = [ilp_relevant(c) for c in classes]
        self.classes = classes
        self.capacity_bytes = capacity_bytes
        self.margin = margin_fraction
        self.relax = relax
        self.minimise = minimise
        self.prob = pulp.LpProblem("autopar_strategies", pulp.LpMinimize)
        # Variables are named by class index: class names need not be valid LP names.
        self._index = {c.name: i for i, c in enumerate(classes)}
        self.y = {
            (c.name, s): self.prob.add_variable(
                f"y_{i}_{s}", 0, c.count, pulp.LpContinuous if relax else pulp.LpInteger)
            for i, c in enumerate(classes)
            for s in c.costs
        }
        self.u = {
            (c.name, s): self.prob.add_variable(
                f"u_{i}_{s}", 0, 1, pulp.LpContinuous if relax else pulp.LpBinary)
            for i, c in enumerate(classes)
            for s, cost in c.costs.items()
            if cost.buffers_bytes > 0 and fixed_buffer_bytes is None
        }
        # Memory rows are written in GiB and time in milliseconds: with raw bytes (~1e9)
        # beside seconds (~1e-3) HiGHS returned a non-optimal "optimal" answer that the
        # brute-force test caught (tests/test_planner.py, seed 12).
        if fixed_buffer_bytes is None:
            self.b = self.prob.add_variable("buffer_gib", lowBound=0)
        else:
            self.b = fixed_buffer_bytes / GIB
        self._memory_expr = _linear(
            (self.y[c.name, s], cost.resident_with(c.inflight) / GIB)
            for c in classes
            for s, cost in c.costs.items()
        ) + self.b
        if minimise == "time":
            self.add_objective_time()
            self.add_memory_fits()
        else:
            self.prob += self._memory_expr
        self.add_count_layers()
        self.add_buffer()
        self.add_host_fits()

    def add_objective_time(self) -> None:
        self.prob += _linear(
            (self.y[c.name, s], cost.time_s * MS)
            for c in self.classes
            for s, cost in c.costs.items()
        )

    def add_count_layers(self) -> None:
        for c in self.classes:
            self.prob += (
                pulp.lpSum(self.y[c.name, s] for s in c.costs) == c.count,
                f"count_layers_{self._index[c.name]}",
            )

    def add_buffer(self) -> None:
        for (name, s), u in self.u.items():
            i = self._index[name]
            count = self.classes[i].count
            cost = self.classes[i].costs[s]
            self.prob += (self.y[name, s] <= count * u, f"uses_{i}_{s}")
            self.prob += (self.b >= cost.buffers_bytes / GIB * u, f"buffer_{i}_{s}")

    def add_memory_fits(self) -> None:
        self.prob += (
            (1 + self.margin) * self._memory_expr <= self.capacity_bytes / GIB - FEASIBILITY_SLACK_GIB,
            "memory_fits",
        )

    def add_host_fits(self) -> None:
        offloaded = [(c, s, cost.host_bytes) for c in self.classes
                     for s, cost in c.costs.items() if cost.host_bytes > 0]
        if offloaded:
            self.prob += (
                pulp.lpSum(nbytes / GIB * self.y[c.name, s] for c, s, nbytes in offloaded)
                <= self.host_capacity_bytes / GIB - FEASIBILITY_SLACK_GIB,
                "host_fits",
            )

    def cannot_fit(self) -> bool:
        """Whether the memory row fails even with every layer on its smallest option. With
        the buffer fixed the row can lose all its variables (options with no resident
        bytes), and HiGHS's presolve then accepts a constant row over by its slack."""
        if self.minimise != "time":
            return False
        smallest = sum(c.count * min(x.resident_with(c.inflight) for x in c.costs.values())
                       for c in self.classes) / GIB
        base = smallest + (self.b if self.fixed_buffer is not None else 0.0)
        return (1 + self.margin) * base > self.capacity_bytes / GIB - FEASIBILITY_SLACK_GIB

    def solve(self, time_limit_s: float = 10.0) -> ILPResult:
        solver = make_solver(time_limit_s)
        if self.cannot_fit():
            return ILPResult(status="infeasible", objective_s=float("inf"),
                             lower_bound_s=float("inf"), choice={}, solver=solver.name,
                             solve_time_s=0.0)
        start = time.perf_counter()
        self.prob.solve(solver)
        elapsed = time.perf_counter() - start
        status = pulp.LpStatus[self.prob.status]
        if status != "Optimal" or self.prob.objective is None:
            return ILPResult(status="infeasible" if status == "Infeasible" else "not solved",
                             objective_s=float("inf"), lower_bound_s=float("inf"), choice={},
                             solver=solver.name, solve_time_s=elapsed)
        scale = MS if self.minimise == "time" else 1 / GIB
        value = float(pulp.value(self.prob.objective)) / scale
        choice = {
            c.name: {s: n for s in c.costs if (n := round(self.y[c.name, s].varValue or 0)) > 0}
            for c in self.classes
        }
        return ILPResult(status="optimal", objective_s=value, lower_bound_s=value, choice=choice,
                         solver=solver.name, solve_time_s=elapsed)


def solve_by_buffer_cap(classes: list[ClassOptions], capacity_bytes: float,
                        margin_fraction: float, time_limit_s: float = 10.0, *,
                        prune: bool = True) -> ILPResult:
    """The integer program solved once per value of the largest buffer b, each time with
    only the options whose buffer fits under it and b fixed: no binaries u, so every
    sub-program is a small knapsack HiGHS closes at once, where the binaries' big-M rows
    made it branch for up to seconds (the 1T-parameter Megatron row took minutes).
    Exact: the optimum's largest buffer is one of the values tried.

    Sub-programs go in order of their LP bound (bounds.py), and HiGHS sees one only while
    that bound could still beat the best answer so far and the best integer point the
    bounds found: most caps close without a solver call. Ties go to the smallest cap, as
    when every cap was solved in increasing order, so pruning does not change the answer."""
    classes = [ilp_relevant(c) for c in classes]
    if not prune:
        return _solve_every_cap(classes, capacity_bytes, margin_fraction, time_limit_s)
    subs = _buffer_caps(classes, capacity_bytes, margin_fraction)
    incumbent = min((upper for _, _, upper, _ in subs), default=math.inf)
    best: tuple[float, ILPResult] | None = None  # (cap, its answer)
    elapsed, solver = 0.0, make_solver(time_limit_s).name
    for lower, cap, _, sub in sorted(subs, key=lambda item: item[:2]):
        if not _may_win(lower, cap, best, incumbent):
            continue
        result = StrategyILP(sub, capacity_bytes, margin_fraction,
                             fixed_buffer_bytes=cap).solve(time_limit_s)
        elapsed += result.solve_time_s
        if result.status == "optimal" and (
                best is None or (result.objective_s, cap) < (best[1].objective_s, best[0])):
            best = (cap, result)
    if best is None:
        return ILPResult(status="infeasible", objective_s=float("inf"),
                         lower_bound_s=float("inf"), choice={}, solver=solver,
                         solve_time_s=elapsed)
    cap, result = best
    choice = least_work(classes, result.choice, cap, capacity_bytes, margin_fraction)
    return ILPResult(status="optimal", objective_s=result.objective_s,
                     lower_bound_s=result.objective_s, choice=choice,
                     solver=result.solver, solve_time_s=elapsed)


TIE_TOLERANCE = 1e-9
"""Relative difference in step time below which two options count as equally fast."""


def least_work(classes: list[ClassOptions], choice: dict[str, dict[str, int]], cap: float,
               capacity_bytes: float, margin_fraction: float) -> dict[str, dict[str, int]]:
    """The same step time with as little compute as fits: layers move to an option exactly
    as fast that computes less (no recomputation, no offloaded optimizer step), while the
    memory row still holds with the buffer at ``cap``.

    Ties are real: in a backward bound by its gradient reduction, recomputation runs while
    the reduction does (cost_models.overlap), so it costs no time, and the program is free
    to pick it. A user reading the plan expects it only where memory needs it."""
    by_name = {c.name: c for c in classes}
    counts = {name: dict(options) for name, options in choice.items()}

    def used() -> float:
        resident = sum(n * by_name[name].costs[s].resident_with(by_name[name].inflight)
                       for name, options in counts.items() for s, n in options.items())
        return (1 + margin_fraction) * (resident + cap)

    limit = capacity_bytes - FEASIBILITY_SLACK_GIB * GIB
    for name, options in choice.items():
        c = by_name[name]
        for s in options:
            chosen = c.costs[s]
            lighter = sorted((x.compute_s, o) for o, x in c.costs.items()
                             if x.compute_s < chosen.compute_s and x.buffers_bytes <= cap
                             and x.time_s <= chosen.time_s * (1 + TIE_TOLERANCE))
            for _, o in lighter:
                while counts[name].get(s, 0) > 0:
                    counts[name][s] -= 1
                    counts[name][o] = counts[name].get(o, 0) + 1
                    if used() > limit:
                        counts[name][o] -= 1
                        counts[name][s] += 1
                        break
    return {name: {s: n for s, n in options.items() if n > 0} for name, options in counts.items()}


def _solve_every_cap(classes: list[ClassOptions], capacity_bytes: float,
                     margin_fraction: float, time_limit_s: float) -> ILPResult:
    """solve_by_buffer_cap without bounds: every cap in increasing order, each unless its
    memory-blind time cannot beat the answer so far (what the bounds must agree with)."""
    best: ILPResult | None = None
    elapsed = 0.0
    for cap in sorted({cost.buffers_bytes for c in classes for cost in c.costs.values()}):
        sub = _under_cap(classes, cap)
        if any(not c.costs for c in sub):
            continue
        fastest = sum(c.count * min(x.time_s for x in c.costs.values()) for c in sub)
        if best is not None and fastest >= best.objective_s:
            continue  # even ignoring memory this cap cannot do better
        result = StrategyILP(sub, capacity_bytes, margin_fraction,
                             fixed_buffer_bytes=cap).solve(time_limit_s)
        elapsed += result.solve_time_s
        if result.status == "optimal" and (best is None or result.objective_s < best.objective_s):
            best = result
    if best is None:
        return ILPResult(status="infeasible", objective_s=float("inf"),
                         lower_bound_s=float("inf"), choice={},
                         solver=make_solver(time_limit_s).name, solve_time_s=elapsed)
    return ILPResult(status="optimal", objective_s=best.objective_s,
                     lower_bound_s=best.objective_s, choice=best.choice, solver=best.solver,
                     solve_time_s=elapsed)


def _under_cap(classes: list[ClassOptions], cap: float) -> list[ClassOptions]:
    """The classes with only their options whose buffer fits under ``cap``."""
    return [ClassOptions(name=c.name, count=c.count, inflight=c.inflight,
                         costs={s: x for s, x in c.costs.items() if x.buffers_bytes <= cap})
            for c in classes]


def _buffer_caps(classes: list[ClassOptions], capacity_bytes: float, margin_fraction: float
                 ) -> list[tuple[float, float, float, list[ClassOptions]]]:
    """Per buffer cap whose LP is feasible: (lower bound, cap, upper bound, sub-program)."""
    out = []
    bounds = CapBounds(classes, capacity_bytes, margin_fraction, time_value)
    for cap in sorted({cost.buffers_bytes for c in classes for cost in c.costs.values()}):
        lower, upper = bounds.at(cap)
        sub = _under_cap(classes, cap)
        if not math.isinf(lower):  # an infeasible LP: so is the integer program
            out.append((lower, cap, upper, sub))
    return out


def _may_win(lower_s: float, cap: float, best: tuple[float, ILPResult] | None,
             incumbent_s: float) -> bool:
    """Whether the sub-program at ``cap`` could still be the answer: strictly faster than
    the best so far or tied with it at a smaller cap, and not beaten by the incumbent."""
    shrunk = lower_s * (1 - BOUND_TOLERANCE)
    if shrunk > incumbent_s * (1 + HIGHS_GAP_MARGIN):
        return False
    if best is None:
        return True
    best_cap, result = best
    return shrunk < result.objective_s or (shrunk == result.objective_s and cap < best_cap)


def solve_strategies(
    classes: list[ClassOptions], capacity_bytes: float, margin_fraction: float,
    time_limit_s: float = 10.0,
) -> ILPResult:
    """The integer program, with its LP relaxation's value as the lower bound."""
    result = solve_by_buffer_cap(classes, capacity_bytes, margin_fraction, time_limit_s)
    if result.status != "optimal":
        return result
    lp = StrategyILP(classes, capacity_bytes, margin_fraction, relax=True).solve(time_limit_s)
    bound = min(lp.objective_s, result.objective_s) if lp.status == "optimal" else 0.0
    return ILPResult(status=result.status, objective_s=result.objective_s, lower_bound_s=bound,
                     choice=result.choice, solver=result.solver,
                     solve_time_s=result.solve_time_s + lp.solve_time_s)


def min_memory(classes: list[ClassOptions], margin_fraction: float
               ) -> tuple[float, dict[str, dict[str, int]]]:
    """The smallest per-rank memory (margin included) any assignment needs, and one that
    needs it. Exact without a solver: once the largest buffer is fixed, every class
    independently takes its least-memory strategy among those within that buffer. When
    that assignment would overflow the host with offloaded states, the figure is taken
    without offload (then an upper bound on the least memory)."""
    need, choice = _min_device_memory(classes, margin_fraction)
    by_name = {c.name: c for c in classes}
    host = sum(n * by_name[name].costs[s].host_bytes
               for name, counts in choice.items() for s, n in counts.items())
    if host <= HOST_MEMORY_BYTES:
        return need, choice
    kept = [ClassOptions(name=c.name, count=c.count, inflight=c.inflight,
                         costs={s: x for s, x in c.costs.items() if x.host_bytes == 0})
            for c in classes]
    return _min_device_memory(kept, margin_fraction)


def _min_device_memory(classes: list[ClassOptions], margin_fraction: float
                       ) -> tuple[float, dict[str, dict[str, int]]]:
    caps = sorted({0.0} | {cost.buffers_bytes for c in classes for cost in c.costs.values()})
    # Per class, its options by buffer: as the cap grows, the least (resident, option) among
    # those under it is a running minimum (the same pair as the minimum over all of them).
    by_buffer = [sorted((cost.buffers_bytes, (cost.resident_with(c.inflight), s))
                        for s, cost in c.costs.items()) for c in classes]
    seen, least = [0] * len(classes), [None] * len(classes)
    best, best_choice = float("inf"), {}
    for cap in caps:
        for i, options in enumerate(by_buffer):
            while seen[i] < len(options) and options[seen[i]][0] <= cap:
                pair = options[seen[i]][1]
                least[i] = pair if least[i] is None or pair < least[i] else least[i]
                seen[i] += 1
        if any(pair is None for pair in least):
            continue
        total, choice = cap, {}
        for c, (resident, strategy) in zip(classes, least, strict=True):
            total += c.count * resident
            choice[c.name] = {strategy: c.count}
        if total < best:
            best, best_choice = total, choice
    return (1 + margin_fraction) * best, best_choice
