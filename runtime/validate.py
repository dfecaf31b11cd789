"""What the runtime refuses about a (model, plan) pair, checked without running anything.

One place for every check of a plan against a model that needs no process group and no
real weights, so the planner can ask the very code ``runtime.apply`` runs before it offers
a plan (``autopar.api`` passes ``check_plan`` to the search): nothing the search returns
is refused at ``compile``. The model may live on the meta device.

    layers          each plan module exists, and no two nest
    tensor parallel each TP layer's styles name modules of the right kind whose split
                    dims (and heads) the tp degree divides     (runtime.tensor_parallel)
    ties            modules sharing a parameter take one strategy (runtime.tied)
    batch norm      no micro-batching, pipeline or cp, which change batch statistics
                    (runtime.batch_norm)
    context         cp > 1 needs fused attention and a position-ids argument
    experts         a layer with expert_parallel > 1 holds MoE blocks whose expert count
                    ep divides, in a supported combination     (runtime.expert_parallel)

The checks that need the world (rank count, real weights) stay in ``runtime.apply``; a
pipeline's stage split is checked where it is made (``passes.split_stages``). What the
ranks' devices must be able to do is ``check_async_tp_ranks``'s: a plan is made for a
cluster, not for the machine that plans it, so ``check_plan`` does not ask.
"""

from __future__ import annotations

import torch.nn as nn

from runtime.async_tp import rank_problem, refusal
from runtime.batch_norm import check_batch_statistics
from runtime.context_parallel import position_argument
from runtime.expert_parallel import check_expert_parallel
from runtime.plan import Plan, PlanError
from runtime.tensor_parallel import validate_tp_layer
from runtime.tied import check_ties


def check_plan(model: nn.Module, plan: Plan) -> None:
    """Raise PlanError naming the layer, module or parameter if the runtime would refuse
    to run ``plan`` on ``model``; see the module docstring for what is checked."""
    _check_layers(model, plan)
    check_ties(model, plan.layers)
    check_batch_statistics(model, plan)
    check_expert_parallel(model, plan)
    if plan.mesh.cp > 1:
        position_argument(model)


def check_async_tp_ranks(plan: Plan, device_type: str) -> None:
    """Raise PlanError, naming the layers and what to do, if the plan asks for async TP
    (``LayerPlan.async_tp``) and ranks on ``device_type`` ('cpu' or 'cuda') with the default
    process group's backend cannot run it (``runtime.async_tp``: CPU ranks and gloo never
    can). Called by ``runtime.apply`` before the mesh is built."""
    modules = [layer.module for layer in plan.layers if layer.async_tp]
    if modules and (problem := rank_problem(device_type, plan.mesh.tp)):
        raise PlanError(refusal(modules, problem))


def plan_problem(model: nn.Module, plan: Plan) -> str | None:
    """``check_plan``'s refusal as text, or None when the runtime runs the plan."""
    try:
        check_plan(model, plan)
    except PlanError as e:
        return str(e)
    return None


def plan_notes(model: nn.Module, plan: Plan) -> list[str]:
    """What a plan the runtime runs does that its writer may not have meant (logged by
    ``runtime.apply``): a plan naming no layers replicates the whole model on every rank."""
    if plan.layers:
        return []
    return [f"the plan names no layers: all of {type(model).__name__} stays with the root "
            "and is replicated on every rank (data parallelism only); list its modules in "
            "'layers', or plan it with `autopar plan`, to shard or split it"]


def _check_layers(model: nn.Module, plan: Plan) -> None:
    for layer in plan.layers:
        try:
            model.get_submodule(layer.module)
        except AttributeError:
            top = [name for name, _ in model.named_children()]
            raise PlanError(
                f"layer {layer.module!r}: no such module in {type(model).__name__}; "
                f"module paths are fully-qualified names as in model.named_modules() "
                f"(top level: {top})"
            ) from None
        if layer.is_tp:
            validate_tp_layer(model, layer, plan.mesh.tp)
    names = sorted(layer.module for layer in plan.layers)
    for outer, inner in zip(names, names[1:], strict=False):
        if inner.startswith(outer + "."):
            raise PlanError(
                f"layers {outer!r} and {inner!r} nest; each module may be planned once, so "
                "plan the inner modules or the outer one"
            )
