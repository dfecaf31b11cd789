"""Pipeline plans, with every schedule, train like one process on the global batch.

The comparison is tests/runtime/test_runtime_numerics.py's (same reference, same steps, same
loss and gradient tolerances), on a 6-block gpt-tiny cut into 2, 4 or 8 stages:

- the global loss of every step:            rtol 1e-5, atol 1e-6
- all gradients after the first backward:   rtol 1e-5, atol 1e-7  (the strict check)
- all parameters after the 3 AdamW steps:   rtol 1e-5, atol 5e-5

Why parameters need atol 5e-5 here (5% of one step, lr = 1e-3) where pp = 1 needs 1e-5:
micro-batching sums the gradient in another order, and AdamW turns rounding noise on a
gradient component near zero into an update of up to lr * noise / eps. Measured: the
gradients agree to 1.5e-8, but ``h.4.mlp.fc_in.weight`` has a component of -1.37e-8
(about eps = 1e-8) that comes out as -1.47e-8 after four micro-batches, and its weight
moves 1.7e-5 differently. The gradient check is what catches real errors (a sum instead
of a mean is invisible to Adam); ``test_comparison_catches_unscaled_microbatch_gradients``
shows it failing.

Data parallelism under pipelining is FSDP2 (``runtime.pipeline``); each dp case has
sharded (``fsdp``) layers on the last stage, where a zero-bubble schedule once lost
every weight gradient of layers resharded after forward.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from reference import single_process_losses
from test_runtime_numerics import (
    BLOCK_TP,
    LR,
    STEPS,
    _full,
    _spec,
    collectives_trapped,
    reference,
)
from test_runtime_numerics import assert_matches_reference as matches_reference
from test_sequence_parallel import BLOCK_SP

from cost_models.schedule import SCHEDULES as SCHEDULE_TABLE
from runtime.plan import (
    SPLIT_BACKWARD_SCHEDULES,
    LayerPlan,
    Mesh,
    PipelineSpec,
    Plan,
    PlanError,
)

PARAM_TOL = dict(rtol=1e-5, atol=5e-5)
# (model, config overrides, global batch, seq), as in test_runtime_numerics
GPT6 = ("gpt-tiny", (("n_layer", 6),), 8, 16)
# Cut units: the embeddings stay together (so no integer tensor crosses a cut), and so do
# the final norm and head; 8 units make 2, 4 or 8 equal stages.
UNITS = [("wte", "wpe")] + [(f"h.{i}",) for i in range(6)] + [("ln_f", "lm_head")]
SHARDED = {"h.0", "h.3", "h.5", "lm_head"}


def _layer(name: str, stage: int, parallel: str) -> LayerPlan:
    if parallel == "tp+sp" and name.startswith("h."):
        return LayerPlan(module=name, stage=stage, strategy="tp", tp_styles=BLOCK_SP,
                         sequence_parallel=True)
    if parallel == "tp" and name.startswith("h."):
        strategy = "tp_fsdp" if name in SHARDED else "tp"
        return LayerPlan(module=name, stage=stage, strategy=strategy, tp_styles=BLOCK_TP)
    if parallel == "tp" and name == "wte":
        return LayerPlan(module=name, stage=stage, strategy="tp",
                         tp_styles={"": "embedding_rowwise"})
    if parallel == "tp" and name == "lm_head":
        return LayerPlan(module=name, stage=stage, strategy="tp",
                         tp_styles={"": "colwise_gather"})
    strategy = "fsdp" if name in SHARDED else "replicate"
    return LayerPlan(module=name, stage=stage, strategy=strategy)


def pipeline_plan(schedule: str, pp: int, *, dp: int = 1, tp: int = 1, m: int = 2,
                  parallel: str = "dp") -> str:
    """GPT6 on pp × dp × tp ranks; v = 2 for the interleaved and V schedules."""
    v = 2 if schedule.startswith("Interleaved") or schedule == "ZBVZeroBubble" else 1
    per = len(UNITS) // (pp * v)
    layers = [_layer(name, i // per, parallel)
              for i, unit in enumerate(UNITS) for name in unit]
    return Plan(
        global_batch=GPT6[2], mesh=Mesh(pp=pp, dp=dp, tp=tp), layers=tuple(layers),
        pipeline=PipelineSpec(schedule=schedule, num_microbatches=m, virtual_stages=v),
    ).to_json()


SCHEDULES = tuple(SCHEDULE_TABLE)


# -- jobs (run on every rank of a pool) ---------------------------------------------------


def _trainer(model: tuple, plan: Plan, scale_grads: bool = True):
    from autopar.lower import make_trainer, microbatch_inputs
    from passes.split_stages import split_stages
    from runtime.pipeline import PipelineTrainer

    spec, (_, _, batch, seq) = _spec(model), model
    net = spec.build(seed=0)
    example = spec.example_inputs(batch, seq, device="meta")

    def adamw(params):
        return torch.optim.AdamW(params, lr=LR)

    if scale_grads:
        return make_trainer(net, plan, spec.loss_fn, example, adamw)
    stages = split_stages(net, plan, microbatch_inputs(plan, example))
    return PipelineTrainer(stages, plan, spec.loss_fn, adamw, scale_grads=False)


def _full_grads(trainer) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    mine = {n: _full(p.grad) for m in trainer.stages for n, p in m.named_parameters()}
    parts: list = [None] * trainer.plan.mesh.pp
    dist.all_gather_object(parts, mine, group=trainer.mesh.get_group("pp"))
    return {n: g for part in parts for n, g in part.items()}


def pipeline_job(model: tuple, plan_json: str, scale_grads: bool = True) -> dict:
    """Train STEPS steps under the plan; return losses, first gradients, final parameters."""
    spec, (_, _, batch, seq) = _spec(model), model
    trainer = _trainer(model, Plan.from_json(plan_json), scale_grads)
    losses, grads = [], {}
    for step in range(STEPS):
        inputs, targets = trainer.shard_batch(*spec.make_batch(batch, seq, seed=step))
        losses.append(trainer.forward_backward(inputs, targets).item())
        if step == 0:
            grads = _full_grads(trainer)
        trainer.step()
    return {"losses": losses, "grads": grads, "params": trainer.full_state_dict()}


def assert_matches_reference(results: list[dict], model: tuple) -> None:
    """The pp = 1 comparison, with this file's parameter tolerance (see the docstring)."""
    matches_reference(results, model, param_tol=PARAM_TOL)


# -- numerics ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_trains_like_one_process(pool2, schedule):
    plan = pipeline_plan(schedule, pp=2, m=2)
    assert_matches_reference(pool2.run(pipeline_job, GPT6, plan), GPT6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp4_trains_like_one_process(pool4, schedule):
    plan = pipeline_plan(schedule, pp=4, m=4)
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan), GPT6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_dp2_trains_like_one_process(pool4, schedule):
    """FSDP2 replicate + shard within each stage, every schedule (DDP is never used)."""
    plan = pipeline_plan(schedule, pp=2, dp=2, m=2)
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan), GPT6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_tp2_trains_like_one_process(pool4, schedule):
    """Megatron TP blocks (tp and tp_fsdp), vocabulary-split embedding and head."""
    plan = pipeline_plan(schedule, pp=2, tp=2, m=2, parallel="tp")
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan), GPT6)


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD_SCHEDULES)
def test_pp2_tp2_sequence_parallel_under_split_backward(pool4, schedule):
    """Sequence-parallel blocks end stages and open the next: their sequence shards cross
    as DTensors (runtime.pipeline_sends.sequence_sharded_boundaries), under split backward.
    A block gathered at a stage end is tests/runtime/test_sp_stage_boundaries.py's."""
    plan = pipeline_plan(schedule, pp=2, tp=2, m=2, parallel="tp+sp")
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan), GPT6)


def test_comparison_catches_unscaled_microbatch_gradients(pool2):
    """Without torch's division by num_microbatches the gradients are the sum over
    micro-batches (2x here); Adam hides that in the parameters, the gradient check not."""
    results = pool2.run(pipeline_job, GPT6, pipeline_plan("1F1B", pp=2, m=2), False)
    with pytest.raises(AssertionError, match="grad of"):
        assert_matches_reference(results, GPT6)


def test_stages_really_split_the_model(pool4):
    """Guards the numerics above against every rank silently running the whole model."""
    counts = pool4.run(local_params_job, GPT6, pipeline_plan("ZBVZeroBubble", pp=4, m=4))
    total = sum(p.numel() for p in _spec(GPT6).build(seed=0).parameters())
    assert sum(counts) == total and max(counts) < total // 2, (counts, total)


def local_params_job(model: tuple, plan_json: str) -> int:
    trainer = _trainer(model, Plan.from_json(plan_json))
    return sum(p.numel() for m in trainer.stages for p in m.parameters())


# -- bad input: a clear PlanError, before any collective -----------------------------------


_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "new_group", "send", "recv",
                "all_gather_object", "batch_isend_irecv")


def bad_pipeline_job(model: tuple, plan_json: str) -> str:
    """make_trainer on rank 0 only, with mesh creation and c10d calls booby-trapped."""
    import torch.distributed as dist

    import runtime.pipeline
    from autopar.lower import make_trainer

    if dist.get_rank() != 0:
        return ""

    spec, (_, _, batch, seq) = _spec(model), model
    try:
        with collectives_trapped((runtime.pipeline, "build_mesh")):
            make_trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn,
                         spec.example_inputs(batch, seq, device="meta"))
    except PlanError as e:
        return f"PlanError: {e}"
    return "no error"


def _edit(plan_json: str, **changes) -> str:
    data = Plan.from_json(plan_json).to_dict()
    for key, value in changes.items():
        data[key] = value
    return Plan.from_dict(data).to_json()


def _cut_through_h3() -> str:
    """h.3 opens stage 1; plan its attention on stage 0 and its MLP on stage 1."""
    plan = Plan.from_json(pipeline_plan("GPipe", pp=2))
    layers = [dataclasses.asdict(la) for la in plan.layers]
    at = next(i for i, la in enumerate(layers) if la["module"] == "h.3")
    layers[at:at + 1] = [{"module": "h.3.attn", "stage": 0}, {"module": "h.3.mlp", "stage": 1}]
    return _edit(plan.to_json(), layers=layers)


BAD_PIPELINES = {
    "world size mismatch": (pipeline_plan("GPipe", pp=4), ["needs 4 ranks", "2 are running"]),
    "cut through a layer": (_cut_through_h3(), ["'h.3.attn' (stage 0) and 'h.3.mlp' (stage 1)",
                                                 "splits layer 'h.3'"]),
    "unknown module": (
        _edit(pipeline_plan("GPipe", pp=2), layers=[{"module": "h.9", "stage": 0},
                                                    {"module": "h.5", "stage": 1}]),
        ["layer 'h.9': no such module"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_PIPELINES))
def test_bad_pipeline_is_rejected_before_any_collective(pool2, case):
    plan_json, phrases = BAD_PIPELINES[case]
    message = pool2.run(bad_pipeline_job, GPT6, plan_json)[0]
    assert message.startswith("PlanError"), message
    for phrase in phrases:
        assert phrase in message, (phrase, message)


@pytest.mark.parametrize("pipeline, message", [
    (dict(schedule="1F1B", num_microbatches=2), "num_microbatches=2 is less than mesh.pp=4"),
    (dict(schedule="Interleaved1F1B", num_microbatches=9, virtual_stages=2),
     "needs num_microbatches to be a multiple"),
    (dict(schedule="ZBVZeroBubble", num_microbatches=4, virtual_stages=3),
     "takes virtual_stages = 2, got 3"),
    (dict(schedule="GPipe", num_microbatches=3), "not divisible by dp × num_microbatches"),
])
def test_schedule_constraints_are_plan_errors(pipeline, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict({"global_batch": 20, "mesh": {"pp": 4, "dp": 2},
                        "pipeline": pipeline, "layers": []})


def uneven_microbatch_job(model: tuple, plan_json: str) -> str:
    spec, (_, _, _, seq) = _spec(model), model
    trainer = _trainer(model, Plan.from_json(plan_json))
    try:
        trainer.train_step(*spec.make_batch(6, seq))
    except PlanError as e:
        return str(e)
    return "no error"


def test_local_batch_not_splitting_into_microbatches_is_refused(pool2):
    messages = pool2.run(uneven_microbatch_job, GPT6, pipeline_plan("GPipe", pp=2, m=4))
    assert all("6 samples does not split into pipeline.num_microbatches=4" in m
               for m in messages), messages


# -- autopar.compile and autopar run -------------------------------------------------------


def compile_job(model: tuple, plan_json: str) -> tuple[str, float]:
    import autopar

    spec, (_, _, batch, seq) = _spec(model), model
    trainer = autopar.compile(spec.build(seed=0), "local", spec.example_inputs(batch, seq),
                              loss_fn=spec.loss_fn, plan=Plan.from_json(plan_json))
    return type(trainer).__name__, trainer.train_step(*spec.make_batch(batch, seq, seed=0))


def test_compile_runs_a_pipeline_plan(pool2):
    results = pool2.run(compile_job, GPT6, pipeline_plan("ZBVZeroBubble", pp=2))
    for name, loss in results:
        assert name == "PipelineTrainer"
        assert loss == pytest.approx(reference(GPT6)["losses"][0], rel=1e-5)



def test_autopar_run_executes_a_pipeline_plan(tmp_path):
    """`autopar run --plan` on a hand-written pp=2 × dp=2 plan: the losses of one process."""
    names = ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]
    plan = Plan(global_batch=8, mesh=Mesh(pp=2, dp=2),
                pipeline=PipelineSpec(schedule="1F1B", num_microbatches=2),
                layers=tuple(LayerPlan(module=n, stage=int(i >= 3), strategy="fsdp")
                             for i, n in enumerate(names)))
    path = tmp_path / "pp2.json"
    plan.save(path)
    result = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "run", "--model", "gpt-tiny", "--nproc", "4",
         "--plan", str(path), "--steps", "2"],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines()
              if line.startswith("step")]
    assert losses == pytest.approx(single_process_losses("gpt-tiny", steps=2), rel=1e-5)


# -- process groups are made once per world -----------------------------------------------


def groups_after_pipeline_job(model: tuple, plan_json: str) -> int:
    """Process groups this rank holds after one more pipeline job (torch's group registry:
    every group made and not destroyed)."""
    import torch.distributed.distributed_c10d as c10d

    pipeline_job(model, plan_json)
    return len(c10d._world.pg_map)


def test_a_repeated_pipeline_plan_makes_no_new_process_groups(pool2):
    """Ranks that train plan after plan (a long-lived pool, a notebook) keep their groups:
    a pipeline stage's sub-meshes are cached by ranks, not by the mesh object slicing makes
    anew each time. Each leaked gloo group keeps threads polling its sockets."""
    plan = pipeline_plan("1F1B", pp=2, m=2)
    first = pool2.run(groups_after_pipeline_job, GPT6, plan)
    assert pool2.run(groups_after_pipeline_job, GPT6, plan) == first
