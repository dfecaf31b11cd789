"""Megatron-LM's standard GPT-3 175B configuration is expressible as a plan and fits an
80 GB A100 by the planner's memory model once its distributed optimizer (``tp_zero1``) is;
with the optimizer states replicated over dp (plain ``tp``) it does not.

The configuration: Megatron-LM's GPT-3 175B example (examples/gpt3/train_gpt3_175b_distributed.sh
in NVIDIA/Megatron-LM: 96 layers, hidden 12288, 96 heads, sequence 2048, tp 8, pp 16,
micro-batch 1, global batch 1,536, fp16, no activation recomputation) with what
Megatron-Core runs by default at that scale: the distributed optimizer
(``--use-distributed-optimizer``), sequence parallelism and the interleaved schedule (2
virtual stages per rank), on 128 DGX A100 80GB nodes (1,024 GPUs: dp = 8). Built and priced
as autopar/planner/published.py builds and prices the SC'21 rows (Megatron-LM's GPT at the
shape, its cluster).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.planner.engine import evaluate_plan
from autopar.planner.published import MegatronRow, megatron_cluster, megatron_graph, megatron_plan
from cost_models.memory import precision
from runtime.plan import Plan

H, LAYERS, TP, PP, DP, VIRTUAL = 12288, 96, 8, 16, 8, 2
ROW = MegatronRow(params_b=175.0, heads=96, hidden=H, layers=LAYERS, tp=TP, pp=PP,
                  gpus=TP * PP * DP, global_batch=1536, tflops_per_gpu=0.0, microbatch=1,
                  interleave=VIRTUAL)
PREC = precision("float16")


@pytest.fixture(scope="module")
def graph():
    return megatron_graph(ROW)


def megatron_core_plan(graph, tensor_parallel: str) -> Plan:
    """The configuration above, every layer Megatron-LM splits over tp taking
    ``tensor_parallel`` (the blocks sequence-parallel), and the layers it does not split
    (position embedding, final norm) ZeRO-1 under the distributed optimizer, replicated
    otherwise."""
    base = megatron_plan(graph, ROW)
    info = {layer.name: layer for layer in graph.layers}
    sharded = tensor_parallel != "tp"
    layers = []
    for layer in base.layers:
        if layer.strategy == "tp":
            sp = info[layer.module].tp.sp_styles if layer.module.startswith("h.") else None
            layers.append(replace(layer, strategy=tensor_parallel, recompute="none",
                                  sequence_parallel=sp is not None,
                                  tp_styles=dict(sp) if sp else layer.tp_styles))
        else:
            layers.append(replace(layer, strategy="zero1" if sharded else "replicate"))
    return replace(base, layers=tuple(layers))


def test_the_configuration_is_the_published_one(graph):
    plan = megatron_core_plan(graph, "tp_zero1")
    assert (plan.mesh.tp, plan.mesh.pp, plan.mesh.dp) == (TP, PP, DP)
    assert plan.pipeline.schedule == "Interleaved1F1B"
    assert plan.pipeline.virtual_stages == VIRTUAL
    assert plan.pipeline.num_microbatches == 1536 // DP  # micro-batch 1
    blocks = [la for la in plan.layers if la.module.startswith("h.")]
    assert len(blocks) == LAYERS
    assert all(la.strategy == "tp_zero1" and la.sequence_parallel for la in blocks)


def test_fits_80gb_with_the_distributed_optimizer_and_not_without(graph):
    cluster = megatron_cluster(ROW)
    capacity = cluster.device.memory_bytes
    assert capacity == 80 * 1024**3
    peak = {}
    for strategy in ("tp", "tp_zero1"):
        outcome = evaluate_plan(graph, cluster, PREC, megatron_core_plan(graph, strategy))
        peak[strategy] = outcome.peak_bytes()
    assert peak["tp"] > capacity > peak["tp_zero1"], {k: v / 2**30 for k, v in peak.items()}


def test_optimizer_states_are_those_of_one_dp_shard_of_a_tp_shard(graph):
    """Hand-derived for a pipeline rank holding blocks only (rank 5: stages 5 and 21, three
    blocks each). A block has 12h² + 13h parameters: the four weight matrices (12h²) and
    the column-split biases of qkv and fc_in (3h + 4h) are split over tp, the two layer
    norms (4h) and the row-split biases of the two output projections (2h) are not. Adam in
    fp16 mixed precision keeps 12 bytes per parameter (fp32 master weight and two moments);
    the distributed optimizer shards them over the dp = 8 replicas."""
    per_block = (12 * H * H + 7 * H) // TP + 6 * H
    assert per_block == 226_576_896
    blocks = LAYERS // (PP * VIRTUAL) * VIRTUAL
    replicated = blocks * per_block * 12
    assert replicated == 16_313_536_512  # 15.2 GiB of the 80 on every rank under plain tp
    cluster = megatron_cluster(ROW)
    for strategy, expected in (("tp", replicated), ("tp_zero1", replicated / DP)):
        outcome = evaluate_plan(graph, cluster, PREC, megatron_core_plan(graph, strategy))
        assert outcome.rank_memory[5].optimizer_bytes == pytest.approx(expected, rel=1e-9)
    # ... and the parameters: fp16 plus FSDP2's dp shard of them beside the gathered copy,
    # the gradients in fp16, accumulated unsharded through the pipeline's micro-batches
    # (autopar/planner/costs.py's table, pipelined zero1).
    params = blocks * per_block
    assert outcome.rank_memory[5].params_bytes == pytest.approx(params * 2 * (1 + 1 / DP),
                                                             rel=1e-9)
    assert outcome.rank_memory[5].grads_bytes == pytest.approx(params * 2, rel=1e-9)
