"""Bytes of the memory-bound kernels of a set of nodes.

A roofline over a whole layer, max(FLOPs / rate, bytes / bandwidth), would hide a layer
norm's or a GELU's traffic under the matmuls' compute. They do not overlap: each kernel
runs alone, so kernels that do no FLOPs take bytes / bandwidth on top of the matmuls.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Node

from passes import meta_keys as K


def memory_bound_bytes(nodes: Iterable[Node]) -> int:
    """Bytes moved (MEM_BYTES) by the kernels among ``nodes`` that do no FLOPs (FLOPS)."""
    return int(sum(n.meta.get(K.MEM_BYTES, 0) for n in nodes
                   if K.OP_KIND in n.meta and n.meta[K.OP_KIND].is_kernel
                   and not n.meta.get(K.FLOPS, 0.0)))
