"""Lower a plan onto a model: the step between ``Plan`` and the runtime.

``runtime`` may not import ``passes`` (the split is a graph transformation), so the
pipeline's stage modules are made here and handed down: ``pp == 1`` plans go to
``runtime.train.Trainer`` as before; ``pp > 1`` plans are split into one module per stage
(``passes.split_stages``) and run by ``runtime.pipeline.PipelineTrainer``. Both have
the same methods (``train_step``, ``forward_backward``, ``step``, ``shard_batch``,
``full_state_dict``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from passes.split_stages import split_stages
from runtime.batch_norm import check_batch_statistics
from runtime.pipeline import PipelineTrainer
from runtime.plan import Plan
from runtime.train import LossFn, OptimizerFactory, Trainer


def microbatch_inputs(plan: Plan, example_inputs: tuple) -> tuple:
    """One micro-batch's worth of ``example_inputs`` (a global batch), for tracing."""
    m = plan.pipeline.num_microbatches if plan.pipeline else 1
    per = max(1, plan.global_batch // (plan.mesh.dp * m))
    return tuple(x[:per] if isinstance(x, torch.Tensor) and x.dim() else x
                 for x in example_inputs)


def make_trainer(
    model: nn.Module,
    plan: Plan,
    loss_fn: LossFn,
    example_inputs: tuple,
    optimizer_factory: OptimizerFactory | None = None,
    device_type: str = "cpu",
) -> Trainer:
    """A trainer for ``plan`` on every rank of an initialised process group.

    ``example_inputs``: a batch of real or meta tensors (only shapes and types are used;
    a pipeline is traced on one micro-batch of it). ``model`` is parallelized in place.
    Raises PlanError before any collective when the plan does not fit.
    """
    kwargs = {} if optimizer_factory is None else {"optimizer_factory": optimizer_factory}
    if plan.mesh.pp == 1:
        return Trainer(model, plan, loss_fn, device_type=device_type, **kwargs)
    check_batch_statistics(model, plan)  # before splitting: a clear error, not a wrong run
    stages = split_stages(model, plan, microbatch_inputs(plan, example_inputs))
    return PipelineTrainer(stages, plan, loss_fn, device_type=device_type, **kwargs)
