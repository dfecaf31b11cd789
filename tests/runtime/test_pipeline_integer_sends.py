"""An integer tensor made on one stage and read on a later one (an argmax used as an index)
is sent like an activation, and the pipeline trains like one process.

torch's ``PipelineStage`` runs each later stage once on buffers of the received shapes to
learn its outputs; it leaves them uninitialised, so an embedding read an out-of-range index
there. ``runtime.pipeline._Stage`` gives integer buffers zeros. Under ZBV (4 stages on 2
ranks, V-placed) the ids cross from stage 1 to stage 2 on one rank, which hands the
metadata over in memory, and from stage 2 to stage 3 between ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from reference import assert_trains_like, pipeline_grads, train_one_process, train_under_plan

from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

STEPS, LR, BATCH = 3, 1e-2, 8
TOL = dict(rtol=1e-5, atol=1e-6)


class ScoredLookup(nn.Module):
    """Picks a row of ``table`` per position by the argmax of a score, two layers before
    the table reads it; the score's first half also joins the stream (so it trains)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.score, self.mid = nn.Linear(4, 8), nn.Linear(8, 16), nn.Linear(8, 8)
        self.table, self.out = nn.Embedding(16, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        score = self.score(h)
        ids = score.argmax(-1)
        h = torch.relu(self.mid(h)) + score[..., :8]
        return self.out(h + self.table(ids))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return ScoredLookup()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 3, 4, generator=gen), torch.randn(BATCH, 3, 4, generator=gen)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


PLAN = Plan(global_batch=BATCH, mesh=Mesh(pp=2),
            pipeline=PipelineSpec(schedule="ZBVZeroBubble", num_microbatches=4,
                                  virtual_stages=2),
            layers=tuple(LayerPlan(module=m, stage=s) for m, s in
                         (("inp", 0), ("score", 1), ("mid", 2), ("table", 3), ("out", 3))))


def pipeline_job(plan_json: str) -> dict:
    from autopar.lower import make_trainer

    trainer = make_trainer(_model(), Plan.from_json(plan_json), _loss, (_batch(0)[0],),
                           lambda params: torch.optim.AdamW(params, lr=LR))
    out = train_under_plan(trainer, lambda step: ((_batch(step)[0],), _batch(step)[1]),
                           pipeline_grads, steps=STEPS)
    return {**out, "stage_ids": trainer.stage_ids}


def test_integer_ids_cross_cuts_on_one_rank_and_between_ranks(pool2):
    from passes.split_stages import split_pipeline

    x = _batch(0)[0]
    stages = split_pipeline(_model(), PLAN, (x,)).modules
    sent = stages[1](stages[0](x))
    assert sorted(str(t.dtype) for t in sent) == ["torch.float32", "torch.float32",
                                                   "torch.int64"]  # h, the score, the ids
    ref = train_one_process(_model(), lambda m, step: _loss(m(_batch(step)[0]), _batch(step)[1]),
                            steps=STEPS, lr=LR)
    results = pool2.run(pipeline_job, PLAN.to_json())
    assert [r["stage_ids"] for r in results] == [[0, 3], [1, 2]]
    for out in results:
        assert_trains_like(out, ref, tol=TOL, param_tol=TOL)
