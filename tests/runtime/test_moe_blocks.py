"""runtime.moe_blocks: MoE blocks are found by structure in HF and hand-written models."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from runtime.moe_blocks import MoEBlock, find_moe_blocks


def _mixtral() -> nn.Module:
    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, vocab_size=64)
    with torch.device("meta"):
        return MixtralForCausalLM(cfg)


def test_finds_mixtral_blocks_with_their_shapes():
    blocks = find_moe_blocks(_mixtral())
    assert blocks == [
        MoEBlock(path=f"model.layers.{i}.mlp", router=f"model.layers.{i}.mlp.gate",
                 experts=f"model.layers.{i}.mlp.experts", num_experts=4, top_k=2,
                 hidden_size=32, intermediate_size=48, gated=True, shared_experts=None)
        for i in range(2)
    ]
    # 4 experts x (2*48*32 + 32*48) parameters
    assert blocks[0].expert_params == 4 * 3 * 48 * 32


def test_prefix_names_blocks_under_a_submodule():
    model = _mixtral()
    blocks = find_moe_blocks(model.model.layers[1], prefix="model.layers.1")
    assert [b.experts for b in blocks] == ["model.layers.1.mlp.experts"]
    assert [b.router for b in blocks] == ["model.layers.1.mlp.gate"]


def test_finds_deepseek_v3_blocks_after_the_dense_layers_with_shared_experts():
    cfg = DeepseekV3Config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                           num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=2, topk_group=1, vocab_size=64, q_lora_rank=16,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=8)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    blocks = find_moe_blocks(model)
    assert [b.path for b in blocks] == ["model.layers.1.mlp", "model.layers.2.mlp"]
    b = blocks[0]
    assert (b.num_experts, b.top_k, b.hidden_size, b.intermediate_size) == (8, 2, 32, 16)
    assert b.shared_experts == "model.layers.1.mlp.shared_experts"


def test_finds_qwen2_moe_shared_expert_and_not_its_one_output_gate():
    cfg = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, vocab_size=64)
    with torch.device("meta"):
        blocks = find_moe_blocks(Qwen2MoeForCausalLM(cfg))
    assert [b.router for b in blocks] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert blocks[0].shared_experts == "model.layers.0.mlp.shared_expert"


def test_dense_model_has_no_blocks():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        assert find_moe_blocks(LlamaForCausalLM(cfg)) == []


class _Experts(nn.Module):
    def __init__(self, e: int, h: int, i: int, *, gated: bool = True, bias: bool = False,
                 transposed: bool = False) -> None:
        super().__init__()
        up = (e, h, 2 * i) if transposed else (e, 2 * i if gated else i, h)
        setattr(self, "gate_up_proj" if gated else "up_proj", nn.Parameter(torch.zeros(up)))
        self.down_proj = nn.Parameter(torch.zeros((e, i, h) if transposed else (e, h, i)))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        self.is_transposed = transposed
        self.act_fn = F.silu

    def forward(self, hidden, top_k_index, top_k_weights):
        return hidden


class _Block(nn.Module):
    def __init__(self, experts: nn.Module, router: nn.Module, top_k: int = 1) -> None:
        super().__init__()
        self.experts = experts
        self.router = router
        self.top_k = top_k


def test_plain_experts_and_a_linear_router_of_any_name_are_found():
    block = _Block(_Experts(3, 8, 5, gated=False), nn.Linear(8, 3, bias=False), top_k=2)
    (found,) = find_moe_blocks(nn.Sequential(block))
    assert (found.path, found.router, found.experts) == ("0", "0.router", "0.experts")
    assert (found.gated, found.intermediate_size, found.top_k) == (False, 5, 2)
    assert found.expert_param_names == ("up_proj", "down_proj")


@pytest.mark.parametrize("experts, router, top_k", [
    (_Experts(4, 8, 6, bias=True), nn.Linear(8, 4), 1),          # biased experts
    (_Experts(4, 8, 6, transposed=True), nn.Linear(8, 4), 1),    # GPT-OSS-like layout
    (_Experts(4, 8, 6), nn.Linear(8, 3), 1),                     # router of 3, 4 experts
    (_Experts(4, 8, 6), nn.Linear(8, 4), 5),                     # top-k above E
])
def test_layouts_the_ep_runtime_cannot_shard_are_not_blocks(experts, router, top_k):
    assert find_moe_blocks(_Block(experts, router, top_k)) == []


def test_finds_the_zoo_moe_blocks():
    from autopar.zoo import get_model

    spec = get_model("moe-tiny")
    blocks = find_moe_blocks(spec.build("meta"))
    cfg = spec.config
    assert [b.experts for b in blocks] == [f"h.{i}.mlp.experts" for i in range(cfg.n_layer)]
    assert {(b.num_experts, b.top_k, b.hidden_size, b.intermediate_size, b.gated)
            for b in blocks} == {(4, 2, 64, 64 * 4 // 2, True)}
