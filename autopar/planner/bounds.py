r"""Bounds on the rank strategy ILP (ilp.py) that need no solver.

With the largest transient buffer fixed to b, the rank ILP is a multiple-choice knapsack:
class c puts its n_c layers on options s, each of value t_s (seconds) and weight m_s
(resident bytes at the class's in-flight count), under

    Σ_c Σ_s m_s y_{c,s} ≤ W(b) = C / (1 + μ) − b,     only options with β_s ≤ b.

Its LP relaxation is solved exactly by a greedy (Sinha & Zoltners, "The multiple-choice
knapsack problem", Operations Research 27(3), 1979): every class starts on its lightest
option and walks the lower convex hull of its (m, t) points, the segments that save the
most seconds per byte first, until W(b) is spent. The LP value equals the Lagrangian
dual's (max over λ ≥ 0 of Σ_c n_c min_s (t_s + λ m_s) − λ W), so it is a lower bound.
At most one class ends split between two hull points; moving the fractional layer back
gives an integer point that fits, whose value is an upper bound.

The ILP's optimum keeps its largest buffer b* among the values tried, so the least of the
per-b lower bounds bounds the ILP. The lower bound leaves out host memory and the solver's
1 KiB slack (dropping constraints only lowers it); the upper bound keeps both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from autopar.planner.costs import HOST_MEMORY_BYTES, LayerCost

if TYPE_CHECKING:  # ilp.py imports this module
    from autopar.planner.ilp import ClassOptions

Value = Callable[[LayerCost], float]
Hull = list[tuple[float, float]]
UPPER_SLACK_BYTES = 2048
"""The upper bound's point keeps clear of the ILP's memory row (1 KiB slack) by this much."""


def time_value(cost: LayerCost) -> float:
    return cost.time_s


def lower_hull(points: Iterable[tuple[float, float]]) -> Hull:
    """The (weight, value) points a minimiser could use at some price of memory: the lower
    convex hull of the Pareto frontier, lightest first, values strictly decreasing."""
    hull: Hull = []
    for w, v in sorted(points):
        if hull and v >= hull[-1][1]:
            continue  # heavier and no faster than a point already kept
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], (w, v)) <= 0:
            hull.pop()  # the middle point lies on or above the chord
        hull.append((w, v))
    return hull


def _cross(a: tuple[float, float], b: tuple[float, float], c: tuple[float, float]) -> float:
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


def greedy(hulls: list[tuple[int, Hull]], capacity: float) -> tuple[float, float]:
    """(LP value, value of the rounded-down integer point) of the knapsack whose classes
    are (count, lower hull); (inf, inf) when even the lightest points overflow."""
    used = sum(n * hull[0][0] for n, hull in hulls)
    total = sum(n * hull[0][1] for n, hull in hulls)
    if used > capacity:
        return math.inf, math.inf
    # Within a class the rates fall along its hull, so one sort by rate keeps every
    # class's segments in order.
    steps = sorted(((v0 - v1) / (w1 - w0), n, w1 - w0, v0 - v1)
                   for n, hull in hulls for (w0, v0), (w1, v1) in itertools.pairwise(hull))
    for _, n, dw, dv in reversed(steps):
        if used + n * dw <= capacity:
            used, total = used + n * dw, total - n * dv
        else:
            layers = (capacity - used) / dw  # how many of the class's n layers can move
            return total - layers * dv, total - math.floor(layers) * dv
    return total, total


def knapsack_lp(classes: list[tuple[int, list[tuple[float, float]]]], capacity: float) -> float:
    """The LP value of min Σ values s.t. Σ weights ≤ capacity, each class (count, its
    (weight, value) options) choosing ``count`` options."""
    return greedy([(n, lower_hull(points)) for n, points in classes], capacity)[0]


def bounds_at_cap(classes: list[ClassOptions], cap: float, capacity_bytes: float,
                  margin_fraction: float, value: Value = time_value) -> tuple[float, float]:
    """(lower bound, upper bound) on the rank ILP with its largest buffer fixed to ``cap``
    (upper: inf when no integer point was found or host memory could bind)."""
    hulls, host = [], 0.0
    for c in classes:
        allowed = [x for x in c.costs.values() if x.buffer_bytes <= cap]
        if not allowed:
            return math.inf, math.inf
        hulls.append((c.count, lower_hull((x.resident_with(c.inflight), value(x))
                                          for x in allowed)))
        host += c.count * max(x.host_bytes for x in allowed)
    lower, _ = greedy(hulls, capacity_bytes / (1 + margin_fraction) - cap)
    _, upper = greedy(hulls, (capacity_bytes - UPPER_SLACK_BYTES) / (1 + margin_fraction) - cap)
    return lower, upper if host <= HOST_MEMORY_BYTES - UPPER_SLACK_BYTES else math.inf


def rank_bound(classes: list[ClassOptions], capacity_bytes: float, margin_fraction: float,
               value: Value = time_value) -> float:
    """A lower bound on the rank ILP's optimum (inf: nothing fits the device)."""
    caps = sorted({x.buffer_bytes for c in classes for x in c.costs.values()})
    return min((bounds_at_cap(classes, cap, capacity_bytes, margin_fraction, value)[0]
                for cap in caps), default=math.inf)
