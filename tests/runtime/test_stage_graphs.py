"""runtime.stage_graphs: which stages use a weight twice (their weight gradients cannot be
deferred by torch's split backward), and the rewrite of a captured device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import symbolic_trace

from passes.split_stages import split_pipeline
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan
from runtime.stage_graphs import on_rank_device, uses_a_weight_twice


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


class ReadTwice(nn.Module):
    """One read of the weight, used by two ops."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.linear(torch.relu(F.linear(x, w)), w)


class Once(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize(("model", "twice"), [(Twice(), True), (ReadTwice(), True),
                                             (Once(), False)], ids=["call", "read", "once"])
def test_a_traced_stage_uses_a_weight_twice(model, twice):
    assert uses_a_weight_twice(symbolic_trace(model)) is twice


class Shared(nn.Module):
    """``block`` runs twice; export unflattens it into ``block`` and ``block@1``. The
    branch on ``dim()`` makes the split an export."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(4, 4), Once(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x = x.unsqueeze(1)
        h = self.inp(x)
        h = self.block(self.block(h))
        return self.head(h)


def test_an_exported_stage_with_a_module_run_twice_uses_its_weights_twice():
    plan = Plan(global_batch=4, mesh=Mesh(pp=2),
                layers=(LayerPlan(module="inp", stage=0), LayerPlan(module="block", stage=0),
                        LayerPlan(module="head", stage=1)),
                pipeline=PipelineSpec(num_microbatches=2))
    split = split_pipeline(Shared(), plan, (torch.randn(2, 4),))
    assert split.method == "export"
    assert [uses_a_weight_twice(m) for m in split.modules] == [True, False]


class Factory(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(x.shape, device=torch.device("cpu"))  # a keyword
        return x.to(torch.device("cpu")) + ones  # an argument


def test_every_captured_device_is_rewritten():
    gm = symbolic_trace(Factory())
    on_rank_device(gm, torch.device("meta"))
    out = gm(torch.ones(2))
    assert out.is_meta
    devices = [a for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values())
               if isinstance(a, torch.device)]
    assert devices == [torch.device("meta")] * 2
