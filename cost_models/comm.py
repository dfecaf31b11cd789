"""Collective and point-to-point time: α-β per link class, hierarchical across nodes.

Placement. A group is described by its size and the rank stride between consecutive members
(the mesh is row-major with tp innermost, so tp groups have stride 1 and dp groups stride
tp). Consecutive ranks fill a node of d = ``devices_per_node`` devices, so a node holds

    L = max(1, min(size, d // stride))  members of the group, over  N = ⌈size / L⌉  nodes

(the fullest node when the split is uneven). N = 1 exactly when size·stride <= d: the group
is inside one node and runs on the intra-node link (NVLink / PCIe).

Inside one node: NCCL's ring (Thakur, Rabenseifner & Gropp 2005; NCCL's ring algorithm), for
a full tensor of S bytes over n ranks, per-device bandwidth B and per-step latency α:

    all_reduce      2(n-1)/n · S/B + 2(n-1)·α
    all_gather      (n-1)/n · S/B + (n-1)·α     (S = size of the gathered output)
    reduce_scatter  (n-1)/n · S/B + (n-1)·α     (S = size of the unreduced input)
    all_to_all      (n-1)/n · S/B + (n-1)·α     (S = one rank's input, S/n to each peer)
    send/recv       S/B + α

Across nodes (N > 1): hierarchical, as NCCL's multi-node collectives move data (NVLink inside,
each GPU's own NIC between nodes: one rail per GPU, as DGX A100/H100 are wired). With L > 1:

    all_reduce      RS(L, intra, S) + AR(N, network, S/L) + AG(L, intra, S)
    reduce_scatter  RS(L, intra, S) + RS(N, network, S/L)
    all_gather      AG(N, network, S/L) + AG(L, intra, S)

The L members of a node run their cross-node phase at once, each on 1/L of the data on its
own rail; ``inter_node.bandwidth_GBps`` is one device's share of the network. With L = 1
the collective runs on the network alone. The hierarchical form is what NCCL's multi-ring
achieves in bandwidth: S/(L·B_net) crosses each node boundary, not S/B_net.

Ring or tree. For the cross-node all_reduce NCCL chooses between the ring and the double
binary tree (Sanders, Speck & Träff 2009; NCCL 2.4) by its own tuning model (NCCL
src/graph/tuning.cc: tree bandwidth ratio 1/2, latency 2·log2(nodes) network hops). We
model NCCL's choice as the faster of the two:

    ring  2(N-1)/N · S/B + 2(N-1)·α
    tree  2·S/B + 2·⌊log₂ N⌋·α         (reduce up, broadcast down; each rank sends ~S per phase)

The tree wins for small messages over many nodes, never at N = 2. Inside a node NCCL runs
the ring (its tree is a chain there); all_gather and reduce_scatter are rings.

All-to-all across nodes: a rank sends S/n to each peer, (L-1)/n·S over the intra-node link
and (n-L)/n·S over the network, concurrently:

    max((L-1)/n · S/B_intra + (L-1)·α_intra,  (n-L)/n · S/B_net + (n-L)·α_net)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.hardware import COLLECTIVES, Cluster, Link

__all__ = ["COLLECTIVES"]  # re-exported: the collectives the estimators below price


@dataclass(frozen=True)
class Group:
    size: int
    """Ranks in the group."""
    stride: int = 1
    """Rank distance between consecutive members."""


# -- placement ------------------------------------------------------------------------------

def ranks_per_node(group: Group, cluster: Cluster) -> int:
    """L: members of the group in its fullest node (consecutive ranks fill a node)."""
    return max(1, min(group.size, cluster.devices_per_node // max(group.stride, 1)))


def nodes_spanned(group: Group, cluster: Cluster) -> int:
    """N: nodes the group's members sit in."""
    return math.ceil(group.size / ranks_per_node(group, cluster))


def group_link(cluster: Cluster, group: Group) -> Link:
    """The slowest link class the group crosses (for send/recv between its members)."""
    if nodes_spanned(group, cluster) == 1:
        return intra_link(cluster, "p2p")
    return cluster.inter_node


def intra_link(cluster: Cluster, kind: str) -> Link:
    """The link inside a node for one collective: its calibrated fit, else ``intra_node``."""
    return cluster.collective_links.get(kind, cluster.intra_node)


# -- one link class: the flat algorithms --------------------------------------------------------

def ring_s(passes: int, nbytes: float, n: int, link: Link) -> float:
    """A ring of ``passes`` sweeps (1: gather or scatter, 2: all_reduce) over n ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = passes * (n - 1)
    return steps / n * nbytes / _bytes_per_s(link) + steps * link.latency_s


def tree_all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Double binary tree all_reduce: 2·S/B + 2·⌊log₂ n⌋·α."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    depth = n.bit_length() - 1
    return 2 * nbytes / _bytes_per_s(link) + 2 * depth * link.latency_s


def flat_all_reduce_s(nbytes: float, n: int, link: Link, *, tree: bool = True) -> float:
    """NCCL's choice on one link class, modelled as the faster of ring and (if allowed) tree."""
    ring = ring_s(2, nbytes, n, link)
    return min(ring, tree_all_reduce_s(nbytes, n, link)) if tree else ring


# -- collectives on the cluster ---------------------------------------------------------------

def all_reduce_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    local, nodes = ranks_per_node(group, cluster), nodes_spanned(group, cluster)
    if nodes == 1:
        return ring_s(2, nbytes, local, intra_link(cluster, "all_reduce"))
    across = flat_all_reduce_s(nbytes / local, nodes, cluster.inter_node)
    # reduce-scatter, then all-gather, inside the node
    inside = (ring_s(1, nbytes, local, intra_link(cluster, "reduce_scatter"))
              + ring_s(1, nbytes, local, intra_link(cluster, "all_gather")))
    return inside + across


def all_reduce_algorithm(nbytes: float, group: Group, cluster: Cluster) -> str:
    """'ring' or 'tree': the algorithm of the cross-node phase (the ring inside one node)."""
    nodes = nodes_spanned(group, cluster)
    if nodes == 1:
        return "ring"
    share = nbytes / ranks_per_node(group, cluster)
    tree = tree_all_reduce_s(share, nodes, cluster.inter_node)
    return "tree" if tree < ring_s(2, share, nodes, cluster.inter_node) else "ring"


def all_gather_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _hierarchical_ring_s(nbytes, group, cluster, "all_gather")


def reduce_scatter_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _hierarchical_ring_s(nbytes, group, cluster, "reduce_scatter")


def all_to_all_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    """``nbytes``: one rank's input, of which 1/n goes to each member (itself included)."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    local = ranks_per_node(group, cluster)
    inside = _pairwise_s((local - 1) / n * nbytes, local - 1, intra_link(cluster, "all_to_all"))
    if nodes_spanned(group, cluster) == 1:
        return inside
    return max(inside, _pairwise_s((n - local) / n * nbytes, n - local, cluster.inter_node))


def p2p_s(nbytes: float, link: Link) -> float:
    return nbytes / _bytes_per_s(link) + link.latency_s


def collective_s(kind: str, nbytes: float, group: Group, cluster: Cluster) -> float:
    """Any of COLLECTIVES; 'p2p' is one send between members ``group.stride`` ranks apart."""
    if kind == "all_reduce":
        return all_reduce_s(nbytes, group, cluster)
    if kind == "all_gather":
        return all_gather_s(nbytes, group, cluster)
    if kind == "reduce_scatter":
        return reduce_scatter_s(nbytes, group, cluster)
    if kind == "all_to_all":
        return all_to_all_s(nbytes, group, cluster)
    if kind == "p2p":
        return p2p_s(nbytes, group_link(cluster, group)) if nbytes > 0 else 0.0
    raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVES)}")


def _hierarchical_ring_s(nbytes: float, group: Group, cluster: Cluster, kind: str) -> float:
    """All-gather or reduce-scatter: a ring inside the node and one per rail across nodes."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    local, nodes = ranks_per_node(group, cluster), nodes_spanned(group, cluster)
    inside = ring_s(1, nbytes, local, intra_link(cluster, kind))
    return inside + ring_s(1, nbytes / local, nodes, cluster.inter_node)


def _pairwise_s(nbytes: float, peers: int, link: Link) -> float:
    """``nbytes`` in all to ``peers`` peers over one link class, one latency per peer."""
    if peers <= 0:
        return 0.0
    return nbytes / _bytes_per_s(link) + peers * link.latency_s


def _bytes_per_s(link: Link) -> float:
    return link.bandwidth_GBps * 1e9
