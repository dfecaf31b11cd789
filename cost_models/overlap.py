"""Communication overlapped with compute: what stays exposed, and what overlap costs.

One window: compute of P seconds (alone) and communication of C seconds start together.
While both run, compute slows by σ >= 1 (``Cluster.overlap``: NCCL kernels take SMs and
memory bandwidth); communication keeps its speed. Compute advances at 1/σ until the
communication ends, then at full speed:

    overlapped   w = min(C, σ·P)
    wall time    P + C - w/σ
    exposed      C - w/σ  =  (C - w)  +  w·(1 - 1/σ)
                            not hidden   compute slowed

so overlap is never free: a fully hidden C still costs C·(1 - 1/σ). A part of C that cannot
start until the compute has ended (``exposed_floor_s``) is exposed whole.

Three patterns, each a sequence of such windows:

- Data parallel (DDP; Li et al., "PyTorch Distributed", VLDB 2020): gradients are reduced in
  B buckets as backward produces them. With gradients ready evenly through backward, bucket
  i can start at i/B of it, so the first 1/B of backward has nothing to hide and the last
  bucket starts after backward ends:  exposed(P·(B-1)/B, C, floor = C/B). With σ = 1 this
  is the exact pipeline max(C/B, C - P + P/B). Under gradient accumulation only the last
  micro-batch's backward overlaps the reduction.
- FSDP prefetch (FSDP2 ``fully_shard``: the next layer's all-gather is issued when a layer's
  compute starts): layer i's gather overlaps layer i-1's compute; the first is exposed. In
  backward the window of layer i also holds the reduce-scatter of the layer before it, and
  the last reduce-scatter is exposed. Each window starts when the previous one ends, so the
  exposed time of a stack is the sum over its windows.
- Pipeline send/recv: a stage sends its output and goes on to its next action; the receiver
  waits for the whole transfer (the schedule simulator charges it on the dependency), and
  the sender's next action is slowed while the transfer runs: w·(1 - 1/σ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def overlap_slowdown_s(compute_s: float, comm_s: float, *, slowdown: float) -> float:
    """Extra compute time from running beside ``comm_s`` of communication: w·(1 - 1/σ)."""
    _check(compute_s, comm_s, slowdown)
    return min(comm_s, slowdown * compute_s) * (1 - 1 / slowdown)


def exposed_comm_s(compute_s: float, comm_s: float, *, slowdown: float = 1.0,
                   exposed_floor_s: float = 0.0) -> float:
    """Wall time beyond ``compute_s`` when ``comm_s`` runs beside it (see the module)."""
    _check(compute_s, comm_s, slowdown)
    floor = min(comm_s, max(exposed_floor_s, 0.0))
    hideable = comm_s - floor
    return comm_s - min(hideable, slowdown * compute_s) / slowdown


def ddp_num_buckets(grad_bytes: float, bucket_bytes: float) -> int:
    """Gradient buckets DDP fills (``Cluster.overlap.ddp_bucket_bytes`` each)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    return max(1, math.ceil(grad_bytes / bucket_bytes))


def dp_grad_sync_exposed_s(backward_s: float, reduce_s: float, *, num_buckets: int,
                           slowdown: float) -> float:
    """Exposed time of a bucketed gradient reduction overlapped with ``backward_s``.

    ``reduce_s``: all buckets' reductions together; the last bucket's share is exposed.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be at least 1, got {num_buckets}")
    window = backward_s * (num_buckets - 1) / num_buckets
    return exposed_comm_s(window, reduce_s, slowdown=slowdown,
                          exposed_floor_s=reduce_s / num_buckets)


def fsdp_exposed_s(compute_s: Sequence[float], gather_s: Sequence[float],
                   reduce_scatter_s: Sequence[float] | None = None, *,
                   slowdown: float) -> float:
    """Exposed FSDP communication of a stack of layers, in execution order.

    Forward: pass the per-layer compute and all-gather times. Backward: pass them in
    backward order, with each layer's gradient reduce-scatter.
    """
    n = len(compute_s)
    if len(gather_s) != n or (reduce_scatter_s is not None and len(reduce_scatter_s) != n):
        raise ValueError("compute_s, gather_s and reduce_scatter_s need one entry per layer")
    scatter = list(reduce_scatter_s) if reduce_scatter_s is not None else [0.0] * n
    # Window i runs layer i's compute beside layer i+1's gather and layer i-1's scatter;
    # window -1 (before the first layer) and the tail after the last have no compute.
    total = gather_s[0] if n else 0.0
    for i in range(n):
        comm = (gather_s[i + 1] if i + 1 < n else 0.0) + (scatter[i - 1] if i >= 1 else 0.0)
        total += exposed_comm_s(compute_s[i], comm, slowdown=slowdown)
    return total + (scatter[-1] if n else 0.0)


def pipeline_p2p_slowdown_s(next_compute_s: float, p2p_s: float, *, slowdown: float) -> float:
    """Extra time of a stage's next action while its send/recv of ``p2p_s`` runs."""
    return overlap_slowdown_s(next_compute_s, p2p_s, slowdown=slowdown)


def _check(compute_s: float, comm_s: float, slowdown: float) -> None:
    if compute_s < 0 or comm_s < 0:
        raise ValueError(f"times must be non-negative, got compute {compute_s}, comm {comm_s}")
    if slowdown < 1:
        raise ValueError(f"slowdown must be >= 1 (compute never speeds up), got {slowdown}")
