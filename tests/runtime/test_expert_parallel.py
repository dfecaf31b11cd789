"""Expert parallelism on 2 and 4 gloo ranks trains like one process on the global batch.

Each case trains a seeded MoE model (the zoo's moe-tiny, and an HF Mixtral from a small
config) for 3 AdamW steps (float32) under a plan whose MoE layers have expert_parallel =
ep, and compares on every rank with one process on the same global batches: the loss of
every step, every gradient after the first backward (the check that catches a gradient
reduced over the wrong ranks or divided by the wrong count: Adam hides a scale error in
the parameters) and every parameter after 3 steps, the experts' as the global [E, ...]
DTensors the runtime makes of each rank's E / ep. Tolerances as
tests/test_runtime_numerics.py, whose docstring explains them.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import full_tensor, train_one_process
from test_runtime_numerics import (  # one process's comparison: steps, rate, tolerances
    GRAD_TOL,
    LOSS_TOL,
    LR,
    PARAM_TOL,
    STEPS,
    ZERO_GRAD_PARAM_TOL,
)

from autopar.zoo import get_model
from runtime.plan import LayerPlan, Mesh, Plan, PlanError

BATCH, SEQ, VOCAB = 8, 16, 128


# -- models: (build, batch, loss) ---------------------------------------------------------


def _mixtral() -> nn.Module:
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def _build(name: str) -> nn.Module:
    return get_model("moe-tiny").build(seed=0) if name == "moe-tiny" else _mixtral()


def _batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(step))
    return (tokens[:, :-1],), tokens[:, 1:]


def _loss(out, targets: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _layers(name: str) -> tuple[tuple[str, bool], ...]:
    """(module, holds experts) of each planned layer."""
    if name == "moe-tiny":
        return (("wte", False), ("wpe", False), ("h.0", True), ("h.1", True),
                ("ln_f", False), ("lm_head", False))
    return (("model.embed_tokens", False), ("model.layers.0", True), ("model.layers.1", True),
            ("model.norm", False), ("lm_head", False))


ATTENTION_TP = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                "attn.out_proj": "rowwise"}
"""moe-tiny's attention split over tp; the MoE block stays whole on every tp rank."""


def plan_json(name: str, strategy: str, dp: int, ep: int, tp: int = 1,
              accumulation: int = 1, recompute: str = "none") -> str:
    def layer(module: str, moe: bool) -> LayerPlan:
        if not moe:
            return LayerPlan(module=module, strategy="fsdp" if strategy == "tp_fsdp"
                             else "replicate" if strategy == "tp" else strategy)
        styles = ATTENTION_TP if strategy in ("tp", "tp_fsdp") else {}
        return LayerPlan(module=module, strategy=strategy, tp_styles=styles,
                         expert_parallel=ep, recompute=recompute)

    layers = tuple(layer(m, moe) for m, moe in _layers(name))
    return Plan(global_batch=BATCH, mesh=Mesh(dp=dp, tp=tp), layers=layers,
                gradient_accumulation=accumulation).to_json()


# -- the job on every rank, and the one-process reference ---------------------------------


def train_job(name: str, plan_text: str) -> dict:
    from runtime.moe_blocks import find_moe_blocks
    from runtime.train import Trainer

    plan = Plan.from_json(plan_text)
    model = _build(name)
    blocks = find_moe_blocks(model)
    trainer = Trainer(model, plan, _loss, lambda ps: torch.optim.AdamW(ps, lr=LR))
    losses, grads = [], {}
    for step in range(STEPS):
        inputs, targets = trainer.shard_batch(*_batch(step))
        losses.append(trainer.forward_backward(inputs, targets).item())
        if step == 0:
            grads = {n: full_tensor(p.grad) for n, p in trainer.applied.model.named_parameters()
                     if p.grad is not None}
        trainer.step()
    local = [trainer.applied.model.get_submodule(b.experts).num_experts for b in blocks]
    return {"losses": losses, "grads": grads, "params": trainer.full_state_dict(),
            "local_experts": local}


@functools.cache
def reference(name: str) -> dict:
    return train_one_process(_build(name), lambda m, step: _loss(m(*_batch(step)[0]),
                                                                 _batch(step)[1]),
                             steps=STEPS, lr=LR)


def _close(got, want, tol: dict, label: str) -> None:
    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


def assert_matches_reference(results: list[dict], name: str, ep: int) -> None:
    ref = reference(name)
    for rank, got in enumerate(results):
        assert got["local_experts"] == [4 // ep] * 2, f"rank {rank} holds all experts"
        _close(got["losses"], ref["losses"], LOSS_TOL, f"rank {rank} losses")
        assert got["grads"].keys() == ref["grads"].keys(), f"rank {rank} gradient names"
        for key, want in ref["grads"].items():
            _close(got["grads"][key], want, GRAD_TOL, f"rank {rank} grad of {key}")
        for key, want in ref["params"].items():
            tol = ZERO_GRAD_PARAM_TOL if key.endswith("k_proj.bias") else PARAM_TOL
            _close(got["params"][key], want, tol, f"rank {rank} param {key}")


# -- numerics -------------------------------------------------------------------------------

CASES_2 = [(name, strategy) for name in ("moe-tiny", "mixtral")
           for strategy in ("replicate", "fsdp")]


@pytest.mark.parametrize("name, strategy", CASES_2, ids=[f"{n}-{s}" for n, s in CASES_2])
def test_ep2_on_2_ranks_matches_one_process(pool2, name, strategy):
    assert_matches_reference(pool2.run(train_job, name, plan_json(name, strategy, 2, 2)), name, 2)


@pytest.mark.parametrize("strategy", ["replicate", "zero2", "fsdp"])
def test_ep2_with_2_micro_batches_matches_one_process(pool2, strategy):
    plan = plan_json("moe-tiny", strategy, 2, 2, accumulation=2)
    assert_matches_reference(pool2.run(train_job, "moe-tiny", plan), "moe-tiny", 2)


@pytest.mark.parametrize("strategy, recompute", [("replicate", "full"), ("fsdp", "full"),
                                                 ("fsdp", "selective")])
def test_ep2_with_recompute_matches_one_process(pool2, strategy, recompute):
    """The recomputed forward repeats the all-to-alls, in the same order on every rank."""
    plan = plan_json("moe-tiny", strategy, 2, 2, recompute=recompute)
    assert_matches_reference(pool2.run(train_job, "moe-tiny", plan), "moe-tiny", 2)


CASES_4 = [("moe-tiny", "replicate", 2), ("moe-tiny", "fsdp", 2), ("moe-tiny", "zero2", 4),
           ("mixtral", "fsdp", 2)]


@pytest.mark.parametrize("name, strategy, ep", CASES_4,
                         ids=[f"{n}-{s}-ep{e}" for n, s, e in CASES_4])
def test_ep_on_4_ranks_matches_one_process(pool4, name, strategy, ep):
    """ep = 2 of dp = 4: each expert lives on 2 ranks, whose gradients are summed."""
    assert_matches_reference(pool4.run(train_job, name, plan_json(name, strategy, 4, ep)),
                             name, ep)


# -- refusals, before any collective -----------------------------------------------------


def _moe_plan(dp: int, tp: int = 1, hsdp: int | None = None, **layer: object) -> Plan:
    fields = dict(module="h.0", strategy="fsdp", expert_parallel=2) | layer
    return Plan(global_batch=12, mesh=Mesh(dp=dp, tp=tp), layers=(LayerPlan(**fields),),
                hsdp_shard_size=hsdp)


@pytest.mark.parametrize("plan, message", [
    (_moe_plan(2, module="wte"), "no mixture-of-experts block"),
    (_moe_plan(3, expert_parallel=3), "has 4 experts, not divisible by 3"),
    (_moe_plan(2, tp=2, strategy="tp", tp_styles={"attn.q_proj": "colwise", "ln_1": "sequence_parallel"},
               sequence_parallel=True),
     "sequence parallelism"),
    (_moe_plan(2, offload=True), "offload does not combine"),
    (_moe_plan(4, hsdp=2, strategy="hsdp"), "strategy 'hsdp' does not combine"),
], ids=["dense-layer", "indivisible", "sequence-parallel", "offload", "hsdp"])
def test_plans_the_runtime_cannot_run_are_refused_by_check_plan(plan, message):
    from runtime.validate import check_plan

    with pytest.raises(PlanError, match=message) as info:
        check_plan(get_model("moe-tiny").build("meta"), plan)
    assert "layer 'h.0'" in str(info.value) or "layer 'wte'" in str(info.value)


def validate_meta_job() -> str:
    from runtime.apply import validate_plan

    try:
        validate_plan(get_model("moe-tiny").build("meta"), _moe_plan(2))
    except PlanError as e:
        return str(e)
    return "accepted"


def test_a_model_on_meta_is_refused_before_any_collective(pool2):
    assert all("real weights" in text for text in pool2.run(validate_meta_job))


CASES_TP = [("fsdp", 2), ("replicate", 2), ("tp", 2), ("tp_fsdp", 2)]


@pytest.mark.parametrize("strategy, ep", CASES_TP, ids=[f"{s}-ep{e}" for s, e in CASES_TP])
def test_ep_on_a_dp2_tp2_mesh_matches_one_process(pool4, strategy, ep):
    """Experts replicated over tp (every tp rank routes the same tokens), split over dp."""
    plan = plan_json("moe-tiny", strategy, 2, ep, tp=2)
    assert_matches_reference(pool4.run(train_job, "moe-tiny", plan), "moe-tiny", ep)


def clip_job(plan_text: str, max_norm: float) -> dict:
    from runtime.train import Trainer

    trainer = Trainer(_build("moe-tiny"), Plan.from_json(plan_text), _loss)
    trainer.forward_backward(*trainer.shard_batch(*_batch(0)))
    norm = trainer.clip_grad_norm_(max_norm)
    return {"norm": float(norm), "grads": {n: full_tensor(p.grad) for n, p in
                                           trainer.applied.model.named_parameters()}}


def test_clip_grad_norm_counts_every_expert_once(pool4):
    """The norm is one process's (an expert counted once, not once per replica or
    missing on the ranks that do not hold it), and clipping scales every gradient alike."""
    net = _build("moe-tiny")
    _loss(net(*_batch(0)[0]), _batch(0)[1]).backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()]))
    torch.nn.utils.clip_grad_norm_(net.parameters(), norm / 2)
    for got in pool4.run(clip_job, plan_json("moe-tiny", "fsdp", 4, 2), norm / 2):
        assert got["norm"] == pytest.approx(norm, rel=1e-5)
        for name, p in net.named_parameters():
            _close(got["grads"][name], p.grad, GRAD_TOL, f"clipped grad of {name}")
