"""The front door. Reads as the data flow:

    capture → annotate → group layers → strategy options → solve → (lower) → execute

``plan`` runs the first five steps on meta/fake tensors and needs no GPU; ``compile``
runs on every rank of an initialised process group and returns a Trainer that executes
the plan with torch.distributed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError, ConfigError
from autopar.explain import attach_rationale
from autopar.lower import make_trainer, microbatch_inputs
from autopar.planner import SearchResult, search
from autopar.planner.estimators import ANALYTIC, Estimators
from autopar.planner.search import ProgressFn
from cost_models.hardware import Cluster
from passes.layer_graph import build_layer_graph
from passes.records import LayerGraph
from passes.split_stages import split_pipeline
from passes.trace import inputs_to_meta, to_meta
from runtime.batch import Inputs, as_inputs
from runtime.device import resolve_device_type
from runtime.launch import launched_plan
from runtime.plan import Mesh, Plan
from runtime.train import LossFn, OptimizerFactory, SchedulerFactory, Trainer
from runtime.validate import plan_problem


def as_cluster(cluster: Cluster | str, world_size: int | None = None) -> Cluster:
    """A Cluster, a preset name, 'local', or a path to a .toml file."""
    if isinstance(cluster, Cluster):
        return cluster
    if cluster == "local":
        return Cluster.local(world_size)
    return Cluster.load(cluster)


def search_plans(
    model: nn.Module,
    cluster: Cluster | str,
    example_inputs: object,
    *,
    precision: str = "float32",
    mesh: Mesh | None = None,
    opaque: Iterable[str] = (),
    model_name: str = "",
    seq_len: int | None = None,
    time_limit_s: float = 60.0,
    progress: ProgressFn | None = None,
    estimators: Estimators = ANALYTIC,
    graph: LayerGraph | None = None,
) -> SearchResult:
    """The best plan and every candidate the search considered.

    ``example_inputs`` is one global batch (real, meta or fake tensors): a tensor, a tuple
    of positional arguments, a dict of keyword arguments (Hugging Face's ``model(**batch)``)
    or ``autopar.Inputs(args, kwargs)``. Its batch dimension (dim 0 of the tensors that
    carry the samples, found as ``runtime.batch`` says) is the global batch the plan is
    made for. ``progress`` is called after each candidate the search evaluates (see
    ``autopar.progress``). ``estimators`` prices every option (autopar/planner/estimators.py:
    replace one of ``ANALYTIC``'s with a calibrated or your own). ``graph``: the layer graph
    of ``model`` already captured on these inputs (``passes.layer_graph.build_layer_graph``),
    searched instead of capturing it again (several searches of one model: meshes,
    clusters). The plan carries its rationale: every option's cost per layer class and the
    best alternatives (``autopar.explain``).

    Whatever this returns, the runtime runs: the search asks the runtime's own validator
    (``runtime.validate``) about every feasible candidate's plan, and a pipeline plan is
    split into its stages here, on meta tensors, as ``compile`` will split it.
    """
    check_model(model)
    cluster = as_cluster(cluster)
    inputs = as_inputs(example_inputs)
    if graph is None:
        graph = build_layer_graph(model, inputs, model_name=model_name, opaque=tuple(opaque),
                                  seq_len=seq_len)
    meta_model = to_meta(model)
    result = search(graph, cluster, precision_name=precision, mesh=mesh,
                    time_limit_s=time_limit_s, progress=progress,
                    check=functools.partial(plan_problem, meta_model), estimators=estimators)
    if result.plan.mesh.pp > 1:
        check_stage_split(meta_model, result.plan, inputs)
    return attach_rationale(result, graph, cluster, precision, estimators)


def check_model(model: object) -> None:
    """A model autopar can plan: a module with parameters to train."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__} "
                          f"({str(model)[:60]!r}); pass the module itself, e.g. "
                          "GPT(config), not its name")
    if not any(p.numel() for p in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameters: there is nothing to "
                          "train or to split across devices")


def check_stage_split(model: nn.Module, plan: Plan, example_inputs: Inputs, *,
                      planned: bool = True) -> None:
    """Split ``model`` (on meta) into ``plan``'s stages as ``compile`` will. The splitter's
    error names the cut; for a plan the planner made (``planned``) it is the planner's
    error, not the user's, and says so."""
    part = inputs_to_meta(as_inputs(microbatch_inputs(plan, example_inputs)))
    try:
        split_pipeline(model, plan, part.args, dict(part.kwargs) or None)
    except AutoparError as e:
        if not planned:
            raise
        raise AutoparError(
            f"the planner chose a pipeline ({plan.mesh.describe()}) that the runtime cannot "
            f"split into stages: {e}. Plan with a fixed mesh=Mesh(pp=1, ...) to avoid "
            "pipelining, and report this: the planner should not offer such a plan"
        ) from e


def plan(model: nn.Module, cluster: Cluster | str, example_inputs: object, **kwargs) -> Plan:
    """Plan ``model`` for ``cluster``; see ``search_plans`` for the options."""
    return search_plans(model, cluster, example_inputs, **kwargs).plan


def compile(  # noqa: A001 - the public name the architecture promises
    model: nn.Module,
    cluster: Cluster | str,
    example_inputs: object,
    *,
    loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    lr_scheduler_factory: SchedulerFactory | None = None,
    plan: Plan | None = None,
    device_type: str = "auto",
    seed: int | None = None,
    weights: str | os.PathLike | None = None,
    **plan_kwargs,
) -> Trainer:
    """Plan (on rank 0, shared with every rank) unless ``plan`` is given, then apply it.

    Call on every rank after the process group is initialised (``autopar run``, torchrun
    or ``runtime.launch.spawn``). Returns a Trainer: ``trainer.train_step(inputs, targets)``
    (a ``runtime.pipeline.PipelineTrainer`` for pipeline plans, split by ``autopar.lower``).
    ``loss_fn(output, targets)`` gets the model's output as it is; without one the model's
    own loss (``output.loss``, as Hugging Face models return with ``labels=``) is trained
    and ``train_step(inputs)`` needs no targets. Without ``plan``, the plan at
    ``$AUTOPAR_PLAN`` runs if set (``autopar run train.py --plan p.json``).

    ``model`` may be built on the meta device (``with torch.device("meta"): ...``) when it
    fits no single device: it is parallelized on meta and each rank then allocates and
    initialises only its own shards (pipeline ranks only their own stages) with the model's
    ``init_weights()`` or its modules' ``reset_parameters()``, the same on every rank and
    equal to ``runtime.materialize.materialize`` on one process for ``seed`` (rank 0's
    seed when None). A model built with real weights trains rank 0's weights.
    ``weights``: a directory of Hugging Face safetensors shards or an autopar checkpoint,
    read straight into each rank's shards (``runtime.weights``).
    ``device_type`` "auto" is CUDA on ``LOCAL_RANK`` when available, else CPU.
    ``optimizer_factory(params)`` makes the optimizer over this rank's parameters (default
    ``torch.optim.AdamW(params, lr=1e-3)``); ``lr_scheduler_factory(optimizer)`` makes an
    LR scheduler that ``trainer.step()`` steps after each optimizer step. Both end up as
    ``trainer.optimizer`` and ``trainer.lr_scheduler``.
    """
    resolve_device_type(device_type)  # CUDA without a GPU: said before any planning
    check_model(model)
    if not dist.is_available() or not dist.is_initialized():
        raise AutoparError(
            "autopar.compile runs on every rank of an initialised process group; start the "
            "ranks with `autopar run`, torchrun, or runtime.launch.spawn, or use autopar.plan "
            "to plan without executing"
        )
    plan = launched_plan(plan)  # a plan passed by path: `autopar run train.py --plan p.json`
    if plan is None:
        # Rank 0 plans; every rank gets the plan, or the error, so none waits forever.
        payload: list[str | AutoparError | None] = [None]
        if dist.get_rank() == 0:
            world = dist.get_world_size()
            try:
                made = search_plans(model, as_cluster(cluster, world), example_inputs,
                                    **plan_kwargs)
                payload = [made.plan.to_json()]
            except AutoparError as e:
                payload = [e]
        dist.broadcast_object_list(payload, src=0)
        if isinstance(payload[0], AutoparError):
            raise payload[0]
        assert isinstance(payload[0], str)
        plan = Plan.from_json(payload[0], source="plan from rank 0")
    return make_trainer(model, plan, loss_fn, example_inputs, optimizer_factory,
                        device_type=device_type, seed=seed, weights=weights,
                        lr_scheduler_factory=lr_scheduler_factory)
