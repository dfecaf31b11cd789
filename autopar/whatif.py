"""What-if studies: re-plan one captured model for other cluster sizes, batches or memory.

The model is captured once (the expensive step); each point re-runs only the search, so a
sweep over a dozen cluster sizes takes about a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from autopar.errors import ConfigError, InfeasibleError
from autopar.planner import search
from cost_models.hardware import Cluster
from passes.records import LayerGraph
from runtime.plan import Plan
from runtime.plan_report import shape


@dataclass(frozen=True, kw_only=True)
class ScalingPoint:
    gpus: int
    samples_per_s: float | None
    """Modelled; None where no plan fits."""
    shape: str = ""
    """The best plan's mesh (and schedule), or why there is none."""


def plan_or_none(graph: LayerGraph, cluster: Cluster, precision: str = "float32"
                 ) -> tuple[Plan | None, str]:
    """The best plan, or None and the reason (does not fit, batch does not divide)."""
    try:
        return search(graph, cluster, precision_name=precision).plan, ""
    except (InfeasibleError, ConfigError) as e:
        return None, str(e)


def scaling_points(graph: LayerGraph, cluster: Cluster, nodes: Iterable[int], *,
                   precision: str = "float32") -> list[ScalingPoint]:
    """Modelled throughput of the best plan for each node count."""
    points = []
    for n in nodes:
        c = cluster.with_nodes(n)
        points.append(scaling_point(c, *plan_or_none(graph, c, precision)))
    return points


def scaling_point(cluster: Cluster, plan: Plan | None, why: str = "") -> ScalingPoint:
    """One point of a scaling curve: ``plan_or_none``'s answer on ``cluster``."""
    if plan is None or plan.prediction is None:
        return ScalingPoint(gpus=cluster.world_size, samples_per_s=None,
                            shape=why.split(";")[0])
    return ScalingPoint(gpus=cluster.world_size,
                        samples_per_s=plan.global_batch / plan.prediction.step_time_s,
                        shape=shape(plan.mesh, plan.pipeline))


def with_memory(cluster: Cluster, memory_gib: float) -> Cluster:
    """The same cluster with ``memory_gib`` GiB per device."""
    device = dataclasses.replace(cluster.device, memory_bytes=int(memory_gib * 1024**3))
    return dataclasses.replace(cluster, device=device)


def default_nodes(nodes: int, *, up_to: int = 64) -> list[int]:
    """Powers of two around ``nodes``: 1, 2, 4, … up to 4 × nodes (at most ``up_to``)."""
    out, n = [], 1
    while n <= min(max(4 * nodes, 4), up_to):
        out.append(n)
        n *= 2
    return out


def repeat_blocks(graph: LayerGraph, n_layer: int) -> LayerGraph:
    """``graph`` with its run of identical blocks repeated to ``n_layer`` blocks.

    Capturing a deep model costs seconds; its blocks are identical (one layer class), so a
    model captured with two blocks and repeated plans exactly as the deep one would.
    Block names follow the first block's (``h.0`` → ``h.0 … h.{n_layer-1}``).
    """
    classes = graph.classes
    block_class = max(classes, key=lambda c: (len(classes[c]), -classes[c][0].index))
    members = classes[block_class]
    if len(members) < 2:
        raise ConfigError("the graph has no repeated blocks to repeat")
    first, last = members[0].index, members[-1].index
    prefix = members[0].name.rsplit(".", 1)[0]
    blocks = [dataclasses.replace(members[0], name=f"{prefix}.{i}") for i in range(n_layer)]
    layers = [*graph.layers[:first], *blocks, *graph.layers[last + 1:]]
    layers = [dataclasses.replace(x, index=i) for i, x in enumerate(layers)]
    # Per-layer facts of the cuts follow their layers: a block's cut is the first block's,
    # the run's last the last block's; a stage may start inside the new run if it could
    # inside the old one.
    shift = n_layer - len(members)
    crossing = graph.boundary_bytes
    if crossing:
        crossing = (*crossing[:first], *[crossing[first]] * (n_layer - 1), crossing[last],
                    *crossing[last + 1:])
    inside = any(first < k <= last for k in graph.uncuttable)
    uncuttable = {k for k in graph.uncuttable if k <= first}
    uncuttable |= {k + shift for k in graph.uncuttable if k > last}
    uncuttable |= set(range(first + 1, first + n_layer)) if inside else set()
    return dataclasses.replace(graph, layers=tuple(layers), boundary_bytes=crossing,
                               uncuttable=frozenset(uncuttable))
