"""The planner's fast paths equal the plain computations they replace, on the cases that
matter most: exact ties, shared allowed sets, equal start times (issue 17, part 7)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.planner.bounds import bounds_at_cap, greedy, lower_hull, rank_bound
from autopar.planner.costs import HOST_MEMORY_BYTES, LayerCost, undominated
from autopar.planner.ilp import GIB, ClassOptions
from autopar.planner.liveness import pipeline_liveness
from autopar.planner.stages import stage_peaks, unit_peaks
from cost_models.schedule import StageTimes, run_actions, simulate, stage_ranks
from runtime.schedule_orders import runtime_orders


def plain_undominated(costs: dict, terms) -> dict:
    """The definition: drop an option another matches or beats in every term, keeping the
    first of exact ties."""
    values = {k: terms(c) for k, c in costs.items()}
    keys = list(costs)
    return {k: costs[k] for i, k in enumerate(keys)
            if not any(all(o <= x for o, x in zip(values[other], values[k], strict=True))
                       and (values[other] != values[k] or j < i)
                       for j, other in enumerate(keys) if j != i)}


# Few distinct values, so that exact ties and partial ties are common.
rows_st = st.lists(st.tuples(*[st.sampled_from([0.0, 1.0, 2.0, 2.5])] * 3),
                   min_size=0, max_size=9)


@settings(max_examples=300, deadline=None)
@given(rows_st)
def test_all_pairs_dominance_keeps_what_the_definition_keeps(rows):
    costs = {f"o{i}": row for i, row in enumerate(rows)}
    assert list(undominated(costs, lambda row: row)) == \
        list(plain_undominated(costs, lambda row: row))


def test_of_identical_options_the_first_is_kept():
    costs = {name: (1.0, 2.0) for name in ("replicate", "zero1", "zero2", "fsdp")}
    assert list(undominated(costs, lambda row: row)) == ["replicate"]


def option(time_s: float, states_gib: float, buffer_gib: float, host_gib: float = 0.0
           ) -> LayerCost:
    return LayerCost(option="o", strategy="replicate", recompute="none", offload=False,
                     sequence_parallel=False, microbatches=1, fwd_s=time_s / 3,
                     bwd_s=time_s / 3, wgrad_s=time_s / 3, step_s=0.0, compute_s=time_s,
                     comm_s=0.0, params_bytes=states_gib * GIB, grads_bytes=0.0,
                     optimizer_bytes=0.0, activations_bytes=states_gib * GIB / 4,
                     buffers_bytes=buffer_gib * GIB, output_bytes=0.0,
                     host_bytes=host_gib * GIB)


def plain_bounds_at_cap(classes, cap, capacity_bytes, margin):
    """bounds.py's knapsack bounds at one cap, each class's hull built from scratch."""
    hulls, host = [], 0.0
    for c in classes:
        allowed = [x for x in c.costs.values() if x.buffers_bytes <= cap]
        if not allowed:
            return math.inf, math.inf
        hulls.append((c.count, lower_hull((x.resident_with(c.inflight), x.time_s)
                                          for x in allowed)))
        host += c.count * max(x.host_bytes for x in allowed)
    lower, _ = greedy(hulls, capacity_bytes / (1 + margin) - cap)
    _, upper = greedy(hulls, (capacity_bytes - 2048) / (1 + margin) - cap)
    return lower, upper if host <= HOST_MEMORY_BYTES - 2048 else math.inf


options_st = st.lists(
    st.builds(option, st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.floats(0.0, 4.0),
              st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.sampled_from([0.0, 0.0, 300.0])),
    min_size=1, max_size=5)
classes_st = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), options_st),
                      min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(classes_st, st.floats(1.0, 24.0))
def test_bounds_with_shared_hulls_equal_the_bounds_built_per_cap(raw, capacity_gib):
    classes = [ClassOptions(name=f"c{i}", count=n, inflight=k,
                            costs={f"s{j}": x for j, x in enumerate(opts)})
               for i, (n, k, opts) in enumerate(raw)]
    caps = sorted({x.buffers_bytes for c in classes for x in c.costs.values()})
    plain = [plain_bounds_at_cap(classes, cap, capacity_gib * GIB, 0.1) for cap in caps]
    assert [bounds_at_cap(classes, cap, capacity_gib * GIB, 0.1) for cap in caps] == plain
    assert rank_bound(classes, capacity_gib * GIB, 0.1) == min(lower for lower, _ in plain)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_peaks_counted_along_the_orders_equal_the_simulated_timelines(schedule, p):
    # Unequal times, so that ranks wait on each other: the count must not depend on when.
    times = [StageTimes(fwd_s=1.0 + s % 3, bwd_s=2.0, wgrad_s=0.5 + s % 2) for s in range(2 * p)]
    for m in (p, 2 * p, 4 * p):
        orders = runtime_orders(schedule, p, 2, m)
        timeline = simulate(schedule, p, m, times, p2p_s=0.3, orders=orders)
        assert unit_peaks(schedule, p, 2, m) == stage_peaks(timeline, 2 * p)


def test_raw_actions_are_the_timelines_slots():
    stages = [StageTimes(fwd_s=1.0 + s, bwd_s=2.0, wgrad_s=0.5) for s in range(8)]
    timeline = simulate("ZBVZeroBubble", 4, 8, stages, p2p_s=0.3, p2p_slowdown=1.5)
    actions = run_actions("ZBVZeroBubble", 4, 8, stages, p2p_s=0.3, p2p_slowdown=1.5)
    assert sorted((s.rank, s.stage, s.action, s.microbatch, s.start_s, s.end_s)
                  for s in timeline.slots) == sorted(actions)


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2),
                                         ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)])
def test_peak_only_liveness_finds_the_full_walks_peak(schedule, v):
    rnd = random.Random(7)
    p, m = 4, 8
    n = 3 * p * v
    stage_of = tuple(i * p * v // n for i in range(n))
    costs = [option(rnd.choice([1.0, 2.0]), rnd.choice([0.0, 1.0, 2.0]),
                    rnd.choice([0.0, 0.5])) for _ in range(n)]
    names = [f"layer{i}" for i in range(n)]
    owner = stage_ranks(schedule, p, p * v)
    times = [StageTimes(fwd_s=1.0, bwd_s=1.0, wgrad_s=0.5) for _ in range(p * v)]
    slots = simulate(schedule, p, m, times).slots
    full = pipeline_liveness(costs, names, stage_of, owner, slots, p)
    peaks = pipeline_liveness(costs, names, stage_of, owner, slots, p, peak_only=True)
    assert [r.peak for r in peaks] == [r.peak for r in full]
    assert all(len(r.timeline) == 1 for r in peaks)


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2),
                                         ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 16])
def test_in_flight_peaks_stop_growing_by_2p_micro_batches(schedule, v, p):
    # The planner counts peaks at min(m, 2p) micro-batches when m is a multiple of p
    # (interleaved schedules take m in multiples of p).
    from autopar.planner.stages import SATURATION_MICROBATCHES_PER_RANK

    saturated = SATURATION_MICROBATCHES_PER_RANK * p
    peaks = {m: unit_peaks(schedule, p, v, m) for m in (saturated, saturated + p, 6 * p)}
    assert len(set(peaks.values())) == 1, peaks


@pytest.mark.parametrize("schedule, v", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)])
@pytest.mark.parametrize("p2p, slowdown, blocking", [(0.0, 1.0, False), (0.3, 1.0, False),
                                                     (0.3, 1.7, False), (0.2, 1.0, True)])
def test_fixed_orders_run_without_the_event_loop_exactly_as_with_it(schedule, v, p2p,
                                                                    slowdown, blocking):
    rnd = random.Random(f"{schedule}{p2p}{slowdown}{blocking}")
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            # Zero-time stages too: ties in start time must order alike.
            stages = [StageTimes(fwd_s=rnd.choice([0.0, 0.5, 1.0, 1.7]),
                                 bwd_s=rnd.choice([0.0, 1.0, 2.3]),
                                 wgrad_s=rnd.choice([0.0, 0.4])) for _ in range(p * v)]
            kwargs = dict(p2p_s=p2p, p2p_slowdown=slowdown, p2p_blocking=blocking)
            assert run_actions(schedule, p, m, stages, **kwargs) == \
                run_actions(schedule, p, m, stages, in_order=False, **kwargs)
