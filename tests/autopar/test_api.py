"""autopar.plan and autopar.compile end to end: capture → plan → execute on gloo ranks."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from reference import hf_gpt2, single_process_losses

import autopar
from autopar.zoo import get_model
from cost_models.hardware import Cluster


def tight_local_cluster(world: int) -> Cluster:
    """This machine's CPU ranks with too little memory for an all-replicated plan."""
    spec = get_model("gpt-tiny")
    inputs = spec.example_inputs(spec.default_batch, device="meta")
    roomy = Cluster.local(world)
    need = autopar.plan(spec.build("meta"), roomy, inputs).prediction.memory.total_bytes
    for fraction in (0.9, 0.8, 0.7, 0.6, 0.5):
        tight = replace(roomy, device=replace(roomy.device, memory_bytes=int(need * fraction)))
        try:
            plan = autopar.plan(spec.build("meta"), tight, inputs)
        except autopar.InfeasibleError:
            break
        if {lp.strategy for lp in plan.layers} != {"replicate"}:
            return tight
    raise AssertionError("no memory size gives a feasible plan other than all-replicated")


def compile_job(memory_bytes: int, steps: int) -> dict:
    spec = get_model("gpt-tiny")
    world = torch.distributed.get_world_size()
    local = Cluster.local(world)
    cluster = replace(local, device=replace(local.device, memory_bytes=memory_bytes))
    model = spec.build(seed=0)
    inputs, _ = spec.make_batch(spec.default_batch, seed=1)
    trainer = autopar.compile(model, cluster, inputs, loss_fn=spec.loss_fn)
    losses = []
    for step in range(steps):
        x, y = spec.make_batch(spec.default_batch, seed=1 + step)
        losses.append(trainer.train_step(x, y))
    return {"plan": trainer.plan.to_json(), "losses": losses}


def test_compile_shares_one_plan_and_trains_like_one_process(pool4):
    cluster = tight_local_cluster(4)
    results = pool4.run(compile_job, cluster.device.memory_bytes, 3)
    plans = {r["plan"] for r in results}
    assert len(plans) == 1, "every rank must execute the plan rank 0 made"
    plan = autopar.Plan.from_json(plans.pop())
    assert {lp.strategy for lp in plan.layers} != {"replicate"}, "memory should bind"
    assert plan.prediction.memory.total_bytes <= cluster.device.memory_bytes
    want = single_process_losses("gpt-tiny", steps=3)
    for r in results:
        assert r["losses"] == pytest.approx(want, rel=1e-5)


def test_a_planning_error_on_rank_0_reaches_every_rank(pool2):
    messages = pool2.run(compile_error_job)
    assert all("smallest per-rank memory any plan needs" in m for m in messages)


def compile_error_job() -> str:
    try:
        compile_job(1024, 1)
    except autopar.InfeasibleError as e:
        return str(e)
    return "no error"


def test_compile_outside_a_process_group_says_how_to_start_ranks():
    spec = get_model("gpt-tiny")
    with pytest.raises(autopar.AutoparError, match="autopar run`, torchrun"):
        autopar.compile(spec.build(), "local", spec.example_inputs(8, device="cpu"),
                        loss_fn=spec.loss_fn)


def test_plan_accepts_a_hugging_face_model_built_from_a_config():
    model = hf_gpt2()
    inputs = (torch.randint(0, 128, (8, 32)),)
    plan = autopar.plan(model, Cluster.local(2), inputs, model_name="hf-gpt2")
    names = [lp.module for lp in plan.layers]
    assert "transformer.h.0" in names and "transformer.h.1" in names
    assert plan.layer("transformer.h.0").layer_class == plan.layer("transformer.h.1").layer_class
    assert all(not lp.is_tp for lp in plan.layers), "fused qkv (Conv1D) offers no exact TP split"


def test_a_search_of_a_graph_already_captured_plans_as_a_capture_does(monkeypatch):
    """Several searches of one model share one capture (``graph=``); the plan is the one
    capturing it again gives, rationale included (all but the solver's wall time)."""
    from passes.layer_graph import build_layer_graph

    def saved(plan) -> dict:
        data = json.loads(plan.to_json())
        del data["solver"]["solve_time_s"]
        return data

    spec = get_model("gpt-tiny")
    model, inputs = spec.build("meta"), spec.example_inputs(8, device="meta")
    graph = build_layer_graph(model, inputs)
    captured = {n: autopar.search_plans(model, Cluster.local(n), inputs).plan for n in (2, 4)}

    def no_capture(*args, **kwargs):
        raise AssertionError("captured again")

    monkeypatch.setattr("autopar.api.build_layer_graph", no_capture)
    for n, plan in captured.items():
        reused = autopar.search_plans(model, Cluster.local(n), inputs, graph=graph).plan
        assert saved(reused) == saved(plan)


def test_uncapturable_model_names_the_line_and_the_opaque_option():
    class Gate(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x * 2
            return x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.lin(x))

    with pytest.raises(autopar.CaptureError) as info:
        autopar.plan(Net(), "local", (torch.randn(2, 4),))
    message = str(info.value)
    assert "test_api.py" in message and "opaque" in message
