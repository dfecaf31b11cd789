"""Bad input through the Python API, and plan files mutated at random: a clear error (a
ConfigError naming what is wrong) or a plan, never a traceback from deep inside."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.errors import ConfigError
from runtime.plan import LayerPlan, Plan, PlanError
from runtime.plan_report import alternatives_lines
from runtime.validate import plan_problem

V1 = Path(__file__).parents[1] / "runtime" / "data" / "plan_v1_gpt_small.json"
INPUTS = torch.randint(0, 64, (4, 8))


def test_a_model_that_is_not_a_module_is_named():
    with pytest.raises(ConfigError, match="model must be a torch.nn.Module, got str"):
        autopar.plan("gpt-tiny", "local", INPUTS)


def test_a_model_without_parameters_is_refused():
    with pytest.raises(ConfigError, match="ReLU has no parameters"):
        autopar.plan(nn.ReLU(), "local", torch.randn(4, 8))


def test_a_cluster_that_is_not_a_cluster_is_named():
    with pytest.raises(ConfigError):
        autopar.plan(nn.Linear(8, 8), 42, torch.randn(4, 8))


def test_cuda_without_a_gpu_is_said_before_anything_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlanError, match="device_type='cuda' but torch sees no CUDA device"):
        autopar.compile(nn.Linear(8, 8), "local", torch.randn(4, 8), device_type="cuda")


def test_a_plan_with_no_layers_runs_and_says_what_it_does():
    """Such a plan is valid (everything on the root, replicated); runtime.apply logs what
    it does rather than running it without a word."""
    from runtime.validate import plan_notes

    plan = Plan(global_batch=4)
    assert plan_problem(nn.Linear(8, 8), plan) is None
    assert plan_notes(nn.Linear(8, 8), plan) == [
        "the plan names no layers: all of Linear stays with the root and is replicated on "
        "every rank (data parallelism only); list its modules in 'layers', or plan it with "
        "`autopar plan`, to shard or split it"]
    model = nn.Sequential(nn.Linear(8, 8))
    assert plan_notes(model, Plan(global_batch=4, layers=(LayerPlan(module="0"),))) == []


def test_only_the_plan_itself_is_marked_chosen_among_alternatives():
    """Two alternatives of the plan's shape (e.g. other stage cuts): the slower one says
    by how much."""
    data = json.loads(V1.read_text())
    alts = data["rationale"]["alternatives"]
    mine = next(a for a in alts if a["mesh"] == data["mesh"] and a["pipeline"] is None)
    slower = {**mine, "step_time_s": mine["step_time_s"] * 1.5}
    data["rationale"]["alternatives"] = [mine, slower, *[a for a in alts if a is not mine]]
    lines = alternatives_lines(Plan.from_dict(data), top_k=3)
    assert sum("chosen" in line for line in lines) == 1
    assert any("slower by" in line and "(+50.0%)" in line for line in lines)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


BASE = json.loads(V1.read_text())
PATHS = [p for p in _paths(BASE) if p]


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), JSON_VALUES, st.booleans())
def test_a_mutated_plan_file_loads_or_is_refused_by_name(path, value, delete):
    """Replace (or delete) one field anywhere in a real plan: the reader returns a plan or
    raises PlanError; nothing else escapes. Seeded (derandomize) so a failure reproduces."""
    data = copy.deepcopy(BASE)
    node = data
    for key in path[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    try:
        Plan.from_json(json.dumps(data), source="plan.json")
    except PlanError as e:
        assert str(e).startswith("plan.json")
