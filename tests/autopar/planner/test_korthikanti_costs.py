"""Activation memory per layer as the planner prices it, against Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022), §4.

A Megatron-shaped block (unfused softmax attention, dropout on the attention probabilities
and after each of the two rowwise Linears) in 16-bit activations with 1-byte dropout masks,
sequence s, micro-batch b, hidden h, a heads, tensor-parallel degree t. Bytes per layer:

    none                     sbh·(34 + 5as/h)                         (eq. 1)
    TP                       sbh·(10 + 24/t + 5as/(ht))               (eq. 2)
    TP + SP                  sbh·(34/t + 5as/(ht))                    (eq. 4)
    full recomputation       2sbh, with SP 2sbh/t                     (§4.3)

Where autopar's runtime differs from Megatron-LM, the difference is derived and asserted:

- LayerNorm statistics (mean and rstd, [s, b] each per norm) are saved too: +8sb bytes
  (the paper leaves them out), divided by t under SP.
- PyTorch's sequence parallelism saves the all-gathered input of the colwise Linears whole
  (Megatron keeps its shard and gathers again in backward): +4sbh·(1 − 1/t) for the two
  gathered norm outputs.
- Selective recomputation is torchtitan's policy (runtime.plan.SELECTIVE_SAVE_OPS): keep the
  layer input and the weight-matmul and collective outputs, rerun the rest. That keeps
  the input 2sbh, Q/K/V 6sbh/t, the attention projection's output 2sbh, the MLP's first
  Linear 8sbh/t and its second 2sbh: sbh·(6 + 14/t); with SP the three replicated ones are
  sequence shards, plus the gathered inputs: sbh·20/t + 4sbh·(1 − 1/t). Both are below the
  paper's selective sbh·(10 + 24/t) (attention core only).
"""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.planner.costs import layer_cost
from autopar.zoo import GPT, GPTConfig
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from passes.records import LayerInfo
from runtime.plan import Mesh

S, B, H, A = 64, 2, 64, 8
SBH, SB = S * B * H, S * B
STATS = 8 * SB
DGX = Cluster.preset("dgx-a100-80g", nodes=1)


@functools.cache
def block() -> LayerInfo:
    cfg = GPTConfig(n_layer=1, n_head=A, n_embd=H, vocab_size=128, block_size=S,
                    attention="unfused", dropout=0.1)
    graph = build_layer_graph(GPT(cfg), (torch.zeros(B, S, dtype=torch.long),))
    return next(layer for layer in graph.layers if layer.name == "h.0")


def saved(option: str, t: int, dtype: str = "float16") -> float:
    """Activation bytes one rank keeps for one micro-batch of the block."""
    cost = layer_cost(block(), option, Mesh(dp=1, tp=t), DGX, precision(dtype))
    return cost.activations_bytes


def test_no_parallelism_is_equation_1():
    assert saved("replicate", 1) == SBH * (34 + 5 * A * S / H) + STATS


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_is_equation_2(t):
    # Everything between a colwise and a rowwise Linear (Q, K, V, the s×s scores with their
    # mask, the MLP's 4h activations) divides by t; norms, dropout after the rowwise
    # Linears and the residual stream do not.
    assert saved("tp", t) == SBH * (10 + 24 / t + 5 * A * S / (H * t)) + STATS


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_is_equation_4_plus_the_gathered_inputs(t):
    gathered = 4 * SBH * (1 - 1 / t)
    assert saved("tp+sp", t) == SBH * (34 / t + 5 * A * S / (H * t)) + gathered + STATS / t


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_full_recomputation_keeps_the_layer_input(t, sp):
    option = "replicate+full" if t == 1 else ("tp+sp+full" if sp else "tp+full")
    assert saved(option, t) == 2 * SBH / (t if sp else 1)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_selective_recomputation_keeps_inputs_and_matmul_outputs(t):
    option = "replicate+selective" if t == 1 else "tp+selective"
    assert saved(option, t) == SBH * (6 + 14 / t)
    assert saved(option, t) <= SBH * (10 + 24 / t)  # at least the paper's saving


@pytest.mark.parametrize("t", [2, 4])
def test_selective_with_sequence_parallel(t):
    assert saved("tp+sp+selective", t) == SBH * 20 / t + 4 * SBH * (1 - 1 / t)


def test_masks_do_not_scale_with_precision():
    """In fp32 the floating activations double; the 1-byte masks (a·s²·b of attention
    dropout, 2·sbh after the rowwise Linears) do not."""
    masks = A * S * S * B + 2 * SBH
    assert saved("replicate", 1, "float32") == 2 * (saved("replicate", 1) - masks) + masks
    sharded_masks = A * S * S * B / 2 + 2 * SBH
    assert saved("tp", 2, "float32") == 2 * (saved("tp", 2) - sharded_masks) + sharded_masks
