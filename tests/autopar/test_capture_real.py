"""Capture and plan ordinary models, and train BatchNorm models like one process.

- A ResNet-50 layout (tests/resnet_layout.py: in-place ReLU layers, in-place residual
  adds, BatchNorm) and Hugging Face T5 (a learned attention bias) plan on dgx-a100-80g.
- Attention whose mask needs a gradient is costed as memory-efficient attention.
- The ResNet layout trains 3 AdamW steps on 2 gloo ranks under DDP and FSDP2 with its
  BatchNorm statistics taken over the data-parallel group, matching one process on the
  global batch: losses, first gradients, final parameters and running statistics.
- Plans that would change batch statistics are refused; a model whose forward updates a
  buffer captures and plans; a pass that fails names the module, op and source line.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import train_one_process
from resnet_layout import LAYOUT, image_batch, resnet_layout

import autopar
from autopar.api import search_plans
from passes import meta_keys as K
from passes.annotate import (
    PassError,
    annotate_module_paths,
    count_ops,
    count_saved_bytes,
    propagate_shapes,
)
from passes.layer_graph import build_layer_graph
from passes.trace import inputs_to_meta, to_meta, trace_module
from runtime.plan import LayerPlan, Mesh, Plan, PlanError

STEPS = 3
LR = 1e-3
# atol is a fraction of the tensor's largest element: a convolution's gradient reaches ~1
# and float32 rounding of a different summation order moves it by ~3e-6 (one process in
# float32 against float64 differs as much), so elements near zero need an absolute margin
# on that scale. A gradient twice too large (a sum for a mean) still fails by far.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
BUFFER_TOL = dict(rtol=1e-5, atol=1e-5)


def t5_model() -> tuple[nn.Module, tuple]:
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=4, use_cache=False)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, 128, (8, 16))
    return model, (ids, None, torch.randint(0, 128, (8, 8)))


# -- planning ------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 4])
def test_resnet_layout_plans_without_micro_batches(nodes):
    """In-place ReLU layers and residual adds capture; BatchNorm keeps the batch whole."""
    (images,), _ = image_batch(64)
    result = search_plans(resnet_layout(), autopar.Cluster.preset("dgx-a100-80g", nodes=nodes),
                          (images,))
    plan = result.plan
    assert plan.world_size == 8 * nodes
    assert plan.mesh.pp == 1 and plan.gradient_accumulation == 1
    assert all(c.microbatches == 1 for c in result.candidates if c.mesh.pp == 1)
    skipped = [c for c in result.candidates if c.mesh.pp > 1]
    assert len(skipped) == 1 and skipped[0].status == "skipped"
    assert "BatchNorm in training mode (bn1 first)" in skipped[0].reason


def test_forced_pipeline_mesh_for_batch_norm_model_is_refused():
    from autopar.errors import ConfigError

    (images,), _ = image_batch(64)
    with pytest.raises(ConfigError, match=r"BatchNorm in training mode \(bn1 first\)"):
        autopar.plan(resnet_layout(), "dgx-a100-80g", (images,), mesh=Mesh(pp=2, dp=4, tp=1))


@pytest.mark.parametrize("nodes", [1, 4])
def test_t5_plans(nodes):
    model, inputs = t5_model()
    plan = autopar.plan(model, autopar.Cluster.preset("dgx-a100-80g", nodes=nodes), inputs)
    assert plan.world_size == 8 * nodes
    assert {layer.module for layer in plan.layers} >= {"encoder.block.0", "decoder.block.1"}


def test_resnet_batch_norm_layers_recorded_per_layer():
    (images,), _ = image_batch(4)
    graph = build_layer_graph(resnet_layout(), (images,))
    by_name = {layer.name: layer for layer in graph.layers}
    width = 8
    assert by_name["bn1"].batch_norm_channels == (width,)
    # a first block: three BatchNorms and the projection shortcut's
    assert by_name["layer1.0"].batch_norm_channels == (width, width, 4 * width, 4 * width)
    assert by_name["layer1.1"].batch_norm_channels == (width, width, 4 * width)
    assert by_name["fc"].batch_norm_channels == ()
    eval_graph = build_layer_graph(resnet_layout().eval(), (images,))
    assert all(not layer.batch_norm_channels for layer in eval_graph.layers)


def test_batch_norm_all_reduces_are_costed():
    """Forward and backward each add, per BatchNorm, all-reduces of C+1 and C float32s over
    the dp replicas (runtime/batch_norm.py), as the cost model prices an all-reduce."""
    from autopar.planner.costs import layer_cost
    from autopar.planner.estimators import batch_norm_sync_s
    from cost_models.comm import Group, all_reduce_s
    from cost_models.memory import precision

    (images,), _ = image_batch(64)
    graph = build_layer_graph(resnet_layout(), (images,))
    layer = next(x for x in graph.layers if x.name == "layer1.0")
    cluster = autopar.Cluster.preset("dgx-a100-80g", nodes=1)
    mesh = Mesh(dp=8, tp=1)
    want = sum(all_reduce_s(n, Group(8, 1), cluster) + cluster.device.skew_s(n)
               for c in layer.batch_norm_channels for n in (4 * (c + 1), 4 * c))
    assert want > 0 and batch_norm_sync_s(layer, mesh, cluster) == pytest.approx(want)
    assert batch_norm_sync_s(layer, Mesh(dp=1, tp=8), cluster) == 0.0
    prec = precision("float32")
    with_bn = layer_cost(layer, "replicate", mesh, cluster, prec)
    import dataclasses

    without = layer_cost(dataclasses.replace(layer, batch_norm_channels=()), "replicate", mesh,
                         cluster, prec)
    assert with_bn.fwd_s - without.fwd_s == pytest.approx(want)
    assert with_bn.bwd_s - without.bwd_s == pytest.approx(want)


class _BiasAttention(nn.Module):
    """Attention with a learned bias (T5's relative position bias) or a fixed mask."""

    def __init__(self, heads: int = 2, seq: int = 16, learned: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        bias = torch.zeros(1, heads, seq, seq)
        if learned:
            self.bias = nn.Parameter(bias)
        else:
            self.register_buffer("bias", bias)

    def forward(self, q, k, v):
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias * 2.0))


def _attention_node(module: nn.Module, b: int = 4, heads: int = 2, seq: int = 16, dim: int = 8):
    inputs = inputs_to_meta(tuple(torch.randn(b, heads, seq, dim) for _ in range(3)))
    meta = to_meta(module)
    gm = trace_module(meta, inputs, prefer="export")
    annotate_module_paths(gm)
    env = propagate_shapes(gm, inputs)
    count_ops(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    count_saved_bytes(gm, nodes, env)
    return next(n for n in nodes if K.ATTENTION_KERNEL in n.meta)


def test_attention_with_learned_bias_is_costed_as_memory_efficient_kernel():
    """The efficient kernel saves q, k, v, the (b, h, s, s) bias it differentiates, the
    output, the log-sum-exp padded to 32 positions and two int64 RNG words; flash, which
    cannot take the bias's gradient, is what a fixed mask gets."""
    b, h, s, d = 4, 2, 16, 8
    node = _attention_node(_BiasAttention(h, s, learned=True), b, h, s, d)
    assert node.meta[K.ATTENTION_KERNEL] == "efficient"
    qkv_out = 4 * b * h * s * d * 4
    bias = h * s * s * 4  # the mul's output, broadcast over the batch by the kernel
    lse = b * h * 32 * 4
    assert node.meta[K.SAVED].nbytes == qkv_out + bias + lse + 2 * 8
    fixed = _attention_node(_BiasAttention(h, s, learned=False), b, h, s, d)
    assert fixed.meta[K.ATTENTION_KERNEL] == "flash"


def test_t5_position_bias_attention_is_memory_efficient():
    model, inputs = t5_model()
    meta_inputs = inputs_to_meta(inputs)
    gm = trace_module(to_meta(model), meta_inputs)
    annotate_module_paths(gm)
    env = propagate_shapes(gm, meta_inputs)
    count_ops(gm)
    count_saved_bytes(gm, [n for n in gm.graph.nodes if n.op == "call_function"], env)
    kernels = {n.meta[K.MODULE_PATH]: n.meta[K.ATTENTION_KERNEL] for n in gm.graph.nodes
               if K.ATTENTION_KERNEL in n.meta}
    assert kernels["encoder.block.1.layer.0.SelfAttention"] == "efficient"
    assert kernels["decoder.block.0.layer.0.SelfAttention"] == "efficient"
    # cross-attention's mask is the padding mask plus zeros: no gradient, flash
    assert kernels["decoder.block.0.layer.1.EncDecAttention"] == "flash"


# -- models whose forward updates state ----------------------------------------------------


class _RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("mean", torch.zeros(16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(y.mean(0), alpha=0.1)
            self.steps += 1  # fx has no in-place add: symbolic tracing would assign a Proxy
        return y - self.mean


class _Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = _RunningMean(), _RunningMean(), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_model_updating_buffers_in_forward_captures_and_plans():
    model = _Stateful()
    graph = build_layer_graph(model, (torch.randn(8, 16),))
    assert graph.extra["capture_method"] == "export"
    assert "a.steps" in graph.extra["capture_fallback_reason"]
    assert [layer.name for layer in graph.layers] == ["a", "b", "head"]
    plan = autopar.plan(model, "dgx-a100-80g", (torch.randn(8, 16),))
    assert plan.world_size == 8
    assert isinstance(model.a.steps, torch.Tensor) and int(model.a.steps) == 0


# -- training with BatchNorm on 2 ranks ----------------------------------------------------

MODELS = {
    # The ResNet-50 layout at this size is ill-conditioned in float32: one process in
    # float32 and in float64 differ by 1e-4 in the logits and by up to 9% in a gradient
    # (errors grow ~1.5x per block, BatchNorms in layer4 normalise 8 values), so any other
    # summation order, such as a split batch, moves float32 gradients by percents. It is
    # compared in float64, where rounding stays far below the tolerances; the same blocks
    # one per stage are well-conditioned and are compared in float32.
    "resnet50-layout-fp64": (LAYOUT, torch.float64, 8),
    "resnet-1111-fp32": ((1, 1, 1, 1), torch.float32, 16),
}


def _build(name: str) -> nn.Module:
    layout, dtype, _ = MODELS[name]
    return resnet_layout(layout=layout).to(dtype)


def _batch(name: str, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    _, dtype, batch = MODELS[name]
    (images,), labels = image_batch(batch, seed=step)
    return (images.to(dtype),), labels


def resnet_plan(strategy: str, name: str = "resnet-1111-fp32", dp: int = 2,
                accumulation: int = 1, recompute: str = "none") -> str:
    """Every block, the stem and the head as layers under ``strategy``, the blocks with
    ``recompute``."""
    net = _build(name)
    blocks = [f"{stage}.{i}" for stage in ("layer1", "layer2", "layer3", "layer4")
              for i in range(len(net.get_submodule(stage)))]
    names = ["conv1", "bn1", *blocks, "fc"]
    return Plan(global_batch=MODELS[name][2], mesh=Mesh(dp=dp, tp=1),
                gradient_accumulation=accumulation,
                layers=tuple(LayerPlan(module=n, strategy=strategy,
                                       recompute=recompute if n in blocks else "none")
                             for n in names)).to_json()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu().clone()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _record(model: nn.Module, losses: list, grads: dict) -> dict:
    return {"losses": losses, "grads": grads,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "buffers": {n: _full(b) for n, b in model.named_buffers()}}


def train_job(name: str, plan_json: str) -> dict:
    """3 steps under the plan on this rank; losses, first gradients, final state."""
    from runtime.train import Trainer

    model = _build(name)
    trainer = Trainer(model, Plan.from_json(plan_json), _loss,
                      lambda params: torch.optim.AdamW(params, lr=LR))
    losses, grads = [], {}
    for step in range(STEPS):
        inputs, targets = trainer.shard_batch(*_batch(name, step))
        losses.append(trainer.forward_backward(inputs, targets).item())
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        trainer.step()
    return _record(model, losses, grads)


def unsynchronised_job(name: str) -> dict:
    """Plain DDP, each rank's BatchNorm on its own half of the batch."""
    import torch.distributed as dist

    model = _build(name)
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    rank, half = dist.get_rank(), MODELS[name][2] // 2
    losses, grads = [], {}
    for step in range(STEPS):
        (x,), y = _batch(name, step)
        mine = slice(rank * half, (rank + 1) * half)
        loss = _loss(net(x[mine]), y[mine])
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return _record(model, losses, grads)


@functools.cache
def reference(name: str) -> dict:
    model = _build(name)

    def step_loss(net: nn.Module, step: int) -> torch.Tensor:
        (x,), y = _batch(name, step)
        return _loss(net(x), y)

    result = train_one_process(model, step_loss, steps=STEPS, lr=LR)
    return _record(model, result["losses"], result["grads"])


def _close(got, want, tol: dict, label: str) -> None:
    scale = want.abs().max().item() if isinstance(want, torch.Tensor) and want.numel() else 1.0
    try:
        torch.testing.assert_close(got, want, rtol=tol["rtol"],
                                   atol=tol["atol"] * max(scale, 0.1))
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


def assert_matches_reference(results: list[dict], name: str) -> None:
    ref = reference(name)
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], LOSS_TOL, f"rank {rank} losses")
        for kind, tol in (("grads", GRAD_TOL), ("params", PARAM_TOL), ("buffers", BUFFER_TOL)):
            assert got[kind].keys() == ref[kind].keys(), f"rank {rank} {kind} names"
            for key, want in ref[kind].items():
                _close(got[kind][key], want, tol, f"rank {rank} {kind} {key}")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_resnet_trains_like_one_process_with_synchronised_batch_norm(pool2, name, strategy):
    assert_matches_reference(pool2.run(train_job, name, resnet_plan(strategy, name)), name)


def test_recomputed_blocks_count_each_batch_once_in_running_statistics(pool2):
    """Full recomputation reruns each block's forward in backward; running statistics
    must still move once per step, as on one process."""
    name = "resnet-1111-fp32"
    plan = resnet_plan("fsdp", name, recompute="full")
    assert_matches_reference(pool2.run(train_job, name, plan), name)


@pytest.mark.parametrize("name", list(MODELS))
def test_comparison_catches_per_rank_batch_statistics(pool2, name):
    """Without synchronisation each rank normalises with its half's statistics: the
    comparison above must fail, or it could not catch a regression."""
    results = pool2.run(unsynchronised_job, name)
    with pytest.raises(AssertionError, match="losses"):
        assert_matches_reference(results, name)


def refused_job(plan_json: str) -> str:
    from runtime.train import Trainer

    try:
        Trainer(_build("resnet-1111-fp32"), Plan.from_json(plan_json), _loss)
    except PlanError as e:
        return str(e)
    return ""


def test_accumulation_with_batch_norm_is_refused(pool2):
    for message in pool2.run(refused_job, resnet_plan("replicate", accumulation=2)):
        assert "gradient_accumulation=2" in message
        assert "'bn1'" in message and "gradient_accumulation = 1" in message


def test_accumulation_allowed_when_batch_norm_uses_running_statistics():
    from runtime.batch_norm import check_batch_statistics

    plan = Plan.from_json(resnet_plan("replicate", accumulation=2))
    check_batch_statistics(resnet_layout().eval(), plan)
    with pytest.raises(PlanError, match="'bn1'"):
        check_batch_statistics(resnet_layout(), plan)


# -- errors --------------------------------------------------------------------------------


class _Numpy(nn.Module):
    def forward(self, x):
        return x * x.numpy().sum()  # runs on real tensors, not on the meta tensors of costing


class _Reads(nn.Module):
    def forward(self, x):
        return x * float(x.sum())  # neither capture method can follow a tensor's value


class _Wraps(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.odd = inner

    def forward(self, x):
        return self.odd(self.fc(x))


def test_failing_pass_names_module_op_and_line():
    with pytest.raises(PassError) as info:
        build_layer_graph(_Wraps(_Numpy()), (torch.randn(2, 4),))
    message = str(info.value)
    assert "op 'numpy'" in message and "in module 'odd'" in message
    assert "test_capture_real.py:" in message and "`return x * x.numpy().sum()" in message
    assert "meta tensors" in message and "control flow" not in message


def test_failing_capture_names_module_and_line_and_blames_the_data_read():
    from autopar.errors import CaptureError

    with pytest.raises(CaptureError) as info:
        trace_module(_Wraps(_Reads()), (torch.randn(2, 4),))
    message = str(info.value)
    assert "module 'odd'" in message and "`return x * float(x.sum())" in message
    assert "reading a tensor's values into Python" in message
    assert "Keep that value a tensor" in message and "without Python control flow" not in message
