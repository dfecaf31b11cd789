"""Pipeline stage boundaries whose tensors are not contiguous train like one process.

Point-to-point sends (gloo and NCCL) take contiguous tensors only. A stage may end in a
transpose or permute (ConvNeXt's and Swin's blocks return one), which makes its forward
send non-contiguous; and a stage that begins with one leaves the gradient of its input
transposed, which makes its backward send non-contiguous. Both once failed on every rank
with "input tensor has to be contiguous" (runtime.pipeline._sendable).

The model here: pairs of blocks, the first applying a Linear to its input's transpose, the
second returning a transpose of a Linear's output, cut after every pair (or two), so that
each boundary's forward and backward sends are both non-contiguous; with 1F1B and a
split-backward schedule (which also ``detach_()``-es stage outputs, so they must not be
views).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import assert_trains_like, pipeline_grads, train_one_process, train_under_plan

from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

BATCH, STEPS, LR = 8, 3, 1e-3
PAIRS = 4
TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)


class TransposeOut(nn.Module):
    """Returns a transposed view: its stage's forward send is not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).transpose(1, 2)


class TransposeIn(nn.Module):
    """Begins with its input's transpose: the gradient of its input is not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x.transpose(1, 2)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(b for _ in range(PAIRS) for b in (TransposeIn(), TransposeOut())))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).flatten(1)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 6, 6, generator=g),), torch.randn(BATCH, 6, generator=g)


def _plan(schedule: str) -> Plan:
    v = 2 if schedule == "ZBVZeroBubble" else 1
    stages = 2 * v
    per = 2 * PAIRS // stages  # whole pairs per stage: each cut follows a TransposeOut
    names = [f"blocks.{i}" for i in range(2 * PAIRS)] + ["head"]
    stage = {name: min(i // per, stages - 1) for i, name in enumerate(names)}
    return Plan(global_batch=BATCH, mesh=Mesh(pp=2),
                layers=tuple(LayerPlan(module=n, stage=stage[n]) for n in names),
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=2,
                                      virtual_stages=v))


def _job(plan_json: str) -> dict:
    import autopar

    trainer = autopar.compile(_model(), autopar.Cluster.local(2), _batch(0)[0],
                              loss_fn=F.mse_loss, plan=Plan.from_json(plan_json))
    return train_under_plan(trainer, _batch, pipeline_grads, steps=STEPS)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_non_contiguous_boundaries_train_like_one_process(pool2, schedule):
    plan = _plan(schedule)
    assert len({la.stage for la in plan.layers}) == plan.num_stages
    ref = train_one_process(_model(), lambda m, s: F.mse_loss(m(*_batch(s)[0]), _batch(s)[1]),
                            steps=STEPS, lr=LR)
    for out in pool2.run(_job, plan.to_json()):
        assert_trains_like(out, ref, tol=TOL, param_tol=PARAM_TOL)
