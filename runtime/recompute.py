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

A layer that modifies in place an output the selective policy saves (``h = linear(x);
h.relu_()``) gets that entry copied before the write (``_CopyOnWrite``): backward replays
the value the matmul made, where torch's cache would refuse the changed one.

Layers that modify their inputs in place (a ``ReLU(inplace=True)`` layer, ``x += f(x)``)
are recomputed exactly, at the price of one copy of those inputs (``_Frame``). Plain
``checkpoint(forward, x)`` cannot run them: it keeps ``x`` to rerun the layer from, the
layer's in-place op changes ``x``, and backward fails on the version check (or, without
it, would rerun the layer on its own output). Refusing such layers instead (no
recomputation where an input is modified) would leave the planner's forced and chosen
plans for ResNets unrunnable, while the copy is exact and costs one memory pass over
inputs that are, in practice, the activations of element-wise layers. So:

- the forward runs the user's code on the user's tensors, unchanged: every mutation and
  every alias the caller sees is eager's;
- before it, each input the layer modifies is copied (``detach().clone()``); the rerun in
  backward starts from a fresh copy of that snapshot, with the ``requires_grad`` the
  input had, so it sees the values the forward saw;
- which inputs the layer modifies is learnt on its first call, which snapshots every
  tensor input and keeps only the snapshots of those whose ``_version`` moved; a later
  call that modifies an input it did not modify before raises PlanError (that input's
  values are gone), as does a rerun whose unmodified input was changed in place after
  the layer ran (by a later layer), which torch would report as a version mismatch.

The inputs therefore reach ``checkpoint`` through the closure, not as its arguments
(which it would keep and version-check); zero-size anchors on the inputs' devices stand
in for them so it still stashes and restores those devices' RNG states. The planner
charges the copy (``LayerInfo.inplace_input_bytes``, autopar/planner/costs.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from runtime.plan import SELECTIVE_SAVE_OPS, LayerPlan, PlanError

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
        return _selective_contexts
    return None


def _selective_contexts() -> tuple:
    """The selective policy's (forward, recompute) modes, the forward one with
    ``_CopyOnWrite`` inside it."""
    caching, cached = create_selective_checkpoint_contexts(selective_policy())
    forward = contextlib.ExitStack()
    forward.enter_context(caching)
    forward.enter_context(_CopyOnWrite(caching))
    return forward, cached


class _CopyOnWrite(TorchDispatchMode):
    """Before an op writes to an output the selective policy has cached (an output of
    SELECTIVE_SAVE_OPS the layer then modifies in place, ``h = linear(x); h.relu_()``),
    the cache's entry becomes a copy, so backward gets the value the op made; torch's
    cache otherwise refuses the changed entry ("Tensor cached during selective
    activation checkpoint has been mutated"). Entered inside the caching mode, it sees
    each op first; the copy is made with both hidden, so the rerun's ops still match the
    forward's one by one. Reads torch's cache layout (``storage``: op -> call -> outputs
    as ``_VersionWrapper`` with ``val`` and ``version``); a layout without it is left alone.
    """

    def __init__(self, caching: TorchDispatchMode) -> None:
        super().__init__()
        self.storage = getattr(caching, "storage", {})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            written = {_storage_key(t) for t in _written(func, args, kwargs)} - {None}
            if written:
                self._copy_cached(written)
        return func(*args, **kwargs)

    def _copy_cached(self, written: set) -> None:
        for calls in list(self.storage.values()):
            for entry in list(calls.values()):
                for wrapper in pytree.tree_leaves(entry):
                    val = getattr(wrapper, "val", None)
                    if isinstance(val, torch.Tensor) and _storage_key(val) in written:
                        with _disable_current_modes():
                            wrapper.val = val.clone()
                        wrapper.version = wrapper.val._version


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` modifies in place (its schema's written arguments)."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def _storage_key(t: torch.Tensor) -> tuple | None:
    """Identity of a tensor's storage (a DTensor's: its shard's); None for a tensor
    subclass that has none."""
    local = getattr(t, "_local_tensor", t)
    try:
        return local.device, local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _Frame:
    """One call of a recomputed layer: its inputs, and the snapshots the rerun starts from."""

    def __init__(self, layer: str, forward: Callable, flat: list, spec: pytree.TreeSpec,
                 copy_at: Iterable[int]) -> None:
        self.layer, self.forward, self.spec = layer, forward, spec
        self.flat: list = flat
        self.tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        self.requires_grad = {i: flat[i].requires_grad for i in self.tensors}
        self.versions = {i: flat[i]._version for i in self.tensors}
        snapshots: dict[int, torch.Tensor] = {}  # by id: an input passed twice is copied once
        self.snapshots = {i: snapshots.setdefault(id(flat[i]), flat[i].detach().clone())
                          for i in copy_at}
        self.ran = False

    def run(self, *anchors: torch.Tensor) -> object:
        """The layer's forward: on the user's tensors the first time, then (the rerun in
        backward) on fresh copies of the snapshots."""
        flat = self.flat if not self.ran else self._rerun_inputs()
        self.ran = True
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return self.forward(*args, **kwargs)

    def modified(self) -> list[int]:
        """After the forward: positions of the inputs it modified in place."""
        return [i for i in self.tensors if self.flat[i]._version != self.versions[i]]

    def keep_only(self, modified: list[int]) -> None:
        """Drop the snapshots of unmodified inputs and the references to modified ones,
        and note the versions the rerun checks the unmodified ones against."""
        self.snapshots = {i: t for i, t in self.snapshots.items() if i in modified}
        self.versions = {i: self.flat[i]._version for i in self.tensors if i not in modified}
        self.flat = [None if i in self.snapshots else v for i, v in enumerate(self.flat)]

    def _rerun_inputs(self) -> list:
        flat = list(self.flat)
        copies: dict[int, torch.Tensor] = {}
        # The copies are ours, not the layer's: hidden from the selective policy's dispatch
        # mode, which replays the rerun's ops against the forward's one by one.
        with _disable_current_modes():
            for i, snapshot in self.snapshots.items():
                if id(snapshot) not in copies:
                    source = snapshot.detach().requires_grad_(self.requires_grad[i])
                    copies[id(snapshot)] = source.clone()  # not a leaf: it may be modified
                flat[i] = copies[id(snapshot)]
        for i, version in self.versions.items():
            if flat[i]._version != version:
                raise PlanError(
                    f"layer {self.layer!r} is recomputed, but its input {i} was modified in "
                    "place after the layer ran (by a later layer or the training loop), so "
                    "its rerun in backward would see other values; plan recompute='none' "
                    f"for {self.layer!r}, or make the later in-place operation out-of-place"
                )
        return flat


def _anchors(flat: list) -> tuple[torch.Tensor, ...]:
    """A zero-size tensor on each device the inputs live on (see the module docstring)."""
    devices = dict.fromkeys(v.device for v in flat if isinstance(v, torch.Tensor))
    return tuple(torch.empty(0, device=d) for d in devices)


class _Recomputed:
    """A layer's ``forward`` run under non-reentrant checkpointing with ``mode``'s policy,
    exact for layers that modify their inputs in place (see the module docstring)."""

    def __init__(self, forward: Callable, mode: str, layer: str) -> None:
        functools.update_wrapper(self, forward)
        self.forward, self.layer = forward, layer
        context_fn = _context_fn(mode)
        self.options = {"context_fn": context_fn} if context_fn is not None else {}
        self.modifies: dict[pytree.TreeSpec, frozenset[int]] = {}
        """Per input structure: positions (in the flattened inputs) the layer modifies."""

    def __call__(self, *args, **kwargs) -> object:
        if not torch.is_grad_enabled():  # nothing is saved, so nothing to recompute
            return self.forward(*args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        known = self.modifies.get(spec)
        frame = _Frame(self.layer, self.forward, flat, spec,
                       known if known is not None else
                       [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)])
        out = checkpoint(frame.run, *_anchors(flat), use_reentrant=False, **self.options)
        modified = frame.modified()
        if known is None:
            self.modifies[spec] = frozenset(modified)
        elif not known.issuperset(modified):
            raise PlanError(
                f"layer {self.layer!r} modified its input {sorted(set(modified) - known)} "
                "in place on this call but not on its first, so recomputation kept no copy "
                f"of it to rerun the layer from; plan recompute='none' for {self.layer!r}"
            )
        frame.keep_only(modified)
        return out


def apply_recompute(model: nn.Module, layers: list[LayerPlan]) -> None:
    """Checkpoint each layer whose ``recompute`` is not ``none`` (in place, names unchanged)."""
    counts: dict[str, int] = {}
    for layer in layers:
        if layer.recompute == "none":
            continue
        module = model.get_submodule(layer.module)
        module.forward = _Recomputed(module.forward, layer.recompute, layer.module)
        counts[layer.recompute] = counts.get(layer.recompute, 0) + 1
    if counts:
        logger.info("applied activation recomputation: %s",
                    ", ".join(f"{n} {mode}" for mode, n in sorted(counts.items())))
