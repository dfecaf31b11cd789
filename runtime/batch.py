"""A batch as users write it, and the one place it is cut into per-rank and micro-batches.

A model's inputs are positional arguments, keyword arguments (Hugging Face's
``model(**batch)``: ``input_ids``, ``attention_mask``, ``labels``), or both. ``as_inputs``
reads each form users pass as ``example_inputs`` or as a training batch:

- a tensor: the one positional argument;
- a tuple (or list): the positional arguments;
- a dict (any mapping with string keys): the keyword arguments;
- ``Inputs(args, kwargs)``: both (also for a model whose one positional argument is a dict).

Which tensors carry the batch: the global batch size is dim 0 of the targets when there
are any, else of the first tensor input with a dim 0 other than 1 (positional first, then
keywords in order; 1 when every dim 0 is 1). Every tensor leaf (nested dicts, tuples and lists included) whose dim 0 equals it
is sliced; tensors whose dim 0 is 1 (one row for every sample, as a position-ids
``[1, seq]`` broadcasts), 0-dim tensors and non-tensors go to every rank unchanged. Any
other dim 0 is an error naming the input, because slicing it, or not, would silently give
some rank a different batch than one device sees.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from runtime.plan import PlanError


@dataclass(frozen=True)
class Inputs:
    """The arguments of one call of a model's forward: ``model(*args, **kwargs)``."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def call(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.args, **self.kwargs)


def as_inputs(value: object) -> Inputs:
    """``value`` in any of the forms the module docstring lists, as ``Inputs``."""
    if isinstance(value, Inputs):
        return value
    if isinstance(value, torch.Tensor):
        return Inputs((value,))
    if isinstance(value, (tuple, list)):
        return Inputs(tuple(value))
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise PlanError(
                f"a dict of inputs is read as keyword arguments, but its keys {bad!r} are not "
                "strings; pass Inputs((the_dict,), {}) if forward takes the dict itself"
            )
        return Inputs((), dict(value))
    raise PlanError(
        f"inputs of type {type(value).__name__} are not understood; pass a tensor, a tuple "
        "of positional arguments, a dict of keyword arguments, or Inputs(args, kwargs)"
    )


def like(original: object, inputs: Inputs) -> object:
    """``inputs`` in the form ``original`` was written in (see ``as_inputs``)."""
    if isinstance(original, torch.Tensor):
        return inputs.args[0]
    if isinstance(original, tuple):
        return inputs.args
    if isinstance(original, list):
        return list(inputs.args)
    if isinstance(original, Mapping):
        return dict(inputs.kwargs)
    return inputs


def leaves_with_names(inputs: Inputs) -> list[tuple[str, Any]]:
    """Every leaf of the inputs with the name a user knows it by: ``inputs[0]``,
    ``attention_mask``, ``batch['pixel_values']``."""
    out = _named("inputs", inputs.args)
    for key, value in inputs.kwargs.items():
        out += _named(key, value)
    return out


def _named(prefix: str, tree: object) -> list[tuple[str, Any]]:
    return [(f"{prefix}{pytree.keystr(path)}", leaf)
            for path, leaf in pytree.tree_flatten_with_path(tree)[0]]


def batch_size(inputs: Inputs, targets: object = None) -> int:
    """The global batch: dim 0 of the targets, else of the first tensor input with a dim 0
    (one that is not 1, which may be a row every sample shares). Raises PlanError naming
    an input whose dim 0 is neither the batch nor 1."""
    named = _named("targets", targets) + leaves_with_names(inputs)
    tensors = [(name, leaf) for name, leaf in named
               if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not tensors:
        names = ", ".join(name for name, _ in named) or "none"
        raise PlanError(
            f"no input has a batch dimension (inputs: {names}); the batch is dim 0 of a "
            "tensor input: pass the samples stacked along dim 0 (one sample as [1, ...])"
        )
    batch = next((int(t.shape[0]) for _, t in tensors if t.shape[0] != 1), 1)
    for name, leaf in tensors:
        _check_rows(name, leaf, batch)
    return batch


def _check_rows(name: str, leaf: torch.Tensor, batch: int) -> bool:
    """Whether ``leaf`` is sliced (dim 0 is the batch) or broadcast; raise when neither."""
    if leaf.dim() == 0:
        return False
    rows = int(leaf.shape[0])
    if rows == batch:
        return True
    if rows == 1:
        return False
    raise PlanError(
        f"input {name!r} has {rows} rows in dim 0, but the batch has {batch} samples: its "
        "batch dimension cannot be found. Put the batch in dim 0 of every per-sample tensor "
        "(transpose it, or build it batch-first); a tensor every sample shares must have "
        "one row in dim 0 (shape [1, ...]) or no dims"
    )


def _map_rows(inputs: Inputs, targets: object, batch: int,
              cut: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Inputs, object]:
    """``cut`` applied to every tensor that holds the batch in dim 0; the rest unchanged."""

    def visit(prefix: str, tree: object) -> object:
        flat, spec = pytree.tree_flatten_with_path(tree)
        leaves = [cut(leaf) if isinstance(leaf, torch.Tensor)
                  and _check_rows(f"{prefix}{pytree.keystr(path)}", leaf, batch) else leaf
                  for path, leaf in flat]
        return pytree.tree_unflatten(leaves, spec)

    args = visit("inputs", inputs.args)
    kwargs = {k: visit(k, v) for k, v in inputs.kwargs.items()}
    return Inputs(args, kwargs), visit("targets", targets)


def shard_rows(inputs: Inputs, targets: object, rank: int, ranks: int,
               transform: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
               ) -> tuple[Inputs, object]:
    """Rank ``rank``'s equal slice (of ``ranks``) of a global batch, each sliced tensor
    passed through ``transform`` (the move to the device, a sequence split)."""
    batch = batch_size(inputs, targets)
    if batch % ranks:
        raise PlanError(
            f"global batch of {batch} samples is not divisible by the data-parallel "
            f"degree dp={ranks}; use a multiple of {ranks}"
        )
    local = batch // ranks
    lo, hi = rank * local, (rank + 1) * local
    return _map_rows(inputs, targets, batch, lambda x: transform(x[lo:hi]))


def split_rows(inputs: Inputs, targets: object, count: int, dp: int,
               setting: str = "gradient_accumulation") -> list[tuple[Inputs, object]]:
    """A local batch cut into ``count`` equal micro-batches along dim 0; ``setting``
    names the plan field that asked for them, for the error message."""
    local = batch_size(inputs, targets)
    check_splits(local, count, dp, setting)
    size = local // count
    return [_map_rows(inputs, targets, local, lambda x, i=i: x[i * size:(i + 1) * size])
            for i in range(count)]


def check_splits(local: int, count: int, dp: int, setting: str) -> None:
    """Raise unless a local batch of ``local`` samples splits into ``count`` equal parts."""
    if local % count:
        raise PlanError(
            f"the local batch of {local} samples does not split into {setting}={count} "
            f"equal micro-batches; use a global batch that is a multiple of dp × {setting} "
            f"= {dp * count}, or change {setting}"
        )


def first_rows(inputs: Inputs, rows: int) -> Inputs:
    """The first ``rows`` samples of a batch (e.g. one micro-batch, for tracing)."""
    batch = batch_size(inputs)
    return _map_rows(inputs, None, batch, lambda x: x[:rows])[0]


def model_loss(output: object) -> torch.Tensor:
    """The loss a model returned: ``output.loss`` (Hugging Face's ``labels=``), a dict's
    ``"loss"``, or the output itself when it is a 0-dim tensor."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise PlanError(
            f"the model returned {type(output).__name__} without a loss, and no loss_fn was "
            "given: pass loss_fn=... (it receives the model's output and the targets), or "
            "have the model return its loss (Hugging Face models: pass labels=)"
        )
    return loss


__all__ = ["Inputs", "as_inputs", "batch_size", "check_splits", "first_rows", "like",
           "model_loss", "shard_rows", "split_rows"]
