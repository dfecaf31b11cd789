"""Gradient clipping by the global norm, the same on every rank for every plan.

The norm is that of the whole model's gradient, as one process computes it on the full
gradients. Each rank holds part of it: replicated tensors (DDP, identical on every
rank), DTensor shards (FSDP2 on dp, tensor parallelism on tp, both on a 2-D mesh), and
under pipelining only its own stages' parameters. torchtitan's ``clip_grad_norm_``
(torchtitan/distributed/utils.py) is followed: ``torch.nn.utils.get_total_norm`` over
DTensors yields a partial norm that ``full_tensor()`` reduces over the DTensors' mesh,
pipeline stages' norms are summed (as p-th powers) over the pp group, and
``torch.nn.utils.clip_grads_with_norm_`` scales the gradients. A plan mixes meshes from
layer to layer (a tp layer next to an fsdp one), and DTensor refuses to combine tensors
of different meshes, so, as torchtitan does for expert-parallel parameters, the norm is
taken per mesh and the groups' norms combined: every rank of a stage holds the same
layers, so every rank takes the same groups in the same order and the collectives line
up.

A tied parameter whose copies live on several stages (``runtime.tied``) holds the same
summed gradient on each after ``forward_backward``; only the first stage's copy counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _group_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """One full (plain, 0-dim) norm per device mesh, plus one for the plain tensors."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault(g.device_mesh, []).append(g)
        else:
            plain.append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain, norm_type))
    return norms


@torch.no_grad()
def total_grad_norm(params: Iterable[torch.nn.Parameter], norm_type: float = 2.0,
                    pp_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of ``params`` (DTensor shards or plain
    tensors) over the whole model: a float32 0-dim tensor, equal on every rank.
    Collective over each DTensor mesh, and over ``pp_group`` when given."""
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    norms = [n.float() for n in _group_norms(grads, norm_type)]
    if device is None:
        device = norms[0].device if norms else torch.device("cpu")
    norms = [n.to(device) for n in norms]
    if not norms:
        total = torch.zeros((), device=device)
    else:
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total ** (1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float,
               total_norm: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / total_norm)`` with
    ``torch.nn.utils.clip_grads_with_norm_``, one call per mesh (its foreach kernels take
    DTensors of one mesh; the 0-dim norm acts on them as a replicated scalar)."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm.to(group[0].grad.device))
