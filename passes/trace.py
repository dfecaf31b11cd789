"""Capture mechanics: an nn.Module + example inputs -> torch.fx GraphModule on meta tensors.

This lives in ``passes`` (not ``autopar``) because ``passes.layer_graph.build_layer_graph``
captures too and ``passes`` may not import ``autopar``. ``autopar.capture.capture`` is the
public front door; ``autopar.errors.CaptureError`` is ``GraphCaptureError``.

Two methods, each keeping ``nn_module_stack`` (module path per node):

- ``export``: ``torch.export.export(strict=False)`` then ``.module()`` (parameters become
  ``get_attr`` nodes named by their fully-qualified names). Handles modern models
  (Hugging Face transformers) but costs ~6.4 s for gpt3-175b (96 blocks) on 2 cores.
- ``symbolic_trace``: ``torch.fx`` with ``opaque`` modules as leaves; 0.02-0.4 s for the
  same models. It is sound-or-fails: tensor values and shapes are proxies, so Python
  control flow on them raises instead of being baked in (export instead specialises on
  shapes, which is also sound for planning at the captured shapes).
"""

from __future__ import annotations

import bisect
import copy
import dis
import functools
import inspect
import os
import re
import time
import traceback
import types
from collections.abc import Iterable

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export._tree_utils import reorder_kwargs

from cost_models.errors import AutoparError, ConfigError
from passes import meta_keys
from runtime.batch import Inputs, as_inputs

METHODS = ("export", "symbolic_trace")
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


class GraphCaptureError(AutoparError):
    """Neither capture method worked; the message names the construct, line and remedy."""


def trace_module(
    model: nn.Module,
    example_inputs: object,
    *,
    opaque: Iterable[str] = (),
    prefer: str = "export",
) -> torch.fx.GraphModule:
    """Capture with ``prefer`` first and the other method as fallback.

    ``example_inputs``: a tensor, a tuple of positional arguments, a dict of keyword
    arguments or ``runtime.batch.Inputs`` (see ``runtime.batch.as_inputs``). The graph's
    placeholders take ``placeholder_values(gm, example_inputs)``."""
    if prefer not in METHODS:
        raise ValueError(f"prefer={prefer!r}; valid: {', '.join(METHODS)}")
    opaque = tuple(opaque)
    _check_opaque(model, opaque)
    _check_arguments(model, as_inputs(example_inputs))
    order = (prefer,) + tuple(m for m in METHODS if m != prefer)
    errors: dict[str, BaseException] = {}
    for method in order:
        start = time.perf_counter()
        try:
            gm = _CAPTURERS[method](model, as_inputs(example_inputs), opaque)
        except Exception as e:  # any failure of one method means: try the other
            errors[method] = e
            continue
        reason = "; ".join(f"{m}: {_first_line(e)}" for m, e in errors.items())
        gm.meta[meta_keys.CAPTURE] = meta_keys.CaptureInfo(
            method=method, seconds=time.perf_counter() - start, fallback_reason=reason
        )
        return gm
    raise GraphCaptureError(explain_failure(model, errors)) from errors[order[0]]


def to_meta(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers live on 'meta'.

    Copies no data (each tensor is replaced via deepcopy's memo), keeps tied parameters
    tied and keeps every module name. Returns ``model`` itself if it is already on meta.
    """
    tensors = list(model.parameters()) + list(model.buffers())
    if all(t.is_meta for t in tensors):
        return model
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def inputs_to_meta(example_inputs: object) -> object:
    """Every tensor of the inputs (nested ones too) on 'meta', in the form they came in."""
    def meta(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")

    if isinstance(example_inputs, Inputs):
        return Inputs(*pytree.tree_map_only(
            torch.Tensor, meta, (example_inputs.args, dict(example_inputs.kwargs))))
    return pytree.tree_map_only(torch.Tensor, meta, example_inputs)


def placeholder_values(gm: torch.fx.GraphModule, example_inputs: object) -> tuple:
    """The value of each placeholder of a captured graph, in graph order.

    An exported graph takes the flattened (args, kwargs) as export saw them; a symbolically
    traced one takes forward's parameters by name, each not given at its default."""
    inputs = as_inputs(example_inputs)
    codegen = gm.graph._codegen
    if isinstance(codegen, torch.fx.graph._PyTreeCodeGen):
        # Export's own reordering, so keyword inputs given in another order still match.
        kwargs = reorder_kwargs(dict(inputs.kwargs), codegen.pytree_info.in_spec)
        return tuple(pytree.tree_leaves((inputs.args, kwargs)))
    bound = _bind(gm, inputs)
    return tuple(bound.get(n.target, n.args[0] if n.args else None)
                 for n in gm.graph.find_nodes(op="placeholder"))


def _check_arguments(model: nn.Module, inputs: Inputs) -> None:
    """Inputs forward cannot take are the user's to fix: name them before capture fails."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C forward: capture will tell
        return
    try:
        signature.bind(*inputs.args, **inputs.kwargs)
    except TypeError as e:
        raise ConfigError(
            f"example inputs do not fit {type(model).__name__}.forward{signature}: {e}; pass "
            "a tuple of positional arguments, a dict of keyword arguments named as forward's "
            "parameters, or Inputs(args, kwargs)"
        ) from e


# -- the two methods --------------------------------------------------------------------------


def _export(model: nn.Module, inputs: Inputs, opaque: tuple[str, ...]) -> torch.fx.GraphModule:
    # `opaque` has no export equivalent short of custom ops; grouping still plans each opaque
    # module as one layer.
    ep = torch.export.export(model, tuple(inputs.args), kwargs=dict(inputs.kwargs) or None,
                             strict=False)
    return ep.module()


class _LeafTracer(torch.fx.Tracer):
    # Buffers become get_attr nodes named by their module path, as parameters do (and as
    # export names them): a buffer sliced by a traced size (a causal mask cut to the
    # sequence length) then traces, and each layer's buffer keeps its layer's name instead
    # of becoming an anonymous root-level tensor constant.
    proxy_buffer_attributes = True

    def __init__(self, opaque: tuple[str, ...]) -> None:
        super().__init__()
        self.opaque = set(opaque)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.opaque or super().is_leaf_module(
            m, module_qualified_name
        )

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _Proxy(node, self)


class _UnpackOnce:
    """``torch.fx.Proxy.__iter__`` (unpacking ``q, k, v = x.split(...)`` or ``B, T, C =
    x.shape``), with the caller's bytecode disassembled once per code object rather than at
    every unpack: fx reads the instruction at the call site to learn how many values are
    unpacked, and disassembling a block's forward 96 times was a third of tracing GPT-3."""

    def __iter__(self):
        caller = inspect.currentframe().f_back
        offsets, instructions = _instructions(caller.f_code)
        inst = instructions[bisect.bisect_left(offsets, caller.f_lasti)]
        if inst.opname == "UNPACK_SEQUENCE":
            return (self[i] for i in range(inst.argval))
        return self.tracer.iter(self)


class _Proxy(_UnpackOnce, torch.fx.Proxy):
    def __getattr__(self, k: str) -> torch.fx.proxy.Attribute:
        return _Attribute(self, k)


class _Attribute(_UnpackOnce, torch.fx.proxy.Attribute):
    pass


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> tuple[list[int], list[dis.Instruction]]:
    instructions = list(dis.get_instructions(code))
    return [i.offset for i in instructions], instructions


def trace_at_defaults(tracer: torch.fx.Tracer, model: nn.Module,
                      num_inputs: int | None = None,
                      given: frozenset[str] = frozenset()) -> torch.fx.Graph:
    """``tracer.trace(model)`` with the optional forward arguments past the first
    ``num_inputs`` (all optional ones when None), other than the keyword arguments
    ``given``, fixed at their defaults, as export treats arguments it is not given:
    ``if pos is None:`` then traces instead of seeing a Proxy."""
    params = list(inspect.signature(model.forward).parameters.values())
    defaults = {p.name: p.default for p in params[num_inputs or 0:]
                if p.default is not inspect.Parameter.empty and p.name not in given
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    graph = tracer.trace(model, concrete_args=defaults or None)
    for node in [n for n in graph.nodes if n.target is torch.fx._symbolic_trace._assert_is_none]:
        graph.erase_node(node)  # fx's guard on a None default: not an op of the model
    return graph


def _symbolic_trace(
    model: nn.Module, inputs: Inputs, opaque: tuple[str, ...]
) -> torch.fx.GraphModule:
    # Placeholders are forward's parameters; a keyword input must name a plain tensor
    # parameter (nested structures are export's to flatten).
    if any(not isinstance(v, torch.Tensor) for v in inputs.kwargs.values()):
        raise TypeError("symbolic_trace takes keyword inputs that are tensors only")
    tracer = _LeafTracer(opaque)
    graph = trace_at_defaults(tracer, model, len(inputs.args), frozenset(inputs.kwargs))
    gm = torch.fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args]
    given = len(inputs.args) + len(inputs.kwargs)
    if not len(required) <= given <= len(placeholders):
        raise TypeError(f"forward takes {len(required)}..{len(placeholders)} inputs, got {given}")
    _bind(gm, inputs)
    return gm


def _bind(gm: torch.fx.GraphModule, inputs: Inputs) -> dict[str, object]:
    """A symbolically traced graph's placeholder names bound to the inputs."""
    names = [str(n.target) for n in gm.graph.find_nodes(op="placeholder")]
    bound = dict(zip(names, inputs.args, strict=False))
    unknown = [k for k in inputs.kwargs if k not in names or k in bound]
    if unknown:
        raise TypeError(f"forward has no parameter (or got twice) {', '.join(unknown)}")
    return {**bound, **inputs.kwargs}


def _keeping_state(capture):
    """``capture``, restoring every module's parameters and buffers afterwards, and failing
    if the forward replaced one. Symbolic tracing runs forward on Proxy values, so a
    forward that assigns a buffer anew (``self.count += 1``: fx has no in-place add, so
    Python assigns ``self.count + 1``) would leave a Proxy in the model and trace the
    update as a value nobody reads; export captures such updates, so it is used instead."""

    def run(model: nn.Module, inputs: Inputs, opaque: tuple[str, ...]) -> torch.fx.GraphModule:
        before = {name: (dict(m._parameters), dict(m._buffers))
                  for name, m in model.named_modules()}
        try:
            gm = capture(model, inputs, opaque)
        finally:
            changed = _restore_state(model, before)
        if changed:
            raise TypeError(
                f"forward assigns a new value to {changed[0]!r} (e.g. `self.x += 1` on a "
                "buffer); symbolic tracing cannot follow state updated in forward")
        return gm

    return run


def _restore_state(model: nn.Module, before: dict[str, tuple[dict, dict]]) -> list[str]:
    """Put back the parameters and buffers recorded in ``before``; the names that changed."""
    changed = []
    for name, module in model.named_modules():
        for now, then in zip((module._parameters, module._buffers), before.get(name, ({}, {})),
                             strict=True):
            for key, value in then.items():
                if now.get(key) is not value:
                    changed.append(f"{name}.{key}" if name else key)
                    now[key] = value
    return changed


_CAPTURERS = {"export": _export, "symbolic_trace": _keeping_state(_symbolic_trace)}


# -- explaining failure ---------------------------------------------------------------------


def explain_failure(model: nn.Module, errors: dict[str, BaseException]) -> str:
    """One message: what construct failed, where in the user's code, and what to try."""
    lines = [f"could not capture {type(model).__name__} as a graph."]
    for method, err in errors.items():
        where = user_frame(err)
        lines.append(
            f"  {method}: {construct_of(err)}"
            + (f" at {where}" if where else "")
            + f" ({type(err).__name__}: {_first_line(err)})"
        )
    text = " ".join(str(e) for e in errors.values())
    config = getattr(model, "config", None)
    if "Cache" in text or getattr(config, "use_cache", False):
        lines.append(
            "  The model returns a key/value cache (DynamicCache), which cannot be captured: "
            "build it with use_cache=False (e.g. config.use_cache = False)."
        )
    module = _module_at(model, errors)
    if module:
        lines[0] += f" The failing line is in module {module!r}."
    hint = f"opaque=[{module!r}]" if module else "opaque=['<module path>']"
    kinds = [_kind_of(e) for e in errors.values()]
    # A data read seen by one method shows as data-dependent control flow to export.
    kind = next((k for k in ("data", "control_flow", "kwargs") if k in kinds), "other")
    lines.append("  " + _REMEDIES[kind].format(hint=hint))
    return "\n".join(lines)


_REMEDIES = {
    "control_flow": "Rewrite that line without Python control flow on tensor values (e.g. "
                    "torch.where), or plan the enclosing module as one unit with {hint} (a "
                    "path from model.named_modules()).",
    "data": "Keep that value a tensor: capture and costing see shapes, never data, so "
            ".item(), .tolist(), .numpy() and float()/int() of a tensor cannot be captured.",
    "kwargs": "Give forward explicit parameters instead of forwarding **kwargs, or plan the "
              "enclosing module as one unit with {hint} (a path from model.named_modules()).",
    "other": "Plan the enclosing module as one unit with {hint} (a path from "
             "model.named_modules()), or rewrite that line with torch operations.",
}


def _kind_of(err: BaseException) -> str:
    msg = str(err)
    if "symbolically traced variables cannot be used as inputs to control flow" in msg or \
            "data-dependent" in msg or "GuardOnDataDependent" in type(err).__name__:
        return "control_flow"
    # The tracer's proxies are this module's _Proxy (passes/trace.py), torch.fx's Proxy inside.
    if re.search(r"(float|int|bool)\(\) argument must be .*'_?Proxy'|numpy\(\)|\.item\(\)|"
                 r"tolist|convert .* to numpy", msg):
        return "data"
    if "co_varnames" in msg:
        return "kwargs"
    return "other"


def construct_of(err: BaseException) -> str:
    msg = str(err)
    if "symbolically traced variables cannot be used as inputs to control flow" in msg:
        return "Python control flow (if/while/bool()) on a traced tensor value"
    if "data-dependent" in msg or "GuardOnDataDependent" in type(err).__name__:
        return "a branch, shape or Python value that depends on tensor values (data-dependent)"
    if _kind_of(err) == "data":
        return "reading a tensor's values into Python (.item(), .tolist(), .numpy(), float())"
    if "co_varnames" in msg:
        return "a function torch.fx cannot wrap (e.g. **kwargs forwarding)"
    if "Cache" in msg:
        return "a non-tensor output (key/value cache)"
    return "an unsupported construct"


def user_frame(err: BaseException) -> str:
    """file:line of the innermost frame outside torch and this module, or ''."""
    best = ""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:  # the traceback of the root cause too
        seen.add(id(e))
        for frame in traceback.extract_tb(e.__traceback__):
            path = os.path.abspath(frame.filename)
            if path.startswith(_TORCH_DIR) or path == _THIS_FILE or "<" in frame.filename:
                continue
            best = f"{frame.filename}:{frame.lineno}" + (f" `{frame.line}`" if frame.line else "")
        e = e.__cause__ or e.__context__
    return best


def _module_at(model: nn.Module, errors: dict[str, BaseException]) -> str:
    """The first named submodule whose ``forward`` contains a failing line, if any."""
    spots = set()
    for e in errors.values():
        file, _, rest = user_frame(e).partition(":")
        if file and rest.split(" ")[0].isdigit():
            spots.add((os.path.abspath(file), int(rest.split(" ")[0])))
    for name, mod in model.named_modules():
        forward = type(mod).forward
        try:
            src = os.path.abspath(inspect.getsourcefile(forward) or "")
            lines, start = inspect.getsourcelines(forward)
        except (OSError, TypeError):
            continue
        if name and any(f == src and start <= ln < start + len(lines) for f, ln in spots):
            return name
    return ""


def _check_opaque(model: nn.Module, opaque: tuple[str, ...]) -> None:
    names = dict(model.named_modules())
    bad = [o for o in opaque if o not in names or not o]
    if bad:
        sample = ", ".join(list(n for n in names if n)[:8])
        raise ValueError(f"opaque={bad} are not submodule paths of the model; e.g. {sample}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
