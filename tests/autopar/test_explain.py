"""explain names the chosen option and prices every alternative with the planner's own
costs; diff of a plan with itself is empty and of two plans lists exactly the changed layers."""

from __future__ import annotations

import dataclasses

import pytest
from report_cases import BATCH, SEQ, gpt2_small_plan

from autopar.api import search_plans
from autopar.diff import diff, format_diff
from autopar.errors import ConfigError
from autopar.explain import explain, format_explanation
from autopar.planner.costs import layer_options
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh, Plan
from runtime.plan_report import human_bytes, ms


def test_explain_names_the_chosen_option_and_prices_every_allowed_one():
    plan = gpt2_small_plan(nodes=2)
    layer = plan.layer("h.3")
    e = explain(plan, "h.3")
    assert e.strategy == layer.option and e.layer_class == layer.layer_class
    spec = get_model("gpt2-small")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(BATCH, SEQ, device="meta"),
                              seq_len=SEQ)
    info = next(x for x in graph.layers if x.name == "h.3")
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    allowed = layer_options(info, SEQ, plan.mesh, cluster, precision("float32"),
                            plan.microbatches)
    assert {v.strategy for v in e.options} == set(allowed)
    for v in e.options:
        cost = allowed[v.strategy]
        assert v.time_s == pytest.approx(cost.time_s)
        assert v.memory_bytes == pytest.approx(cost.resident_bytes, abs=4)
        assert v.chosen == (v.strategy == layer.option)
    text = format_explanation(e)
    assert f"h.3: {layer.option}" in text
    for v in e.options:
        assert v.strategy in text and ms(v.time_s) in text


def test_explain_says_memory_binds_when_a_faster_option_does_not_fit():
    plan = gpt2_small_plan(memory_gib=2)
    slowed = [e for e in (explain(plan, x.module) for x in plan.layers)
              if any(v.delta_time_s < 0 for v in e.options)]
    assert slowed, "at 2 GiB per device some layers must trade time for memory"
    e = slowed[0]
    faster = [v for v in e.options if v.delta_time_s < 0]
    assert faster and not any(v.fits for v in faster)
    assert "memory binds" in e.reason
    assert human_bytes(plan.prediction.capacity_bytes) in e.reason


def test_explain_lists_strategies_the_mesh_cannot_offer():
    plan = gpt2_small_plan()
    e = explain(plan, "ln_f")
    assert "tp" in e.unavailable and "tp_fsdp" in e.unavailable
    assert "not available" in format_explanation(e)


def test_explain_says_why_the_distributed_optimizer_was_not_offered():
    """On dp 4 × tp 2 with one micro-batch per step the planner prices tp_zero2 for a block
    and not tp_zero1, which is then ZeRO-2's program: explain gives the spec's reason
    (runtime.strategies), not a missing tensor-parallel split."""
    spec = get_model("gpt2-small")
    plan = search_plans(spec.build("meta"), Cluster.preset("dgx-a100-80g", nodes=1),
                        spec.example_inputs(BATCH, SEQ, device="meta"), model_name=spec.name,
                        seq_len=SEQ, mesh=Mesh(dp=4, tp=2)).plan
    assert plan.microbatches == 1
    e = explain(plan, "h.3")
    assert any(v.strategy.startswith("tp_zero2") for v in e.options)
    assert e.unavailable["tp_zero1"].startswith("one micro-batch per step")
    assert "no exact tensor-parallel split" not in format_explanation(e)


def test_explain_errors_name_the_problem():
    plan = gpt2_small_plan()
    with pytest.raises(ConfigError, match="no layer 'h.99'"):
        explain(plan, "h.99")
    with pytest.raises(ConfigError, match="re-plan"):
        explain(dataclasses.replace(plan, rationale=None), "h.0")


def test_diff_of_a_plan_with_itself_is_empty():
    plan = gpt2_small_plan()
    d = diff(plan, Plan.from_json(plan.to_json()))
    assert d.is_empty and format_diff(d) == "the plans are the same"


def test_diff_lists_exactly_the_changed_layers():
    plan = gpt2_small_plan()
    changed = {m: "replicate" if plan.layer(m).strategy != "replicate" else "fsdp"
               for m in ("h.2", "lm_head")}
    layers = tuple(dataclasses.replace(x, strategy=changed[x.module], tp_styles={})
                   if x.module in changed else x for x in plan.layers)
    assert all(plan.layer(m).strategy != s for m, s in changed.items())
    other = dataclasses.replace(plan, layers=layers)
    d = diff(plan, other)
    assert d.changed_layers == ("h.2", "lm_head")
    assert not d.fields and not d.only_in_a and not d.only_in_b
    text = format_diff(d)
    assert "2 layer(s) changed" in text and "h.2: strategy" in text and "h.3" not in text


def test_diff_of_two_plans_reports_the_mesh_and_prediction():
    a, b = gpt2_small_plan(nodes=1), gpt2_small_plan(nodes=2)
    d = diff(a, b)
    assert "cluster" in d.fields
    expected = tuple(x.module for x, y in zip(a.layers, b.layers, strict=True)
                     if (x.strategy, x.tp_styles, x.stage) != (y.strategy, y.tp_styles, y.stage))
    assert d.changed_layers == expected
    assert "step_time_s" in d.prediction
