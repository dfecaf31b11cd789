"""Solver-free bounds on the rank ILP: below its optimum, and pruning with them changes nothing."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autopar.planner.bounds import bounds_at_cap, knapsack_lp, lower_hull, rank_bound
from autopar.planner.costs import LayerCost
from autopar.planner.ilp import FEASIBILITY_SLACK_GIB, GIB, ClassOptions, solve_by_buffer_cap
from autopar.planner.stages import stage_peaks, unit_peaks
from cost_models.schedule import StageTimes, simulate
from runtime.schedule_orders import runtime_orders

MARGIN = 0.1


def option(time_s: float, states_gib: float, buffer_gib: float) -> LayerCost:
    return LayerCost(option="o", strategy="replicate", recompute="none", offload=False,
                     sequence_parallel=False, microbatches=1, fwd_s=time_s / 3,
                     bwd_s=time_s / 3, wgrad_s=time_s / 3, step_s=0.0, compute_s=time_s,
                     comm_s=0.0, params_bytes=states_gib * GIB, grads_bytes=0.0,
                     optimizer_bytes=0.0, activations_bytes=0.0, buffers_bytes=buffer_gib * GIB,
                     output_bytes=0.0)


def brute_force(classes: list[ClassOptions], capacity_bytes: float) -> float:
    """The rank ILP's optimum: every multiset of options per class, the memory row as the
    ILP writes it (margin, largest buffer, 1 KiB slack)."""
    per_class = [list(itertools.combinations_with_replacement(c.costs.values(), c.count))
                 for c in classes]
    best = math.inf
    for combo in itertools.product(*per_class):
        chosen = [x for group in combo for x in group]
        memory = sum(x.resident_bytes for x in chosen) + max(x.buffers_bytes for x in chosen)
        if (1 + MARGIN) * memory <= capacity_bytes - FEASIBILITY_SLACK_GIB * GIB:
            best = min(best, sum(x.time_s for x in chosen))
    return best


options_st = st.lists(
    st.builds(option, st.floats(0.1, 10), st.floats(0.0, 4.0),
              st.sampled_from([0.0, 0.5, 1.0, 2.0])),
    min_size=1, max_size=4)
classes_st = st.lists(st.tuples(st.integers(1, 3), options_st), min_size=1, max_size=3)


def as_classes(raw) -> list[ClassOptions]:
    return [ClassOptions(name=f"c{i}", count=n, costs={f"s{j}": x for j, x in enumerate(opts)})
            for i, (n, opts) in enumerate(raw)]


@settings(max_examples=150, deadline=None)
@given(classes_st, st.floats(1.0, 24.0))
def test_rank_bound_never_exceeds_the_ilp_optimum(raw, capacity_gib):
    classes = as_classes(raw)
    optimum = brute_force(classes, capacity_gib * GIB)
    bound = rank_bound(classes, capacity_gib * GIB, MARGIN)
    assert bound <= optimum * (1 + 1e-9)
    if math.isinf(bound):
        assert math.isinf(optimum)  # inf only where nothing fits
    for cap in {x.buffers_bytes for c in classes for x in c.costs.values()}:
        lower, upper = bounds_at_cap(classes, cap, capacity_gib * GIB, MARGIN)
        assert lower <= upper
        if upper < math.inf:  # the rounded point fits, so the optimum is no worse
            assert optimum <= upper * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(classes_st, st.floats(1.0, 24.0))
# A row left with no variables (nothing resident, the buffer fixed) over by exactly the
# slack: HiGHS's presolve accepted it, brute force does not.
@example([(1, [option(1.0, 0.0, 1.0)])], 1.1)
def test_pruned_cap_search_gives_the_same_answer_as_solving_every_cap(raw, capacity_gib):
    classes = as_classes(raw)
    pruned = solve_by_buffer_cap(classes, capacity_gib * GIB, MARGIN)
    every = solve_by_buffer_cap(classes, capacity_gib * GIB, MARGIN, prune=False)
    assert (pruned.status, pruned.choice) == (every.status, every.choice)
    optimum = brute_force(classes, capacity_gib * GIB)
    assert (pruned.status == "optimal") == math.isfinite(optimum)
    assert pruned.objective_s == pytest.approx(optimum, rel=1e-6) or math.isinf(optimum)


def test_lp_value_is_the_lagrangian_dual():
    # Two classes of 2 layers; the LP fills the best time-per-byte moves first.
    classes = [(2, [(1.0, 10.0), (2.0, 6.0), (4.0, 5.0)]), (2, [(0.0, 8.0), (3.0, 2.0)])]
    capacity = 9.0
    lp = knapsack_lp(classes, capacity)
    dual = max(sum(n * min(v + lam * w for w, v in pts) for n, pts in classes) - lam * capacity
               for lam in [i / 1000 for i in range(0, 10001)])
    assert lp == pytest.approx(dual, abs=1e-6)


def test_lower_hull_drops_dominated_and_non_convex_points():
    points = [(1.0, 10.0), (2.0, 9.5), (3.0, 4.0), (3.5, 6.0), (5.0, 3.5), (6.0, 3.5)]
    assert lower_hull(points) == [(1.0, 10.0), (3.0, 4.0), (5.0, 3.5)]


@pytest.mark.parametrize("schedule,v", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2),
                                        ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)])
@pytest.mark.parametrize("pp,m", [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_fixed_order_peaks_match_the_simulated_ones(schedule, v, pp, m):
    unit = [StageTimes(fwd_s=1.0, bwd_s=1.0, wgrad_s=1.0)] * (pp * v)
    simulated = stage_peaks(simulate(schedule, pp, m, unit,
                                     orders=runtime_orders(schedule, pp, v, m)), pp * v)
    assert unit_peaks(schedule, pp, v, m) == simulated
