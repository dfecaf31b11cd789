"""GEMM sizes in the layer costs: captured per node, mapped under each option, priced on
the efficiency curve e(d) = E∞·d/(d + d½) of the smallest dimension d."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from planner_cases import make_cluster

from autopar.planner.costs import allowed_options, layer_cost
from autopar.zoo import GPT, GPTConfig
from cost_models.compute import gemm_shortfall_flops
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from passes.records import GemmShape, LayerInfo, TPOption
from runtime.plan import Mesh, option_label

FP32 = precision("float32")
PEAK, E_INF, HALF = 100e12, 0.5, 64.0
CLUSTER = make_cluster(per_node=4)
CLUSTER = replace(CLUSTER, device=replace(CLUSTER.device, matmul_efficiency=E_INF,
                                          matmul_half_dim={"float32": HALF}))


class Block(nn.Module):
    """A Linear on a [b, s, 16] input, then a product of two head-split activations."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.proj(x).view(b, s, 2, 12).transpose(1, 2)  # [b, 2 heads, s, 12]
        return y @ y.transpose(-1, -2)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks[0](x)
        return out + self.blocks[1](x)


@pytest.mark.parametrize("prefer", ["symbolic_trace", "export"])
def test_capture_records_a_linears_and_a_batched_products_dims(prefer):
    graph = build_layer_graph(Stack(), (torch.randn(3, 5, 16),), prefer=prefer)
    block = graph.layers[0]
    assert block.name == "blocks.0"
    linear = GemmShape(module="proj", flops=2.0 * 15 * 24 * 16, m=15, n=24, k=16)
    scores = GemmShape(module="", flops=2.0 * 6 * 5 * 5 * 12, m=5, n=5, k=12, batch=6,
                       batched=True)
    assert block.gemms == (linear, scores)
    assert sum(g.flops for g in block.gemms) == block.fwd_flops
    assert graph.layers[1].gemms == block.gemms


# One block at the captured batch of 8 samples × 512 tokens: fc_in 256 -> 1024 (colwise),
# fc_out 1024 -> 256 (rowwise), attention scores over 8 samples × 4 heads of dim 64, and
# fused-attention FLOPs that are no GEMM. All of it splits under TP.
TOKENS = 8 * 512
FC_IN = GemmShape(module="fc_in", flops=2.0 * TOKENS * 1024 * 256, m=TOKENS, n=1024, k=256)
FC_OUT = GemmShape(module="fc_out", flops=2.0 * TOKENS * 256 * 1024, m=TOKENS, n=256, k=1024)
SCORES = GemmShape(module="attn", flops=2.0 * 32 * 512 * 512 * 64, m=512, n=512, k=64,
                   batch=32, batched=True)
FUSED = 3e9
FWD = FC_IN.flops + FC_OUT.flops + SCORES.flops + FUSED


def block(gemms: tuple[GemmShape, ...] = (FC_IN, FC_OUT, SCORES)) -> LayerInfo:
    tp = TPOption(styles={"fc_in": "colwise", "fc_out": "rowwise"}, divisors=(4,),
                  sharded_param_bytes=0, sharded_fwd_flops=FWD, sharded_saved_bytes=0,
                  collectives=())
    return LayerInfo(name="h.0", layer_class="Block#0", index=0, param_count=0,
                     param_bytes=0, fwd_flops=FWD, bwd_flops=2 * FWD, saved_bytes=0,
                     output_bytes=0, mem_bytes=0, num_ops=0, gemms=gemms, tp=tp)


def at(flops: float, d: float) -> float:
    """Seconds of a GEMM of ``flops`` FLOPs whose smallest dimension is d, by hand."""
    return flops / (PEAK * E_INF * d / (d + HALF))


def test_forward_prices_each_gemm_at_its_size_after_the_batch_split():
    # dp 2 × 2 micro-batches: 1024 tokens per micro-batch. fc_in 1024×1024×256 and fc_out
    # 1024×256×1024 have smallest dim 256, the scores 512×512×64 dim 64.
    cost = layer_cost(block(), "replicate", Mesh(dp=2), CLUSTER, FP32, 2)
    expected = (at(FC_IN.flops / 4, 256) + at(FC_OUT.flops / 4, 256)
                + at(SCORES.flops / 4, 64) + FUSED / 4 / (PEAK * E_INF))
    assert cost.fwd_s == pytest.approx(expected, rel=1e-12)
    assert cost.bwd_s + cost.wgrad_s == pytest.approx(2 * expected, rel=1e-12)


def test_tensor_parallel_splits_colwise_out_and_rowwise_in_features():
    # tp 4, dp 2: 4096 / 2 = 2048 tokens; fc_in 2048×(1024/4)×256 and fc_out 2048×256×(1024/4)
    # have smallest dim 256; the scores keep 512×512×64 on a quarter of the heads.
    cost = layer_cost(block(), option_label("tp", "none", False, False), Mesh(dp=2, tp=4),
                      CLUSTER, FP32)
    expected = (at(FC_IN.flops / 8, 256) + at(FC_OUT.flops / 8, 256)
                + at(SCORES.flops / 8, 64) + FUSED / 8 / (PEAK * E_INF))
    assert cost.fwd_s == pytest.approx(expected, rel=1e-12)


def test_tensor_parallel_can_make_the_weight_dim_the_smallest():
    # tp 8, 4 micro-batches: 1024 tokens; fc_in 1024×128×256 (n = 1024/8) and fc_out
    # 1024×256×128 (k = 1024/8): smallest dim 128.
    cost = layer_cost(block((FC_IN, FC_OUT)), option_label("tp", "none", False, False),
                      Mesh(tp=8), CLUSTER, FP32, 4)
    expected = (at(FC_IN.flops / 32, 128) + at(FC_OUT.flops / 32, 128)
                + (SCORES.flops + FUSED) / 32 / (PEAK * E_INF))
    assert cost.fwd_s == pytest.approx(expected, rel=1e-12)


def test_shortfall_is_the_extra_asymptote_flops_of_the_curve():
    assert gemm_shortfall_flops([(1e9, 64.0), (2e9, 256.0)], CLUSTER.device, "float32") == \
        pytest.approx(1e9 * 64 / 64 + 2e9 * 64 / 256)
    with pytest.raises(ValueError, match="positive"):
        gemm_shortfall_flops([(1e9, 0.0)], CLUSTER.device, "float32")


def small_gpt() -> list[LayerInfo]:
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=256, block_size=64,
                    attention="unfused", dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(8, 64, dtype=torch.long)
    return list(build_layer_graph(model, (tokens,)).layers)


def test_zero_half_dim_reproduces_the_large_gemm_rate_exactly():
    saturating = replace(CLUSTER, device=replace(CLUSTER.device, matmul_half_dim={
        "float32": 0.0}))
    mesh = Mesh(dp=2, tp=2)
    priced = 0
    for layer in small_gpt():
        blind = replace(layer, gemms=())
        for option in allowed_options(layer, mesh, seq_len=64):
            with_sizes = layer_cost(layer, option, mesh, saturating, FP32, 2)
            assert with_sizes == layer_cost(blind, option, mesh, saturating, FP32, 2)
            priced += bool(layer.gemms)
    assert priced > 0


def test_small_gpt_gemms_cost_more_than_at_the_asymptote():
    mesh = Mesh(dp=2, tp=2)
    blocks = [layer for layer in small_gpt() if layer.name.startswith("h.")]
    assert blocks[0].layer_class == blocks[1].layer_class  # GEMMs keep them identical
    assert blocks[0].gemms == blocks[1].gemms
    for option in ("replicate", option_label("tp", "none", False, False)):
        sized = layer_cost(blocks[0], option, mesh, CLUSTER, FP32)
        blind = layer_cost(replace(blocks[0], gemms=()), option, mesh, CLUSTER, FP32)
        assert sized.fwd_s > blind.fwd_s
        assert sized.bwd_s > blind.bwd_s
