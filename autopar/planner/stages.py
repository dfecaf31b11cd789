"""Pipeline stages: cutting the layers into stages, and the micro-batches a stage holds.

A stage's activations count once per micro-batch between its forward and the backward that
frees them (W where the schedule splits the backward, else B), along the order its rank
runs (``runtime.schedule_orders.runtime_orders``: torch's own schedule tables)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from cost_models.schedule import SCHEDULES, Timeline
from runtime.schedule_orders import runtime_orders

SATURATION_MICROBATCHES_PER_RANK = 2
"""In-flight peaks of every schedule stop growing by m = 2p: 1F1B's by m = p (rank r holds
p - r), the interleaved and zero-bubble tables' (which take m in multiples of p) by their
second round of p micro-batches. An observation on torch's tables, not a theorem: the
peaks at m = 3p, 4p, 5p, 6p and 8p equal those at 2p for every p ≤ 16 and v ≤ 8, at 3p,
4p and 6p for v up to 16 at p = 4, 6, 8, and at 3p and 4p for p = 24, 32, 48, 64 and v ≤ 4
(tests/autopar/planner/test_inflight_saturation.py checks the small shapes and the
planner's largest). Peaks are counted on m = min(m, 2p), whose
tables are shorter and shared by every larger m."""


def unit_peaks(schedule: str, pp: int, virtual_stages: int, microbatches: int
               ) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once: counted along
    the ranks' orders, without simulating, since a stage's count moves only with its own
    rank's actions, which run in that order. F takes a micro-batch's activations; the
    backward that frees them is W where the schedule splits it off, else B."""
    frees = "W" if SCHEDULES[schedule].split_backward else "B"
    num_stages = pp * virtual_stages
    peak, held = [0] * num_stages, [0] * num_stages
    for order in runtime_orders(schedule, pp, virtual_stages, microbatches):
        for action, stage, _ in order:
            if action == "F":
                held[stage] += 1
                peak[stage] = max(peak[stage], held[stage])
            elif action == frees:
                held[stage] -= 1
    return tuple(peak)


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


def balanced_bounds(weights: list[float], stages: int, uncuttable: Iterable[int] = ()
                    ) -> tuple[int, ...]:
    """Cut points splitting ``weights`` into ``stages`` contiguous non-empty runs so that
    the heaviest run is as light as possible (binary search on that bound, greedy fill),
    with no cut at an index of ``uncuttable``: the layers across such an index are cut as
    one unit."""
    starts = [k for k in range(len(weights)) if k == 0 or k not in set(uncuttable)]
    if len(starts) == len(weights):
        return _balanced(weights, stages)
    units = [sum(weights[a:b]) for a, b in itertools.pairwise([*starts, len(weights)])]
    return tuple(starts[c] for c in _balanced(units, stages))


def _balanced(weights: list[float], stages: int) -> tuple[int, ...]:
    n = len(weights)
    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        if _greedy_fits(weights, mid, stages):
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


def _greedy_fits(weights: list[float], limit: float, stages: int) -> bool:
    """Whether ``_greedy_cuts(weights, limit)`` makes at most ``stages`` runs: the same
    walk, stopped at the first run too many."""
    runs, acc, most = 1, 0.0, limit * (1 + 1e-12)
    for w in weights:
        if acc + w > most and acc > 0:
            runs += 1
            if runs > stages:
                return False
            acc = 0.0
        acc += w
    return True


def _greedy_cuts(weights: list[float], limit: float) -> list[int]:
    cuts, acc = [], 0.0
    for i, w in enumerate(weights):
        if acc + w > limit * (1 + 1e-12) and acc > 0:
            cuts.append(i)
            acc = 0.0
        acc += w
    return cuts


def stage_assignment(n: int, bounds: tuple[int, ...]) -> tuple[int, ...]:
    out, stage = [], 0
    cuts = set(bounds)
    for i in range(n):
        if i in cuts:
            stage += 1
        out.append(stage)
    return tuple(out)


