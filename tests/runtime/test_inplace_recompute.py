"""Layers that modify their inputs in place are recomputed exactly (runtime/recompute.py).

- One process: a ``ReLU(inplace=True)`` layer and an in-place residual block (``x +=
  f(x)``) under full and selective recomputation give eager's gradients, and the caller
  still sees eager's mutation and alias; inputs changed in place where the rerun cannot
  reproduce them are refused with a PlanError naming the layer; selective recomputation
  of a layer that modifies a saved matmul output in place gives eager's gradients.
- Two gloo ranks: the ResNet layout (1-1-1-1, float32) with every layer, the stem's
  in-place ReLU included, recomputed under zero2, and a stack of in-place residual blocks
  recomputed under DDP, train 3 steps like one process on the global batch.
- The planner charges the copy: the layer graph records the bytes of the inputs a layer
  modifies in place, and recomputing such a layer holds at least that copy.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import train_one_process, train_under_plan
from resnet_layout import image_batch, resnet_layout
from torch.distributed.tensor import DTensor

from autopar.planner.costs import layer_cost
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import LayerPlan, Mesh, Plan, PlanError, option_label
from runtime.recompute import apply_recompute

STEPS = 3
LR = 1e-3
MODES = ("full", "selective")
# As tests/autopar/test_capture_real.py: atol is a fraction of the tensor's largest element.
TOL = dict(rtol=1e-5, atol=1e-5)


class InplaceResidual(nn.Module):
    """``x += fc(relu(x))``: modifies its input, which eager autograd allows because
    nothing saved the input before the add (ReLU saves its own output)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.fc(torch.relu(x))
        return x


class ResidualStack(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.act = nn.ReLU(inplace=True)
        # Between them: the blocks' adds must not modify what the in-place ReLU saved.
        self.norm = nn.LayerNorm(dim)
        self.blocks = nn.Sequential(*(InplaceResidual(dim) for _ in range(depth)))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.norm(self.act(self.embed(x)))))


def _stack(seed: int = 0) -> ResidualStack:
    torch.manual_seed(seed)
    return ResidualStack()


def _stack_batch(step: int, batch: int = 8) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(batch, 8, generator=gen),), torch.randint(0, 4, (batch,), generator=gen)


def _resnet(seed: int = 0) -> nn.Module:
    return resnet_layout(layout=(1, 1, 1, 1), seed=seed)


def _resnet_batch(step: int, batch: int = 16) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return image_batch(batch, seed=step)


MODELS = {
    "resnet-1111": (_resnet, _resnet_batch, ("conv1", "bn1", "relu", "maxpool", "layer1.0",
                                             "layer2.0", "layer3.0", "layer4.0", "avgpool",
                                             "fc")),
    "inplace-residual": (_stack, _stack_batch, ("embed", "act", "norm", "blocks.0", "blocks.1",
                                                "blocks.2", "head")),
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# -- one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_inplace_layers_recompute_to_eager_gradients(name, mode):
    build, batch, layers = MODELS[name]
    eager, recomputed = build(), build()
    apply_recompute(recomputed, [LayerPlan(module=n, recompute=mode) for n in layers])
    for step in range(2):  # the first call learns which inputs change; the second uses it
        (x,), y = batch(step)
        F.cross_entropy(eager(x), y).backward()
        F.cross_entropy(recomputed(x), y).backward()
        want, got = _grads(eager), _grads(recomputed)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("mode", MODES)
def test_caller_sees_the_mutation_and_alias_as_in_eager(mode):
    torch.manual_seed(0)
    holder = nn.Sequential(InplaceResidual(4))
    eager = copy.deepcopy(holder)
    apply_recompute(holder, [LayerPlan(module="0", recompute=mode)])
    base = torch.randn(3, 4, requires_grad=True)
    x, x_eager = base * 1.0, base * 1.0
    out = holder(x)
    assert out is x, "the layer returns its input; the caller must get that very tensor"
    torch.testing.assert_close(x, eager(x_eager))
    (x * x).sum().backward()  # through the caller's (modified) tensor
    got, base.grad = base.grad.clone(), None
    (x_eager * x_eager).sum().backward()
    torch.testing.assert_close(got, base.grad)


class _ReadsThenLaterChanged(nn.Module):
    """``act`` reads x (ReLU saves only its output); the model then adds to x in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        y = self.act(x)
        x += 1.0
        return y.sum() + x.sum()


def test_input_changed_after_a_recomputed_layer_is_refused_naming_it():
    model = _ReadsThenLaterChanged()
    model(torch.randn(2, 4)).backward()  # eager runs it
    apply_recompute(model, [LayerPlan(module="act", recompute="full")])
    loss = model(torch.randn(2, 4))
    with pytest.raises(PlanError, match="'act'.*modified in place after the layer ran"):
        loss.backward()


class _SometimesInplace(nn.Module):
    def forward(self, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        return F.relu(x, inplace=inplace)


def test_layer_modifying_an_input_it_did_not_modify_before_is_refused():
    holder = nn.Sequential()
    holder.add_module("act", _SometimesInplace())
    apply_recompute(holder, [LayerPlan(module="act", recompute="full")])
    x = torch.randn(3, requires_grad=True)
    holder.act(x * 1.0, False).sum().backward()
    with pytest.raises(PlanError, match="'act' modified its input"):
        holder.act(x * 1.0, True)


def test_only_inputs_the_layer_modifies_are_kept_as_copies():
    """After the first call the rerun keeps copies of the modified input only: the other
    input is the caller's tensor (checked by the version test above), not a copy."""

    class TwoInputs(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            a.mul_(2.0)
            return a * b

    holder = nn.Sequential()
    holder.add_module("two", TwoInputs())
    apply_recompute(holder, [LayerPlan(module="two", recompute="full")])
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    for _ in range(2):
        holder.two(a * 1.0, b * 1.0).sum().backward()
    assert set(holder.two.forward.modifies.values()) == {frozenset({0})}
    torch.testing.assert_close(a.grad, 2 * 2.0 * b.detach())
    torch.testing.assert_close(b.grad, 2 * 2.0 * a.detach())


# -- two ranks -----------------------------------------------------------------------------


STRATEGY = {"resnet-1111": "zero2", "inplace-residual": "replicate"}
"""zero2 on FSDP2 where it can run: FSDP2 hands a module with parameters its inputs as
views made by a custom Function, which autograd forbids modifying in place, so the
residual blocks (which have parameters) run under DDP; the ResNet's ReLU has none."""


def _plan(name: str, mode: str) -> str:
    build, batch, layers = MODELS[name]
    (x,), _ = batch(0)
    return Plan(global_batch=x.shape[0], mesh=Mesh(dp=2, tp=1),
                layers=tuple(LayerPlan(module=n, strategy=STRATEGY[name], recompute=mode)
                             for n in layers)).to_json()


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu().clone()


def _record(model: nn.Module, losses: list, grads: dict) -> dict:
    return {"losses": losses, "grads": grads,
            "params": {n: _full(p) for n, p in model.named_parameters()}}


def train_job(name: str, plan_json: str) -> dict:
    from runtime.train import Trainer

    build, batch, _ = MODELS[name]
    model = build()
    trainer = Trainer(model, Plan.from_json(plan_json), F.cross_entropy,
                      lambda params: torch.optim.AdamW(params, lr=LR))
    return train_under_plan(
        trainer, batch, lambda t: {n: _full(p.grad) for n, p in model.named_parameters()},
        steps=STEPS)


@functools.cache
def reference(name: str) -> dict:
    build, batch, _ = MODELS[name]
    model = build()

    def step_loss(net: nn.Module, step: int) -> torch.Tensor:
        (x,), y = batch(step)
        return F.cross_entropy(net(x), y)

    result = train_one_process(model, step_loss, steps=STEPS, lr=LR)
    return _record(model, result["losses"], result["grads"])


def _close(got, want, label: str) -> None:
    scale = want.abs().max().item() if isinstance(want, torch.Tensor) and want.numel() else 1.0
    try:
        torch.testing.assert_close(got, want, rtol=TOL["rtol"], atol=TOL["atol"] * max(scale, 0.1))
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_inplace_layers_recomputed_train_like_one_process(pool2, name, mode):
    ref = reference(name)
    for rank, got in enumerate(pool2.run(train_job, name, _plan(name, mode))):
        _close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), f"rank {rank} losses")
        for kind in ("grads", "params"):
            assert got[kind].keys() == ref[kind].keys()
            for key, want in ref[kind].items():
                _close(got[kind][key], want, f"rank {rank} {kind} {key}")


# -- the planner's view --------------------------------------------------------------------


@pytest.mark.parametrize("prefer", ["symbolic_trace", "export"])
def test_layer_graph_records_the_stem_relu_modifying_its_input(prefer):
    (images,), _ = image_batch(4)
    graph = build_layer_graph(_resnet(), (images,), prefer=prefer)
    assert graph.extra["capture_method"] == prefer
    modified = {layer.name: layer.inplace_input_bytes for layer in graph.layers
                if layer.inplace_input_bytes}
    # bn1's output, (4, 8, 16, 16) float32; the blocks modify only their own tensors
    assert modified == {"relu": 4 * 8 * 16 * 16 * 4}


def test_exported_graph_shows_in_place_residual_adds():
    """Export keeps ``x += f(x)`` as ``aten.add_``; symbolic tracing records it as ``x + y``
    (torch.fx has no in-place operators), so only export sees the blocks modify x."""
    graph = build_layer_graph(_stack(), _stack_batch(0)[0], prefer="export")
    modified = {layer.name: layer.inplace_input_bytes for layer in graph.layers
                if layer.inplace_input_bytes}
    assert modified == {name: 8 * 16 * 4 for name in ("act", "blocks.0", "blocks.1", "blocks.2")}


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_recomputing_a_layer_that_modifies_its_input_costs_the_copy(mode):
    """The stem ReLU on 2 replicas keeps its input's copy (half the batch) to backward,
    copies it twice (forward and rerun: each reads and writes it) and holds a second copy
    while it reruns; without recomputation nothing changes."""
    (images,), _ = image_batch(8)
    relu = next(layer for layer in build_layer_graph(_resnet(), (images,)).layers
                if layer.name == "relu")
    plain = replace(relu, inplace_input_bytes=0)
    cluster, mesh = Cluster.preset("dgx-a100-80g", nodes=1), Mesh(dp=2)
    prec = precision("float32")
    got, base = (layer_cost(layer, option_label("zero2", mode), mesh, cluster, prec)
                 for layer in (relu, plain))
    copy = relu.inplace_input_bytes / 2
    copy_s = 2 * copy / (cluster.device.memory_bandwidth_GBps * 1e9)
    if mode == "none":
        assert (got.activations_bytes, got.buffers_bytes, got.compute_s) == \
            (base.activations_bytes, base.buffers_bytes, base.compute_s)
        return
    assert got.activations_bytes == pytest.approx(copy)  # what a ReLU would keep anyway
    assert got.buffers_bytes - base.buffers_bytes == pytest.approx(copy)
    assert got.compute_s - base.compute_s == pytest.approx(2 * copy_s)


class _ModifiesSavedOutput(nn.Module):
    """``h = fc(x); h.mul_(2); h.relu_()``: modifies the output of a matmul the selective
    policy saves; a rerun from the modified value would double it again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(2.0)
        h.relu_()
        return self.fc2(h)


def test_selective_replays_a_saved_output_the_layer_then_modifies():
    torch.manual_seed(0)
    eager = nn.Sequential(_ModifiesSavedOutput())
    recomputed = copy.deepcopy(eager)
    apply_recompute(recomputed, [LayerPlan(module="0", recompute="selective")])
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        eager(x).square().sum().backward()
        recomputed(x).square().sum().backward()
        want, got = _grads(eager), _grads(recomputed)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=n)
