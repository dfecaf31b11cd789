"""A user's estimator reaches every price the search makes (issue 17, part 3): the pp = 1
path, the pipeline path (per-rank ILPs and the simulated step), the rationale, and
``autopar.plan``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.planner import search
from autopar.planner.costs import layer_cost, on_ddp
from autopar.planner.engine import evaluate_plan
from autopar.planner.estimators import ANALYTIC, ComputeTimes, compute_s
from autopar.planner.one_stage import runs_on_ddp
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh

SLOWDOWN = 3.0


def slow_compute(layer, ctx) -> ComputeTimes:
    """The analytic compute, SLOWDOWN times slower (a calibrated device might say so)."""
    t = compute_s(layer, ctx)
    return ComputeTimes(fwd_matmul_s=SLOWDOWN * t.fwd_matmul_s,
                        fwd_alone_s=SLOWDOWN * t.fwd_alone_s,
                        loss_fwd_s=SLOWDOWN * t.loss_fwd_s, bwd_s=SLOWDOWN * t.bwd_s)


SLOW = dataclasses.replace(ANALYTIC, compute=slow_compute)
F32 = precision("float32")


@pytest.fixture(scope="module")
def tiny():
    spec = get_model("gpt-tiny")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(8, device="meta"),
                              model_name="gpt-tiny")
    return graph, Cluster.local(2)


def plan_priced_again(graph, cluster, plan, estimators):
    """The plan's step re-priced layer by layer with ``estimators`` (pp = 1)."""
    by_name = {layer.module: layer for layer in plan.layers}
    costs = [layer_cost(layer, by_name[layer.name].option, plan.mesh, cluster, F32,
                        plan.gradient_accumulation, estimators=estimators)
             for layer in graph.layers]
    if runs_on_ddp(costs, F32, plan.mesh):
        costs = [on_ddp(c) for c in costs]
    return sum(c.time_s for c in costs)


def test_the_flat_search_prices_with_the_given_estimators(tiny):
    graph, cluster = tiny
    plan = search(graph, cluster, mesh=Mesh(dp=2), pipeline=False, estimators=SLOW).plan
    analytic = search(graph, cluster, mesh=Mesh(dp=2), pipeline=False).plan
    assert plan.prediction.step_time_s == pytest.approx(
        plan_priced_again(graph, cluster, plan, SLOW), rel=1e-9)
    # compute_s also holds the optimizer step and host time, which the estimator leaves
    assert plan.prediction.compute_s > 1.5 * analytic.prediction.compute_s


def test_the_pipeline_search_prices_with_the_given_estimators(tiny):
    graph, cluster = tiny
    plan = search(graph, cluster, mesh=Mesh(pp=2, dp=1), estimators=SLOW).plan
    assert plan.pipeline is not None
    slow = evaluate_plan(graph, cluster, F32, plan, estimators=SLOW).step_time_s
    analytic = evaluate_plan(graph, cluster, F32, plan).step_time_s
    assert plan.prediction.step_time_s == pytest.approx(slow, rel=1e-9)
    assert slow > 1.5 * analytic  # the bubble and the transfers scale with compute, not all


def test_autopar_plan_takes_estimators_and_the_rationale_shows_their_prices():
    spec = get_model("gpt-tiny")
    model = spec.build("cpu")
    inputs = spec.example_inputs(8)
    torch.manual_seed(0)
    plain = autopar.plan(model, Cluster.local(1), inputs, mesh=Mesh(dp=1))
    slow = autopar.plan(model, Cluster.local(1), inputs, mesh=Mesh(dp=1), estimators=SLOW)
    assert slow.prediction.compute_s > 1.5 * plain.prediction.compute_s
    plain_costs = {(c.layer_class, o.strategy): o.compute_s
                   for c in plain.rationale.classes for o in c.options}
    ratios = [o.compute_s / plain_costs[(c.layer_class, o.strategy)]
              for c in slow.rationale.classes for o in c.options
              if plain_costs.get((c.layer_class, o.strategy), 0) > 0]
    assert ratios and min(ratios) > 1.0 and max(ratios) > 2.0
