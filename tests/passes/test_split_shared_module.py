"""A module the model runs at several depths (ALBERT's one layer) splits into pipeline stages.

``torch.export`` unflattens each call of a reused module into its own path (``block``,
``block@1``, and inside them ``attn``, ``attn@1``), several of which reach the same
parameter objects. The export split's clean-up (``passes.split_export._drop_unread_state``)
once found what the stage graphs read by de-duplicated module path but deleted state by
every path, so it deleted a parameter the stage reads under an alias and then failed with
"AttributeError: 'InterpreterModule' object has no attribute 'weight'" inside
``autopar.plan``.

The model: one ``Block`` (a nested submodule, as ALBERT's layer group holds its attention)
applied twice between an input and an output layer. Its forward branches on a tensor's
``dim()``, which symbolic tracing cannot capture, so it is split by ``torch.export`` like a
Hugging Face model. A layer called twice stays on one stage (with the layers between its
calls), so the reused parameters are on one stage, whichever it is.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import assert_trains_like, pipeline_grads, train_one_process, train_under_plan

from passes.split_stages import split_pipeline
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

BATCH, STEPS, LR = 8, 3, 1e-3
TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.tanh(self.q(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Inner()
        self.ffn = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.attn(x))


class SharedBlockNet(nn.Module):
    """``block`` runs at depths 1 and 2: one module, one set of parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = Block()
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # a branch on the input: symbolic tracing fails, export does not
            x = x.unsqueeze(1)
        h = self.inp(x)
        for _ in range(2):
            h = self.block(h)
        return self.head(torch.relu(self.mid(h))).flatten(1)


def _model() -> SharedBlockNet:
    torch.manual_seed(0)
    return SharedBlockNet()


def _batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 4, generator=g),), torch.randn(BATCH, 1, generator=g)


def _plan(block_stage: int) -> Plan:
    stages = {"inp": 0, "block": block_stage, "mid": 1, "head": 1}
    return Plan(global_batch=BATCH, mesh=Mesh(pp=2),
                layers=tuple(LayerPlan(module=n, stage=s) for n, s in stages.items()),
                pipeline=PipelineSpec(schedule="1F1B", num_microbatches=2))


@pytest.mark.parametrize("block_stage", [0, 1])
def test_reused_block_keeps_every_parameter_its_stage_reads(block_stage):
    model = _model()
    split = split_pipeline(model, _plan(block_stage), (_batch(0)[0][0][: BATCH // 2],))
    assert split.method == "export"
    held = [dict(m.named_parameters()) for m in split.modules]
    block = {f"block.{n}" for n, _ in model.block.named_parameters()}
    assert block <= held[block_stage].keys()
    assert not block & held[1 - block_stage].keys()
    assert {n for h in held for n in h} == {n for n, _ in model.named_parameters()}
    assert split.tied == ()
    # Both calls of the block read the one parameter: every alias reaches the same tensor.
    stage = split.modules[block_stage]
    assert stage.get_parameter("block.attn.q.weight") is \
        stage.get_submodule("block@1").get_parameter("attn.q.weight")
    x = _batch(0)[0][0][: BATCH // 2]
    with torch.no_grad():
        out = split.modules[1](split.modules[0](x))
        torch.testing.assert_close(out, model(x))


def test_planner_pipelines_a_reused_block():
    import autopar

    plan = autopar.plan(_model(), autopar.Cluster.local(2), _batch(0)[0], mesh=Mesh(pp=2, dp=1))
    assert plan.mesh.pp == 2
    assert {la.module for la in plan.layers} >= {"inp", "block", "mid", "head"}


def _job(plan_json: str, build=_model) -> dict:
    import autopar

    trainer = autopar.compile(build(), autopar.Cluster.local(2), _batch(0)[0],
                              loss_fn=F.mse_loss, plan=Plan.from_json(plan_json))
    return train_under_plan(trainer, _batch, pipeline_grads, steps=STEPS)


def _zero_bubble_plan(schedule: str) -> Plan:
    """Four stages, two per rank; the block's stage computes its weight gradients apart
    from its input gradients (the split backward of the zero-bubble schedules)."""
    stages = {"inp": 0, "block": 1, "mid": 2, "head": 3}
    return Plan(global_batch=BATCH, mesh=Mesh(pp=2),
                layers=tuple(LayerPlan(module=n, stage=s) for n, s in stages.items()),
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=4,
                                      virtual_stages=2))


@pytest.mark.parametrize("plan", [_plan(0), _plan(1), _zero_bubble_plan("ZBVZeroBubble"),
                                  _zero_bubble_plan("InterleavedZeroBubble")],
                         ids=["block-on-stage-0", "block-on-stage-1", "zbv", "interleaved-zb"])
def test_reused_block_trains_like_one_process(pool2, plan):
    """torch's split backward groups a stage's weights by the autograd nodes that lead to
    them, and a weight used at two depths joins two groups it does not merge: its weight
    pass then ran backward twice through one node ("Trying to backward through the graph a
    second time"). Such a stage computes its weight gradients with its input gradients."""
    ref = train_one_process(_model(), lambda m, s: F.mse_loss(m(*_batch(s)[0]), _batch(s)[1]),
                            steps=STEPS, lr=LR)
    for out in pool2.run(_job, plan.to_json(), timeout_s=300):
        assert_trains_like(out, ref, tol=TOL, param_tol=PARAM_TOL)


class CalledAgainNet(SharedBlockNet):
    """``block`` runs, then ``mid``, then ``block`` again: ``mid`` must share its stage.
    Symbolic tracing captures it (no branch on the input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.inp(x))
        h = self.block(torch.relu(self.mid(h)))
        return self.head(h)


def _called_again() -> CalledAgainNet:
    torch.manual_seed(0)
    return CalledAgainNet()


def test_a_module_called_again_after_another_layer_keeps_them_on_one_stage(pool2):
    """The planner once cut between ``mid`` and the block's second call, and
    ``autopar.plan`` failed inside the symbolic split with "KeyError: relu_1"."""
    import autopar

    plan = autopar.plan(_called_again(), autopar.Cluster.local(2), _batch(0)[0],
                        mesh=Mesh(pp=2, dp=1))
    stage = {la.module: la.stage for la in plan.layers}
    assert stage["block"] == stage["mid"]
    assert len(set(stage.values())) == plan.num_stages
    ref = train_one_process(_called_again(),
                            lambda m, s: F.mse_loss(m(*_batch(s)[0]), _batch(s)[1]),
                            steps=STEPS, lr=LR)
    for out in pool2.run(_job, plan.to_json(), _called_again, timeout_s=300):
        assert_trains_like(out, ref, tol=TOL, param_tol=PARAM_TOL)


class TwoPlacesNet(nn.Module):
    """One module object at two places of a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Linear(8, 8)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([block, nn.Linear(8, 8), block])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def test_one_module_at_two_places_is_refused_for_a_pipeline_naming_both():
    """The refusal once blamed "the root (no planned module)" for the second place."""
    import autopar

    with pytest.raises(autopar.AutoparError) as e:
        autopar.plan(TwoPlacesNet(), autopar.Cluster.local(2), _batch(0)[0], mesh=Mesh(pp=2, dp=1))
    message = str(e.value)
    assert "one module is registered at 'blocks.0' and 'blocks.2'" in message
    assert "register it once and call it again where it is reused" in message
    assert "the root" not in message


def test_the_planner_prices_a_reused_layers_weight_gradients_in_its_backward():
    """A split-backward schedule cannot defer the weight gradients of a layer that uses a
    weight twice (the runtime computes them with the input gradients), so its W pass is
    empty and its B pass holds the whole backward."""
    from dataclasses import replace

    from autopar.planner.costs import layer_cost
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from passes.layer_graph import build_layer_graph

    for make in (_model, _called_again):  # captured by export, and by symbolic tracing
        graph = build_layer_graph(make(), _batch(0)[0])
        assert {la.name for la in graph.layers if la.reuses_weights} == {"block"}
    block = next(la for la in graph.layers if la.name == "block")
    cost = functools.partial(layer_cost, option="replicate", mesh=Mesh(dp=2),
                             cluster=Cluster.local(2), prec=precision("float32"))
    reused, plain = cost(block), cost(replace(block, reuses_weights=False))
    assert reused.wgrad_s == 0 < plain.wgrad_s
    assert reused.bwd_s == pytest.approx(plain.bwd_s + plain.wgrad_s)
