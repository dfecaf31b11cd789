"""Gradient clipping by the global norm: every rank returns one process's norm, for every plan.

Each case runs one forward/backward of gpt-tiny (or gpt-tiny-tied) on 2 gloo ranks under a
plan, clips to half the reference norm (so clipping acts), and compares on every rank the
returned norm and the full clipped gradients with one process doing
``torch.nn.utils.clip_grad_norm_`` on the whole batch's gradients (fp32, rtol 1e-5).
A per-rank norm (the bug this guards against: 1.40 on rank 0 and 0.56 on rank 1 on a
mixed plan) differs from the reference on at least one rank.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from test_pipeline_numerics import _full_grads
from test_runtime_numerics import (
    GPT,
    _full,
    _spec,
    gpt_all,
    gpt_mixed,
    gpt_replicate_fsdp,
    gpt_tp,
)

from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

TIED = ("gpt-tiny-tied", (), 8, 16)
TOL = dict(rtol=1e-5, atol=1e-7)


def pipeline_plan(name: str = "fsdp") -> str:
    """pp=2: the embeddings and h.0 on stage 0, h.1, ln_f and the head on stage 1; for
    gpt-tiny-tied the head's weight is a copy of wte's on the other rank."""
    stages = {"wte": 0, "wpe": 0, "h.0": 0, "h.1": 1, "ln_f": 1, "lm_head": 1}
    layers = tuple(LayerPlan(module=m, stage=s, strategy=name if m.startswith("h.") else
                             "replicate") for m, s in stages.items())
    return Plan(global_batch=8, mesh=Mesh(pp=2), layers=layers,
                pipeline=PipelineSpec(schedule="GPipe", num_microbatches=2)).to_json()


CASES = {
    "ddp": (GPT, gpt_all("replicate", dp=2)),
    "fsdp": (GPT, gpt_all("fsdp", dp=2)),
    "tp": (GPT, gpt_tp(dp=1, tp=2)),
    "replicate+fsdp": (GPT, gpt_replicate_fsdp(dp=2)),
    "mixed-tp-fsdp": (GPT, gpt_mixed(dp=1, tp=2)),
    "pp2": (GPT, pipeline_plan()),
    "pp2-tied": (TIED, pipeline_plan()),
}


@functools.cache
def reference(model: tuple, norm_type: float) -> dict:
    spec, (_, _, batch, seq) = _spec(model), model
    net = spec.build(seed=0)
    inputs, targets = spec.make_batch(batch, seq, seed=0)
    spec.loss_fn(net(*inputs), targets).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()], norm_type)
    torch.nn.utils.clip_grad_norm_(net.parameters(), float(norm) / 2, norm_type)
    grads = {n: _full(p.grad) for n, p in net.named_parameters(remove_duplicate=False)}
    return {"norm": float(norm), "grads": grads}


def clip_job(model: tuple, plan_json: str, max_norm: float, norm_type: float) -> dict:
    from autopar.lower import make_trainer

    spec, (_, _, batch, seq) = _spec(model), model
    plan = Plan.from_json(plan_json)
    trainer = make_trainer(spec.build(seed=0), plan, spec.loss_fn,
                           spec.example_inputs(batch, seq, device="meta"))
    trainer.forward_backward(*trainer.shard_batch(*spec.make_batch(batch, seq, seed=0)))
    norm = trainer.clip_grad_norm_(max_norm, norm_type)
    if plan.mesh.pp > 1:
        grads = _full_grads(trainer)
    else:
        grads = {n: _full(p.grad) for n, p in trainer.applied.model.named_parameters()}
    return {"norm": float(norm), "grads": grads}


def _check(results: list[dict], ref: dict) -> None:
    for rank, got in enumerate(results):
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5), (rank, got["norm"])
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], **TOL,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_clip_grad_norm_returns_one_process_norm_on_every_rank(pool2, case):
    model, plan_json = CASES[case]
    ref = reference(model, 2.0)
    _check(pool2.run(clip_job, model, plan_json, ref["norm"] / 2, 2.0), ref)


@pytest.mark.parametrize("case", ["mixed-tp-fsdp", "pp2-tied"])
def test_clip_grad_norm_by_the_largest_entry(pool2, case):
    model, plan_json = CASES[case]
    ref = reference(model, math.inf)
    _check(pool2.run(clip_job, model, plan_json, ref["norm"] / 2, math.inf), ref)


def test_a_tied_copy_on_another_stage_is_counted_once(pool2):
    """The head's copy of wte holds the whole tied gradient too; counting it twice would
    give sqrt(|rest|² + 2|tie|²), not the reference."""
    ref = reference(TIED, 2.0)
    tie = ref["grads"]["wte.weight"].norm().item()
    twice = math.sqrt(ref["norm"] ** 2 + tie**2)
    assert twice > ref["norm"] * (1 + 1e-3)  # the check below can tell the two apart
    results = pool2.run(clip_job, TIED, CASES["pp2-tied"][1], ref["norm"] / 2, 2.0)
    assert [r["norm"] for r in results] == pytest.approx([ref["norm"]] * 2, rel=1e-5)


def float16_job(plan_json: str, lr: float) -> dict:
    """A float16 plan with loss scaling: clip (unscales), then an SGD step."""
    from runtime.train import Trainer

    spec, (_, _, batch, seq) = _spec(GPT), GPT
    trainer = Trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn,
                      lambda params: torch.optim.SGD(params, lr=lr))
    before = trainer.full_state_dict()
    trainer.forward_backward(*trainer.shard_batch(*spec.make_batch(batch, seq, seed=0)))
    norm = trainer.clip_grad_norm_(1e9)
    grads = {n: _full(p.grad) for n, p in trainer.applied.model.named_parameters()}
    trainer.step()
    return {"norm": float(norm), "grads": grads, "before": before,
            "after": trainer.full_state_dict()}


def test_float16_clipping_sees_unscaled_gradients_and_the_step_does_not_unscale_again(pool2):
    """The loss is scaled by 2^16; the norm and the gradients after clipping are the
    unscaled ones (float16's tolerance against one float32 process), and SGD then moves
    each weight by exactly lr × that gradient (unscaling twice would move it 2^16× less)."""
    from test_runtime_dims import gpt

    lr = 0.1
    plan = gpt("fsdp", 2, param_dtype="float16", loss_scaling="dynamic")
    ref = reference(GPT, 2.0)
    for got in pool2.run(float16_job, plan, lr):
        assert got["norm"] == pytest.approx(ref["norm"], rel=2e-2)
        for name, grad in got["grads"].items():
            step = got["before"][name] - lr * grad
            torch.testing.assert_close(got["after"][name], step, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        assert got["grads"]["h.0.mlp.fc_in.weight"].abs().max() < 10
