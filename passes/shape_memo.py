"""``ShapeMemo``: shape propagation runs each distinct op once, not once per repeated block.

Running a node on meta tensors costs Python dispatch and the op's meta function (tens to
hundreds of microseconds for a linear, a norm or attention); GPT-3 175B's 96 identical
blocks run the same few dozen ops 96 times at the same shapes. An op's output shapes,
strides and dtypes are a function of what it is and of its inputs' shapes, strides,
dtypes and constant arguments, so a node whose key (below) was seen before gets fresh meta
tensors laid out as the first one's outputs, without running.

Only what is known to be a function of that key is reused: PyTorch ops (aten overloads,
``torch.*`` functions, Python operators and builtins), methods called on a tensor, and
leaf ``torch.nn`` modules keyed by their plain attributes and parameter/buffer layouts.
Everything else runs as before: user functions and modules (which may read state the key
does not see), in-place ops and anything that mutates (a metadata change such as
``unsqueeze_`` would be skipped), arguments of types the key cannot state exactly, and ops
whose output is one of their inputs or holds a value other than a tensor or a plain
constant. What is lost is storage sharing between a reused output and its base; the passes
that read the values (``passes.annotate.run_nodes``) read only their layouts, and rerun
every op of a layer they annotate.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import Node

_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device,
          torch.memory_format, torch.layout, type(Ellipsis))
_MUTATING_OPERATORS = frozenset({
    "setitem", "delitem", "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul",
    "imod", "imul", "ior", "ipow", "irshift", "isub", "itruediv", "ixor", "setattr",
    "delattr"})
_PURE_MODULES = ("torch", "_operator", "operator", "builtins", "math")


class _Unkeyable(Exception):
    """A value the key cannot state exactly: the node runs."""


def _value_key(value: object) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("T", type(value), tuple(value.shape), value.stride(), value.storage_offset(),
                value.dtype, value.device, value.layout, value.requires_grad,
                value.is_conj(), value.is_neg())
    if isinstance(value, _PLAIN):
        return (type(value), value)  # the type: 1, 1.0 and True are equal keys otherwise
    if isinstance(value, (tuple, list)):  # torch.Size included
        return (type(value), tuple(_value_key(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _value_key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _value_key(value.start), _value_key(value.stop), _value_key(value.step))
    raise _Unkeyable(type(value).__name__)


def _module_key(mod: nn.Module) -> Hashable:
    """A leaf ``torch.nn`` module by its type, plain attributes (features, eps, stride,
    training, inplace ...) and the layout of its parameters and buffers."""
    if (not type(mod).__module__.startswith("torch.nn.") or mod._modules
            or mod._forward_hooks or mod._forward_pre_hooks):
        raise _Unkeyable(type(mod).__name__)
    attrs = tuple(sorted((k, _value_key(v)) for k, v in vars(mod).items()
                         if not k.startswith("_")))
    tensors = tuple((k, None if t is None else _value_key(t))
                    for table in (mod._parameters, mod._buffers) for k, t in table.items())
    return (type(mod), attrs, tensors)


def _target_key(gm: torch.fx.GraphModule, node: Node, args: tuple) -> Hashable:
    target = node.target
    if node.op == "call_module":
        return ("module", _module_key(gm.get_submodule(str(target))))
    if node.op == "call_method":
        name = str(target)
        if name.endswith("_") or not args or not isinstance(args[0], torch.Tensor):
            raise _Unkeyable(name)  # in-place or dunder (x.add_, x.__setitem__), non-tensor
        return ("method", name)
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable:
            raise _Unkeyable(str(target))
        return ("op", target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", "")
    if (module.split(".")[0] not in _PURE_MODULES or name.endswith("_")
            or name in _MUTATING_OPERATORS):
        raise _Unkeyable(str(target))
    return ("function", target)


class ShapeMemo:
    """Outputs by node key, for one propagation over one graph."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self._seen: dict[Hashable, tuple | None] = {}  # key -> template, or None: always run
        self.hits = 0

    def key(self, node: Node, args: tuple, kwargs: dict) -> Hashable | None:
        """The node's key, or None when it must run (see the module docstring)."""
        if node.op not in ("call_function", "call_method", "call_module"):
            return None
        if kwargs.get("inplace") is True or "out" in kwargs:
            return None
        try:
            return (_target_key(self.gm, node, args), _value_key(args), _value_key(kwargs))
        except _Unkeyable:
            return None

    def lookup(self, key: Hashable | None) -> tuple[bool, object]:
        """(True, fresh output) when ``key`` was recorded as reusable, else (False, None)."""
        template = self._seen.get(key) if key is not None else None
        if template is None:
            return False, None
        spec, leaves = template
        self.hits += 1
        return True, pytree.tree_unflatten([_rebuild(leaf) for leaf in leaves], spec)

    def record(self, key: Hashable | None, args: tuple, kwargs: dict, out: object) -> None:
        if key is None or key in self._seen:
            return
        leaves, spec = pytree.tree_flatten(out)
        inputs = {id(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        templates = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) in inputs or type(leaf) is not torch.Tensor \
                        or leaf.requires_grad or leaf.device.type != "meta":
                    self._seen[key] = None  # returns an input, a parameter ...: keep running
                    return
                templates.append(("T", tuple(leaf.shape), leaf.stride(),
                                  leaf.storage_offset(), leaf.dtype))
            elif isinstance(leaf, _PLAIN) or type(leaf) is torch.Size:
                templates.append(("V", leaf))
            else:
                self._seen[key] = None
                return
        self._seen[key] = (spec, tuple(templates))


def _rebuild(template: tuple) -> object:
    if template[0] == "V":
        return template[1]
    _, shape, stride, offset, dtype = template
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) \
        if all(shape) else 0
    base = torch.empty(offset + extent, dtype=dtype, device="meta")
    return base.as_strided(shape, stride, offset)
