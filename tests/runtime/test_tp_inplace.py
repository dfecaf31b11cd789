"""Tensor-parallel Linears whose outputs the model modifies in place train like one process.

DTensor hands a TP module's local output out as a view made inside a custom autograd
Function, which autograd forbids modifying in place; the runtime hands on the module's
own fresh output instead (``runtime.tensor_parallel._owned_output``). The splits here are
the ones the planner offers for these blocks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import assert_trains_like, full_tensor, train_one_process, train_under_plan

from passes.layer_graph import build_layer_graph
from runtime.plan import LayerPlan, Mesh, Plan

D, VOCAB, STEPS, LR = 16, 64, 2, 1e-3
TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)


class _Block(nn.Module):
    """``relu_``: an in-place ReLU on the column-parallel output (``nn.ReLU(inplace=True)``
    after a Linear); ``add_``: the residual added into the row-parallel output in place
    (``y = fc2(h); y += x``, as Hugging Face Falcon's parallel block does)."""

    def __init__(self, inplace: str) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        h = self.fc1(x)
        h = F.relu(h, inplace=True) if self.inplace == "relu_" else F.gelu(h)
        y = self.fc2(h)
        if self.inplace == "add_":
            y += x
            return y
        return x + y


class _Net(nn.Module):
    def __init__(self, inplace: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(_Block(inplace) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(inplace: str) -> _Net:
    torch.manual_seed(0)
    return _Net(inplace)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(step))
    return ids, ids.roll(-1, dims=1)


def _loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


@functools.cache
def _plan(inplace: str) -> str:
    graph = build_layer_graph(_build(inplace), (_batch(0)[0],))
    layers = tuple(LayerPlan(module=la.name, strategy="tp", tp_styles=dict(la.tp.styles))
                   if la.tp is not None else LayerPlan(module=la.name) for la in graph.layers)
    assert [la.tp_styles for la in layers if la.module.startswith("blocks")] == [
        {"fc1": "colwise", "fc2": "rowwise"}] * 2
    return Plan(global_batch=8, mesh=Mesh(dp=1, tp=2), layers=layers).to_json()


def _job(inplace: str, plan_json: str) -> dict:
    from runtime.train import Trainer

    trainer = Trainer(_build(inplace), Plan.from_json(plan_json), _loss,
                      lambda params: torch.optim.AdamW(params, lr=LR))
    return train_under_plan(
        trainer, lambda step: ((_batch(step)[0],), _batch(step)[1]),
        lambda tr: {n: full_tensor(p.grad) for n, p in tr.applied.model.named_parameters()},
        steps=STEPS)


@pytest.mark.parametrize("inplace", ["relu_", "add_"])
def test_tp_outputs_modified_in_place_train_like_one_process(pool2, inplace):
    ref = train_one_process(_build(inplace), lambda net, step: _loss(net(_batch(step)[0]),
                                                                     _batch(step)[1]),
                            steps=STEPS, lr=LR)
    for out in pool2.run(_job, inplace, _plan(inplace)):
        assert_trains_like(out, ref, tol=TOL, param_tol=PARAM_TOL)
