"""Sequence parallelism: offered from graph facts, trains like one process, saves what it says.

Numerics use the helpers and tolerances of tests/runtime/test_runtime_numerics.py (3 AdamW steps of
the seeded gpt-tiny, losses / first gradients / final parameters against one process).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_runtime_numerics import (
    BLOCK_TP,
    GPT,
    _plan,
    _spec,
    assert_matches_reference,
    bad_plan_job,
    train_job,
)
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.zoo import get_model
from passes.layer_graph import build_layer_graph
from runtime.plan import LayerPlan, Plan, PlanError

F32 = 4
BLOCK_SP = {"ln_1": "sequence_parallel", **{k: v for k, v in BLOCK_TP.items() if "attn" in k},
            "ln_2": "sequence_parallel", **{k: v for k, v in BLOCK_TP.items() if "mlp" in k}}


@pytest.fixture(scope="module")
def tiny_graph():
    spec = get_model("gpt-tiny")
    return build_layer_graph(spec.build("meta"), spec.example_inputs(8, 16))


# -- graph: when SP is offered, and its numbers ----------------------------------------------


def test_gpt_blocks_get_sp_styles_saved_bytes_and_collectives(tiny_graph):
    b, s, h = 8, 16, 64
    a = b * s * h * F32
    stats = 2 * b * s * F32  # LayerNorm mean and rstd, one per token
    for block in tiny_graph.layers[2:4]:
        tp = block.tp
        assert tp.sp_styles == BLOCK_SP  # in execution order, TP styles unchanged beside it
        assert tp.styles == BLOCK_TP
        # What runs on sequence shards saves: ln_1's input (the block input) and statistics,
        # ln_2's input (the residual after attention) and statistics. ln_1/ln_2 outputs are
        # saved by q/k/v and fc_in as the gathered, whole-sequence tensor: not divided.
        assert tp.sp_saved_bytes == 2 * (a + stats)
        kinds = sorted((c.kind, c.phase, c.nbytes) for c in tp.sp_collectives)
        # one gather per TP region (ln_1 out for q/k/v together, ln_2 out for fc_in), one
        # reduce-scatter per rowwise output; backward swaps them.
        assert kinds == sorted([("all_gather", "fwd", a), ("reduce_scatter", "bwd", a),
                                ("reduce_scatter", "fwd", a), ("all_gather", "bwd", a)] * 2)
    for name in ("wte", "lm_head"):  # single-module splits: input or output is not [b, s, h]
        layer = next(la for la in tiny_graph.layers if la.name == name)
        assert layer.tp.sp_collectives is None and layer.tp.sp_styles is None
        assert layer.tp.sp_saved_bytes == 0


class _Block(nn.Module):
    """Pre-norm MLP block; ``mix`` adds a token-mixing op between the TP regions, or
    ("gate") scales the MLP's output by a learned gate, as Mllama's gated layers do."""

    def __init__(self, mix: str = "", d: int = 16) -> None:
        super().__init__()
        self.mix = mix
        self.norm = nn.LayerNorm(d)
        self.fc_in, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        h = self.fc_out(F.gelu(self.fc_in(self.norm(x))))
        x = x + (torch.tanh(self.gate) * h if self.mix == "gate" else h)
        if self.mix == "mean":
            x = x - x.mean(dim=1, keepdim=True)  # every token reads the whole sequence
        if self.mix == "cumsum":
            x = x.cumsum(1)
        return x


class _Wrap(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block])

    def forward(self, x):
        return self.blocks[0](x)


def _block_option(block: nn.Module, prefer: str = "symbolic_trace"):
    return build_layer_graph(_Wrap(block), (torch.randn(2, 6, 16),), prefer=prefer).layers[0].tp


@pytest.mark.parametrize("prefer", ["symbolic_trace", "export"])
def test_a_per_token_block_with_colwise_directly_inside_gathers_at_the_linear(prefer):
    tp = _block_option(_Block(), prefer)
    assert tp.sp_styles == {"norm": "sequence_parallel", "fc_in": "colwise", "fc_out": "rowwise"}
    assert tp.sp_saved_bytes == 2 * 6 * (16 + 2) * F32  # norm input and its statistics
    assert [(c.kind, c.phase) for c in tp.sp_collectives] == [
        ("all_gather", "fwd"), ("reduce_scatter", "fwd"),
        ("reduce_scatter", "bwd"), ("all_gather", "bwd")]


@pytest.mark.parametrize("mix", ["mean", "cumsum"])
def test_token_mixing_between_regions_gets_no_sp(mix):
    tp = _block_option(_Block(mix))
    assert tp is not None and tp.styles == {"fc_in": "colwise", "fc_out": "rowwise"}
    assert tp.sp_collectives is None and tp.sp_styles is None and tp.sp_saved_bytes == 0


@pytest.mark.parametrize("prefer", ["symbolic_trace", "export"])
def test_a_learned_gate_on_sequence_shards_gets_no_sp(prefer):
    """tanh(gate) is made outside any module that runs on shards: each rank's gradient of
    the gate would sum its own tokens only."""
    tp = _block_option(_Block("gate"), prefer)
    assert tp.styles == {"fc_in": "colwise", "fc_out": "rowwise"} and tp.sp_styles is None


def test_a_block_on_2d_inputs_gets_no_sp():
    spec = get_model("mlp")
    lg = build_layer_graph(spec.build("meta"), spec.example_inputs(16))
    block = next(la for la in lg.layers if la.name == "blocks.0")
    assert block.tp.styles and block.tp.sp_collectives is None


# -- numerics on 2 and 4 ranks ---------------------------------------------------------------


def _gpt(dp: int, tp: int, h0: LayerPlan, h1: LayerPlan, *, seq_model=GPT) -> str:
    return _plan(
        dp, tp, seq_model[2],
        LayerPlan(module="wte", strategy="tp", tp_styles={"": "embedding_rowwise"}),
        LayerPlan(module="wpe", strategy="replicate"),
        h0, h1,
        LayerPlan(module="ln_f", strategy="replicate"),
        LayerPlan(module="lm_head", strategy="tp", tp_styles={"": "colwise_gather"}),
    )


def _sp(name: str, strategy: str = "tp") -> LayerPlan:
    return LayerPlan(module=name, strategy=strategy, tp_styles=BLOCK_SP, sequence_parallel=True)


def _tp(name: str, strategy: str = "tp") -> LayerPlan:
    return LayerPlan(module=name, strategy=strategy, tp_styles=BLOCK_TP)


CASES_2 = {
    "all blocks sp": _gpt(1, 2, _sp("h.0"), _sp("h.1")),
    "sp then plain tp": _gpt(1, 2, _sp("h.0"), _tp("h.1")),
    "fsdp then sp": _gpt(1, 2, LayerPlan(module="h.0", strategy="fsdp"), _sp("h.1", "tp_fsdp")),
}
CASES_4 = {
    "all blocks sp, tp_fsdp": _gpt(2, 2, _sp("h.0", "tp_fsdp"), _sp("h.1", "tp_fsdp")),
    "sp then fsdp": _gpt(2, 2, _sp("h.0", "tp_fsdp"), LayerPlan(module="h.1", strategy="fsdp")),
}


def many_train_jobs(plans: list[str]) -> list[dict]:
    """Several plans in one pool job: each rank trains them one after the other."""
    return [train_job(GPT, plan) for plan in plans]


def test_sequence_parallel_trains_like_one_process_on_2_ranks(pool2):
    results = pool2.run(many_train_jobs, list(CASES_2.values()))
    for i, case in enumerate(CASES_2):
        try:
            assert_matches_reference([r[i] for r in results], GPT)
        except AssertionError as e:
            raise AssertionError(f"case {case!r}: {e}") from None


def test_sequence_parallel_trains_like_one_process_on_dp2_x_tp2(pool4):
    results = pool4.run(many_train_jobs, list(CASES_4.values()))
    for i, case in enumerate(CASES_4):
        try:
            assert_matches_reference([r[i] for r in results], GPT)
        except AssertionError as e:
            raise AssertionError(f"case {case!r}: {e}") from None


# -- saved activations really shrink ----------------------------------------------------------


def saved_bytes_job(plan_json: str) -> int:
    """Bytes autograd saves in one forward + loss on this rank (parameters excluded;
    DTensors counted by their local shard; storages counted once)."""
    from runtime.mesh import build_mesh, data_parallel_meshes
    from runtime.tensor_parallel import apply_tensor_parallel

    spec, plan = _spec(GPT), Plan.from_json(plan_json)
    model = spec.build(seed=0)
    meshes = data_parallel_meshes(build_mesh(plan.mesh, "cpu"))
    apply_tensor_parallel(model, list(plan.layers), meshes.tp)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = {StorageWeakRef(local(p.detach()).untyped_storage()) for p in model.parameters()}
    seen: set = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(local(t).untyped_storage())
        if ref not in params and ref not in seen:
            seen.add(ref)
            sizes.append(local(t).untyped_storage().nbytes())
        return t

    sizes: list[int] = []
    inputs, targets = spec.make_batch(GPT[2], GPT[3], seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = spec.loss_fn(model(*inputs), targets)
    loss.backward()
    return sum(sizes)


def test_sp_divides_the_saved_bytes_the_graph_says(pool2, tiny_graph):
    tp = 2
    with_sp = pool2.run(saved_bytes_job, _gpt(1, tp, _sp("h.0"), _sp("h.1")))
    without = pool2.run(saved_bytes_job, _gpt(1, tp, _tp("h.0"), _tp("h.1")))
    predicted = sum(la.tp.sp_saved_bytes for la in tiny_graph.layers[2:4]) * (1 - 1 / tp)
    for rank in range(2):
        saved = without[rank] - with_sp[rank]
        # Tolerance 1%: the model of saved bytes is exact here, but DTensor bookkeeping may
        # keep a few small tensors of its own.
        assert abs(saved - predicted) <= 0.01 * predicted, (rank, saved, predicted)


# -- bad input: clear PlanErrors ---------------------------------------------------------------


def uneven_sequence_job(plan_json: str, seq: int) -> str:
    from runtime.train import Trainer

    spec = _spec(GPT)
    trainer = Trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn)
    try:
        trainer.forward_backward(*trainer.shard_batch(*spec.make_batch(8, seq)))
    except PlanError as e:
        return str(e)
    return "no error"


def test_sequence_not_divisible_by_tp_is_rejected_at_the_first_forward(pool2):
    messages = pool2.run(uneven_sequence_job, _gpt(1, 2, _sp("h.0"), _sp("h.1")), 15)
    for m in messages:
        assert "'h.0'" in m and "sequence length 15" in m and "tp=2" in m, m


BAD_SP_PLANS = {
    "sequence_parallel without sp styles": (
        _plan(1, 2, 8, LayerPlan(module="h.0", strategy="tp", tp_styles=BLOCK_TP,
                                 sequence_parallel=True)),
        ["'h.0'", "no tp_styles entry is 'sequence_parallel'", "sp_styles"],
    ),
    "sp style without the flag": (
        _plan(1, 2, 8, LayerPlan(module="h.0", strategy="tp", tp_styles=BLOCK_SP)),
        ["'h.0'", "tp_styles['ln_1'] = 'sequence_parallel'", "sequence_parallel is false"],
    ),
    "sp on a gathered head": (
        _plan(1, 2, 8, LayerPlan(module="lm_head", strategy="tp", sequence_parallel=True,
                                 tp_styles={"": "colwise_gather"})),
        ["'lm_head'", "no tp_styles entry is 'sequence_parallel'"],
    ),
    "sp style on a missing submodule": (
        _plan(1, 2, 8, LayerPlan(module="h.0", strategy="tp", sequence_parallel=True,
                                 tp_styles={**BLOCK_SP, "ln_3": "sequence_parallel"})),
        ["'h.0.ln_3'", "no submodule"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_SP_PLANS))
def test_bad_sp_plan_is_rejected_before_any_collective(pool2, case):
    plan_json, phrases = BAD_SP_PLANS[case]
    message = pool2.run(bad_plan_job, GPT, plan_json)[0]
    assert message.startswith("PlanError"), message
    for phrase in phrases:
        assert phrase in message, (phrase, message)
