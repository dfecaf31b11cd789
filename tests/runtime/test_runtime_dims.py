"""Recompute, ZeRO-1/2, HSDP, offload, gradient accumulation and mixed precision, on 2 and
4 gloo ranks, train like one process on the global batch.

float32 cases use tests/runtime/test_runtime_numerics.py's comparison (3 AdamW steps; losses rtol
1e-5, first gradients rtol 1e-5 / atol 1e-7, parameters rtol 1e-5 / atol 1e-5, same
reference). Gradients are read after the whole step's micro-batches, so accumulation is
checked against one backward on the full batch.

Low precision is compared with one process that casts as the runtime does
(``reference.mixed_precision_reference``: a param_dtype copy of the float32 master
weights runs the whole batch, output cast to float32 for the loss, gradients cast to
float32 for AdamW). The difference left is where the rounding happens: each rank rounds
the gradient of its half batch to param_dtype, one process the gradient of the whole
batch, and reduce_dtype = param_dtype rounds the sum once more. Measured on gpt-tiny and
the MLP (largest over the cases below), with the bound used about 1.5-2x above it:

                        measured   bound      (grads: |diff| / the parameter's max |grad|)
    bfloat16 loss       2.8e-4     rtol 6e-4
    bfloat16 grads      4.1e-2     6e-2       LayerNorm biases: sums over all tokens that
                                              cancel, so a few bf16 ulps of each partial
                                              sum are a few % of the result
    float16 loss        1.1e-5     rtol 3e-5
    float16 grads       1.1e-2     2e-2
    parameters          4.4e-3     atol 6e-3  AdamW moves each weight by about lr = 1e-3 per
                                              step whatever the gradient's size, so a
                                              near-zero gradient whose sign the rounding
                                              flips moves up to 2 x 3 steps x lr apart;
                                              the gradient checks are the informative ones

Against float32 (how far the precision moves training, not a runtime check): the first
step's loss and gradients, from identical weights. Measured: loss 1.8e-4 (bf16) and
1.7e-5 (fp16) relative; gradients 1.9e-2 (bf16) and 1.2e-2 (fp16) of the max. Bounds:
loss rtol 5e-4 / 5e-5, gradients 3e-2 / 2.5e-2. The k_proj bias (exact gradient zero,
see tests/runtime/test_runtime_numerics.py) holds only noise and is left out of the low-precision
gradient checks.

All jobs run on the session-wide pools of ranks (tests/dist_pool.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from reference import mixed_precision_reference
from test_runtime_numerics import (
    BLOCK_TP,
    GPT,
    LR,
    MLP,
    STEPS,
    _close,
    _full,
    _spec,
    assert_matches_reference,
    reference,
)
from torch.distributed.tensor import DTensor

from runtime.plan import LayerPlan, Mesh, Plan, PlanError

GPT_NAMES = ("wte", "wpe", "h.0", "h.1", "ln_f", "lm_head")
MLP_NAMES = ("proj_in", "blocks.0", "blocks.1", "head")
LOW = {  # dtype -> (loss rtol, grad atol as a fraction of max |grad|, param atol)
    "bfloat16": (6e-4, 6e-2, 6e-3),
    "float16": (3e-5, 2e-2, 6e-3),
}
VS_FP32 = {"bfloat16": (5e-4, 3e-2), "float16": (5e-5, 2.5e-2)}  # first loss rtol, grad frac


# -- plans ---------------------------------------------------------------------------------


def _plan(dp: int, tp: int, batch: int, layers, **fields) -> str:
    return Plan(global_batch=batch, mesh=Mesh(dp=dp, tp=tp), layers=tuple(layers),
                **fields).to_json()


def gpt(strategy: str, dp: int, *, recompute: str = "none", offload: bool = False,
        tp: int = 1, **fields) -> str:
    """Every layer ``strategy``; the blocks also recompute and offload as asked."""
    def layer(name: str) -> LayerPlan:
        block = name.startswith("h.")
        return LayerPlan(module=name, strategy=strategy,
                         recompute=recompute if block else "none", offload=offload and block)
    return _plan(dp, tp, GPT[2], map(layer, GPT_NAMES), **fields)


def gpt_tp(dp: int, tp: int, *, recompute: str, block: str = "tp", offload: bool = False,
           **fields) -> str:
    """Megatron blocks (recomputed as asked), vocabulary-split embedding and head."""
    return _plan(dp, tp, GPT[2], [
        LayerPlan(module="wte", strategy="tp", tp_styles={"": "embedding_rowwise"}),
        LayerPlan(module="wpe", strategy="replicate"),
        *(LayerPlan(module=f"h.{i}", strategy=block, tp_styles=BLOCK_TP, recompute=recompute,
                    offload=offload) for i in range(2)),
        LayerPlan(module="ln_f", strategy="zero2"),
        LayerPlan(module="lm_head", strategy="tp", tp_styles={"": "colwise_gather"}),
    ], **fields)


def mlp_mixed(dp: int, **fields) -> str:
    """One dimension per layer: zero1, offloaded fsdp with full recompute, zero2, replicate."""
    return _plan(dp, 1, MLP[2], [
        LayerPlan(module="proj_in", strategy="zero1"),
        LayerPlan(module="blocks.0", strategy="fsdp", offload=True, recompute="full"),
        LayerPlan(module="blocks.1", strategy="zero2", recompute="selective"),
        LayerPlan(module="head", strategy="replicate"),
    ], **fields)


# -- the job (run on every rank) -----------------------------------------------------------


def _trainer(model: tuple, plan: Plan, scales: dict | None):
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from runtime.train import Trainer

    spec = _spec(model)
    trainer = Trainer(spec.build(seed=0), plan, spec.loss_fn,
                      lambda params: torch.optim.AdamW(params, lr=LR))
    if scales:  # the test's own starting scale, to force an overflow
        trainer.loss_scaler = ShardedGradScaler(device="cpu", init_scale=scales[0],
                                                process_group=dist.group.WORLD)
    return trainer


def _inject_inf(trainer, name: str) -> None:
    """Set the first element of ``name``'s gradient to inf on rank 0 only: in its shard."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        grad = dict(trainer.applied.model.named_parameters())[name].grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")


def dims_job(model: tuple, plan_json: str, scales: dict | None = None,
             inf_grads: dict | None = None, observe: bool = False) -> dict:
    """Train STEPS steps; return losses, every step's unscaled gradients, each step's
    loss scale, final parameters, and (``observe``) what step 0's micro-batches saw."""
    spec, (_, _, batch, seq) = _spec(model), model
    trainer = _trainer(model, Plan.from_json(plan_json), scales)
    seen, hook = _observe(trainer) if observe else (None, None)
    out: dict = {"losses": [], "grads": [], "scales": [], "seen": seen, "watched": []}
    for step in range(STEPS):
        if scales and step and step in scales:
            trainer.loss_scaler.update(new_scale=scales[step])
        inputs, targets = trainer.shard_batch(*spec.make_batch(batch, seq, seed=step))
        out["losses"].append(trainer.forward_backward(inputs, targets).item())
        scale = trainer.loss_scaler.get_scale() if trainer.loss_scaler else 1.0
        out["scales"].append(scale)
        out["grads"].append({n: _full(p.grad) / scale
                             for n, p in trainer.applied.model.named_parameters()})
        if hook is not None and step == 0:
            seen.append(("after backward", _state(trainer)))
            hook.remove()
        if inf_grads and step in inf_grads:
            _inject_inf(trainer, inf_grads[step])
        trainer.step()
        out["watched"].append(_full(_watched(trainer)))
    out["params"] = trainer.full_state_dict()
    return out


def _watched(trainer) -> torch.Tensor:
    """The first block's fc_in weight, whose state the observations report."""
    root = trainer.applied.model
    return root.get_submodule("h.0.mlp.fc_in" if hasattr(root, "h")
                              else "blocks.0.mlp.fc_in").weight


def _state(trainer) -> tuple[bool, str]:
    """(is the watched weight sharded, what its .grad is: none / sharded / full)."""
    weight = _watched(trainer)
    grad = weight.grad
    kind = "none" if grad is None else "sharded" if isinstance(grad, DTensor) else "full"
    return isinstance(weight, DTensor), kind


def _observe(trainer) -> tuple[list, object]:
    """Record, before each micro-batch's forward (ahead of FSDP2's own hook), the state of
    one block's weight and gradient; return the record and the hook's handle."""
    seen: list = []
    root = trainer.applied.model
    block = root.get_submodule("h.0" if hasattr(root, "h") else "blocks.0")
    hook = block.register_forward_pre_hook(
        lambda m, args: seen.append(("before", _state(trainer))), prepend=True)
    return seen, hook


# -- comparisons ---------------------------------------------------------------------------


def assert_fp32_matches(results: list[dict], model: tuple) -> None:
    """tests/runtime/test_runtime_numerics.py's comparison (first step's gradients)."""
    assert_matches_reference([{**r, "grads": r["grads"][0]} for r in results], model)


@functools.cache
def low_reference(model: tuple, dtype: str, scales: tuple = (), inf_grads: tuple = ()) -> dict:
    spec, (_, _, batch, seq) = _spec(model), model
    batches = [spec.make_batch(batch, seq, seed=step) for step in range(STEPS)]
    return mixed_precision_reference(
        spec.build(seed=0), batches, spec.loss_fn, dtype=getattr(torch, dtype), lr=LR,
        scales=dict(scales) or None, inf_grads=dict(inf_grads) or None)


def _grads_close(got: dict, want: dict, frac: float, label: str) -> None:
    for name, w in want.items():
        if not name.endswith("k_proj.bias"):
            tol = dict(rtol=0, atol=frac * float(w.abs().max()))
            _close(got[name], w, tol, f"{label} grad of {name}")


def assert_low_matches(results: list[dict], model: tuple, dtype: str, *, scales: tuple = (),
                       inf_grads: tuple = ()) -> None:
    """Every rank against one process in the same precision, and near float32."""
    loss_rtol, grad_frac, param_atol = LOW[dtype]
    ref = low_reference(model, dtype, scales, inf_grads)
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], dict(rtol=loss_rtol, atol=0), f"rank {rank} losses")
        assert got["scales"] == ref["scales"], (rank, got["scales"], ref["scales"])
        for step, (grads, want) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            if all(torch.isfinite(g).all() for g in want.values()):  # not a skipped step
                _grads_close(grads, want, grad_frac, f"rank {rank} step {step}")
        for name, want in ref["params"].items():
            _close(got["params"][name], want, dict(rtol=0, atol=param_atol),
                   f"rank {rank} param {name}")
        if not scales:
            _assert_near_fp32(got, model, dtype, f"rank {rank}")


def _assert_near_fp32(got: dict, model: tuple, dtype: str, label: str) -> None:
    loss_rtol, grad_frac = VS_FP32[dtype]
    fp32 = reference(model)
    _close(got["losses"][0], fp32["losses"][0], dict(rtol=loss_rtol, atol=0),
           f"{label} first loss vs float32")
    _grads_close(got["grads"][0], fp32["grads"], grad_frac, f"{label} vs float32")


# -- float32: every dimension against one process -----------------------------------------

CASES_2 = {
    "recompute-full-ddp": (GPT, gpt("replicate", 2, recompute="full")),
    "recompute-selective-ddp": (GPT, gpt("replicate", 2, recompute="selective")),
    "recompute-full-fsdp": (GPT, gpt("fsdp", 2, recompute="full")),
    "recompute-selective-fsdp": (GPT, gpt("fsdp", 2, recompute="selective")),
    "recompute-full-tp": (GPT, gpt_tp(1, 2, recompute="full")),
    "recompute-selective-tp": (GPT, gpt_tp(1, 2, recompute="selective")),
    "zero1-acc1": (GPT, gpt("zero1", 2)),
    "zero1-acc2": (GPT, gpt("zero1", 2, gradient_accumulation=2)),
    "zero2-acc1": (GPT, gpt("zero2", 2)),
    "zero2-acc2": (GPT, gpt("zero2", 2, gradient_accumulation=2)),
    "offload-fsdp": (GPT, gpt("fsdp", 2, offload=True)),
    "offload-fsdp_modules-full-acc2": (GPT, gpt("fsdp_modules", 2, offload=True, recompute="full",
                                                gradient_accumulation=2)),
    "offload-tp_fsdp-acc2": (GPT, gpt_tp(1, 2, recompute="selective", block="tp_fsdp",
                                         offload=True, gradient_accumulation=2)),
    "accumulation-ddp": (GPT, gpt("replicate", 2, gradient_accumulation=4)),
    "accumulation-fsdp": (GPT, gpt("fsdp", 2, gradient_accumulation=2)),
    "mlp-mixed-dims-acc2": (MLP, mlp_mixed(2, gradient_accumulation=2)),
}
CASES_4 = {
    "hsdp-2x2-acc2": (GPT, gpt("hsdp", 4, hsdp_shard_size=2, gradient_accumulation=2)),
    "zero1-acc2": (GPT, gpt("zero1", 4, gradient_accumulation=2)),
    "tp2-dp2-offload-recompute": (GPT, gpt_tp(2, 2, recompute="full", block="tp_fsdp",
                                              offload=True)),
}


@pytest.mark.parametrize("case", list(CASES_2))
def test_two_ranks_train_like_one_process(pool2, case):
    model, plan = CASES_2[case]
    assert_fp32_matches(pool2.run(dims_job, model, plan), model)


@pytest.mark.parametrize("case", list(CASES_4))
def test_four_ranks_train_like_one_process(pool4, case):
    model, plan = CASES_4[case]
    assert_fp32_matches(pool4.run(dims_job, model, plan), model)


# -- what each dimension does, observed ----------------------------------------------------


def test_zero_stages_hold_what_they_promise_between_microbatches(pool2):
    """Before micro-batch 2 of a step: zero2 keeps the gathered weight and has already
    reduce-scattered its gradient; zero1 keeps the weight and an unsharded gradient; fsdp
    has resharded both. After the last backward all three are sharded again."""
    def seen(strategy: str) -> list:
        plan = gpt(strategy, 2, gradient_accumulation=2)
        return pool2.run(dims_job, GPT, plan, observe=True)[0]["seen"]

    sharded_after = ("after backward", (True, "sharded"))
    assert seen("zero2") == [("before", (True, "none")), ("before", (False, "none")),
                             sharded_after]
    assert seen("zero1") == [("before", (True, "none")), ("before", (False, "full")),
                             sharded_after]
    assert seen("fsdp") == [("before", (True, "none")), ("before", (True, "sharded")),
                            sharded_after]


def recompute_count_job(model: tuple, plan_json: str) -> dict[str, int]:
    """One forward + backward; count ops that ran during backward, and block forwards."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from runtime.train import Trainer

    counts = {"addmm": 0, "attention": 0, "mlp forwards": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "addmm":
                counts["addmm"] += 1
            if name.startswith("_scaled_dot_product") and "backward" not in name:
                counts["attention"] += 1
            return func(*args, **(kwargs or {}))

    spec, (_, _, batch, seq) = _spec(model), model
    trainer = Trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn)
    # A pre-hook: recomputation stops as soon as the saved tensors are rebuilt, before the
    # MLP's forward returns, so its post-hooks do not run again.
    trainer.applied.model.get_submodule("h.0.mlp").register_forward_pre_hook(
        lambda *_: counts.__setitem__("mlp forwards", counts["mlp forwards"] + 1))
    backward = trainer._backward

    def counted(loss):
        with Count():
            backward(loss)

    trainer._backward = counted
    trainer.forward_backward(*trainer.shard_batch(*spec.make_batch(batch, seq)))
    return counts


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_recompute_reruns_what_its_mode_says(pool2, strategy):
    """full: backward runs each block's forward again (its matmuls, its attention);
    selective: only the attention core again; none: nothing."""
    def counts(mode: str) -> dict:
        return pool2.run(recompute_count_job, GPT, gpt(strategy, 2, recompute=mode))[0]

    none, selective, full = counts("none"), counts("selective"), counts("full")
    assert none == {"addmm": 0, "attention": 0, "mlp forwards": 1}, none
    assert selective["addmm"] == 0 and selective["attention"] == 2, selective
    assert full["addmm"] > 0 and full["attention"] == 2 and full["mlp forwards"] == 2, full


def names_job(model: tuple, plan_json: str) -> tuple[list[str], int]:
    from runtime.apply import apply_plan

    net = apply_plan(_spec(model).build(seed=0), Plan.from_json(plan_json))
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                for p in net.parameters())
    return [n for n, _ in net.named_parameters()], local


def test_recompute_keeps_parameter_names_and_hsdp_shards_in_groups(pool4):
    names = [n for n, _ in _spec(GPT).build(seed=0).named_parameters()]
    total = sum(p.numel() for p in _spec(GPT).build(seed=0).parameters())
    results = pool4.run(names_job, GPT, gpt("hsdp", 4, recompute="full", hsdp_shard_size=2))
    for got, local in results:
        assert got == names
        assert total // 2 - 64 <= local <= total // 2 + 64, (local, total)


# -- mixed precision -----------------------------------------------------------------------


@pytest.mark.parametrize("case, plan", [
    ("fsdp bf16, reduce fp32", gpt("fsdp", 2, param_dtype="bfloat16")),
    ("replicate bf16, reduce bf16", gpt("replicate", 2, param_dtype="bfloat16",
                                       reduce_dtype="bfloat16")),
    ("tp + zero2 bf16, selective", gpt_tp(1, 2, recompute="selective",
                                          param_dtype="bfloat16")),
    ("zero2 bf16, 2 micro-batches", gpt("zero2", 2, param_dtype="bfloat16",
                                        gradient_accumulation=2)),
], ids=lambda x: x if len(x) < 40 else "")
def test_bfloat16_trains_like_one_bfloat16_process(pool2, case, plan):
    assert_low_matches(pool2.run(dims_job, GPT, plan), GPT, "bfloat16")


@pytest.mark.parametrize("case, plan", [
    ("fsdp fp16, reduce fp32", gpt("fsdp", 2, param_dtype="float16", loss_scaling="dynamic")),
    ("zero1 fp16, reduce fp16, 2 micro-batches", gpt(
        "zero1", 2, param_dtype="float16", reduce_dtype="float16", loss_scaling="dynamic",
        gradient_accumulation=2)),
], ids=lambda x: x if len(x) < 50 else "")
def test_float16_trains_like_one_float16_process(pool2, case, plan):
    assert_low_matches(pool2.run(dims_job, GPT, plan), GPT, "float16")


def test_bfloat16_mlp_with_every_dimension(pool2):
    plan = mlp_mixed(2, param_dtype="bfloat16")
    assert_low_matches(pool2.run(dims_job, MLP, plan), MLP, "bfloat16")


def test_float16_skips_overflowing_steps_on_every_rank(pool2):
    """Step 0 overflows for real (loss scale 2^40); step 1's gradient gets an inf in one
    element that only rank 0's shard holds. Both steps are skipped on both ranks (the
    parameters do not move, the scale halves); step 2 trains; all like one process."""
    scales, infs = ((0, 2.0**40), (1, 2.0**12)), ((1, "h.0.mlp.fc_in.weight"),)
    plan = gpt("fsdp", 2, param_dtype="float16", loss_scaling="dynamic")
    results = pool2.run(dims_job, GPT, plan, dict(scales), dict(infs))
    assert_low_matches(results, GPT, "float16", scales=scales, inf_grads=infs)
    init = _spec(GPT).build(seed=0).state_dict()["h.0.mlp.fc_in.weight"]
    for r in results:
        assert r["scales"] == [2.0**40, 2.0**12, 2.0**11], r["scales"]
        after = r["watched"]
        assert torch.equal(after[0], init) and torch.equal(after[1], init)
        assert not torch.equal(after[2], init)


# -- bad input -----------------------------------------------------------------------------


def uneven_accumulation_job(model: tuple, plan_json: str) -> str:
    from runtime.train import Trainer

    spec = _spec(model)
    trainer = Trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn)
    try:
        trainer.train_step(*spec.make_batch(6, 16))
    except PlanError as e:
        return str(e)
    return "no error"


def test_local_batch_not_splitting_into_accumulation_is_refused(pool2):
    messages = pool2.run(uneven_accumulation_job, GPT, gpt("zero1", 2, gradient_accumulation=2))
    assert all("3 samples does not split into gradient_accumulation=2" in m
               and "multiple of dp × gradient_accumulation = 4" in m for m in messages), messages


@pytest.mark.parametrize("fields, message", [
    (dict(param_dtype="float16"), "float16' needs loss_scaling 'dynamic'"),
    (dict(param_dtype="bfloat16", reduce_dtype="float16"), "reduce_dtype 'float16' must be"),
    (dict(gradient_accumulation=3), "dp × gradient_accumulation = 2 × 3"),
    (dict(hsdp_shard_size=3), "hsdp_shard_size 3 must be a positive divisor"),
])
def test_bad_dimension_fields_are_plan_errors(fields, message):
    with pytest.raises(PlanError, match=message):
        Plan(global_batch=8, mesh=Mesh(dp=2), **fields)


@pytest.mark.parametrize("layer, message", [
    (dict(strategy="zero2", offload=True), "offload needs a fully sharded strategy"),
    (dict(strategy="fsdp", recompute="some"), "recompute 'some' is not one of"),
])
def test_bad_layer_dimensions_are_plan_errors(layer, message):
    with pytest.raises(PlanError, match=message):
        LayerPlan(module="h.0", **layer)


def test_hsdp_without_shard_size_is_a_plan_error():
    with pytest.raises(PlanError, match="uses 'hsdp' but the plan has no hsdp_shard_size"):
        gpt("hsdp", 2)



# -- pipelines honour recompute and precision ---------------------------------------------


def pipeline_dims_job(plan_json: str) -> dict:
    """tests/runtime/test_pipeline_numerics.py's job, with gradients as a one-step list."""
    from test_pipeline_numerics import GPT6, pipeline_job

    out = pipeline_job(GPT6, plan_json)
    return {**out, "grads": [out["grads"]], "scales": [1.0] * STEPS}


def _pipeline_plan(**fields) -> str:
    from test_pipeline_numerics import pipeline_plan

    data = Plan.from_json(pipeline_plan("1F1B", pp=2, m=2)).to_dict()
    data["layers"] = [{**la, "recompute": "full" if la["module"].startswith("h.") else "none"}
                      for la in data["layers"]]
    return Plan.from_dict({**data, **fields}).to_json()


def test_pipeline_recomputes_in_bfloat16_like_one_process(pool2):
    from test_pipeline_numerics import GPT6

    results = pool2.run(pipeline_dims_job, _pipeline_plan(param_dtype="bfloat16"))
    ref = low_reference(GPT6, "bfloat16")
    loss_rtol, grad_frac, param_atol = LOW["bfloat16"]
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], dict(rtol=loss_rtol, atol=0), f"rank {rank} losses")
        _grads_close(got["grads"][0], ref["grads"][0], grad_frac, f"rank {rank}")
        _assert_near_fp32(got, GPT6, "bfloat16", f"rank {rank}")
