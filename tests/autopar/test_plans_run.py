"""One source of truth: the planner asks the runtime's validator before it offers a plan.

For every real model (tests/real_models.py) on several clusters, every candidate the
search reports feasible had its plan checked by ``runtime.validate`` (the code
``runtime.apply`` runs) and passed; the returned plan passes it too, and a pipeline plan
splits into its stages as ``compile`` splits it. A check that refuses plans makes the
search report them 'refused' with the runtime's reason and return another.
"""

from __future__ import annotations

import functools

import pytest
import torch
from real_models import MODELS, planning_inputs

from autopar.api import check_stage_split
from autopar.planner import search
from cost_models.hardware import Cluster
from passes.layer_graph import build_layer_graph
from runtime.batch import as_inputs
from runtime.validate import plan_problem

CLUSTERS = {
    "local-2": lambda: Cluster.local(2),
    "dgx-1": lambda: Cluster.preset("dgx-a100-80g", nodes=1),
    "dgx-4": lambda: Cluster.preset("dgx-a100-80g", nodes=4),
}
BATCH = 32


def _key(mesh, microbatches, schedule=None, virtual=1) -> tuple:
    return (mesh, microbatches, schedule, virtual)


def _plan_key(plan) -> tuple:
    if plan.pipeline is None:
        return _key(plan.mesh, plan.gradient_accumulation)
    p = plan.pipeline
    return _key(plan.mesh, p.num_microbatches, p.schedule, p.virtual_stages)


def _model(name: str):
    with torch.device("meta"):
        return MODELS[name].make()


@functools.cache
def _captured(name: str):
    """The planning inputs and layer graph of a model, captured once for all clusters (the
    capture does not depend on the cluster)."""
    spec = MODELS[name]
    inputs = as_inputs(planning_inputs(spec, spec.batch(BATCH)))
    return inputs, build_layer_graph(_model(name), inputs)


@pytest.mark.parametrize("cluster", list(CLUSTERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_every_feasible_candidate_passes_runtime_validation(name, cluster):
    model, (inputs, graph) = _model(name), _captured(name)
    asked = []

    def check(plan):
        asked.append(plan)
        return plan_problem(model, plan)

    result = search(graph, CLUSTERS[cluster](), check=check)
    passed = {_plan_key(p) for p in asked if plan_problem(model, p) is None}
    feasible = [c for c in result.candidates if c.status == "optimal"]
    assert feasible
    for c in feasible:
        key = _key(c.mesh, c.microbatches, c.schedule, c.virtual_stages)
        assert key in passed, f"{c.mesh.describe()} was reported feasible unchecked"
    assert plan_problem(model, result.plan) is None
    if result.plan.mesh.pp > 1:
        check_stage_split(model, result.plan, inputs)


def test_a_refused_plan_is_never_returned_and_says_why():
    model, inputs = _model("hf-llama"), as_inputs(MODELS["hf-llama"].batch(BATCH))
    graph = build_layer_graph(model, inputs)
    cluster = CLUSTERS["dgx-1"]()
    free = search(graph, cluster)
    assert free.plan.mesh.dp > 1  # what a refusal must change

    def no_data_parallel(plan):
        return "refusing dp > 1 for this test" if plan.mesh.dp > 1 else None

    result = search(graph, cluster, check=no_data_parallel)
    assert result.plan.mesh.dp == 1
    refused = [c for c in result.candidates if c.status == "refused"]
    assert refused and all("refusing dp > 1" in c.reason for c in refused)
    assert all(c.mesh.dp == 1 for c in result.candidates if c.status == "optimal")
