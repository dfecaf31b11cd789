"""Megatron tensor parallelism from ``LayerPlan.tp_styles``, with ``parallelize_module``.

Each style maps to one of PyTorch's ``ParallelStyle``s (see ``runtime.plan.TP_STYLES``):

    colwise           ColwiseParallel()                          out: Shard(-1), local tensor
    rowwise           RowwiseParallel()                          in: Shard(-1), out: Replicate
    colwise_gather    ColwiseParallel(output_layouts=Replicate()) out: all-gathered
    embedding_rowwise RowwiseParallel(input_layouts=Replicate()) vocabulary split, out all-reduced

Outputs are local tensors (``use_local_output=True``), so code between the split modules
runs unchanged on the local shard: the zoo's attention reads its head count from the
tensor shape, which is why a head-aligned split of q/k/v is exact.

Sequence parallelism (``LayerPlan.sequence_parallel``; Korthikanti et al. 2022), as
torchtitan applies it to a block, with the layer's styles read as:

    sequence_parallel SequenceParallel()          runs on sequence shards (DTensor Shard(1))
    colwise           ColwiseParallel()           inside a submodule entered through
                      + PrepareModuleInput on its PrepareModuleInput(Shard(1) -> Replicate):
                      parent                      one all-gather per parent (``attn``,
                                                  ``mlp``); shape reads there see the whole
                                                  sequence. Directly in the layer:
                                                  ColwiseParallel(input_layouts=Shard(1))
    rowwise           RowwiseParallel(output_layouts=Shard(1))   reduce-scatter

The layer itself gets ``PrepareModuleInputOutput``: its input arrives as sequence shards
from a sequence-parallel layer just before it in the plan (plan order is execution order),
else whole and split locally (no communication); its output stays sharded, as a DTensor,
when the next layer of the plan is sequence-parallel too, else it is all-gathered whole.
The layer and each gathering parent get the residual stream as their one positional
input (``_first_input_alone``); what else they take (masks, rotary tables) passes by name,
whole. Across a pipeline stage boundary likewise (``sp_before``/``sp_after``): the shard crosses
as it is (``runtime.pipeline_sends.sequence_sharded_boundaries``).
A sequence-parallel layer may also ask for PyTorch's async TP (``LayerPlan.async_tp``):
after its styles are applied it is compiled with Inductor's micro-pipeline pass, which
overlaps those all-gathers and reduce-scatters with the Linears chunk by chunk
(``runtime.async_tp``: what it needs, CUDA GPUs among them).

Between two such layers the residual stream is a Shard(1) DTensor, so anything that
touched it in between would run with global semantics or fail loudly, never compute on a
shard as if it were whole. Element-wise code between the layer's submodules (residual
adds) runs on local shards: ``passes.tensor_parallel`` offers the SP styles only where
the graph shows it acts per token.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from runtime.async_tp import enable_async_tp, rank_problem, refusal
from runtime.plan import LayerPlan, PlanError

logger = logging.getLogger(__name__)

# style -> (module type it applies to, which weight dim it splits, what that dim is called)
_STYLE_TARGETS: dict[str, tuple[type[nn.Module], int, str]] = {
    "colwise": (nn.Linear, 0, "out_features"),
    "rowwise": (nn.Linear, 1, "in_features"),
    "colwise_gather": (nn.Linear, 0, "out_features"),
    "embedding_rowwise": (nn.Embedding, 0, "num_embeddings"),
}
# Attributes that, on the module holding a column-split projection, give a head count or
# head size; a split must not cut a head in two.
_HEAD_COUNT_ATTRS = ("n_head", "num_heads", "num_attention_heads")
_HEAD_DIM_ATTRS = ("head_dim",)
SP_STYLES = ("colwise", "rowwise", "sequence_parallel")
"""The styles a sequence-parallel layer may use."""


def parallel_style(style: str) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    raise PlanError(f"unknown tp style {style!r}; valid: {', '.join(_STYLE_TARGETS)}")


def _full_name(layer: LayerPlan, sub: str) -> str:
    return f"{layer.module}.{sub}" if sub else layer.module


def validate_tp_layer(model: nn.Module, layer: LayerPlan, tp_degree: int) -> None:
    """Check every ``tp_styles`` entry of one layer before anything is sharded.

    Raises PlanError naming the layer, the submodule, the dim and the degree.
    """
    root = model.get_submodule(layer.module)
    _check_sequence_parallel(layer)
    for sub, style in layer.tp_styles.items():
        where = f"layer {layer.module!r}, tp_styles[{sub!r}] = {style!r}"
        try:
            target = root.get_submodule(sub) if sub else root
        except AttributeError:
            raise PlanError(
                f"{where}: no submodule {_full_name(layer, sub)!r} in the model; "
                f"name a child of {layer.module!r} (e.g. one of "
                f"{[n for n, _ in root.named_children()][:8]})"
            ) from None
        if style == "sequence_parallel":
            continue  # any module: it runs under DTensor semantics on sequence shards
        kind, dim, dim_name = _STYLE_TARGETS[style]
        if not isinstance(target, kind):
            raise PlanError(
                f"{where}: {_full_name(layer, sub)!r} is a {type(target).__name__}, but "
                f"{style!r} splits an nn.{kind.__name__}; name an nn.{kind.__name__} or use "
                "a data-parallel strategy for this layer"
            )
        size = target.weight.shape[dim]
        if size % tp_degree:
            raise PlanError(
                f"{where}: {dim_name}={size} of {_full_name(layer, sub)!r} is not divisible "
                f"by tp={tp_degree}; choose a tp degree that divides {size}"
            )
        if style in ("colwise", "colwise_gather"):
            _check_heads(root, sub, where, size, tp_degree)


def _check_sequence_parallel(layer: LayerPlan) -> None:
    """The 'sequence_parallel' styles and the layer's flag must agree, and an SP layer
    may only use styles whose sequence-sharded form the runtime knows."""
    where = f"layer {layer.module!r}"
    marked = [sub for sub, style in layer.tp_styles.items() if style == "sequence_parallel"]
    if not layer.sequence_parallel:
        if marked:
            raise PlanError(
                f"{where}: tp_styles[{marked[0]!r}] = 'sequence_parallel' but the layer's "
                "sequence_parallel is false; set sequence_parallel true or drop the entry")
        return
    if not marked:
        raise PlanError(
            f"{where}: sequence_parallel is true but no tp_styles entry is "
            "'sequence_parallel'; name the norm/element-wise submodules that run on sequence "
            "shards (the planner's TPOption.sp_styles, e.g. {'ln_1': 'sequence_parallel', "
            "...}) or set sequence_parallel false")
    for sub, style in layer.tp_styles.items():
        if style not in SP_STYLES:
            raise PlanError(
                f"{where}: tp_styles[{sub!r}] = {style!r} cannot be sequence-parallel; a "
                f"sequence-parallel layer takes {', '.join(map(repr, SP_STYLES))} styles, "
                "so set sequence_parallel false for it")
        if not sub:
            raise PlanError(
                f"{where}: tp_styles[''] = {style!r}: a sequence-parallel layer names its "
                "submodules, not itself")
        parent = sub.rpartition(".")[0]
        if style == "colwise" and parent in layer.tp_styles:
            raise PlanError(
                f"{where}: tp_styles[{sub!r}] = 'colwise' under tp_styles[{parent!r}]; with "
                f"sequence parallelism {parent!r} gathers the sequence for its colwise "
                "Linears and cannot have a style of its own")


def _check_heads(root: nn.Module, sub: str, where: str, out_features: int, tp: int) -> None:
    """A colwise split of an attention projection must keep whole heads on each rank."""
    parent = root.get_submodule(sub.rpartition(".")[0]) if sub else root
    for attr in _HEAD_COUNT_ATTRS:
        heads = getattr(parent, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise PlanError(f"{where}: {attr}={heads} heads are not divisible by tp={tp}; "
                            f"choose a tp degree that divides {heads}")
    for attr in _HEAD_DIM_ATTRS:
        head_dim = getattr(parent, attr, None)
        if isinstance(head_dim, int) and head_dim > 0 and out_features % head_dim == 0:
            heads = out_features // head_dim
            if heads % tp:
                raise PlanError(
                    f"{where}: the projection holds {heads} heads of size {head_dim}, not "
                    f"divisible by tp={tp}; choose a tp degree that divides {heads}"
                )


def apply_tensor_parallel(model: nn.Module, layers: list[LayerPlan], tp_mesh: DeviceMesh, *,
                          sp_before: bool = False, sp_after: bool = False) -> None:
    """Shard the TP layers' submodules over ``tp_mesh`` in place.

    ``layers`` are the plan's layers of this module in execution order; layers that are not
    tensor-parallel are skipped, but they end a run of sequence-parallel layers (whose
    residual stream is passed on sharded only to an immediately following SP layer).
    ``sp_before`` / ``sp_after``: the plan's layer just before ``layers[0]`` / just after
    ``layers[-1]`` is sequence-parallel and runs in another module (a pipeline stage's
    neighbour), so the residual stream crosses between the two as sequence shards.
    """
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not layer.is_tp:
            continue
        root = model.get_submodule(layer.module)
        if layer.sequence_parallel:
            prev_sp = layers[i - 1].sequence_parallel if i > 0 else sp_before
            next_sp = layers[i + 1].sequence_parallel if i + 1 < len(layers) else sp_after
            _apply_sequence_parallel(root, layer, tp_mesh, prev_sp=prev_sp, next_sp=next_sp)
            continue
        plan = {sub: parallel_style(style) for sub, style in layer.tp_styles.items() if sub}
        if "" in layer.tp_styles:
            parallelize_module(root, tp_mesh, parallel_style(layer.tp_styles[""]))
        if plan:
            parallelize_module(root, tp_mesh, plan)
    for layer in layers:
        if layer.is_tp:
            root = model.get_submodule(layer.module)
            laid_out = set(layer.tp_styles) | ({""} if layer.sequence_parallel else set())
            for sub in laid_out:  # after the styles' own output hooks
                root.get_submodule(sub).register_forward_hook(_owned_output)
    _apply_async_tp(model, layers, tp_mesh)
    tp_layers = [layer.module for layer in layers if layer.is_tp]
    if tp_layers:
        sp = sum(1 for layer in layers if layer.sequence_parallel)
        logger.info(
            "applied tensor parallelism (tp=%d) to %d layer(s), %d sequence-parallel: %s",
            tp_mesh.size(), len(tp_layers), sp, ", ".join(tp_layers),
        )


def _apply_async_tp(model: nn.Module, layers: list[LayerPlan], tp_mesh: DeviceMesh) -> None:
    """PyTorch's async TP for the layers that ask for it (``runtime.async_tp``), refused
    with the reason on ranks that cannot run it (``runtime.validate.check_async_tp_ranks``
    refuses it earlier, before the mesh is built, in ``runtime.apply``)."""
    modules = [layer.module for layer in layers if layer.async_tp]
    if not modules:
        return
    problem = rank_problem(tp_mesh.device_type, tp_mesh.size(), tp_mesh.get_group())
    if problem:
        raise PlanError(refusal(modules, problem))
    enable_async_tp([model.get_submodule(name) for name in modules], tp_mesh)


def _apply_sequence_parallel(root: nn.Module, layer: LayerPlan, tp_mesh: DeviceMesh, *,
                             prev_sp: bool, next_sp: bool) -> None:
    """One SP layer: its boundary layouts from its neighbours, then its submodules."""
    # before the layouts' hooks, which lay out positional inputs only
    root.register_forward_pre_hook(_first_input_alone(root, layer.module), with_kwargs=True)
    root.register_forward_pre_hook(_sequence_check(layer, tp_mesh.size(), prev_sp))
    parallelize_module(root, tp_mesh, PrepareModuleInputOutput(
        input_layouts=(Shard(1) if prev_sp else Replicate(),),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Shard(1) if next_sp else Replicate(),),
        use_local_output=not next_sp,
    ))
    styles = sequence_parallel_styles(layer.tp_styles)
    for path, style in styles.items():
        if isinstance(style, PrepareModuleInput):
            module = root.get_submodule(path)
            module.register_forward_pre_hook(
                _first_input_alone(module, f"{layer.module}.{path}"), with_kwargs=True)
    parallelize_module(root, tp_mesh, styles)


class _Owned(torch.autograd.Function):
    """The identity, returning a tensor autograd does not see as a view of its input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 - autograd's signature
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad


def _owned_output(_module: nn.Module, _args: tuple, output: object) -> object:
    """A forward hook making a TP module's local output modifiable in place.

    DTensor hands the local shard out as a view made inside a custom autograd Function
    (``to_local``), and autograd forbids modifying such a view in place: user code such as
    ``F.relu(fc1(x), inplace=True)`` or ``y = fc2(h); y += x`` (Falcon's parallel block) then
    fails under TP. The shard is this module's own fresh output (the matmul's or the
    collective's result, which nothing else reads), so handing it on as a plain tensor,
    without a copy, is safe; autograd passes the gradient straight through."""
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
        return _Owned.apply(output)
    return None


def _first_input_alone(module: nn.Module, path: str) -> Callable:
    """A forward pre-hook passing the module's first parameter positionally and the rest
    by name. The layouts of a sequence-parallel layer and of the parents it gathers for
    apply to the one positional input (the residual stream); Hugging Face calls them with
    more (BERT: ``layer(hidden_states, attention_mask)``) or with keywords only (Llama:
    ``self_attn(hidden_states=..., position_embeddings=...)``)."""
    signature = inspect.signature(module.forward)
    params = list(signature.parameters.values())
    first = params[0].name if params and params[0].kind in _BY_POSITION else None

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if first is None or (len(args) == 1 and first not in kwargs):
            return None
        bound = signature.bind(*args, **kwargs).arguments
        if first not in bound:
            return None
        rest: dict = {}
        for name, value in bound.items():
            kind = signature.parameters[name].kind
            if name == first:
                continue
            if kind is inspect.Parameter.VAR_KEYWORD:
                rest.update(value)
            elif kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          inspect.Parameter.KEYWORD_ONLY):
                rest[name] = value
            else:
                raise PlanError(
                    f"{path!r} (sequence_parallel): its forward takes {name!r} by position "
                    "only, so its input cannot be gathered alone; set sequence_parallel "
                    "false for the layer")
        return (bound[first],), rest

    return hook


_BY_POSITION = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def sequence_parallel_styles(tp_styles: dict[str, str]) -> dict[str, ParallelStyle]:
    """The ParallelStyle of each submodule of a sequence-parallel layer (module docstring).

    A colwise Linear's parent gathers the sequence once for all its colwise children, so
    q/k/v share one all-gather forward and one reduce-scatter backward (their input
    gradients are summed as Partial DTensors first).
    """
    styles: dict[str, ParallelStyle] = {}
    for sub, style in tp_styles.items():
        parent = sub.rpartition(".")[0]
        if style == "sequence_parallel":
            styles[sub] = SequenceParallel(use_local_output=True)
        elif style == "rowwise":
            styles[sub] = RowwiseParallel(output_layouts=Shard(1))
        elif parent:
            styles[sub] = ColwiseParallel()
            styles.setdefault(parent, PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_output=False))
        else:
            styles[sub] = ColwiseParallel(input_layouts=Shard(1))
    return styles


def _sequence_check(layer: LayerPlan, tp: int, prev_sp: bool) -> Callable:
    """A forward pre-hook: the input must split evenly along the sequence (known only
    when data arrives), and arrive sharded when the layer before it handed on shards."""
    where = f"layer {layer.module!r} (sequence_parallel)"

    def check(module: nn.Module, args: tuple) -> None:
        if len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            raise PlanError(
                f"{where}: takes its input as one positional [batch, seq, ...] tensor, got "
                f"{len(args)} positional argument(s); set sequence_parallel false for it")
        x = args[0]
        if prev_sp and not isinstance(x, DTensor):
            raise PlanError(
                f"{where}: expected the sequence shards of the sequence-parallel layer before "
                "it in the plan, got a plain tensor; list the plan's layers in execution "
                "order, or set sequence_parallel false for one of the two")
        seq = x.shape[1]
        if seq % tp:
            raise PlanError(
                f"{where}: sequence length {seq} (dim 1 of its input of shape "
                f"{tuple(x.shape)}) is not divisible by tp={tp}; use a sequence length that "
                f"is a multiple of {tp} or set sequence_parallel false")

    return check
