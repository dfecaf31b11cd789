"""Lower a plan onto a model: the step between ``Plan`` and the runtime.

``runtime`` may not import ``passes`` (the split is a graph transformation), so the
pipeline's stage modules are made here and handed down: ``pp == 1`` plans go to
``runtime.train.Trainer`` as before; ``pp > 1`` plans are split into one module per stage
(``passes.split_stages.split_pipeline``: symbolic tracing where it works, else PyTorch's
export-based ``pipeline()``) and run by ``runtime.pipeline.PipelineTrainer``, which also
gets the names of the parameters several stages hold copies of (tied weights). Both have
the same methods (``train_step``, ``forward_backward``, ``step``, ``shard_batch``,
``full_state_dict``).
"""

from __future__ import annotations

import os

import torch.nn as nn

from passes.split_stages import split_pipeline
from passes.trace import inputs_to_meta
from runtime.batch import Inputs, as_inputs, first_rows
from runtime.materialize import first_names, on_meta
from runtime.pipeline import PipelineTrainer
from runtime.plan import Plan, PlanError
from runtime.train import LossFn, OptimizerFactory, SchedulerFactory, Trainer
from runtime.validate import check_plan
from runtime.weights import check_source, load_weights


def microbatch_inputs(plan: Plan, example_inputs: object) -> tuple | Inputs:
    """One micro-batch's worth of ``example_inputs`` (a global batch, in any form
    ``runtime.batch.as_inputs`` reads), for tracing: the positional arguments as a tuple,
    or ``Inputs`` when there are keyword arguments."""
    m = plan.pipeline.num_microbatches if plan.pipeline else 1
    per = max(1, plan.global_batch // (plan.mesh.dp * m))
    part = first_rows(as_inputs(example_inputs), per)
    return part if part.kwargs else part.args


def make_trainer(
    model: nn.Module,
    plan: Plan,
    loss_fn: LossFn | None,
    example_inputs: object,
    optimizer_factory: OptimizerFactory | None = None,
    device_type: str = "auto",
    seed: int | None = None,
    weights: str | os.PathLike | None = None,
    lr_scheduler_factory: SchedulerFactory | None = None,
) -> Trainer:
    """A trainer for ``plan`` on every rank of an initialised process group.

    ``example_inputs``: a batch of real or meta tensors (only shapes and types are used;
    a pipeline is traced on one micro-batch of it, and one split from a ``torch.export``
    capture then runs at that micro-batch's shapes only: the plan's global batch and these
    inputs' other dims, such as the sequence length). ``model`` is parallelized in place;
    on the meta device, each rank allocates only its own shards (``runtime.materialize``).
    ``weights``: a directory of Hugging Face safetensors or an autopar checkpoint, read
    into the shards (``runtime.weights``). Raises PlanError before any collective when the
    plan does not fit.
    """
    if loss_fn is None and plan.mesh.pp > 1:
        raise PlanError(
            f"mesh.pp={plan.mesh.pp}: a pipeline computes the loss on its last stage from "
            "the stage's output and the targets, so it needs loss_fn=...; a model that "
            "computes its own loss (labels=) trains under plans with pp=1"
        )
    if weights is not None:
        check_source(weights)  # a wrong path fails here, not after the model is sharded
    kwargs: dict = {"lr_scheduler_factory": lr_scheduler_factory}
    if optimizer_factory is not None:
        kwargs["optimizer_factory"] = optimizer_factory
    first = first_names(model)
    if plan.mesh.pp == 1:
        trainer = Trainer(model, plan, loss_fn, device_type=device_type, seed=seed, **kwargs)
    else:
        trainer = _pipeline_trainer(model, plan, loss_fn, example_inputs, device_type, seed,
                                    kwargs)
    if weights is not None:
        modules = trainer.stages if isinstance(trainer, PipelineTrainer) else [trainer.applied.model]
        load_weights(modules, weights, first)
    return trainer


def _pipeline_trainer(model: nn.Module, plan: Plan, loss_fn: LossFn | None,
                      example_inputs: object, device_type: str, seed: int | None,
                      kwargs: dict) -> PipelineTrainer:
    """Split ``model`` into the plan's stages and build this rank's (on meta, allocated
    only for this rank's stages)."""
    check_plan(model, plan)  # before splitting: a clear error, not a wrong run
    meta = on_meta(model)
    part = as_inputs(microbatch_inputs(plan, example_inputs))
    if meta:  # captured on meta like the model (only shapes are used)
        part = inputs_to_meta(part)
    split = split_pipeline(model, plan, part.args, dict(part.kwargs) or None)
    return PipelineTrainer(split.modules, plan, loss_fn, device_type=device_type,
                           tied=split.tied, output_fn=split.output_fn,
                           model=model if meta else None, seed=seed, **kwargs)
