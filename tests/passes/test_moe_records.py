"""passes.moe: the layer holding a MoE block records its shape, tokens and what the
capture counted for its experts; a block whose router and experts are separate layers is
not recorded (nothing could split it as one unit)."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.zoo import Experts, TopKRouter
from passes.layer_graph import build_layer_graph

H, E, WIDTH, K = 16, 4, 32, 2


class Loose(nn.Module):
    """Router and experts as two children of the root: two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.gate = TopKRouter(H, E, K)
        self.experts = Experts(H, E, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x)
        return self.experts(x, index, weights)


class Held(nn.Module):
    """The same block as one child, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = Loose()
        self.head = nn.Linear(H, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


def test_the_layer_holding_a_block_records_it():
    """12 tokens, top-2: 24 rows through SwiGLU experts of H = 16, I = 32: the op registers
    24·(2·16·64 + 2·32·16) = 73,728 FLOPs; 4 experts of 16·64 + 32·16 = 1,536 weights."""
    with torch.device("meta"):
        model = Held()
    graph = build_layer_graph(model, (torch.zeros(12, H, device="meta"),))
    layers = {x.name: x for x in graph.layers}
    assert not layers["head"].moe
    (block,) = layers["moe"].moe
    assert (block.block, block.experts) == ("", "experts")
    assert block.tokens == 12
    assert (block.shape.num_experts, block.shape.top_k, block.shape.hidden_size,
            block.shape.intermediate_size, block.shape.gated) == (E, K, H, WIDTH, True)
    assert block.param_count == 4 * 1536 and block.param_tensors == 2
    assert block.fwd_flops == 73_728
    assert 0 < block.saved_bytes <= layers["moe"].saved_bytes
    assert 0 < block.num_ops <= layers["moe"].num_ops


def test_a_block_split_over_two_layers_is_not_recorded():
    with torch.device("meta"):
        model = Loose()
    graph = build_layer_graph(model, (torch.zeros(12, H, device="meta"),))
    assert [x.name for x in graph.layers] == ["gate", "experts"]
    assert all(not x.moe for x in graph.layers)
