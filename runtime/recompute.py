"""Activation recomputation per layer (``LayerPlan.recompute``) with ``torch.utils.checkpoint``.

- ``full``: the layer's forward runs under non-reentrant ``checkpoint``; only its inputs
  are kept, and backward runs the whole forward again first.
- ``selective``: the same, with torchtitan's op-level selective policy
  (``create_selective_checkpoint_contexts``): the outputs of the ops named in
  ``runtime.plan.SELECTIVE_SAVE_OPS`` (weight matmuls, TP collectives) are saved
  (``MUST_SAVE``), every other op is run again in backward (``PREFER_RECOMPUTE``), so
  backward repeats no weight matmul and no collective. The layer then holds its inputs
  and those outputs, nothing else: the inverse policy (recompute a short list, save the
  rest) keeps the output of every other op and view, needed by backward or not, and was
  measured holding 1.4x the bytes of no recomputation on a Megatron-shaped block.
  Dropout is recomputed with the same mask: ``checkpoint`` restores the RNG state it
  saved at the layer's forward (``preserve_rng_state``, its default).

The layer's ``forward`` attribute is replaced by a checkpointed call of the original one,
instead of wrapping the module: parameter names stay as in the user's model (plans and
checkpoints name them; ``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module``).
The composable ``torch.distributed._composable.checkpoint`` keeps names too, but it
enters the checkpoint in a forward pre-hook registered before FSDP2's, so FSDP2's input
casting runs inside the checkpointed region, and a selective policy then fails in
backward on the profiler op that casting records. Replacing ``forward`` puts every hook
(FSDP2's all-gather and casting) outside the region, as ``checkpoint_wrapper`` does.

Order (``runtime.apply``): after tensor parallelism, so TP's collectives are inside the
region (saved by the selective policy, re-run by ``full``); before FSDP2/DDP, whose
hooks stay outside it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from runtime.plan import SELECTIVE_SAVE_OPS, LayerPlan

logger = logging.getLogger(__name__)


def _save_packets() -> frozenset:
    """SELECTIVE_SAVE_OPS as overload packets; ops this torch lacks are skipped."""
    packets = []
    for name in SELECTIVE_SAVE_OPS:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            packets.append(packet)
    return frozenset(packets)


def selective_policy() -> Callable:
    """Checkpoint policy: save SELECTIVE_SAVE_OPS' outputs, recompute everything else."""
    save = _save_packets()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", op) in save:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _context_fn(mode: str) -> Callable | None:
    if mode == "selective":
        return functools.partial(create_selective_checkpoint_contexts, selective_policy())
    return None


def _checkpointed(forward: Callable, mode: str) -> Callable:
    """``forward`` run under non-reentrant checkpointing with ``mode``'s policy."""
    context_fn = _context_fn(mode)
    options = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


def apply_recompute(model: nn.Module, layers: list[LayerPlan]) -> None:
    """Checkpoint each layer whose ``recompute`` is not ``none`` (in place, names unchanged)."""
    counts: dict[str, int] = {}
    for layer in layers:
        if layer.recompute == "none":
            continue
        module = model.get_submodule(layer.module)
        module.forward = _checkpointed(module.forward, layer.recompute)
        counts[layer.recompute] = counts.get(layer.recompute, 0) + 1
    if counts:
        logger.info("applied activation recomputation: %s",
                    ", ".join(f"{n} {mode}" for mode, n in sorted(counts.items())))
