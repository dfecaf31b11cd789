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

import bisect
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
    return CapBounds(classes, capacity_bytes, margin_fraction, value).at(cap)


def rank_bound(classes: list[ClassOptions], capacity_bytes: float, margin_fraction: float,
               value: Value = time_value, hulls: Hulls | None = None) -> float:
    """A lower bound on the rank ILP's optimum (inf: nothing fits the device); ``hulls``:
    a store shared with other programs priced by the same ``value``."""
    caps = sorted({x.buffers_bytes for c in classes for x in c.costs.values()})
    bounds = CapBounds(classes, capacity_bytes, margin_fraction, value, hulls)
    return min((bounds.lower_at(cap) for cap in caps), default=math.inf)


class Hulls:
    """Per class of options, its options by buffer size and the lower hull of its allowed
    lightest-buffer ones at an in-flight count, under one ``value``: shared by programs
    whose classes hold the same options (a pipeline's ranks, and configurations on one
    mesh, hold one layer class's options at a handful of in-flight counts). Keyed by the
    identity of a class's costs dict, which is kept here so that its id is not reused."""

    def __init__(self, value: Value) -> None:
        self.value = value
        self._sorted: dict[int, tuple[dict, list[LayerCost], list[float]]] = {}
        self._hulls: dict[tuple[int, int, int], tuple[Hull, float]] = {}

    def by_buffer(self, costs: dict[str, LayerCost]) -> tuple[list[LayerCost], list[float]]:
        """The options sorted by buffer size (stable), and their buffers."""
        entry = self._sorted.get(id(costs))
        if entry is None or entry[0] is not costs:
            if entry is not None:  # a dead dict's id, reused: its hulls are not these
                self._hulls = {k: h for k, h in self._hulls.items() if k[0] != id(costs)}
            options = sorted(costs.values(), key=lambda x: x.buffers_bytes)
            entry = (costs, options, [x.buffers_bytes for x in options])
            self._sorted[id(costs)] = entry
        return entry[1], entry[2]

    def hull(self, costs: dict[str, LayerCost], inflight: int, allowed: int
             ) -> tuple[Hull, float]:
        """The hull over the ``allowed`` lightest-buffer options, and their most host
        bytes."""
        key = (id(costs), inflight, allowed)
        if key not in self._hulls:
            kept = self.by_buffer(costs)[0][:allowed]
            self._hulls[key] = (
                lower_hull((x.resident_with(inflight), self.value(x)) for x in kept),
                max(x.host_bytes for x in kept))
        return self._hulls[key]


class CapBounds:
    """``bounds_at_cap`` for many caps of one program. A class's allowed options, and so
    its hull, change only at its own buffer sizes: each class's options are sorted by
    buffer once and its hull is built once per distinct allowed set, not once per cap
    (nor once per program, with a ``hulls`` store shared among programs)."""

    def __init__(self, classes: list[ClassOptions], capacity_bytes: float,
                 margin_fraction: float, value: Value, hulls: Hulls | None = None) -> None:
        self.capacity_bytes, self.margin_fraction = capacity_bytes, margin_fraction
        if hulls is None or hulls.value is not value:
            hulls = Hulls(value)
        self.hulls = hulls
        self.classes = []  # (count, inflight, costs, their buffers in increasing order)
        for c in classes:
            self.classes.append((c.count, c.inflight, c.costs, hulls.by_buffer(c.costs)[1]))

    def lower_at(self, cap: float) -> float:
        """``at(cap)``'s lower bound alone (no second greedy for the integer point)."""
        hulls = []
        for count, inflight, costs, buffers in self.classes:
            allowed = bisect.bisect_right(buffers, cap)
            if not allowed:
                return math.inf
            hulls.append((count, self.hulls.hull(costs, inflight, allowed)[0]))
        return greedy(hulls, self.capacity_bytes / (1 + self.margin_fraction) - cap)[0]

    def at(self, cap: float) -> tuple[float, float]:
        hulls, host = [], 0.0
        for count, inflight, costs, buffers in self.classes:
            allowed = bisect.bisect_right(buffers, cap)
            if not allowed:
                return math.inf, math.inf
            hull, most_host = self.hulls.hull(costs, inflight, allowed)
            hulls.append((count, hull))
            host += count * most_host
        lower, _ = greedy(hulls, self.capacity_bytes / (1 + self.margin_fraction) - cap)
        _, upper = greedy(hulls, (self.capacity_bytes - UPPER_SLACK_BYTES)
                          / (1 + self.margin_fraction) - cap)
        return lower, upper if host <= HOST_MEMORY_BYTES - UPPER_SLACK_BYTES else math.inf
