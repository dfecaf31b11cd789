"""A model calling one parameterless module at every depth trains under the planner's
pipeline like one process: the planner may cut between the module's calls, and each stage
runs the calls made among its layers (passes.group_layers.stateless_layers)."""

from __future__ import annotations

import torch
import torch.nn as nn
from reference import assert_trains_like, pipeline_grads, train_one_process, train_under_plan
from shared_module_stack import SharedActivationStack

STEPS, LR, BATCH = 3, 1e-2, 8
TOL = dict(rtol=1e-5, atol=1e-6)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 16, (BATCH, 6), generator=gen), torch.randint(0, 16, (BATCH, 6),
                                                                          generator=gen)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return SharedActivationStack(blocks=4)


def pipeline_job(plan_json: str) -> dict:
    from autopar.lower import make_trainer
    from runtime.plan import Plan

    plan = Plan.from_json(plan_json)
    trainer = make_trainer(_model(), plan, _loss, (_batch(0)[0],),
                           lambda params: torch.optim.AdamW(params, lr=LR))
    return train_under_plan(trainer, lambda step: ((_batch(step)[0],), _batch(step)[1]),
                            pipeline_grads, steps=STEPS)


def test_the_planner_cuts_between_the_calls_and_the_pipeline_trains_like_one_process(pool2):
    import autopar
    from cost_models.hardware import Cluster
    from runtime.plan import Mesh

    plan = autopar.plan(_model(), Cluster.local(2), (_batch(0)[0],), mesh=Mesh(pp=2, dp=1))
    stages = {layer.module: layer.stage for layer in plan.layers}
    # Cuts fall inside the stack, between calls of `act` (before, none could).
    assert stages["blocks.0"] < stages["norm"], stages
    ref = train_one_process(_model(), lambda m, step: _loss(m(_batch(step)[0]), _batch(step)[1]),
                            steps=STEPS, lr=LR)
    for out in pool2.run(pipeline_job, plan.to_json()):
        assert_trains_like(out, ref, tol=TOL, param_tol=TOL)
