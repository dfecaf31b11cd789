"""``split_stages``: cut a model into one module per pipeline stage, as a plan says.

Two captures, one set of rules for where the cuts go (steps 1 and 3 below):

- **symbolic_trace** (this module): ``torch.fx`` with every layer as a leaf; each stage is
  a ``GraphModule`` that calls the user's own layer modules. Preferred where it works: it
  is shape-generic, tensor parallelism can replace the layers' ``nn.Linear`` weights, and
  it is about nine times faster: gpt-tiny with 6 blocks cut into 2 stages splits in
  0.05 s against 0.45 s for the export split (``python bench/split_speed.py``,
  BENCHMARKS.md), with the same parameters under the same names per stage and the same
  outputs (tests/passes/test_split_stages.py checks both).
- **export** (``passes.split_export``): PyTorch's ``torch.distributed.pipelining.pipeline``
  on a ``torch.export`` capture, for what symbolic tracing cannot capture (every Hugging
  Face model, keyword inputs) and for parameters used on two stages (tied weights), which
  it copies onto each stage that uses them.

The symbolic split's steps, in order:

1. **layer stages.** The units of a cut are the layers of ``passes.group_layers``
   (``h.3``, ``wte``, ``ln_f``). A plan module that is a layer, inside one, or holds
   several gives its stage to those layers; two plan modules inside one layer on different
   stages are a cut through that layer (PlanError). Layers the plan does not name join the
   stage of the layer before them in execution order (the one after, if none ran yet).
2. **capture.** ``torch.fx`` symbolic tracing with every layer as a leaf, so each layer is
   one ``call_module`` node that calls the user's own module object.
3. **node stages.** A layer's node goes to the layer's stage; placeholders to stage 0; a
   node run by no layer (``pos = arange(T)``, the residual add between layers) to the stage
   of the layer that ran last before it (the first layer's stage if none ran yet), which
   is how ``group_layers`` assigns such nodes too. Stages must follow execution order.
4. **values between stages.** Shapes are propagated on meta copies. Every value made on
   a stage ``<= s`` and used on a stage ``> s`` is an output of stage ``s`` and an input
   of ``s + 1`` (values that skip a stage are passed through it), because a pipeline
   stage only talks to its neighbours. Such values must be floating-point tensors.
5. **stage modules.** One ``GraphModule`` per stage over the user's model: it holds the
   stage's layers under their fully-qualified names (stage 1 has ``h.2.attn.q_proj``), so
   per-layer tensor/data parallelism applies by name unchanged and ``named_parameters``
   match the user's model. Parameters are shared with the user's model, not copied.

Limits of the symbolic split (``method="auto"`` then uses the export split): the model
must be symbolically traceable with its layers as leaves, and a parameter must be used on
one stage. Either way, a layer called twice must stay on one stage and only
floating-point tensors cross a cut.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn
from torch.fx import GraphModule, Node

from passes.constants import constant_nodes
from passes.group_layers import layer_names, owning_layer, stateless_layers
from passes.split_export import Send, StageSplit, check_sendable, export_stages, send_record
from passes.trace import (
    GraphCaptureError,
    explain_failure,
    inputs_to_meta,
    to_meta,
    trace_at_defaults,
)
from runtime.pipeline_sends import check_sends
from runtime.plan import Plan, PlanError

_CALLS = ("call_function", "call_method", "call_module")
METHODS = ("auto", "symbolic_trace", "export")
"""``split_pipeline``'s capture choices; 'auto' tries symbolic tracing, then export."""

__all__ = ["METHODS", "StageSplit", "layer_stages", "split_pipeline", "split_stages"]


class _SharedAcrossStages(PlanError):
    """A parameter used on two stages: the symbolic split would train two copies apart."""


def split_stages(model: nn.Module, plan: Plan, example_inputs: tuple,
                 example_kwargs: dict | None = None, *, method: str = "auto") -> list[nn.Module]:
    """One module per pipeline stage (index = stage id); ``split_pipeline(...).modules``."""
    return split_pipeline(model, plan, example_inputs, example_kwargs, method=method).modules


def split_pipeline(model: nn.Module, plan: Plan, example_inputs: tuple,
                   example_kwargs: dict | None = None, *, method: str = "auto") -> StageSplit:
    """The stage modules of ``plan``, and which parameters several stages hold copies of.

    ``example_inputs`` (and ``example_kwargs``, export only): one micro-batch (real or meta
    tensors); only shapes and types are used, and an exported split runs at these shapes
    only. Raises PlanError when the plan does not fit the model, GraphCaptureError when
    the model cannot be captured.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}; valid: {', '.join(METHODS)}")
    units = layer_names(model)
    if units == [""]:
        raise PlanError(
            f"{type(model).__name__} has no submodules, so it cannot be cut into "
            f"{plan.num_stages} pipeline stages; re-plan with pp=1"
        )
    symbolic: BaseException | None = None
    if method != "export" and not example_kwargs:
        try:
            modules, sends = _symbolic_stages(model, plan, units, example_inputs)
            split = StageSplit(modules=modules, tied=(), method="symbolic_trace", sends=sends)
            check_sends(plan, split.sends)
            return split
        except (GraphCaptureError, _SharedAcrossStages) as e:
            if method == "symbolic_trace":
                raise
            symbolic = e.__cause__ if isinstance(e, GraphCaptureError) else None
    _check_no_tensor_parallel(model, plan)
    try:
        split = export_stages(model, units, lambda order: _layer_stages(model, plan, order),
                              plan.num_stages, example_inputs, example_kwargs)
        check_sends(plan, split.sends)
        return split
    except GraphCaptureError as e:
        if symbolic is None:
            raise
        exported = e.__cause__.__cause__ or e.__cause__  # pipeline() wraps export's error
        raise GraphCaptureError(
            "splitting into pipeline stages failed with both captures:\n"
            + explain_failure(model, {"symbolic_trace": symbolic, "export": exported})
        ) from e


def _symbolic_stages(model: nn.Module, plan: Plan, units: list[str], example_inputs: tuple
                     ) -> tuple[list[nn.Module], tuple[tuple[Send, ...], ...]]:
    gm = _trace(model, units)
    order = _execution_order(gm, set(units))
    stages = _layer_stages(model, plan, order)
    node_stage = _node_stages(gm, stages, set(units), plan.num_stages,
                              stateless_layers(model, units))
    values = _propagate(gm, model, example_inputs)
    constants = constant_nodes(gm)
    crossing = [_crossing(gm, node_stage, s, constants) for s in range(plan.num_stages - 1)]
    modules = [_stage_module(gm, model, node_stage, values, s, crossing, constants)
               for s in range(plan.num_stages)]
    _check_tied(modules)
    sends = tuple(tuple(send_record(n, values[n]) for n in sent) for sent in crossing)
    return modules, sends


def _check_no_tensor_parallel(model: nn.Module, plan: Plan) -> None:
    tp = [la.module for la in plan.layers if la.is_tp]
    if tp:
        raise PlanError(
            f"layer(s) {tp} are planned tensor-parallel, but {type(model).__name__}'s "
            "pipeline stages come from torch.export (symbolic tracing cannot capture it, or a "
            "parameter is used on two stages), whose modules are not the model's nn.Linear/"
            "nn.Embedding layers that tensor parallelism splits; plan these layers with a "
            "data-parallel strategy, or pp=1"
        )


def layer_stages(model: nn.Module, plan: Plan) -> dict[str, int]:
    """The stage of every layer of ``model`` (planned or not), in execution order."""
    units = layer_names(model)
    gm = _trace(model, units)
    return _layer_stages(model, plan, _execution_order(gm, set(units)))


# -- 1. layer stages ---------------------------------------------------------------------


def _layer_stages(model: nn.Module, plan: Plan, order: list[str]) -> dict[str, int]:
    names = dict(model.named_modules())
    fixed: dict[str, tuple[int, str]] = {}  # layer -> (stage, plan module that set it)
    for layer in plan.layers:
        if layer.module not in names:
            top = [n for n, _ in model.named_children()]
            raise PlanError(
                f"layer {layer.module!r}: no such module in {type(model).__name__}; module "
                f"paths are fully-qualified names as in model.named_modules() (top level: {top})"
            )
        inside = owning_layer(layer.module, set(order))
        covered = [inside] if inside else [u for u in order if u.startswith(layer.module + ".")]
        for unit in covered:
            if unit in fixed and fixed[unit][0] != layer.stage:
                other = fixed[unit][1]
                raise PlanError(
                    f"the stage cut between {other!r} (stage {fixed[unit][0]}) and "
                    f"{layer.module!r} (stage {layer.stage}) splits layer {unit!r}; a layer "
                    f"runs on one stage: put {other!r} and {layer.module!r} on the same stage"
                )
            fixed[unit] = (layer.stage, layer.module)
    if not fixed:
        raise PlanError(
            f"the plan has {plan.num_stages} pipeline stages but names none of the model's "
            f"layers ({', '.join(order[:6])}, ...); give each layer a stage"
        )
    stages: dict[str, int] = {}
    first = next(fixed[u][0] for u in order if u in fixed)
    current = first
    for unit in order:
        current = fixed[unit][0] if unit in fixed else current
        stages[unit] = current
    _check_monotone(stages)
    return stages


def _check_monotone(stages: dict[str, int]) -> None:
    items = list(stages.items())
    for (a, sa), (b, sb) in zip(items, items[1:], strict=False):
        if sb < sa:
            raise PlanError(
                f"layer {b!r} (stage {sb}) runs after layer {a!r} (stage {sa}); stages must "
                "follow the order in which the model runs its layers"
            )


# -- 2. capture ------------------------------------------------------------------------------


class _LayerTracer(torch.fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.leaves or super().is_leaf_module(m, qualified_name)


def _trace(model: nn.Module, units: list[str]) -> GraphModule:
    tracer = _LayerTracer(set(units))
    try:
        graph = trace_at_defaults(tracer, model)
    except Exception as e:
        raise GraphCaptureError(
            "splitting into pipeline stages traces the model with torch.fx.symbolic_trace "
            "(layers as leaves), which failed:\n" + explain_failure(model, {"symbolic_trace": e})
        ) from e
    return GraphModule(tracer.root, graph, type(model).__name__)


def _layer_of(node: Node, units: set[str]) -> str | None:
    if node.op != "call_module":
        return None
    return owning_layer(str(node.target), units)


def _execution_order(gm: GraphModule, units: set[str]) -> list[str]:
    order: dict[str, None] = {}
    for node in gm.graph.nodes:
        layer = _layer_of(node, units)
        if layer is not None:
            order.setdefault(layer)
    return list(order)


# -- 3. node stages --------------------------------------------------------------------------


def _node_stages(gm: GraphModule, stages: dict[str, int], units: set[str],
                 num_stages: int, stateless: set[str]) -> dict[Node, int]:
    out: dict[Node, int] = {}
    first = next(iter(stages.values()))
    last_run: int | None = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out[node] = 0
        elif node.op == "output":
            out[node] = num_stages - 1
        elif node.op == "get_attr":
            continue  # materialised in every stage that uses it (see _stage_module)
        else:
            layer = _layer_of(node, units)
            if layer in stateless and last_run is not None and stages[layer] < last_run:
                layer = None  # a stateless layer called again later runs where it is called
            if layer is not None:
                last_run = stages[layer]
                out[node] = last_run
            else:
                out[node] = first if last_run is None else last_run
    _check_attrs(gm, out)
    return out


def _check_attrs(gm: GraphModule, node_stage: dict[Node, int]) -> None:
    """A parameter used on two stages: the symbolic split shares the user's modules, so it
    cannot give each stage a copy (the export split does)."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(str(node.target))(gm)
        used = sorted({node_stage[u] for u in node.users})
        if isinstance(value, nn.Parameter) and len(used) > 1:
            raise _SharedAcrossStages(
                f"parameter {node.target!r} is used on stages {used}; the symbolic-tracing "
                "split keeps a parameter on one stage: put the layers that use it on the same "
                "stage, or split with method='export' (a copy on each stage)"
            )


def _check_tied(modules: list[GraphModule]) -> None:
    """A parameter held by two stages (tied weights): as ``_check_attrs``."""
    seen: dict[int, tuple[int, str]] = {}
    for s, module in enumerate(modules):
        for name, p in module.named_parameters():
            if id(p) in seen and seen[id(p)][0] != s:
                first, other = seen[id(p)]
                raise _SharedAcrossStages(
                    f"parameter {other!r} (stage {first}) is tied to {name!r} (stage {s}); the "
                    "symbolic-tracing split keeps tied parameters on one stage: put the layers "
                    "holding them on the same stage, or split with method='export' (a copy on "
                    "each stage)"
                )
            seen.setdefault(id(p), (s, name))


# -- 4. values between stages ---------------------------------------------------------------


class _MetaRun(torch.fx.Interpreter):
    """Run the traced graph with the layers of a meta copy of the model."""

    def __init__(self, gm: GraphModule, meta_model: nn.Module) -> None:
        super().__init__(gm)
        self.meta_model = meta_model

    def call_module(self, target, args, kwargs):
        return self.meta_model.get_submodule(target)(*args, **kwargs)

    def get_attr(self, target, args, kwargs):
        value = operator.attrgetter(target)(self.meta_model)
        # A tensor the trace folded (``_tensor_constant0``) is a plain attribute that
        # ``to_meta`` leaves where it is.
        return value.to("meta") if isinstance(value, torch.Tensor) else value


def _propagate(gm: GraphModule, model: nn.Module, example_inputs: tuple) -> dict[Node, object]:
    values: dict[Node, object] = {}
    run = _MetaRun(gm, to_meta(model))
    original = run.run_node

    def record(node: Node) -> object:
        values[node] = original(node)
        return values[node]

    run.run_node = record
    with torch.no_grad():
        run.run(*inputs_to_meta(tuple(example_inputs)))
    return values


def _crossing(gm: GraphModule, node_stage: dict[Node, int], s: int, constants: set[Node]
              ) -> list[Node]:
    """Values made on a stage <= s and used on a stage > s, in graph order; ``constants``
    (``passes.constants``: a causal mask, positions) are remade on the later stage."""
    return [
        n for n in gm.graph.nodes
        if n in node_stage and n.op != "output" and node_stage[n] <= s and n not in constants
        and any(node_stage.get(u, -1) > s for u in n.users)
    ]


# -- 5. stage modules ------------------------------------------------------------------------


def _stage_module(gm: GraphModule, model: nn.Module, node_stage: dict[Node, int],
                  values: dict[Node, object], s: int, crossing: list[list[Node]],
                  constants: set[Node]) -> GraphModule:
    """Stage ``s``: it receives ``crossing[s - 1]`` and sends ``crossing[s]``."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    if s == 0:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = graph.node_copy(node)
    else:
        for node in crossing[s - 1]:
            check_sendable(node, values[node], s - 1)
            env[node] = graph.placeholder(node.name)

    def arg(n: Node) -> Node:
        if n not in env and (n.op == "get_attr" or n in constants):
            env[n] = graph.node_copy(n, arg)  # a constant made on an earlier stage: remade
        return env[n]

    for node in gm.graph.nodes:
        if node.op in _CALLS and node_stage[node] == s:
            env[node] = graph.node_copy(node, arg)
    if s == len(crossing):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        graph.node_copy(out, arg)
    else:
        sent = crossing[s]
        for node in sent:
            check_sendable(node, values[node], s)
        graph.output(arg(sent[0]) if len(sent) == 1 else tuple(arg(n) for n in sent))
    graph.lint()
    return GraphModule(model, graph, f"{type(model).__name__}Stage{s}")
