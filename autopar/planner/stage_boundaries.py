"""What crossing a pipeline stage boundary costs, as the runtime crosses it.

The boundary after layer A (last of stage s) and before layer B (first of s + 1), with S
the bytes of A's whole output per micro-batch (a send also carries what earlier layers
made for later stages: ``send_s``'s ``crossing``) and tp the tensor-parallel degree:

    A and B sequence-parallel   each tp rank hands on its sequence shard, S/tp, as it is
                                (runtime.pipeline_sends.sequence_sharded_boundaries): one
                                send of S/tp each way, no collective
    A sequence-parallel only    A gathers its output whole at the end of stage s: an
                                all-gather of S forward (its backward is a local slice);
                                then the whole tensor is sent as below
    B sequence-parallel only    B splits its whole input locally; backward all-gathers the
                                gradient (S) on stage s + 1 before sending it
    neither                     the whole tensor: S each way, or scattered over tp
                                (``scattered_p2p_s``) with ``pipeline.scatter_sends``

The gathers run on the stage, whether or not the next stage is on another rank (the V
schedules' turn hands tensors over in memory), so they are charged to the stage's forward
or backward time; the sends only where the boundary crosses ranks, on the pipeline link.
"""

from __future__ import annotations

from autopar.planner.costs import LayerCost
from cost_models.comm import Group, all_gather_s, p2p_s, scattered_p2p_s
from cost_models.hardware import Cluster, Link


def whole_bytes(cost: LayerCost, tp: int) -> float:
    """S: the layer's whole output per micro-batch (an SP layer's cost holds its shard)."""
    return cost.output_bytes * (tp if cost.sequence_parallel else 1)


def sharded(out: LayerCost, into: LayerCost, tp: int) -> bool:
    """The boundary passes sequence shards (both sides sequence-parallel)."""
    return tp > 1 and out.sequence_parallel and into.sequence_parallel


def send_s(out: LayerCost, into: LayerCost, tp: int, link: Link, cluster: Cluster,
           scatter: bool, crossing: float = 1.0) -> float:
    """One send across the boundary on ``link`` (forward; the gradient's is the same).
    ``crossing``: what crosses it as a multiple of A's output (values made before A that a
    later stage uses cross too: ``LayerGraph.boundary_bytes``)."""
    nbytes = whole_bytes(out, tp) * crossing
    if nbytes <= 0:
        return 0.0
    if sharded(out, into, tp):
        return p2p_s(nbytes / tp, link)
    if scatter and tp > 1:
        return scattered_p2p_s(nbytes, link, tp, cluster)
    return p2p_s(nbytes, link)


def gather_s(out: LayerCost, into: LayerCost, tp: int, cluster: Cluster
             ) -> tuple[float, float]:
    """(forward seconds on stage s, backward seconds on stage s + 1): the all-gather of a
    sequence-parallel side facing a side that is not, per micro-batch, with its skew as
    the layers' own collectives (autopar.planner.estimators)."""
    if tp == 1 or out.sequence_parallel == into.sequence_parallel:
        return 0.0, 0.0
    nbytes = whole_bytes(out, tp)
    seconds = all_gather_s(nbytes, Group(tp, 1), cluster) + cluster.device.skew_s(nbytes)
    return (seconds, 0.0) if out.sequence_parallel else (0.0, seconds)
