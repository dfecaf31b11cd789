"""Collective and point-to-point time, α-β per link class.

A group is described by its size and the rank stride between consecutive members (the mesh
is row-major with tp innermost, so tp groups have stride 1 and dp groups stride tp). A
group whose members all sit in one node runs on the intra-node link (NVLink / PCIe);
otherwise every ring step crosses the network, which bounds the whole ring.

Ring costs (Thakur, Rabenseifner & Gropp 2005; NCCL's ring algorithm), for a full tensor of
S bytes over n ranks with per-device bandwidth B and per-step latency α:

    all_reduce      2(n-1)/n · S/B + 2(n-1)·α
    all_gather      (n-1)/n · S/B + (n-1)·α     (S = size of the gathered output)
    reduce_scatter  (n-1)/n · S/B + (n-1)·α     (S = size of the unreduced input)
    send/recv       S/B + α
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.hardware import Cluster, Link

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class Group:
    size: int
    """Ranks in the group."""
    stride: int = 1
    """Rank distance between consecutive members."""


def group_link(cluster: Cluster, group: Group) -> Link:
    """The slowest link class a ring over this group crosses."""
    if group.size * group.stride <= cluster.devices_per_node:
        return cluster.intra_node
    return cluster.inter_node


def all_reduce_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _ring_s(2, nbytes, group, cluster)


def all_gather_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _ring_s(1, nbytes, group, cluster)


def reduce_scatter_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _ring_s(1, nbytes, group, cluster)


def p2p_s(nbytes: float, link: Link) -> float:
    return nbytes / (link.bandwidth_GBps * 1e9) + link.latency_s


def collective_s(kind: str, nbytes: float, group: Group, cluster: Cluster) -> float:
    if kind == "all_reduce":
        return all_reduce_s(nbytes, group, cluster)
    if kind == "all_gather":
        return all_gather_s(nbytes, group, cluster)
    if kind == "reduce_scatter":
        return reduce_scatter_s(nbytes, group, cluster)
    raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVES[:3])}")


def _ring_s(passes: int, nbytes: float, group: Group, cluster: Cluster) -> float:
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = group_link(cluster, group)
    steps = passes * (n - 1)
    return steps / n * nbytes / (link.bandwidth_GBps * 1e9) + steps * link.latency_s
