"""What many tests share: the single-process reference training loop, and a small
Hugging Face model built from a config (random init, no downloads)."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from autopar.zoo import get_model


def single_process_losses(name: str, *, steps: int, seed: int = 0) -> list[float]:
    """What `autopar run` trains, on one process: the seeded model, AdamW(lr=1e-3), the
    model's default global batch with batch seeds seed + 1 + step."""
    spec = get_model(name)
    model = spec.build(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        (x,), y = spec.make_batch(spec.default_batch, seed=seed + 1 + step)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A (possibly sharded) tensor's full value, detached, on CPU. Collective for DTensors."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu().clone()


def train_one_process(model: nn.Module, step_loss, *, steps: int, lr: float,
                      names=None) -> dict:
    """The one-process reference the runtime tests compare with: AdamW(lr) for ``steps``,
    ``step_loss(model, step)`` the loss of each step's global batch. Returns the losses, the
    first step's gradients and the final parameters, by name: ``names`` (default
    ``model.named_parameters()``) lists the (name, parameter) pairs to report."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    named = list(model.named_parameters() if names is None else names)
    losses, grads = [], {}
    for step in range(steps):
        loss = step_loss(model, step)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: full_tensor(p.grad) for n, p in named if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: full_tensor(p) for n, p in named}}


def train_under_plan(trainer, step_batch, first_grads, *, steps: int) -> dict:
    """Each rank's side of ``train_one_process``: ``trainer`` (a ``Trainer`` or
    ``PipelineTrainer``) takes ``steps`` steps, ``step_batch(step)`` giving the arguments of
    ``shard_batch`` (a global batch); returns the global losses, ``first_grads(trainer)``
    after the first backward, and the final full parameters."""
    losses, grads = [], {}
    for step in range(steps):
        inputs, targets = trainer.shard_batch(*step_batch(step))
        losses.append(trainer.forward_backward(inputs, targets).item())
        if step == 0:
            grads = first_grads(trainer)
        trainer.step()
    return {"losses": losses, "grads": grads, "params": trainer.full_state_dict()}


def assert_trains_like(out: dict, ref: dict, *, tol: dict, param_tol: dict) -> None:
    """One rank's ``train_under_plan`` result against ``train_one_process``'s: every loss
    and first gradient within ``tol``, every final parameter within ``param_tol``."""
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), **tol)
    assert out["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(out["grads"][name], grad, **tol, msg=name)
    assert out["params"].keys() == ref["params"].keys()
    for name, param in ref["params"].items():
        torch.testing.assert_close(out["params"][name], param, **param_tol, msg=name)


def pipeline_grads(trainer) -> dict:
    """Every stage's full gradients, gathered from all pipeline ranks (a ``first_grads``
    for ``train_under_plan`` under pipelining; collective over the world)."""
    import torch.distributed as dist

    mine = {n: full_tensor(p.grad) for m in trainer.stages for n, p in m.named_parameters()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {n: g for part in parts for n, g in part.items()}


def hf_gpt2(use_cache: bool = False) -> nn.Module:
    """A 2-layer Hugging Face GPT-2 (fused qkv Conv1D), seeded."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                  n_positions=64, use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)



def mixed_precision_reference(model: nn.Module, batches: list, loss_fn, *, dtype: torch.dtype,
                              lr: float, scales: dict[int, float] | None = None,
                              inf_grads: dict[int, str] | None = None) -> dict:
    """One process training ``model`` (float32 master weights) with the casting of
    runtime.precision: each step a ``dtype`` copy of the weights runs forward and backward
    on the whole batch (floating inputs cast to ``dtype``, output cast to float32 for the
    loss); its gradients are cast to float32 onto the master weights and AdamW steps them.

    float16 scales the loss with ``torch.amp.GradScaler("cpu")`` (which skips steps with
    inf/nan gradients); ``scales``: {step: loss scale set before that step}.
    ``inf_grads``: {step: parameter name} whose first gradient element is set to inf
    before that step's optimizer update. Returns per-step losses, the unscaled float32
    gradients of every step, each step's scale, and the final parameters.
    """
    import copy

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scales = scales or {}
    scaler = torch.amp.GradScaler("cpu", init_scale=scales.get(0, 2.0**16),
                                  enabled=dtype == torch.float16)
    params = dict(model.named_parameters())
    out: dict = {"losses": [], "grads": [], "scales": []}
    for step, (inputs, targets) in enumerate(batches):
        if step and step in scales:
            scaler.update(new_scale=scales[step])
        compute = copy.deepcopy(model).to(dtype)
        cast = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
        loss = loss_fn(compute(*cast).float(), targets)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        for name, p in compute.named_parameters():
            params[name].grad = p.grad.float()
        out["losses"].append(loss.item())
        out["scales"].append(scale)
        out["grads"].append({n: p.grad / scale for n, p in params.items()})
        if inf_grads and step in inf_grads:
            params[inf_grads[step]].grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in params.items()}
    return out
