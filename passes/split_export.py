"""Pipeline stage modules from ``torch.export``, cut by PyTorch's own pipeline frontend.

``torch.distributed.pipelining.pipeline`` exports the model once and hands the exported
graph to a ``split_policy``, which marks the cuts with ``pipe_split`` nodes; it then splits
the graph there (``split_module``), unflattens each part into modules under the user's
fully-qualified names (stage 1 holds ``model.layers.2.self_attn.q_proj.weight``), moves
each parameter into the stage that uses it and deep-copies a parameter used by several
stages into each of them (``Pipe.replicated_params``). The policy, not a ``SplitPoint`` per
cut, places the cuts: which layer opens a stage depends on the order in which the layers
run (planned layers give their stage to the unplanned ones after them), which only the
trace shows, and a policy sees the same single export that is split.

The policy's steps, on the exported graph, in order:

1. **node stages.** A node belongs to the layer of its ``nn_module_stack``; the layers'
   stages come from the caller (``split_stages``'s rules); a node run by no layer goes to
   the stage of the layer that ran last before it. Stages must not decrease along the graph;
   a ``pipe_split`` node goes before the first node of each stage but the first.
2. **recompute constants.** A value used on a later stage that depends on no input and no
   parameter (Hugging Face Llama's boolean causal mask, its rotary cos/sin from a buffer)
   is recomputed on that stage instead of sent: a constant needs neither a send nor a
   gradient.
3. **pass through.** A value used two or more stages later is cloned on every stage in
   between, and a model input used past stage 0 is cloned on stage 0, because a
   ``PipelineStage`` receives only its neighbour's outputs; a model output made before the
   last stage is cloned on every stage after it, as the last stage returns the outputs.
4. **check** that every value crossing a cut is a tensor (of any dtype).

The stages are exported at the example micro-batch's shapes, and their modules are the
export's ``InterpreterModule``s, not the user's module objects: tensor parallelism, which
replaces ``nn.Linear``/``nn.Embedding`` weights, needs the symbolic-tracing split.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.pipelining import pipeline
from torch.distributed.pipelining._IR import aten_pipe_split_alias
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_unflatten

from passes import meta_keys as K
from passes.annotate import annotate_module_paths
from passes.constants import constant_nodes
from passes.group_layers import owning_layer, stateless_layers
from passes.trace import GraphCaptureError, explain_failure
from runtime.materialize import on_meta
from runtime.pipeline_sends import Send
from runtime.plan import PlanError
from runtime.stage_graphs import (
    StateAlias,
    set_state_aliases,
    set_tensor_names,
    state_aliases,
)

_CALLS = ("call_function", "call_method", "call_module")

StagesOf = Callable[[list[str]], dict[str, int]]
"""Layer names in execution order -> the stage of every layer (raises PlanError)."""


@dataclass(frozen=True)
class StageSplit:
    """What ``passes.split_stages.split_pipeline`` returns."""

    modules: list[nn.Module]
    """One module per stage (index = stage id)."""
    tied: tuple[dict[int, str], ...]
    """Per parameter used on several stages (tied weights), the copy each of those stages
    holds: {stage: the parameter's name in that stage's module}. The copies start equal;
    their gradients must be summed across those stages each step to train them as one."""
    method: str
    """How the model was captured: 'symbolic_trace' or 'export'."""
    output_fn: Callable[[object], object] | None = None
    """Maps the last stage's output (flat tensors) to what the model returns, for
    ``loss_fn``; None when the last stage returns that already."""
    sends: tuple[tuple[Send, ...], ...] = ()
    """Per boundary s (stage s to s + 1), the tensors that cross it, at the split's
    (micro-batch) shapes: what ``runtime.pipeline_sends.check_sends`` checks."""


def export_stages(model: nn.Module, units: list[str], stages_of: StagesOf, num_stages: int,
                  example_inputs: tuple, example_kwargs: dict | None = None) -> StageSplit:
    """Split ``model`` into ``num_stages`` stage modules with ``pipeline()``; see the module
    docstring. ``example_inputs``/``example_kwargs``: one micro-batch (real or meta).

    A model on meta is exported on fake CPU tensors, so that it is captured as the same
    model built on CPU is: its code sees a CPU device (transformers' MoE layers pick their
    ``histc`` by ``device.type``), and a constant it makes in ``forward`` (Falcon's
    ``torch.tensor([-2])``) keeps its value. The stages then hold meta tensors, allocated
    by ``runtime.materialize``, and those constants."""
    policy = _CutPolicy(units, stages_of, num_stages, stateless_layers(model, units))
    with _captured_on_cpu(model) as to_capture:
        inputs = tuple(to_capture(x) for x in example_inputs)
        kwargs = {k: to_capture(v) for k, v in (example_kwargs or {}).items()}
        try:
            pipe = pipeline(model, inputs, kwargs or None, split_policy=policy)
        except RuntimeError as e:
            if "cannot capture your model" not in str(e) or e.__cause__ is None:
                raise  # not the export: a bug to see as it is
            raise GraphCaptureError(
                "splitting into pipeline stages exports the model with torch.export, which "
                "failed:\n" + explain_failure(model, {"export": e.__cause__})
            ) from e
    _first_stage_reads_inputs_in_order(pipe.split_gm)
    modules = [pipe.get_stage_module(s) for s in range(num_stages)]
    for module in modules:
        _drop_unread_state(module)
        _fake_to_meta(module)
        _state_dict_names_as_in(model, module)
    _names_no_stage_runs(model, modules)
    restore = None
    if policy.out_spec is not None:
        restore = _output_structure(pipe.split_gm, policy.out_spec)
    index = {f"submod_pp_{s}": s for s in range(num_stages)}
    tied = tuple({index[sub]: fqn for sub, fqn in uses.items()}
                 for uses in pipe.replicated_params)
    return StageSplit(modules=modules, tied=tied, method="export", output_fn=restore,
                      sends=policy.sends)


def _first_stage_reads_inputs_in_order(split_gm: GraphModule) -> None:
    """Give stage 0's graph the model's inputs in the model's order.

    ``pipeline()`` lets stage 0 take the model's own arguments by copying the model's
    pytree codegen onto it, which binds the flattened arguments to stage 0's placeholders
    by position; but ``split_module`` orders those placeholders by first use. A model input
    that stage 0 only passes through to a later stage (T5's ``decoder_input_ids`` under a
    cut inside the encoder) is used first, by its clone at the stage's start, and would
    receive another input's value. Reorders stage 0's placeholders, and the arguments the
    split graph calls it with, by the model's order."""
    order = {n: i for i, n in enumerate(split_gm.graph.find_nodes(op="placeholder"))}
    call = next(n for n in split_gm.graph.nodes if n.op == "call_module")
    stage0 = split_gm.get_submodule(call.target)
    if not isinstance(stage0, GraphModule) or not all(a in order for a in call.args):
        return
    placeholders = list(stage0.graph.find_nodes(op="placeholder"))
    ranked = sorted(range(len(call.args)), key=lambda i: order[call.args[i]])
    if ranked == list(range(len(call.args))):
        return
    after = next(n for n in stage0.graph.nodes if n.op != "placeholder")
    for i in ranked:  # each in turn just before the first other node: the model's order
        after.prepend(placeholders[i])
    call.args = tuple(call.args[i] for i in ranked)
    stage0.recompile()
    split_gm.recompile()


@contextlib.contextmanager
def _captured_on_cpu(model: nn.Module) -> Iterator[Callable[[object], object]]:
    """While open, a model with meta tensors holds fake CPU tensors in their place (tied
    ones stay tied); yields what turns an example input into one the capture accepts."""
    if not on_meta(model):
        device = next(model.parameters(), torch.empty(0)).device
        yield lambda x: (torch.zeros(x.shape, dtype=x.dtype, device=device)
                         if isinstance(x, torch.Tensor) and x.is_meta else x)
        return
    mode = FakeTensorMode()

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            with mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return mode.from_tensor(t)

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    with warnings.catch_warnings():
        # pipeline() deep-copies a weight two stages use (a tied head), and Tensor's
        # __deepcopy__ reads data_ptr(), which a fake tensor warns of; it has no data.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        try:
            _replace_tensors(model, fake, swapped)
            yield lambda x: fake(x) if isinstance(x, torch.Tensor) else x
        finally:
            for slots, name, t in swapped:
                slots[name] = t


def _fake_to_meta(stage: nn.Module) -> None:
    """Replace the fake tensors a capture on fake tensors left in ``stage`` by meta ones."""
    def meta(t: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(t, FakeTensor):
            return None
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    _replace_tensors(stage, meta, [])


def _replace_tensors(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor | None],
                     replaced: list[tuple[dict, str, torch.Tensor]]) -> None:
    """Put ``make(t)`` in place of each parameter and buffer ``t`` of ``module`` it is not
    None for: one replacement per tensor object (tied tensors stay tied), a parameter's a
    parameter. Appends (slots, name, t) per slot replaced, as it goes."""
    new: dict[int, torch.Tensor | None] = {}
    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in list(slots.items()):
                if t is None:
                    continue
                if id(t) not in new:
                    made = make(t)
                    new[id(t)] = (nn.Parameter(made, t.requires_grad)
                                  if made is not None and isinstance(t, nn.Parameter) else made)
                if new[id(t)] is not None:
                    replaced.append((slots, name, t))
                    slots[name] = new[id(t)]


# -- the split policy -------------------------------------------------------------------------


class _CutPolicy:
    """``pipeline()``'s ``split_policy``: marks the planned cuts on the exported graph."""

    def __init__(self, units: list[str], stages_of: StagesOf, num_stages: int,
                 stateless: set[str]) -> None:
        self.units = set(units)
        self.stateless = stateless
        self.stages_of = stages_of
        self.num_stages = num_stages
        self.out_spec = None
        self.sends: tuple[tuple[Send, ...], ...] = ()

    def __call__(self, gm: GraphModule) -> GraphModule:
        self.out_spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
        annotate_module_paths(gm)
        node_stage = self._node_stages(gm)
        firsts = _first_nodes(gm, node_stage, self.num_stages)
        for s in range(1, self.num_stages):
            with gm.graph.inserting_before(firsts[s]):
                gm.graph.call_function(aten_pipe_split_alias, ())
        _recompute_constants(gm, node_stage, firsts)
        _pass_through(gm, node_stage, firsts)
        _check_crossings(gm, node_stage)
        self.sends = _sends(gm, node_stage, self.num_stages)
        gm.graph.lint()
        gm.recompile()
        return gm

    def _layer(self, node: Node) -> str | None:
        if node.op not in _CALLS:
            return None
        return owning_layer(node.meta[K.MODULE_PATH], self.units)

    def _node_stages(self, gm: GraphModule) -> dict[Node, int]:
        order = list(dict.fromkeys(la for n in gm.graph.nodes if (la := self._layer(n))))
        if not order:
            raise PlanError(
                f"no op of the exported graph runs inside a layer ({', '.join(sorted(self.units)[:6])}"
                ", ...), so there is nothing to cut into pipeline stages; re-plan with pp=1"
            )
        stages = self.stages_of(order)
        out: dict[Node, int] = {}
        current = stages[order[0]]
        last_layer = order[0]
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                out[node] = 0
            elif node.op == "output":
                out[node] = self.num_stages - 1
            elif node.op in _CALLS:
                layer = self._layer(node)
                if layer in self.stateless and stages[layer] < current:
                    layer = None  # called again later: runs where it is called
                if layer is not None and stages[layer] < current:
                    raise PlanError(
                        f"layer {layer!r} (stage {stages[layer]}) runs again after layer "
                        f"{last_layer!r} (stage {current}); a layer called more than once "
                        f"must be on one stage with the layers between its calls"
                    )
                if layer is not None:
                    current, last_layer = stages[layer], layer
                out[node] = current
        return out


def _first_nodes(gm: GraphModule, node_stage: dict[Node, int], num_stages: int) -> list[Node]:
    firsts: dict[int, Node] = {}
    for node in gm.graph.nodes:
        if node.op in _CALLS:
            firsts.setdefault(node_stage[node], node)
    empty = [s for s in range(num_stages) if s not in firsts]
    if empty:
        raise PlanError(
            f"pipeline stage(s) {empty} would run no layer of the model; give every stage at "
            "least one layer, or plan fewer stages"
        )
    return [firsts[s] for s in range(num_stages)]


def _users_by_stage(node: Node, node_stage: dict[Node, int]) -> dict[int, list[Node]]:
    out: dict[int, list[Node]] = {}
    for user in node.users:
        out.setdefault(node_stage[user], []).append(user)
    return out


def _recompute_constants(gm: GraphModule, node_stage: dict[Node, int], firsts: list[Node]
                         ) -> None:
    constants = {n for n in constant_nodes(gm) if n.target is not aten_pipe_split_alias}
    for s in range(1, len(firsts)):
        copies: dict[Node, Node] = {}
        for node in list(gm.graph.nodes):
            if node in constants and node.op != "get_attr" and node_stage[node] < s:
                for user in _users_by_stage(node, node_stage).get(s, []):
                    copy = _copy_onto(gm, node, s, node_stage, copies, firsts[s])
                    user.replace_input_with(node, copy)
        if copies:
            # The stage opens with them now (each went in just before firsts[s], in order),
            # so values passed through it go before them, at the root: between a copy and
            # the layers in the same parent module, they cut that module's unflattened call
            # in two, which fails (Hugging Face decoders: rotary values in ``model``).
            firsts[s] = next(iter(copies.values()))


def _copy_onto(gm: GraphModule, node: Node, s: int, node_stage: dict[Node, int],
               copies: dict[Node, Node], before: Node) -> Node:
    """``node`` and the constants it is made from, copied onto stage ``s`` (once each)."""
    if node.op == "get_attr" or node_stage.get(node) == s:
        return node
    if node not in copies:
        args = {a: _copy_onto(gm, a, s, node_stage, copies, before) for a in node.all_input_nodes}
        with gm.graph.inserting_before(before):
            copies[node] = gm.graph.node_copy(node, args.__getitem__)
        node_stage[copies[node]] = s
    return copies[node]


def _pass_through(gm: GraphModule, node_stage: dict[Node, int], firsts: list[Node]) -> None:
    last = len(firsts) - 1
    for node in list(gm.graph.nodes):
        if node not in node_stage or node.op == "output":
            continue  # get_attr (moved into each stage that reads it), pipe_split
        made = node_stage[node]
        users = _users_by_stage(node, node_stage)
        if made < last:
            # The pipeline returns what its last stage returns, so a model output made
            # earlier (T5's and BART's encoder_last_hidden_state) is carried through it:
            # the output node reads it as a stage after the last would.
            returned = [u for u in users.get(last, []) if u.op == "output"]
            users[last] = [u for u in users.get(last, []) if u.op != "output"]
            users[last + 1] = returned
        later = {s: us for s, us in users.items() if s > made and us}
        if not later or (node.op != "placeholder" and max(later) == made + 1):
            continue
        carrier = node  # the value as held on stage `at`
        for at in range(made if node.op == "placeholder" else made + 1, max(later)):
            with gm.graph.inserting_before(firsts[at]):
                carrier = gm.graph.call_function(torch.ops.aten.clone.default, (carrier,))
            # The root module's frame: unflattening places every node by its module stack.
            root = next(iter((firsts[at].meta.get("nn_module_stack") or {}).items()), None)
            carrier.meta = {"val": node.meta.get("val"), K.MODULE_PATH: "",
                            "nn_module_stack": dict([root]) if root else {}}
            node_stage[carrier] = at
            for user in later.get(at + 1, []):
                user.replace_input_with(node, carrier)


def _check_crossings(gm: GraphModule, node_stage: dict[Node, int]) -> None:
    for node in gm.graph.nodes:
        if node not in node_stage or node.op == "output":
            continue
        s = node_stage[node]
        if any(node_stage[u] > s for u in node.users):
            check_sendable(node, node.meta.get("val"), s)


def _sends(gm: GraphModule, node_stage: dict[Node, int], num_stages: int
           ) -> tuple[tuple[Send, ...], ...]:
    """Per boundary, the values its stage hands to the next (after ``_pass_through``, no
    value skips a stage)."""
    sends: list[list[Send]] = [[] for _ in range(num_stages - 1)]
    for node in gm.graph.nodes:
        s = node_stage.get(node)
        if s is None or node.op == "output" or s >= num_stages - 1:
            continue
        if any(node_stage.get(u, -1) > s for u in node.users):
            sends[s].append(send_record(node, node.meta.get("val")))
    return tuple(tuple(b) for b in sends)


def send_record(node: Node, value: object) -> Send:
    """What crosses a boundary (``value``: a tensor, as ``check_sendable`` made sure)."""
    assert isinstance(value, torch.Tensor), node
    module = str(node.target) if node.op == "call_module" else node.meta.get(K.MODULE_PATH, "")
    return Send(name=node.name, shape=tuple(value.shape), module=module or "",
                floating=value.is_floating_point())


def check_sendable(node: Node, value: object, s: int) -> None:
    """PlanError unless ``value`` (made by ``node`` on stage ``s``, used on a later stage) may
    cross the cut: a tensor, of any dtype (``runtime.pipeline._Stage`` defines
    integer ones in torch's metadata run); a Python value cannot be sent."""
    if not isinstance(value, torch.Tensor):
        raise PlanError(
            f"the cut after stage {s} needs value {node.name!r} ({type(value).__name__}, "
            f"made by `{node.format_node()}`) on a later stage, but only tensors can be "
            "sent between pipeline stages; move the cut so that it is used where it is made"
        )


# -- after the split ---------------------------------------------------------------------------


def _drop_unread_state(stage: nn.Module) -> None:
    """Remove parameters and buffers no graph of ``stage`` reads.

    ``pipeline()`` assigns every state-dict name whose parent module exists in a stage, so a
    stage holding the embedding also got the tied ``lm_head.weight`` (the user's object,
    never read there): it would be trained by no one and named twice across stages.

    State is keyed by its holder module object and attribute name, not by path: a module
    the model runs more than once (ALBERT's one layer at every depth) is unflattened into
    several paths (``attention``, ``attention@1``), and one holder may be reached under
    several of them, while a graph reads its state under only one."""
    read: set[tuple[int, str]] = set()
    for _, module in stage.named_modules(remove_duplicate=False):
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                if node.op == "get_attr":
                    path, _, attr = str(node.target).rpartition(".")
                    read.add((id(module.get_submodule(path)), attr))
    for module in stage.modules():  # each holder once
        held = [*module.named_parameters(recurse=False, remove_duplicate=False),
                *module.named_buffers(recurse=False, remove_duplicate=False)]
        for attr in [a for a, _ in held if (id(module), a) not in read]:
            delattr(module, attr)


def _state_dict_names_as_in(model: nn.Module, stage: nn.Module) -> None:
    """Give ``stage`` the state-dict names ``model`` has for what it holds, so that a
    checkpoint saved under a pipeline loads under any plan (runtime.checkpoint compares
    and loads by state-dict name):

    - a buffer the model does not save is not saved by the stage either: a non-persistent
      one (Llama's ``rotary_emb.inv_freq``, BERT's ``position_ids``) and a constant the
      export lifted from ``forward`` (Falcon's ``lifted_tensor_0``);
    - a tensor the model holds under several names (BERT's head bias, ``cls.predictions.bias``
      and ``cls.predictions.decoder.bias``) is held by the stage, as one object, under each
      of them whose module the stage runs; the export names it once;
    - a module the model runs at several depths (ALBERT's layer) is one module per call in
      the stage (``attention``, ``attention@1``), all holding its tensors: they are saved
      under the model's name only, and loaded from it into every copy.
    """
    saved = set(model.state_dict(keep_vars=True))
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, t in params.items():
        aliases.setdefault(id(t), []).append(name)
    for prefix, module in stage.named_modules():
        for name, _ in module.named_buffers(recurse=False):
            if f"{prefix}.{name}".lstrip(".") not in saved:
                module._non_persistent_buffers_set.add(name)
    held: dict[int, torch.Tensor] = {}
    for name, t in list(stage.named_parameters(remove_duplicate=False)):
        if name not in params:
            continue  # a per-call copy's name (``attention@1``)
        # One object per model tensor: the split can hold two (T5's encoder and decoder
        # embed_tokens on one stage, one of them ``pipeline()``'s copy), and each would take
        # only its own module's gradient.
        t = held.setdefault(id(params[name]), t)
        for alias in aliases[id(params[name])]:
            path, _, leaf = alias.rpartition(".")
            try:
                owner = stage.get_submodule(path)
            except AttributeError:
                continue  # the alias's module is on another stage
            if not isinstance(getattr(owner, "graph", None), torch.fx.Graph):
                continue  # a module left without a graph: it runs on another stage
            if owner._parameters.get(leaf) is not t:
                owner.register_parameter(leaf, t)
    set_tensor_names(stage, {name: tuple(aliases[id(params[name])])
                             for name, _ in stage.named_parameters(remove_duplicate=False)
                             if name in params and len(aliases[id(params[name])]) > 1})
    named = stage.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for name, t in named.items():
        if name in saved:
            first.setdefault(id(t), name)
    copies = {name: first[id(t)] for name, t in named.items()
              if name not in saved and id(t) in first}
    if copies:
        stage.register_state_dict_post_hook(functools.partial(_drop_copies, copies))
        stage.register_load_state_dict_pre_hook(functools.partial(_fill_copies, copies))


def _names_no_stage_runs(model: nn.Module, stages: list[nn.Module]) -> None:
    """A model's name for a tensor whose module runs no op (T5's and BART's ``shared``
    embedding, run as the encoder's and the decoder's ``embed_tokens``) is in no stage.
    The first stage holding the tensor under another name records it (``state_aliases``),
    so that a pipeline checkpoint names what one process's does. Not as a parameter of
    the stage: FSDP2 would shard it apart from its other name's."""
    params = dict(model.named_parameters(remove_duplicate=False))
    order = {name: i for i, name in enumerate(params)}
    held = [set(stage.state_dict(keep_vars=True)) for stage in stages]
    missing = set(model.state_dict(keep_vars=True)) & params.keys() - set().union(*held)
    for name in sorted(missing, key=order.__getitem__):
        for stage, names in zip(stages, held, strict=True):
            same = [n for n in names if params.get(n) is params[name]]
            if same:
                source = min(same, key=order.__getitem__)
                alias = StateAlias(source, first=order[name] < order[source])
                set_state_aliases(stage, {**state_aliases(stage), name: alias})
                break


def _drop_copies(copies: dict[str, str], module: nn.Module, state_dict: dict, prefix: str,
                 *_: object) -> None:
    for name in copies:
        state_dict.pop(prefix + name, None)


def _fill_copies(copies: dict[str, str], module: nn.Module, state_dict: dict, prefix: str,
                 *_: object) -> None:
    for name, source in copies.items():
        if prefix + source in state_dict:
            state_dict.setdefault(prefix + name, state_dict[prefix + source])


def _output_structure(split_gm: GraphModule, out_spec) -> Callable[[object], object] | None:
    """A function from the last stage's output to what the model returns (a Hugging Face
    ``ModelOutput`` with ``.logits``), so ``loss_fn`` sees the same object as with one
    process; None when the model's output is not the last stage's (a leaf made earlier).
    The stage itself returns the flat tensors: a ``PipelineStage`` accepts nothing else."""
    output = next(n for n in split_gm.graph.nodes if n.op == "output")
    leaves = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    picks: list[tuple[str, object]] = []
    for leaf in leaves:
        if isinstance(leaf, Node) and leaf.op == "call_module":
            picks.append(("whole", None))
        elif isinstance(leaf, Node) and leaf.target is operator.getitem:
            picks.append(("item", leaf.args[1]))
        elif isinstance(leaf, Node):
            return None
        else:
            picks.append(("const", leaf))

    def restore(out: object) -> object:
        flat = [out if how == "whole" else out[at] if how == "item" else at
                for how, at in picks]
        return tree_unflatten(flat, out_spec)

    return restore
