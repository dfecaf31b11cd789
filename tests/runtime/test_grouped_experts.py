"""runtime.grouped_experts and the zoo MoE built on it: the numbers of a token-by-token
mixture of experts, gradients, FLOPs, and capture on meta tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.zoo import get_model, gpt_param_count
from runtime.grouped_experts import expert_mlp, grouped_swiglu


def _token_by_token(experts, hidden, index, weights):
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gate, up = (experts.gate_up_proj[e] @ hidden[t]).chunk(2)
            out[t] += weights[t, j] * (experts.down_proj[e] @ (F.silu(gate) * up))
    return out


def test_zoo_experts_equal_each_token_through_its_chosen_experts():
    experts = get_model("moe-tiny").build().h[0].mlp.experts.double()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 64, dtype=torch.float64, generator=gen)
    index = torch.randint(0, 4, (10, 2), generator=gen)
    weights = torch.rand(10, 2, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(experts(hidden, index, weights),
                               _token_by_token(experts, hidden, index, weights))


def test_grouped_swiglu_gradients_with_idle_experts():
    gen = torch.Generator().manual_seed(1)
    rows, gate_up, down = (torch.randn(*s, dtype=torch.float64, generator=gen).requires_grad_()
                           for s in ((7, 5), (4, 6, 5), (4, 5, 3)))
    counts = torch.tensor([2, 0, 5, 0])
    assert gradcheck(lambda r, a, b: grouped_swiglu(r, counts, a, b), (rows, gate_up, down))


def test_expert_mlp_with_no_rows_still_gives_every_weight_a_zero_gradient():
    up = torch.randn(2, 6, 4, requires_grad=True)
    down = torch.randn(2, 4, 3, requires_grad=True)
    out = expert_mlp(torch.zeros(0, 4), [0, 0], up, down, F.silu, gated=True)
    out.sum().backward()
    assert out.shape == (0, 4)
    assert torch.count_nonzero(up.grad) == 0 and torch.count_nonzero(down.grad) == 0


def test_grouped_swiglu_flops_are_three_gemms_per_row():
    rows, gate_up, down = torch.randn(7, 5), torch.randn(4, 6, 5), torch.randn(4, 5, 3)
    with FlopCounterMode(display=False) as counter:
        grouped_swiglu(rows, torch.tensor([2, 0, 5, 0]), gate_up, down)
    # per row: [5] x [5, 6] then [3] x [3, 5]: 2*5*6 + 2*3*5 multiply-adds
    assert counter.get_total_flops() == 7 * (2 * 5 * 6 + 2 * 3 * 5)


def test_moe_tiny_is_captured_and_planned_on_meta():
    spec = get_model("moe-tiny")
    model = spec.build("meta")
    # 2 blocks of: router 4x64, experts 4 x (256x64 + 64x128), attention, 2 norms
    assert sum(p.numel() for p in model.parameters()) == gpt_param_count(spec.config)
    plan = autopar.plan(model, autopar.Cluster.local(), spec.example_inputs(8, 16))
    assert {layer.module for layer in plan.layers} >= {"h.0", "h.1"}
