"""Async TP in the cost model and the planner (autopar/planner/estimators.py ``_async_tp_s``):
the exposed sequence-parallel collectives by hand, where the option is offered, and the
predicted speed-up of async over vanilla TP against torchtitan's published pairs.

Published pairs (autopar/data/fsdp_scaling.csv, FSDP2 × TP 8 with sequence parallelism on
H100s, torch.compile in both columns):

    rows   model            precision   vanilla   async    speed-up
    21/22  Llama 3 70B      bf16          597.3   652.4    1.092    TT-ASYNCTP-2506
    23/24  Llama 3 8B       bf16         4378    4809.4    1.099    TT-ASYNCTP-2506
    16/17  Llama 3.1 70B    float8        829     876      1.057    TT-H100-2412
    7/8    Llama 3.1 405B   float8        177     185      1.045    TT-405B-2408

The bf16 pairs are checked. The float8 pairs are not: float8 GEMMs run about twice as fast as
the bf16 ones the model prices, so less compute hides the collectives (and torchao gathers
float8 activations), which the model does not describe; priced as bf16 it predicts 1.08-1.15.
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.planner.costs import allowed_options, layer_cost, layer_options
from autopar.planner.estimators import CostContext, _sp_pairs, async_tp_comm_s, tp_comm_s
from autopar.planner.fsdp_published import FSDP_TABLE_PATH
from autopar.whatif import repeat_blocks
from autopar.zoo import GPT, GPTConfig
from cost_models.comm import Group, collective_s
from cost_models.hardware import Cluster, GiB
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh
from runtime.strategies import spec

BF16 = precision("bfloat16")
H100 = Cluster.preset("dgx-h100")


def gpt_block(batch: int = 4, seq: int = 64, embd: int = 256, heads: int = 4):
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=heads, n_embd=embd, vocab_size=512,
                              block_size=seq, bias=False))
    graph = build_layer_graph(model, (torch.zeros(batch, seq, dtype=torch.long,
                                                  device="meta"),), seq_len=seq)
    return next(la for la in graph.layers if la.name == "h.0")


def ctx(cluster: Cluster, tp: int = 2, *, overlap: bool = True) -> CostContext:
    return CostContext(mesh=Mesh(dp=1, tp=tp), cluster=cluster, prec=BF16, microbatches=1,
                       strategy=spec("tp"), sequence_parallel=True, async_tp=overlap)


# -- the exposed collectives by hand --------------------------------------------------------------

def test_a_gpt_block_gathers_twice_and_scatters_twice_each_beside_its_linears():
    groups, rows = _sp_pairs(gpt_block())
    assert groups == [("attn.q_proj", "attn.k_proj", "attn.v_proj"), ("mlp.fc_in",)]
    assert rows == ["attn.out_proj", "mlp.fc_out"]


@pytest.mark.parametrize("peak", [1e12, 1e16])  # matmuls far slower than the transfers; faster
def test_exposed_collectives_by_hand(peak):
    """tp = 2, one micro-batch of b·s = 256 tokens, h = 256, bf16. Every sequence-parallel
    collective moves the [b, s, h] stream: 256·256·2 bytes. A fused collective is exposed by
    what (tp − 1)/tp of its chunk-matmuls do not hide, plus what splitting adds: (tp − 1)
    kernels per matmul, the copies through symmetric memory at HBM bandwidth, two barriers.
    Backward, the gathered q/k/v input's gradient is the sum of three matmuls' gradients:
    its reduce-scatter is not fused, and is exposed whole."""
    layer, tp, tokens, h = gpt_block(), 2, 4 * 64, 256
    nbytes = tokens * h * 2
    # GEMMs at the asymptote whatever their size: the count below prices chunks that way
    device = replace(H100.device, peak_flops={**H100.device.peak_flops, "bfloat16": peak},
                     matmul_half_dim={})
    cluster = replace(H100, device=device)
    rate = peak * device.matmul_efficiency * device.software_efficiency  # the GEMM asymptote
    floor = device.kernel_floor_s
    hbm = device.memory_bandwidth_GBps * 1e9
    group = Group(tp, 1)

    def fused(kind: str, out_features: list[float], k: float, hidden: bool = False) -> float:
        comm = collective_s(kind, nbytes, group, cluster)
        chunked = sum(2 * tokens * n * k / tp / rate + tp * floor for n in out_features)
        copies = 4 * nbytes / tp if kind == "all_gather" else nbytes + nbytes / tp
        exposed = 0.0 if hidden else max(0.0, comm - (tp - 1) / tp * chunked)
        return (exposed + (tp - 1) * floor * len(out_features) + copies / hbm
                + 2 * cluster.intra_node.latency_s)

    qkv, fc_in = [h, h, h], [4 * h]
    fwd = (fused("all_gather", qkv, h) + fused("reduce_scatter", [h], h)
           + fused("all_gather", fc_in, h) + fused("reduce_scatter", [h], 4 * h))
    bwd = (collective_s("reduce_scatter", nbytes, group, cluster)
           + fused("all_gather", [h], 4 * h) + fused("reduce_scatter", fc_in, h)
           + fused("all_gather", [h], h))
    got = async_tp_comm_s(layer, ctx(cluster))
    assert got == pytest.approx((fwd, bwd), rel=1e-9)
    plain = tp_comm_s(layer, ctx(cluster, overlap=False))
    if peak == 1e12:  # every fused transfer hidden: what is left is the splitting's cost
        assert got[0] == pytest.approx(
            fused("all_gather", qkv, h, True) + fused("reduce_scatter", [h], h, True)
            + fused("all_gather", fc_in, h, True)
            + fused("reduce_scatter", [h], 4 * h, True), rel=1e-9)
    else:  # nothing to hide behind: async only adds its costs
        assert got[0] > plain[0] and got[1] > plain[1]


def test_a_layer_whose_collectives_do_not_pair_with_its_linears_hides_nothing():
    layer = replace(gpt_block(), gemms=())  # no matmul recorded to pair with
    assert async_tp_comm_s(layer, ctx(H100)) == tp_comm_s(layer, ctx(H100, overlap=False))


# -- where it is offered -----------------------------------------------------------------------

def test_async_options_are_offered_on_hopper_nodes_only_and_beat_vanilla_sp_there():
    layer, mesh = gpt_block(batch=8, seq=1024, embd=2048, heads=16), Mesh(dp=2, tp=8)
    labels = allowed_options(layer, mesh, seq_len=1024, async_tp=True)
    assert "tp+sp+async" in labels and "tp_fsdp+sp+async+full" in labels
    assert not any("async" in o and "+sp" not in o for o in labels)
    assert not any("async" in o for o in allowed_options(layer, mesh, seq_len=1024))
    for name in ("dgx-a100-80g", "pcie-8x-a100"):
        costs = layer_options(layer, 1024, mesh, Cluster.preset(name), BF16)
        assert not any("async" in o for o in costs), name
    # 4,096 tokens a rank, h = 2,048: each chunk-matmul is too small to hide its share of
    # the transfers, and the splitting costs more than it hides in forward.
    small = {o: layer_cost(layer, o, mesh, H100, BF16) for o in ("tp+sp", "tp+sp+async")}
    assert small["tp+sp+async"].fwd_s > small["tp+sp"].fwd_s
    costs = layer_options(layer, 1024, mesh, H100, BF16)
    assert "tp+sp" in costs and "tp+sp+async" in costs  # neither dominates
    # 32,768 tokens a rank, h = 4,096: async hides more than half the collectives, and vanilla
    # SP, slower in every term and no smaller, is no option.
    big = gpt_block(batch=16, seq=4096, embd=4096, heads=32)
    costs = layer_options(big, 4096, mesh, H100, BF16)
    assert "tp+sp" not in costs and costs["tp+sp+async"].async_tp
    vanilla = layer_cost(big, "tp+sp", mesh, H100, BF16)
    assert costs["tp+sp+async"].comm_s < 0.5 * vanilla.comm_s
    assert costs["tp+sp+async"].compute_s == vanilla.compute_s
    for mode in ("", "+full"):  # the same collectives issued: what async does not expose, it hides
        overlapped = layer_cost(big, f"tp+sp+async{mode}", mesh, H100, BF16)
        plain = layer_cost(big, f"tp+sp{mode}", mesh, H100, BF16)
        assert overlapped.comm_s + overlapped.hidden_comm_s == pytest.approx(
            plain.comm_s + plain.hidden_comm_s, rel=1e-12)
        assert overlapped.hidden_comm_s > plain.hidden_comm_s
    with pytest.raises(ValueError, match="asks for async TP, but the cluster's device "
                                         "'A100-SXM4-80GB' has compute capability 8.0"):
        layer_cost(layer, "tp+sp+async", mesh, Cluster.preset("dgx-a100-80g"), BF16)


# -- against torchtitan's published pairs ------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False),
            nn.Linear(ffn, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    """Llama's block (RMSNorm, SwiGLU MLP) with multi-head attention: autopar's TP split
    refuses grouped-query attention, so k and v are as wide as q (Llama 3's are 1/8 of it).
    As in torchtitan's Llama, the attention and the MLP each gather their input once."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = _Attention(hidden, heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = _SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Llama(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden, heads, ffn) for _ in range(2))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def _row(row_id: int) -> dict[str, str]:
    lines = [x for x in FSDP_TABLE_PATH.read_text().splitlines() if not x.startswith("#")]
    return next(r for r in csv.DictReader(io.StringIO("\n".join(lines)))
                if r["row_id"] == str(row_id))


@functools.cache
def _priced(row_id: int):
    """(graph, mesh, recompute, tokens per GPU per step) of a published row's configuration:
    FSDP over dp_shard, TP + SP over tp, its local batch and recomputation, float32 gradient
    reduction (torchtitan's), on dgx-h100 nodes with 96 GiB."""
    r = _row(row_id)
    tp, dp, local = int(r["tp"]), int(r["dp_shard"]), int(r["local_batch_seqs"])
    seq = int(r["seq_len"])
    with torch.device("meta"):
        model = _Llama(int(r["hidden"]), int(r["heads"]), int(r["ffn_hidden"]),
                       int(r["vocab"]))
    tokens = torch.zeros(dp * local, seq, dtype=torch.long, device="meta")
    graph = repeat_blocks(build_layer_graph(model, (tokens,), seq_len=seq), int(r["layers"]))
    recompute = r["act_ckpt"].split(" ")[0]
    return graph, Mesh(dp=dp, tp=tp), recompute, dp * local * seq / int(r["gpus"])


def _step_s(row_id: int, efficiency: float, overlap: bool) -> float:
    """The row's step: every layer tensor-parallel and FSDP-sharded (tp_fsdp), with
    sequence parallelism where the layer takes it (the blocks), async TP when ``overlap``."""
    graph, mesh, recompute, _ = _priced(row_id)
    device = replace(H100.device, memory_bytes=96 * GiB, matmul_efficiency=efficiency)
    cluster = replace(H100.with_nodes(mesh.world_size // 8), device=device)
    prec = replace(BF16, grad_bytes=4)
    blocks = max(graph.classes, key=lambda c: len(graph.classes[c]))
    total = 0.0
    for layer in graph.layers:
        options = allowed_options(layer, mesh, seq_len=graph.seq_len, async_tp=True)
        option = next(o for o in ("tp_fsdp+sp+async" if overlap else "tp_fsdp+sp",
                                  "tp_fsdp", "fsdp") if o in options)
        if layer.layer_class == blocks:
            option += f"+{recompute}"
        total += layer_cost(layer, option, mesh, cluster, prec).time_s
    return total


def _speed_up(row_id: int, efficiency: float) -> float:
    return _step_s(row_id, efficiency, False) / _step_s(row_id, efficiency, True)


def _published(vanilla: int, overlapped: int) -> float:
    return (float(_row(overlapped)["tokens_per_s_per_gpu"])
            / float(_row(vanilla)["tokens_per_s_per_gpu"]))


@pytest.mark.parametrize(("vanilla", "overlapped"), [(21, 22), (23, 24)])
def test_async_tp_speed_up_over_vanilla_tp_is_the_published_size(vanilla, overlapped):
    """The ratio, not the throughput: the preset's compute rate (a 700 W H100's, where these
    are 500 W parts run under torch.compile) puts vanilla TP 24-45% above the published
    throughput, so the collectives are a larger share of its step and async TP's gain is
    overstated in proportion. Two checks:

    - at the preset: predicted 1.133 (70B) and 1.114 (8B) against 1.092 and 1.099;
      within 0.05;
    - with the matmul efficiency fitted so the vanilla step takes the published time (one
      number per row, the compute rate these runs reached): 1.114 and 1.086; within 0.03.
      What remains is mostly the proxy model's: k and v as wide as q give the attention's
      gather more matmul to hide behind than Llama 3's grouped-query projections (up to
      about 1% on the 8B); run-to-run spread of the published single runs is of that order.
    """
    published = _published(vanilla, overlapped)
    assert _speed_up(vanilla, H100.device.matmul_efficiency) == pytest.approx(published,
                                                                             abs=0.05)
    *_, tokens = _priced(vanilla)
    measured = tokens / float(_row(vanilla)["tokens_per_s_per_gpu"])
    fitted = _root(lambda e: _step_s(vanilla, e, False) - measured, 0.1, 1.0, xtol=1e-3)
    assert _speed_up(vanilla, fitted) == pytest.approx(published, abs=0.03)
    assert _speed_up(vanilla, fitted) > 1.0


def _root(f, lo: float, hi: float, *, xtol: float) -> float:
    """The x in [lo, hi] where f changes sign, by bisection (f monotone there)."""
    f_lo = f(lo)
    assert f_lo * f(hi) < 0, "no sign change in the bracket"
    while hi - lo > xtol:
        mid = (lo + hi) / 2
        if (f(mid) < 0) == (f_lo < 0):
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
