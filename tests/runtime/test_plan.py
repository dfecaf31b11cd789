"""Plans are data: they round-trip through JSON, and bad ones are named and explained."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.plan import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    STRATEGIES,
    TP_STYLES,
    LayerPlan,
    MemoryBreakdown,
    Mesh,
    PipelineSpec,
    Plan,
    PlanError,
    Prediction,
    SolverReport,
)
from runtime.strategies import spec

finite = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
sizes = st.integers(min_value=0, max_value=2**40)
module_names = st.from_regex(r"[a-z_]{1,6}(\.[0-9]{1,2})?(\.[a-z_]{1,6})?", fullmatch=True)


@st.composite
def layer_plans(draw, mesh: Mesh) -> LayerPlan:
    choices = [s for s in STRATEGIES if mesh.tp > 1 or not spec(s).tensor_parallel]
    strategy = draw(st.sampled_from(choices))
    styles = {}
    if spec(strategy).tensor_parallel:
        styles = draw(st.dictionaries(st.sampled_from(["", "fc_in", "attn.q_proj", "mlp.fc_out"]),
                                      st.sampled_from(TP_STYLES), min_size=1, max_size=3))
    return LayerPlan(
        module=draw(module_names),
        strategy=strategy,
        tp_styles=styles,
        layer_class=draw(st.sampled_from(["", "Block", "Embedding"])),
        memory_bytes=draw(st.none() | sizes),
        time_s=draw(st.none() | finite),
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        offload=spec(strategy).offloadable and draw(st.booleans()),
    )


def _runs(schedule: str, pp: int, m: int) -> bool:
    """The micro-batch counts torch's schedules accept (Plan._check_pipeline)."""
    if schedule == "1F1B":
        return m >= pp
    if schedule.startswith("Interleaved"):
        return m % max(1, m // pp) == 0
    return True


@st.composite
def plans(draw) -> Plan:
    mesh = Mesh(pp=draw(st.integers(1, 4)), dp=draw(st.integers(1, 8)), tp=draw(st.integers(1, 8)))
    pipeline = None
    if mesh.pp > 1:
        schedule = draw(st.sampled_from(sorted(SCHEDULES)))
        v = {"ZBVZeroBubble": 2}.get(schedule, 1)
        if schedule.startswith("Interleaved"):
            v = draw(st.integers(2, 3))
        m = draw(st.integers(1, 8).filter(lambda m: _runs(schedule, mesh.pp, m)))
        pipeline = PipelineSpec(schedule=schedule, num_microbatches=m, virtual_stages=v)
    num_stages = mesh.pp * (pipeline.virtual_stages if pipeline else 1)
    layers = draw(st.lists(layer_plans(mesh), min_size=num_stages if pipeline else 0,
                           max_size=max(6, num_stages), unique_by=lambda la: la.module))
    # Stages are contiguous runs in execution order and every stage holds a layer.
    layers = [replace(la, stage=i * num_stages // len(layers)) for i, la in enumerate(layers)]
    if pipeline and pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:  # selective cannot run
        layers = [replace(la, recompute="full") if la.recompute == "selective" else la
                  for la in layers]
    prediction = draw(st.none() | st.builds(
        Prediction, step_time_s=finite, compute_s=finite, comm_s=finite,
        memory=st.builds(MemoryBreakdown, params_bytes=sizes, grads_bytes=sizes,
                         optimizer_bytes=sizes, activations_bytes=sizes),
        capacity_bytes=sizes, source=st.sampled_from(["modelled", "calibrated", "measured"]),
    ))
    solver = draw(st.none() | st.builds(
        SolverReport, solver=st.just("highs"), status=st.just("Optimal"), objective_s=finite,
        lower_bound_s=finite, gap=finite, solve_time_s=finite, candidates=st.integers(1, 50),
    ))
    return Plan(
        model=draw(st.sampled_from(["", "gpt-tiny", "gpt2-xl"])),
        cluster=draw(st.sampled_from(["", "dgx-a100-80g"])),
        global_batch=mesh.dp * (pipeline.num_microbatches if pipeline else 1)
        * draw(st.integers(1, 64)),
        seq_len=draw(st.none() | st.integers(1, 8192)),
        mesh=mesh,
        layers=tuple(layers),
        hsdp_shard_size=1 if any(la.strategy == "hsdp" for la in layers) else None,
        param_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        pipeline=pipeline,
        prediction=prediction,
        solver=solver,
    )


@settings(max_examples=60, deadline=None)
@given(plans())
def test_json_round_trip_is_exact(plan):
    text = plan.to_json()
    assert Plan.from_json(text) == plan
    assert Plan.from_json(text).to_json() == text


@settings(max_examples=20, deadline=None)
@given(plans())
def test_save_then_load_returns_the_same_plan(tmp_path_factory, plan):
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert not [p for p in path.parent.iterdir() if p.name != "plan.json"]  # no temp left


def _valid() -> dict:
    return Plan(
        global_batch=8, mesh=Mesh(dp=2, tp=2),
        layers=(LayerPlan(module="h.0", strategy="tp", tp_styles={"mlp.fc_in": "colwise"}),),
    ).to_dict()


def _edit(path: str, value) -> dict:
    data = _valid()
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    return data


@pytest.mark.parametrize(("path", "value", "phrases"), [
    ("version", 99, ["version 99 is not supported", "autopar plan"]),
    ("colour", "red", ["unknown field(s) ['colour']", "valid fields"]),
    ("mesh.tp", 0, ["mesh.tp must be a positive integer"]),
    ("mesh.ep", 2, ["plan: mesh: unknown field(s) ['ep']"]),
    ("global_batch", 7, ["global_batch 7 is not divisible", "mesh.dp=2"]),
    ("layers.0.strategy", "zero4", ["layer 'h.0'", "unknown strategy 'zero4'", "tp_fsdp"]),
    ("layers.0.tp_styles", {"fc": "diagonal"}, ["'diagonal' is not one of", "colwise"]),
    ("layers.0.tp_styles", {}, ["needs tp_styles"]),
    ("layers.0.stage", 1, ["on stage 1 but the plan has 1 stage(s)"]),
    ("layers", [{"module": "a"}, {"module": "a"}], ["'a' appears twice"]),
    ("layers", [{"strategy": "fsdp"}], ["layers[0]", "module"]),
])
def test_bad_plan_json_names_the_field(path, value, phrases):
    with pytest.raises(PlanError) as info:
        Plan.from_dict(_edit(path, value))
    for phrase in phrases:
        assert phrase in str(info.value), (phrase, str(info.value))


def test_tp_strategy_needs_a_tp_axis():
    with pytest.raises(PlanError, match="uses 'tp' but mesh.tp is 1"):
        Plan.from_dict(_edit("mesh.tp", 1))


def test_not_json_and_unreadable_files_are_plan_errors(tmp_path):
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(PlanError, match="a plan must be a JSON object"):
        Plan.from_json(json.dumps([1, 2]))
    with pytest.raises(PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "pipeline, stages, message",
    [
        (None, [0, 1], "mesh.pp > 1 needs a 'pipeline' section"),
        (dict(schedule="1F1B", num_microbatches=3), [0, 1], "not divisible by dp × num_microbatches"),
        (dict(schedule="1F1B", num_microbatches=2), [1, 0], "contiguous runs of layers"),
        (dict(schedule="Interleaved1F1B", num_microbatches=2, virtual_stages=2), [0, 1],
         "stage(s) [2, 3] hold no layer"),
        (dict(schedule="ZBVZeroBubble", num_microbatches=2), [0, 1], "takes virtual_stages = 2"),
        (dict(schedule="PipeDream", num_microbatches=2), [0, 1], "is not one of GPipe, 1F1B"),
        (dict(schedule="1F1B", num_microbatches=1), [0, 1],
         "pipeline.num_microbatches=1 is less than mesh.pp=2; schedule '1F1B'"),
        (dict(schedule="Interleaved1F1B", num_microbatches=5, virtual_stages=2), [0, 1, 2, 3],
         "pipeline.num_microbatches=5 with schedule 'Interleaved1F1B' and mesh.pp=2"),
    ],
)
def test_bad_pipeline_sections_are_named(pipeline, stages, message):
    data = {
        "global_batch": 8, "mesh": {"pp": 2, "dp": 2}, "pipeline": pipeline,
        "layers": [{"module": f"h.{i}", "stage": s} for i, s in enumerate(stages)],
    }
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan.from_dict(data)


def test_selective_recompute_under_a_split_backward_schedule_is_refused():
    layers = (LayerPlan(module="a", stage=0, recompute="selective"),
              LayerPlan(module="b", stage=1), LayerPlan(module="c", stage=2),
              LayerPlan(module="d", stage=3))
    spec = PipelineSpec(schedule="ZBVZeroBubble", num_microbatches=2, virtual_stages=2)
    with pytest.raises(PlanError, match="'a' recomputes selectively, which schedule "
                                        "'ZBVZeroBubble' cannot run"):
        Plan(global_batch=4, mesh=Mesh(pp=2), layers=layers, pipeline=spec)
    full = tuple(replace(la, recompute="full") if la.module == "a" else la for la in layers)
    Plan(global_batch=4, mesh=Mesh(pp=2), layers=full, pipeline=spec)  # full runs there
