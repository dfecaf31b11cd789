"""Collective and point-to-point time: α-β per link class; across nodes, NCCL's ring with rails.

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

Across nodes (N > 1): NCCL runs one ring through every member (its rings enter a node on
one GPU's NIC, cross the node on NVLink and leave on another GPU's NIC; one channel per
NIC pair, so each GPU's own NIC is a rail, as DGX A100/H100 are wired). The ring moves in
lock-step: at each of its steps every member forwards one block of S/n bytes, and the
next step needs the block just received, so a step takes as long as its slowest hop. The
inter-node hop of a step carries the blocks of the node's L members on L NICs at once,
so one member's block crosses at min(B_intra, L·B_net) and the step's latency is the
network's:

    step(S)         α_net + (S/n) / min(B_intra, L·B_net)
    all_gather      (n-1)·step(S)          reduce_scatter  (n-1)·step(S)
    all_reduce      2(n-1)·step(S)   (ring; or the tree below, whichever is faster)

The bandwidth term is the hierarchical bound (S/(L·B_net) crosses each node boundary);
the latency term grows with n, not with the node count: the ring latency NCCL's
developers describe ("the latency of ring increases linearly with the communicator
size", NVIDIA/nccl#1712), which is what makes all-gathers and reduce-scatters over
hundreds of ranks slow at the message sizes of one layer. Check: NVIDIA/nccl#1218
measured all_gather of 2 GiB over 256 H100 (32 nodes, 8×400 Gb/s) at 200 GB/s bus
bandwidth; this model, with the dgx-h100 preset's figures, gives 289 GB/s, and 240 with
the 14 µs that NCCL's own tuning table gives a network step of its Simple protocol (the
preset's α is 8 µs); NCCL's tuning model, which adds each hop's latency once rather than
pacing every step by the network's, gives 329.

Message-size efficiency. The same step is the size curve: a collective reaches the bus
bandwidth B_eff = min(B_intra, L·B_net) times (S/n) / (S/n + α·B_eff), half of it where each
member's block S/n is α·B_eff (10 µs × 200 GB/s = 2 MB on DGX A100 nodes): a 3.6 GB
all-gather over 1,536 ranks moves 2.3 MB blocks and runs at 54% of the links' bandwidth.

The all_reduce tree (Sanders, Speck & Träff 2009; NCCL 2.4's double binary tree between
nodes, a chain inside each) reduces inside the node, runs the tree across nodes on each
member's 1/L of the data, and broadcasts back; NCCL's tuner (src/graph/tuning.cc: tree
bandwidth ratio 1/2, 2·log2(nodes) network hops) picks it for small messages over many
nodes. We model NCCL's choice as the faster of the two:

    tree  RS(L, intra, S) + 2·(S/L)/B_net + 2·⌊log₂ N⌋·α_net + AG(L, intra, S)

NVLink SHARP (NVLS: the NVSwitch reduces in the switch; H100/H200 DGX and HGX): inside a
node NCCL runs all_reduce on it where it is faster than the ring, at the bus bandwidth
``Cluster.nvls_bus_GBps`` measured by nccl-tests:

    nvls  2(n-1)/n · S / B_nvls + 2·α_intra

Launch. Every NCCL collective pays a fixed base latency beyond its steps (NCCL
src/graph/tuning.h ``baseLat``: 8.4 µs for the ring's Simple protocol, the one large
messages use): ``NCCL_LAUNCH_S``, on GPU links only (gloo's figures are calibrated whole),
charged to the ring and tree collectives (all_to_all and send/recv keep their α-β form).

All-to-all across nodes: a rank sends S/n to each peer, (L-1)/n·S over the intra-node link
and (n-L)/n·S over the network, concurrently:

    max((L-1)/n · S/B_intra + (L-1)·α_intra,  (n-L)/n · S/B_net + (n-L)·α_net)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.hardware import COLLECTIVES, Cluster, Link

__all__ = ["COLLECTIVES"]  # re-exported: the collectives the estimators below price

NCCL_LAUNCH_S = 8.4e-6
"""NCCL's base latency of a collective (src/graph/tuning.h ``baseLat``, Ring / Simple)."""
NCCL_LINK_KINDS = ("nvlink", "pcie", "network")
"""Links NCCL runs on; 'loopback' is gloo between CPU processes."""


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


def lockstep_ring_s(passes: int, nbytes: float, group: Group, cluster: Cluster,
                    kind: str) -> float:
    """A ring through all n members across nodes (the module's step(S), ``passes`` sweeps)."""
    n, local = group.size, ranks_per_node(group, cluster)
    net = cluster.inter_node
    bandwidth = min(_bytes_per_s(intra_link(cluster, kind)), local * _bytes_per_s(net))
    return passes * (n - 1) * (net.latency_s + nbytes / n / bandwidth)


def nvls_all_reduce_s(nbytes: float, n: int, cluster: Cluster) -> float:
    """NVLink SHARP all_reduce inside one node (inf where the cluster has none)."""
    if cluster.nvls_bus_GBps <= 0:
        return math.inf
    link = intra_link(cluster, "all_reduce")
    return 2 * (n - 1) / n * nbytes / (cluster.nvls_bus_GBps * 1e9) + 2 * link.latency_s


# -- collectives on the cluster ---------------------------------------------------------------

def all_reduce_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return launch_s(group, cluster) + _all_reduce_steps_s(nbytes, group, cluster)[0]


def all_reduce_algorithm(nbytes: float, group: Group, cluster: Cluster) -> str:
    """'ring', 'tree' or 'nvls': the algorithm NCCL is modelled to choose."""
    return _all_reduce_steps_s(nbytes, group, cluster)[1]


def _all_reduce_steps_s(nbytes: float, group: Group, cluster: Cluster) -> tuple[float, str]:
    local, nodes = ranks_per_node(group, cluster), nodes_spanned(group, cluster)
    if nodes == 1:
        ring = ring_s(2, nbytes, local, intra_link(cluster, "all_reduce"))
        nvls = nvls_all_reduce_s(nbytes, local, cluster)
        return (nvls, "nvls") if nvls < ring else (ring, "ring")
    ring = lockstep_ring_s(2, nbytes, group, cluster, "all_reduce")
    # reduce-scatter inside the node, the tree across nodes, all-gather inside the node
    tree = (ring_s(1, nbytes, local, intra_link(cluster, "reduce_scatter"))
            + tree_all_reduce_s(nbytes / local, nodes, cluster.inter_node)
            + ring_s(1, nbytes, local, intra_link(cluster, "all_gather")))
    return (tree, "tree") if tree < ring else (ring, "ring")


def all_gather_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _gather_or_scatter_s(nbytes, group, cluster, "all_gather")


def reduce_scatter_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _gather_or_scatter_s(nbytes, group, cluster, "reduce_scatter")


def launch_s(group: Group, cluster: Cluster) -> float:
    """NCCL's base latency of one collective, on GPU links (gloo's is in its fitted α)."""
    link = group_link(cluster, group)
    return NCCL_LAUNCH_S if link.kind in NCCL_LINK_KINDS else 0.0


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


def scattered_p2p_s(nbytes: float, link: Link, tp: int, cluster: Cluster) -> float:
    """A send of ``nbytes`` that every rank of a tp group holds, scattered (Narayanan et
    al., SC'21, section 4.1; runtime/pipeline_sends.py): each tp rank sends its 1/tp over
    ``link``, and the receiving ranks all-gather the slices over their own tp group
    (consecutive ranks: NVLink inside a node). Gradients come back the same way."""
    if nbytes <= 0:
        return 0.0
    return p2p_s(nbytes / tp, link) + all_gather_s(nbytes, Group(tp, 1), cluster)


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


def _gather_or_scatter_s(nbytes: float, group: Group, cluster: Cluster, kind: str) -> float:
    """All-gather or reduce-scatter: NCCL's ring, inside a node or through every member."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if nodes_spanned(group, cluster) == 1:
        steps = ring_s(1, nbytes, group.size, intra_link(cluster, kind))
    else:
        steps = lockstep_ring_s(1, nbytes, group, cluster, kind)
    return launch_s(group, cluster) + steps


def _pairwise_s(nbytes: float, peers: int, link: Link) -> float:
    """``nbytes`` in all to ``peers`` peers over one link class, one latency per peer."""
    if peers <= 0:
        return 0.0
    return nbytes / _bytes_per_s(link) + peers * link.latency_s


def _bytes_per_s(link: Link) -> float:
    return link.bandwidth_GBps * 1e9
