"""Every strategy, on 2 and 4 gloo ranks, trains like one process on the global batch.

Each case trains a seeded zoo model for 3 AdamW steps (fp32) under a plan and compares,
on every rank, with one process training the same model on the same global batches:

- the global loss of every step:            rtol 1e-5, atol 1e-6
- all gradients after the first backward:   rtol 1e-5, atol 1e-7  (the strict check)
- all parameters after the 3 steps:         rtol 1e-5, atol 1e-5

Why parameters need atol 1e-5 (1% of one step, lr = 1e-3): AdamW's update
lr * m / (sqrt(v) + eps) normalises the gradient, so a gradient component near zero turns
its rounding noise into an update of up to lr * noise / eps. Measured here: gradients agree
to 6e-8, but a few weights with cancelling gradients move by up to 2e-6 differently. The
attention key bias is the extreme case: its exact gradient is zero (softmax is invariant
to adding q.b_k to every score of a row), so it holds pure noise amplified to ~1e-5; it
is compared at atol 1e-4 and carries no information. Adam is also invariant to a
gradient's scale, so a sum-instead-of-mean bug shows only in the gradient check, which
is why that check exists.

All jobs run on two session-wide pools of ranks (tests/dist_pool.py).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.zoo import get_model
from runtime.plan import LayerPlan, Mesh, Plan, PlanError

STEPS = 3
LR = 1e-3
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
ZERO_GRAD_PARAM_TOL = dict(rtol=1e-5, atol=1e-4)
# (model, config overrides, global batch, seq)
GPT = ("gpt-tiny", (), 8, 16)
MLP = ("mlp", (("n_layer", 2), ("d_in", 32), ("d_model", 64), ("n_classes", 8)), 16, None)

BLOCK_TP = {
    "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
    "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise",
}
MLP_TP = {"mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}


# -- plans ---------------------------------------------------------------------------------


def _plan(dp: int, tp: int, batch: int, *layers: LayerPlan) -> str:
    return Plan(global_batch=batch, mesh=Mesh(dp=dp, tp=tp), layers=layers).to_json()


def gpt_all(strategy: str, dp: int, tp: int = 1) -> str:
    names = ("wte", "wpe", "h.0", "h.1", "ln_f", "lm_head")
    return _plan(dp, tp, GPT[2], *(LayerPlan(module=n, strategy=strategy) for n in names))


def gpt_tp(dp: int, tp: int) -> str:
    """Every block, the embedding and the head tensor-parallel; the rest replicated."""
    return _plan(
        dp, tp, GPT[2],
        LayerPlan(module="wte", strategy="tp", tp_styles={"": "embedding_rowwise"}),
        LayerPlan(module="wpe", strategy="replicate"),
        LayerPlan(module="h.0", strategy="tp", tp_styles=BLOCK_TP),
        LayerPlan(module="h.1", strategy="tp", tp_styles=BLOCK_TP),
        LayerPlan(module="ln_f", strategy="replicate"),
        LayerPlan(module="lm_head", strategy="tp", tp_styles={"": "colwise_gather"}),
    )


def gpt_mixed(dp: int, tp: int) -> str:
    """One strategy per layer; wpe is left out of the plan (replicated by the root)."""
    return _plan(
        dp, tp, GPT[2],
        LayerPlan(module="wte", strategy="tp", tp_styles={"": "embedding_rowwise"}),
        LayerPlan(module="h.0", strategy="tp_fsdp", tp_styles=BLOCK_TP),
        LayerPlan(module="h.1", strategy="fsdp"),
        LayerPlan(module="ln_f", strategy="replicate"),
        LayerPlan(module="lm_head", strategy="tp", tp_styles={"": "colwise_gather"}),
    )


def gpt_replicate_fsdp(dp: int) -> str:
    """Data parallelism only, mixed per layer (FSDP2 replicate + shard, no DDP)."""
    return _plan(
        dp, 1, GPT[2],
        LayerPlan(module="h.0", strategy="fsdp"),
        LayerPlan(module="h.1", strategy="replicate"),
        LayerPlan(module="lm_head", strategy="fsdp"),
    )


def mlp_mixed(dp: int, tp: int) -> str:
    return _plan(
        dp, tp, MLP[2],
        LayerPlan(module="blocks.0", strategy="tp_fsdp" if dp > 1 else "tp", tp_styles=MLP_TP),
        LayerPlan(module="blocks.1", strategy="fsdp"),
        LayerPlan(module="head", strategy="replicate"),
    )


def mlp_all(strategy: str, dp: int) -> str:
    names = ("proj_in", "blocks.0", "blocks.1", "head")
    return _plan(dp, 1, MLP[2], *(LayerPlan(module=n, strategy=strategy) for n in names))


# -- jobs (run on every rank of a pool) and the one-process reference --------------------


def _spec(model: tuple):
    name, overrides, _, _ = model
    spec = get_model(name)
    return spec.with_config(**dict(overrides)) if overrides else spec


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu().clone()


def train_job(model: tuple, plan_json: str, loss_scale: float = 1.0) -> dict:
    """Train STEPS steps under the plan; return losses, first gradients, final parameters."""
    from runtime.train import Trainer

    spec, (_, _, batch, seq) = _spec(model), model
    plan = Plan.from_json(plan_json)
    trainer = Trainer(
        spec.build(seed=0), plan, lambda out, y: spec.loss_fn(out, y) * loss_scale,
        lambda params: torch.optim.AdamW(params, lr=LR),
    )
    losses, grads = [], {}
    for step in range(STEPS):
        inputs, targets = trainer.shard_batch(*spec.make_batch(batch, seq, seed=step))
        losses.append(trainer.forward_backward(inputs, targets).item() / loss_scale)
        if step == 0:
            grads = {n: _full(p.grad) for n, p in trainer.applied.model.named_parameters()}
        trainer.step()
    return {"losses": losses, "grads": grads, "params": trainer.full_state_dict()}


@functools.cache
def reference(model: tuple) -> dict:
    spec, (_, _, batch, seq) = _spec(model), model
    net = spec.build(seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        inputs, targets = spec.make_batch(batch, seq, seed=step)
        loss = spec.loss_fn(net(*inputs), targets)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: _full(p.grad) for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": {n: _full(p) for n, p in net.named_parameters()}}


def _close(got, want, tol: dict, label: str) -> None:
    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


def assert_matches_reference(results: list[dict], model: tuple, *,
                             param_tol: dict = PARAM_TOL) -> None:
    """Every rank's losses, first gradients and final parameters against one process."""
    ref = reference(model)
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], LOSS_TOL, f"rank {rank} losses")
        assert got["params"].keys() == ref["params"].keys(), f"rank {rank} parameter names"
        assert got["grads"].keys() == ref["grads"].keys(), f"rank {rank} gradient names"
        for name, want in ref["grads"].items():
            _close(got["grads"][name], want, GRAD_TOL, f"rank {rank} grad of {name}")
        for name, want in ref["params"].items():
            tol = ZERO_GRAD_PARAM_TOL if name.endswith("k_proj.bias") else param_tol
            _close(got["params"][name], want, tol, f"rank {rank} param {name}")


# -- numerics ------------------------------------------------------------------------------

CASES_2 = {
    "gpt-ddp": (GPT, gpt_all("replicate", dp=2)),
    "gpt-fsdp": (GPT, gpt_all("fsdp", dp=2)),
    "gpt-fsdp_modules": (GPT, gpt_all("fsdp_modules", dp=2)),
    "gpt-tp2": (GPT, gpt_tp(dp=1, tp=2)),
    "gpt-replicate+fsdp": (GPT, gpt_replicate_fsdp(dp=2)),
    "gpt-mixed-1x2": (GPT, gpt_mixed(dp=1, tp=2)),
    "mlp-fsdp": (MLP, mlp_all("fsdp", dp=2)),
    "mlp-mixed-1x2": (MLP, mlp_mixed(dp=1, tp=2)),
}
CASES_4 = {
    "gpt-ddp": (GPT, gpt_all("replicate", dp=4)),
    "gpt-ddp-redundant-tp": (GPT, gpt_all("replicate", dp=2, tp=2)),
    "gpt-fsdp": (GPT, gpt_all("fsdp", dp=4)),
    "gpt-tp4": (GPT, gpt_tp(dp=1, tp=4)),
    "gpt-tp2-dp2": (GPT, gpt_tp(dp=2, tp=2)),
    "gpt-mixed-2x2": (GPT, gpt_mixed(dp=2, tp=2)),
    "mlp-ddp": (MLP, mlp_all("replicate", dp=4)),
    "mlp-mixed-2x2": (MLP, mlp_mixed(dp=2, tp=2)),
}


@pytest.mark.parametrize("case", list(CASES_2))
def test_two_ranks_train_like_one_process(pool2, case):
    model, plan = CASES_2[case]
    assert_matches_reference(pool2.run(train_job, model, plan), model)


@pytest.mark.parametrize("case", list(CASES_4))
def test_four_ranks_train_like_one_process(pool4, case):
    model, plan = CASES_4[case]
    assert_matches_reference(pool4.run(train_job, model, plan), model)


def test_comparison_catches_unaveraged_gradients(pool2):
    """A sum-instead-of-mean bug (gradients 2x) leaves Adam's steps almost unchanged; the
    gradient check must still catch it, or the tests above could not fail."""
    results = pool2.run(train_job, GPT, gpt_all("fsdp", dp=2), 2.0)
    with pytest.raises(AssertionError, match="grad of"):
        assert_matches_reference(results, GPT)


def test_comparison_catches_missing_gradient_reduction(pool2):
    """Each rank stepping on its own half-batch gradients must fail the comparison."""
    bad = pool2.run(local_only_job, GPT)
    with pytest.raises(AssertionError):
        assert_matches_reference(bad, GPT)


def local_only_job(model: tuple) -> dict:
    """Like train_job under DDP, but inside no_sync: gradients are never all-reduced."""
    import torch.distributed as dist

    spec, (_, _, batch, seq) = _spec(model), model
    net = nn.parallel.DistributedDataParallel(spec.build(seed=0))
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, grads = [], {}
    for step in range(STEPS):
        inputs, targets = spec.make_batch(batch, seq, seed=step)
        local = slice(rank * batch // world, (rank + 1) * batch // world)
        with net.no_sync():
            loss = spec.loss_fn(net(inputs[0][local]), targets[local])
            loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: _full(p.grad) for n, p in net.module.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: _full(p) for n, p in net.module.named_parameters()}}


def test_strategies_really_shard(pool4):
    """Guards the numerics above against a plan silently applied as plain replication."""
    def local_numel(plan_json: str) -> list[int]:
        return pool4.run(local_numel_job, GPT, plan_json)

    total = sum(p.numel() for p in _spec(GPT).build(seed=0).parameters())
    assert local_numel(gpt_all("replicate", dp=4)) == [total] * 4
    fsdp = local_numel(gpt_all("fsdp", dp=4))
    assert all(n <= total // 4 + 64 for n in fsdp), (fsdp, total)
    tp4 = local_numel(gpt_tp(dp=1, tp=4))
    assert all(n < total // 2 for n in tp4), (tp4, total)


def test_fsdp_modules_makes_each_weight_matrix_a_unit(pool2):
    """``fsdp_modules`` shards each Linear of a block as an FSDP2 unit of its own and the
    block as one more (its norms); ``fsdp`` the block alone. A plan-file mistake that
    silently gave 'fsdp' would still pass the numerics above."""
    linears = [f"h.0.{m}" for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj",
                                    "attn.out_proj", "mlp.fc_in", "mlp.fc_out")]
    assert pool2.run(fsdp_units_job, GPT, gpt_all("fsdp_modules", dp=2))[0] == sorted(
        [*linears, "h.0"])
    assert pool2.run(fsdp_units_job, GPT, gpt_all("fsdp", dp=2))[0] == ["h.0"]


def fsdp_units_job(model: tuple, plan_json: str) -> list[str]:
    """The FSDP2 units at or under h.0, sorted by name."""
    from torch.distributed.fsdp import FSDPModule

    from runtime.apply import apply_plan

    net = apply_plan(_spec(model).build(seed=0), Plan.from_json(plan_json))
    return sorted(f"h.0.{n}".rstrip(".") for n, m in net.get_submodule("h.0").named_modules()
                  if isinstance(m, FSDPModule))


def local_numel_job(model: tuple, plan_json: str) -> int:
    from runtime.apply import apply_plan

    net = apply_plan(_spec(model).build(seed=0), Plan.from_json(plan_json))
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in net.parameters()
    )


# -- bad plans: a clear PlanError, raised before any collective ----------------------------


_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "new_group", "reduce_scatter")


@contextlib.contextmanager
def collectives_trapped(*extra: tuple[object, str]):
    """Every way into a collective raises while inside: the usual c10d calls and the
    given (module, name) entry points such as mesh creation."""
    import torch.distributed as dist

    def trap(*args, **kwargs):
        raise AssertionError("a collective ran before the plan was validated")

    targets = list(extra) + [(dist, name) for name in _COLLECTIVES]
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    try:
        for mod, name in targets:
            setattr(mod, name, trap)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def bad_plan_job(model: tuple, plan_json: str) -> str:
    """Apply on rank 0 only, with every way into a collective booby-trapped. (Anything
    unpatched would hang rank 0, whose peers take no part, until the process-group
    timeout, failing the test too.)"""
    import torch.distributed as dist

    import runtime.apply
    from runtime.apply import apply_plan

    if dist.get_rank() != 0:
        return ""
    spec = _spec(model)
    net = spec.build("meta" if plan_json.endswith("#meta") else "cpu", seed=0)
    if plan_json.endswith("#meta"):
        net.init_weights = None  # a model that cannot initialise its mask buffer
    try:
        with collectives_trapped((runtime.apply, "build_mesh")):
            apply_plan(net, Plan.from_json(plan_json.removesuffix("#meta")))
    except PlanError as e:
        return f"PlanError: {e}"
    return "no error"


BAD_PLANS = {
    "unknown module": (
        GPT, _plan(2, 1, 8, LayerPlan(module="h.7", strategy="fsdp")),
        ["'h.7'", "no such module", "named_modules"],
    ),
    "tp style on a LayerNorm": (
        GPT, _plan(1, 2, 8, LayerPlan(module="h.0", strategy="tp", tp_styles={"ln_1": "colwise"})),
        ["'h.0'", "'h.0.ln_1' is a LayerNorm", "nn.Linear"],
    ),
    "tp style on a missing submodule": (
        GPT, _plan(1, 2, 8, LayerPlan(module="h.0", strategy="tp", tp_styles={"attn.qkv": "colwise"})),
        ["'h.0.attn.qkv'", "no submodule"],
    ),
    "embedding style on a Linear": (
        GPT, _plan(1, 2, 8, LayerPlan(module="lm_head", strategy="tp",
                                      tp_styles={"": "embedding_rowwise"})),
        ["'lm_head' is a Linear", "nn.Embedding"],
    ),
    "tp degree not dividing heads": (
        ("gpt-tiny", (("n_embd", 48), ("n_head", 3)), 8, 16),
        _plan(1, 2, 8, LayerPlan(module="h.0", strategy="tp", tp_styles=BLOCK_TP)),
        ["'h.0'", "attn.q_proj", "3 heads", "tp=2"],
    ),
    "tp degree not dividing a dim": (
        ("mlp", (("n_classes", 15),), 16, None),
        _plan(1, 2, 16, LayerPlan(module="head", strategy="tp", tp_styles={"": "colwise_gather"})),
        ["'head'", "out_features=15", "tp=2"],
    ),
    "world size mismatch": (
        GPT, _plan(4, 1, 8), ["needs 4 ranks", "2 are running"],
    ),
    "nested layers": (
        GPT, _plan(2, 1, 8, LayerPlan(module="h.0", strategy="fsdp"),
                   LayerPlan(module="h.0.mlp", strategy="replicate")),
        ["'h.0' and 'h.0.mlp' nest"],
    ),
    "meta buffer without initialisation": (
        ("gpt-tiny", (("attention", "unfused"),), 8, 16), _plan(2, 1, 8) + "#meta",
        ["'h.0.attn' (CausalSelfAttention) holds 'future' on the meta device", "init_weights()"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_is_rejected_before_any_collective(pool2, case):
    model, plan_json, phrases = BAD_PLANS[case]
    message = pool2.run(bad_plan_job, model, plan_json)[0]
    assert message.startswith("PlanError"), message
    for phrase in phrases:
        assert phrase in message, (phrase, message)


def test_plan_rejects_global_batch_not_divisible_by_dp():
    with pytest.raises(PlanError, match="global_batch 7 is not divisible.*mesh.dp=2"):
        Plan(global_batch=7, mesh=Mesh(dp=2))


def uneven_batch_job(model: tuple, plan_json: str) -> str:
    from runtime.train import Trainer

    spec = _spec(model)
    trainer = Trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn)
    try:
        trainer.shard_batch(*spec.make_batch(7, 16))
    except PlanError as e:
        return str(e)
    return "no error"


def test_shard_batch_rejects_batch_not_divisible_by_dp(pool2):
    messages = pool2.run(uneven_batch_job, GPT, gpt_all("replicate", dp=2))
    assert all("batch of 7 samples is not divisible" in m and "dp=2" in m for m in messages)


# -- the harness and the launcher ----------------------------------------------------------


def rank_job(fail_rank: int | None = None) -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == fail_rank:
        raise ValueError(f"boom on {rank}")
    if fail_rank is not None:
        dist.barrier()  # the healthy ranks wait for the failed one: a would-be hang
    return rank * 10


def test_pool_reports_the_failing_rank_and_recovers(pool2):
    import time

    from dist_pool import DistJobError

    start = time.monotonic()
    with pytest.raises(DistJobError, match=r"(?s)rank 0 ---\nno result; probably stuck.*rank 1 ---\nValueError: boom on 1"):
        pool2.run(rank_job, 1)
    assert time.monotonic() - start < 20  # rank 0 is stuck in a barrier; we did not wait for it
    assert pool2.run(rank_job) == [0, 10]  # a fresh pool took over


def test_spawn_returns_results_by_rank_and_names_a_failing_rank():
    from runtime.launch import LaunchError, spawn

    assert spawn(rank_job, 2) == [0, 10]
    with pytest.raises(LaunchError, match=r"(?s)rank 0 of 2 failed: ValueError: boom on 0"):
        spawn(rank_job, 2, 0, timeout_s=20)
