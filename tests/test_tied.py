"""Tied parameters end to end: the runtime shards tied modules as one FSDP2 unit and
matches one process, refuses tied modules given different strategies before any
collective, and sums a pipeline's tied copies' gradients; the planner gives tied modules
one strategy on every cluster and never cuts a pipeline through a tie.

Models: a nanoGPT-style model with ``lm_head.weight = wte.weight`` and Hugging Face's
``GPT2LMHeadModel`` (tiny config, random init, dropout off so ranks match one process).
Jobs run on the session's pool of 2 gloo ranks (tests/dist_pool.py).
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_runtime_numerics import _close, collectives_trapped

from runtime.plan import LayerPlan, Mesh, Plan, PlanError

STEPS = 3
LR = 1e-3
BATCH, SEQ, VOCAB = 8, 16, 64
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
KEY_BIAS_TOL = dict(rtol=1e-5, atol=STEPS * LR)
"""The key bias's true gradient is zero (softmax ignores a shift shared by every key), so
AdamW divides rounding noise by its own size and moves it by up to lr a step, either way
(seen: 2e-4). Its gradients are still compared at FP32_TOL."""
KEY_BIAS = ("qkv.bias", "c_attn.bias")
BF16_TOL = dict(rtol=2e-2, atol=2e-3)


# -- models ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TiedGPT(nn.Module):
    """nanoGPT's layout and weight tying (``lm_head.weight = wte.weight``)."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, n_layer: int = 2, seq: int = SEQ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def hf_gpt2_tied() -> nn.Module:
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=SEQ, use_cache=False, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return TiedGPT() if name == "nanogpt" else hf_gpt2_tied()


def loss_fn(out, y: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (tokens[:, :-1],), tokens[:, 1:]


NAMES = {
    "nanogpt": ("wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"),
    "gpt2": ("transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
             "transformer.h.1", "transformer.ln_f", "lm_head"),
}
TIED = {"nanogpt": ("wte", "lm_head"), "gpt2": ("transformer.wte", "lm_head")}


# -- plans -----------------------------------------------------------------------------------


def forced_plan(model: str, kind: str) -> str:
    """fsdp, zero2+full, bf16 (fsdp in bfloat16), or a mixed per-layer plan."""
    names = NAMES[model]
    dtype = "bfloat16" if kind == "bf16" else "float32"
    if kind == "mixed":
        # The tied pair sharded together; the rest one strategy each, with recomputation.
        others = ["replicate", "zero2", "fsdp", "replicate", "zero2"]
        layers, i = [], 0
        for n in names:
            if n in TIED[model]:
                layers.append(LayerPlan(module=n, strategy="fsdp", offload=True))
            else:
                layers.append(LayerPlan(module=n, strategy=others[i % len(others)],
                                        recompute="full" if ".h." in f".{n}" else "none"))
                i += 1
    else:
        strategy = "zero2" if kind == "zero2_full" else "fsdp"
        recompute = "full" if kind == "zero2_full" else "none"
        layers = [LayerPlan(module=n, strategy=strategy, recompute=recompute) for n in names]
    return Plan(global_batch=BATCH, mesh=Mesh(dp=2), layers=tuple(layers), param_dtype=dtype,
                reduce_dtype="float32").to_json()


# -- jobs and references ---------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu().float().clone()


def train_job(model: str, plan_json: str) -> dict:
    """STEPS steps under the plan: losses, every step's gradients, final parameters."""
    from runtime.train import Trainer

    trainer = Trainer(build(model), Plan.from_json(plan_json), loss_fn,
                      lambda params: torch.optim.AdamW(params, lr=LR))
    net = trainer.applied.model
    tied_together = net.lm_head.weight is _input_embedding(net).weight
    losses, grads = [], []
    for step in range(STEPS):
        inputs, targets = trainer.shard_batch(*batch(step))
        losses.append(trainer.forward_backward(inputs, targets).item())
        grads.append({n: _full(p.grad) for n, p in net.named_parameters()})
        trainer.step()
    return {"losses": losses, "grads": grads, "params": trainer.full_state_dict(),
            "tied": tied_together}


def _input_embedding(net: nn.Module) -> nn.Module:
    return net.wte if hasattr(net, "wte") else net.transformer.wte


@functools.cache
def reference(model: str, dtype: str = "float32") -> dict:
    """One process; with ``dtype`` bfloat16, runtime.precision's casting (float32 master
    weights, a bfloat16 copy runs forward and backward, the loss in float32), as
    tests/reference.py's mixed_precision_reference, whose output cast needs a tensor."""
    net = build(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        inputs, targets = batch(step)
        compute = net if dtype == "float32" else copy.deepcopy(net).to(getattr(torch, dtype))
        loss = loss_fn(compute(*inputs), targets)
        loss.backward()
        for p, q in zip(net.parameters(), compute.parameters(), strict=True):
            p.grad = q.grad.float()
        losses.append(loss.item())
        grads.append({n: _full(p.grad) for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: _full(p) for n, p in net.named_parameters()}}


def assert_matches(results: list[dict], model: str, dtype: str = "float32") -> None:
    ref = reference(model, dtype)
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    for rank, got in enumerate(results):
        assert got["tied"], f"rank {rank}: the tie was broken by parallelization"
        _close(got["losses"], ref["losses"], tol, f"rank {rank} losses")
        for step, (mine, want) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            assert mine.keys() == want.keys()
            for name in want:
                _close(mine[name], want[name].float(), tol, f"rank {rank} step {step} grad {name}")
        for name, want in ref["params"].items():
            ptol = PARAM_TOL if dtype == "float32" else BF16_TOL
            if name.endswith(KEY_BIAS):
                ptol = dict(rtol=ptol["rtol"], atol=KEY_BIAS_TOL["atol"])
            _close(got["params"][name], want.float(), ptol, f"rank {rank} param {name}")


# -- runtime ---------------------------------------------------------------------------------

RUNTIME_CASES = [(m, k) for m in ("nanogpt", "gpt2") for k in ("fsdp", "zero2_full", "mixed", "bf16")]


@pytest.mark.parametrize(("model", "kind"), RUNTIME_CASES)
def test_tied_modules_train_as_one_fsdp_unit_like_one_process(pool2, model, kind):
    results = pool2.run(train_job, model, forced_plan(model, kind))
    assert_matches(results, model, "bfloat16" if kind == "bf16" else "float32")


def split_tie_job(model: str, plan_json: str) -> str:
    """Apply on rank 0 only, every way into a collective trapped (see bad_plan_job)."""
    import torch.distributed as dist

    import runtime.apply

    if dist.get_rank() != 0:
        return ""
    try:
        with collectives_trapped((runtime.apply, "build_mesh")):
            runtime.apply.apply_plan(build(model), Plan.from_json(plan_json))
    except PlanError as e:
        return str(e)
    return "accepted"


def _split_strategies(model: str) -> str:
    head, embedding = "lm_head", TIED[model][0]
    layers = [LayerPlan(module=n, strategy="replicate" if n == head else "zero2")
              for n in NAMES[model]]
    assert any(la.module == embedding for la in layers)
    return Plan(global_batch=BATCH, mesh=Mesh(dp=2), layers=tuple(layers)).to_json()


@pytest.mark.parametrize("model", ["nanogpt", "gpt2"])
def test_tied_modules_with_different_strategies_are_refused_before_any_collective(pool2, model):
    message = pool2.run(split_tie_job, model, _split_strategies(model))[0]
    embedding = TIED[model][0]
    assert f"'{embedding}', 'lm_head' share parameter '{embedding}.weight' = 'lm_head.weight'" \
        in message, message
    assert "'lm_head': replicate" in message and f"'{embedding}': zero2" in message
    assert "give them the same strategy" in message
