"""Context parallelism: ring attention and training with mesh.cp > 1 match one process.

Ring attention alone (forward and backward) is compared with
``F.scaled_dot_product_attention`` on the whole sequence at rtol 1e-5 / atol 1e-6 in
float32 (measured: largest difference 1.3e-6 causal, 2.1e-6 full attention, on values and
gradients of size ~1, all within atol + rtol·|want|). In float64 it agrees to 1.8e-15, so
what float32 leaves is rounding, not algorithm. Training uses tests/runtime/test_runtime_numerics.py's comparison (3 AdamW steps of
the seeded gpt-tiny, fused attention, no dropout: losses rtol 1e-5, first gradients rtol
1e-5 / atol 1e-7, final parameters rtol 1e-5 / atol 1e-5), on the session-wide pools.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_runtime_numerics import (
    BLOCK_TP,
    GPT,
    _spec,
    assert_matches_reference,
    bad_plan_job,
    train_job,
)
from test_sequence_parallel import BLOCK_SP

from runtime.context_parallel import shard_sequence, zigzag_layout, zigzag_positions
from runtime.plan import LayerPlan, Mesh, Plan, PlanError

ATTN_TOL = dict(rtol=1e-5, atol=1e-6)
GPT_NAMES = ("wte", "wpe", "h.0", "h.1", "ln_f", "lm_head")


def _cp_plan(strategies: dict[str, str], *, dp: int = 1, cp: int = 2, tp: int = 1,
             recompute: dict[str, str] | None = None, model: tuple = GPT) -> str:
    """A plan over ``model``'s global batch and sequence; blocks with strategy 'tp' get
    the Megatron styles."""
    recompute = recompute or {}
    layers = [LayerPlan(module=name, strategy=s, recompute=recompute.get(name, "none"),
                        tp_styles=BLOCK_TP if s in ("tp", "tp_fsdp") else {})
              for name, s in strategies.items()]
    return Plan(global_batch=model[2], seq_len=model[3] or 16,
                mesh=Mesh(dp=dp, cp=cp, tp=tp), layers=tuple(layers)).to_json()


def _all(strategy: str) -> dict[str, str]:
    return dict.fromkeys(GPT_NAMES, strategy)


# -- the zigzag layout ---------------------------------------------------------------------


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    layout = zigzag_layout(24, 3)
    assert sorted(layout.flatten().tolist()) == list(range(24))
    x = torch.arange(2 * 16).view(2, 16)
    assert torch.equal(shard_sequence(x, 2, 1), x[:, 4:12])


def test_sequence_not_divisible_by_two_cp_is_rejected_by_the_plan():
    with pytest.raises(PlanError, match=r"seq_len 18 is not divisible by 2 × mesh.cp = 4"):
        Plan(global_batch=8, seq_len=18, mesh=Mesh(cp=2))
    with pytest.raises(PlanError, match="not divisible by 2 × cp = 4"):
        zigzag_positions(18, 2, 0)


# -- ring attention alone ------------------------------------------------------------------


def ring_attention_job(causal: bool, dtype: torch.dtype = torch.float32) -> dict:
    """This rank's output and q/k/v gradients from ring attention, and the same chunks of
    one-process SDPA on the whole sequence; GQA through RingAttentionMode."""
    import torch.distributed as dist

    from runtime.context_parallel import RingAttentionMode, ring_attention

    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 4, 24, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v, dout = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    kv_gqa = rand(B, 2, S, D)

    def grads(fn, *inputs, grad_out):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad_out)
        return [out.detach(), *(x.grad for x in leaves)]

    def local(t):
        return shard_sequence(t, cp, rank, dim=2)

    layout = zigzag_layout(S, cp)
    want = grads(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal),
                 q, k, v, grad_out=dout)
    got = grads(lambda *a: ring_attention(*a, layout, dist.group.WORLD, is_causal=causal),
                local(q), local(k), local(v), grad_out=local(dout))

    def gqa(*a):
        return F.scaled_dot_product_attention(*a, is_causal=causal, enable_gqa=True)

    gqa_want = grads(gqa, q, kv_gqa, kv_gqa, grad_out=dout)
    with RingAttentionMode(dist.group.WORLD, layout):
        gqa_got = grads(gqa, local(q), local(kv_gqa), local(kv_gqa), grad_out=local(dout))
    want, gqa_want = [local(t) for t in want], [local(t) for t in gqa_want]
    return {"got": got + gqa_got, "want": want + gqa_want}


def ring_attention_jobs() -> dict:
    """Causal and full attention in float32, causal in float64: one pool job."""
    return {"causal": ring_attention_job(True), "full": ring_attention_job(False),
            "float64": ring_attention_job(True, torch.float64)}


def test_ring_attention_forward_and_backward_match_sdpa(pool2):
    names = ["out", "dq", "dk", "dv", "gqa out", "gqa dq", "gqa dk", "gqa dv"]
    for rank, results in enumerate(pool2.run(ring_attention_jobs)):
        for case, r in results.items():
            # float64 agrees to ~1e-15: what float32 leaves is rounding, not algorithm
            tol = dict(rtol=1e-12, atol=1e-12) if case == "float64" else ATTN_TOL
            for name, got, want in zip(names, r["got"], r["want"], strict=True):
                torch.testing.assert_close(
                    got, want, **tol, msg=lambda m, n=f"rank {rank} {case} {name}": f"{n}: {m}")


# -- training on the cp ring matches one process ---------------------------------------------

CASES_2 = {
    "cp2 replicate (DDP)": _cp_plan(_all("replicate")),
    "cp2 fsdp, recompute": _cp_plan(
        {**_all("fsdp"), "h.1": "zero2"}, recompute={"h.0": "full", "h.1": "selective"}),
}
CASES_4 = {
    "dp2 x cp2 fsdp": _cp_plan(_all("fsdp"), dp=2),
    "cp2 x tp2": _cp_plan({"wte": "replicate", "h.0": "tp", "h.1": "tp_fsdp",
                           "lm_head": "fsdp"}, tp=2),
    "cp2 x tp2, sequence parallel": Plan(
        global_batch=GPT[2], seq_len=GPT[3], mesh=Mesh(cp=2, tp=2),
        layers=(LayerPlan(module="wte", strategy="replicate"),
                *(LayerPlan(module=f"h.{i}", strategy="tp", tp_styles=BLOCK_SP,
                            sequence_parallel=True) for i in range(2)),
                LayerPlan(module="lm_head", strategy="fsdp"))).to_json(),
}


def many_train_jobs(plans: list[str]) -> list[dict]:
    """Several plans in one pool job: each rank trains them one after the other."""
    return [train_job(GPT, plan) for plan in plans]


def _check_cases(results: list[list[dict]], cases: dict) -> None:
    for i, case in enumerate(cases):
        try:
            assert_matches_reference([r[i] for r in results], GPT)
        except AssertionError as e:
            raise AssertionError(f"case {case!r}: {e}") from None


def test_context_parallel_trains_like_one_process_on_2_ranks(pool2):
    _check_cases(pool2.run(many_train_jobs, list(CASES_2.values())), CASES_2)


def test_context_parallel_composes_with_dp_and_tp_on_4_ranks(pool4):
    _check_cases(pool4.run(many_train_jobs, list(CASES_4.values())), CASES_4)


# -- bad input: clear errors -----------------------------------------------------------------


def forward_error_job(model: tuple, plan_json: str) -> str:
    from runtime.train import Trainer

    spec, (_, _, batch, seq) = _spec(model), model
    trainer = Trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn)
    try:
        trainer.forward_backward(*trainer.shard_batch(*spec.make_batch(batch, seq)))
    except PlanError as e:
        return str(e)
    return "no error"


def test_attention_dropout_under_cp_names_the_module(pool2):
    model = ("gpt-tiny", (("dropout", 0.1),), 8, 16)
    for message in pool2.run(forward_error_job, model, _cp_plan(_all("fsdp"), model=model)):
        assert "F.scaled_dot_product_attention in module 'h.0.attn'" in message, message
        assert "dropout_p=0.1" in message and "mesh.cp" in message, message


BAD_CP_PLANS = {
    "unfused attention": (("gpt-tiny", (("attention", "unfused"),), 8, 16),
                          ["GPT computes attention unfused", "fused attention",
                           "position ids", "attention='fused'"]),
    "no position ids": (("mlp", (("n_layer", 1),), 8, None),
                        ["MLPNet.forward takes no position ids", "pos or position_ids",
                         "fused attention"]),
}


@pytest.mark.parametrize("case", list(BAD_CP_PLANS))
def test_model_unfit_for_cp_is_rejected_before_any_collective(pool2, case):
    model, phrases = BAD_CP_PLANS[case]
    message = pool2.run(bad_plan_job, model, _cp_plan({}, model=model))[0]
    assert message.startswith("PlanError"), message
    for phrase in phrases:
        assert phrase in message, (phrase, message)


class _Toy(torch.nn.Module):
    """Takes positions; attends with explicit scores, or by SDPA with a mask on rank 0."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x, pos):
        import torch.distributed as dist

        if self.how == "explicit":
            return torch.softmax(x @ x.transpose(-2, -1), -1) @ x
        mask = torch.ones(4, 4, dtype=torch.bool) if dist.get_rank() == 0 else None
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


def toy_job(how: str) -> str:
    import torch.distributed as dist

    from runtime.context_parallel import ContextParallel

    model = _Toy(how)
    cp = ContextParallel(model, dist.group.WORLD, "pos")
    try:
        with cp.attention(4, torch.device("cpu")) as kwargs:
            model(torch.randn(1, 1, 4, 3), **kwargs)
    except PlanError as e:
        return str(e)
    return "no error"


def test_a_forward_without_sdpa_is_refused(pool2):
    for message in pool2.run(toy_job, "explicit"):
        assert "made no F.scaled_dot_product_attention call" in message, message
        assert "fused attention" in message and "position ids" in message, message


def test_a_call_refused_on_one_rank_is_refused_on_all(pool2):
    """No rank is left waiting on the ring for one that raised."""
    mine, other = pool2.run(toy_job, "mask on rank 0")
    assert "F.scaled_dot_product_attention in the model has an attn_mask" in mine, mine
    assert "another context-parallel rank refused this call" in other, other


def test_pipelines_with_cp_are_refused_before_any_collective():
    with pytest.raises(PlanError, match=r"pp=2 × dp=1 × cp=2 × tp=1: context parallelism "
                                        r"\(cp > 1\) does not run in pipelines"):
        Mesh(pp=2, cp=2)  # a mesh the runtime cannot build is not a mesh
