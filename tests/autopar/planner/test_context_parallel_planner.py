"""Context parallelism in the planner: when a model can use it, what it costs, when it wins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.errors import ConfigError
from autopar.planner.configs import candidate_meshes, context_degrees
from autopar.planner.costs import layer_cost
from autopar.planner.estimators import RING_MERGE_KERNELS
from autopar.planner.search import search
from autopar.zoo import GPT, GPTConfig
from cost_models.comm import p2p_s
from cost_models.compute import roofline_s
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh

DGX = Cluster.preset("dgx-a100-80g", nodes=1)
BF16 = precision("bfloat16")


def gpt_graph(seq: int, batch: int, *, layers: int = 4, hidden: int = 4096, heads: int = 32,
              **config):
    cfg = GPTConfig(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=32000,
                    block_size=seq, **config)
    with torch.device("meta"):
        model = GPT(cfg)
    return build_layer_graph(model, (torch.zeros(batch, seq, dtype=torch.long,
                                                 device="meta"),), model_name="gpt")


class NoPositions(GPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(idx)


def test_context_parallel_wins_at_128k_and_not_at_2k():
    # Same model and 8 GPUs. At 2K with 64 samples data parallelism splits the batch and
    # context parallelism only adds ring steps. At 128K a whole sample's activations do
    # not fit one GPU without recomputation, so splitting the sequence wins.
    short = search(gpt_graph(2048, 64, layers=8), DGX, precision_name="bfloat16",
                   pipeline=False).plan
    assert short.mesh.cp == 1
    long_graph = gpt_graph(131072, 8, layers=8)
    long = search(long_graph, DGX, precision_name="bfloat16", pipeline=False).plan
    assert long.mesh.cp > 1
    # The data-parallel plan of the same sequence exists but is slower.
    dp_only = search(long_graph, DGX, precision_name="bfloat16", pipeline=False,
                     mesh=Mesh(dp=8)).plan
    assert dp_only.prediction.step_time_s > long.prediction.step_time_s


def test_context_parallel_splits_tokens_like_data_parallel_plus_a_ring():
    """Against cp = 1 with the same number of replicas: the same compute, states and
    activations per rank; on top, cp − 1 ring steps that each send one K/V block."""
    batch, seq, hidden = 8, 4096, 1024
    graph = gpt_graph(seq, batch, layers=1, hidden=hidden, heads=16)
    block_layer = next(la for la in graph.layers if la.attention_kv_bytes)
    # K and V: [b, s, h] each, captured in fp32.
    assert block_layer.attention_kv_bytes == 2 * batch * seq * hidden * 4
    by_dp = layer_cost(block_layer, "replicate", Mesh(dp=2), DGX, BF16)
    by_cp = layer_cost(block_layer, "replicate", Mesh(cp=2), DGX, BF16)
    assert by_cp.activations_bytes == by_dp.activations_bytes
    assert by_cp.states_bytes == by_dp.states_bytes
    assert by_cp.compute_s == by_dp.compute_s
    assert by_cp.wgrad_s == by_dp.wgrad_s
    # One ring step: this rank's K/V block, [b, s/2, h] twice in bf16, over NVLink; it hides
    # behind attending to the block in hand (half of this rank's attention compute).
    block = 2 * batch * (seq // 2) * hidden * 2
    share = block_layer.attention_fwd_flops / block_layer.fwd_flops
    attend = share * by_dp.fwd_s / 2
    merge = roofline_s(0.0, 3 * block / 2, RING_MERGE_KERNELS, DGX.device, "float32")
    transfer = p2p_s(block, DGX.intra_node)
    assert by_cp.fwd_s - by_dp.fwd_s == pytest.approx(max(0.0, transfer - attend) + merge)
    assert by_cp.bwd_s - by_dp.bwd_s == pytest.approx(
        max(0.0, 2 * transfer - 2 * attend) + merge)
    assert by_cp.buffers_bytes - by_dp.buffers_bytes == pytest.approx(4 * block)


def test_ring_transfer_hides_behind_long_attention_but_not_short():
    def exposed(seq: int) -> float:
        graph = gpt_graph(seq, 1, layers=1, hidden=1024, heads=16)
        layer = next(la for la in graph.layers if la.attention_kv_bytes)
        ring = (layer_cost(layer, "replicate", Mesh(cp=8), DGX, BF16).fwd_s
                - layer_cost(layer, "replicate", Mesh(dp=8), DGX, BF16).fwd_s)
        block = layer.attention_kv_bytes * BF16.activation_bytes / 4 / 8
        merge = roofline_s(0.0, 3 * block / 2, RING_MERGE_KERNELS, DGX.device, "float32")
        return ring - 7 * merge
    assert exposed(65536) == pytest.approx(0.0, abs=1e-12)
    assert exposed(512) > 0


@pytest.mark.parametrize("config, model_class, problem", [
    (dict(attention="unfused"), GPT, "calls no F.scaled_dot_product_attention"),
    (dict(dropout=0.1), GPT, "attention dropout 0.1 at h.0.attn"),
    ({}, NoPositions, "takes no position ids"),
])
def test_models_that_cannot_split_their_sequence_get_no_context_parallel_mesh(
        config, model_class, problem):
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=128, block_size=64, **config)
    graph = build_layer_graph(model_class(cfg), (torch.zeros(2, 64, dtype=torch.long),))
    assert problem in graph.context_parallel_problem
    meshes = candidate_meshes(DGX, 8, seq_len=64,
                              context_parallel=graph.context_parallel_problem is None)
    assert all(m.cp == 1 for m, _ in meshes)
    with pytest.raises(ConfigError, match=f"cannot run context-parallel: .*{problem}"):
        search(graph, DGX, mesh=Mesh(dp=1, cp=8), pipeline=False)


def test_a_model_with_fused_causal_attention_and_positions_can_split():
    graph = gpt_graph(64, 2, layers=1, hidden=64, heads=4)
    assert graph.context_parallel_problem is None
    assert {m.cp for m, _ in candidate_meshes(DGX, 8, seq_len=64, context_parallel=True)} == \
        {1, 2, 4, 8}


def test_context_degrees_need_two_chunks_per_rank():
    assert context_degrees(8, 4096) == [1, 2, 4, 8]
    assert context_degrees(8, 12) == [1, 2]  # 12 splits into 2·cp chunks for cp = 1, 2, 3
    assert context_degrees(6, 4096) == [1, 2]  # cp must divide the ranks
    assert context_degrees(8, None) == [1]


def test_fixed_mesh_must_split_the_sequence_evenly():
    graph = gpt_graph(72, 2, layers=1, hidden=64, heads=4)  # 72 = 2·cp·k for cp ≤ 4 only
    with pytest.raises(ConfigError, match="2·cp equal chunks"):
        search(graph, DGX, mesh=Mesh(dp=1, cp=8), pipeline=False)


def test_a_module_without_attention_is_not_context_parallel():
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
            return self.fc(x)

    graph = build_layer_graph(MLP(), (torch.zeros(2, 4, 8),))
    assert "calls no F.scaled_dot_product_attention" in graph.context_parallel_problem
