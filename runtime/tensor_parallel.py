"""Megatron tensor parallelism from ``LayerPlan.tp_styles``, with ``parallelize_module``.

Each style maps to one of PyTorch's ``ParallelStyle``s (see ``runtime.plan.TP_STYLES``):

    colwise           ColwiseParallel()                          out: Shard(-1), local tensor
    rowwise           RowwiseParallel()                          in: Shard(-1), out: Replicate
    colwise_gather    ColwiseParallel(output_layouts=Replicate()) out: all-gathered
    embedding_rowwise RowwiseParallel(input_layouts=Replicate()) vocabulary split, out all-reduced

Outputs are local tensors (``use_local_output=True``), so code between the split modules
runs unchanged on the local shard: the zoo's attention reads its head count from the
tensor shape, which is why a head-aligned split of q/k/v is exact.
"""

from __future__ import annotations

import logging

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

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


def apply_tensor_parallel(model: nn.Module, layers: list[LayerPlan], tp_mesh: DeviceMesh) -> None:
    """Shard the TP layers' submodules over ``tp_mesh`` in place."""
    for layer in layers:
        root = model.get_submodule(layer.module)
        plan = {sub: parallel_style(style) for sub, style in layer.tp_styles.items() if sub}
        if "" in layer.tp_styles:
            parallelize_module(root, tp_mesh, parallel_style(layer.tp_styles[""]))
        if plan:
            parallelize_module(root, tp_mesh, plan)
    if layers:
        logger.info(
            "applied tensor parallelism (tp=%d) to %d layer(s): %s",
            tp_mesh.size(), len(layers), ", ".join(layer.module for layer in layers),
        )
