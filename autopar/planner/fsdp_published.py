"""Published fully-sharded data-parallel runs (autopar/data/fsdp_scaling.csv), priced by the
cost model as the planner prices its own plans.

Rows priced: llm-foundry's MPT table (source LF-MPT): FSDP1 ``FULL_SHARD`` alone, bf16, no
float8 and no ``torch.compile``, on A100-40GB, A100-80GB and H100-80GB. MPT is the zoo's
GPT (multi-head attention, a 4·d GELU MLP, no biases; ALiBi's bias adds no matmul FLOPs),
so the captured graph is the model that ran. Rows not priced here, and why:

- torchtitan and fms-fsdp rows (TT-*, FMS-2405, PTB-FP8-2411) train Llama models
  (grouped-query attention, SwiGLU, RoPE), which the zoo's GPT is not; several use float8
  or ``torch.compile`` (which a bf16 cost model of eager kernels does not describe), and the
  torchtitan H100s are 96 GB / 500 W parts, not the dgx-h100 preset's 80 GB / 700 W.

Each row's configuration becomes a plan: every layer ``fsdp`` on a pure data-parallel mesh
of the row's GPU count, full recomputation of every block where the row says so, its
micro-batch and gradient accumulation. Throughput is tokens per second per GPU, as the
source reports it (cluster tokens/s ÷ GPUs).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from importlib import resources

import torch

from autopar.planner.costs import layer_cost
from autopar.whatif import repeat_blocks
from autopar.zoo import GPT, GPTConfig
from cost_models.hardware import Cluster, GiB
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from passes.records import LayerGraph
from runtime.plan import Mesh

FSDP_TABLE_PATH = resources.files("autopar") / "data" / "fsdp_scaling.csv"
PRICED_SOURCES = ("LF-MPT",)
CLUSTERS = {"H100-80GB": ("dgx-h100", 80), "A100-40GB": ("dgx-a100-80g", 40),
            "A100-80GB": ("dgx-a100-80g", 80)}
"""Hardware column prefix -> (preset, memory GiB). llm-foundry's A100 tables state 1,600
Gb/s per node (RoCE): 25 GB/s per GPU, the dgx-a100-80g preset's network."""


@dataclass(frozen=True, kw_only=True)
class FsdpRow:
    """One priced row of ``fsdp_scaling.csv``."""

    row_id: int
    source: str
    hardware: str
    gpus: int
    model: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    full_recompute: bool
    tokens_per_s_per_gpu: float

    @property
    def global_batch(self) -> int:
        return self.gpus * self.micro_batch * self.grad_accum

    @property
    def label(self) -> str:
        return f"{self.model} {self.hardware} ×{self.gpus}"


def fsdp_rows() -> list[FsdpRow]:
    """The rows this module prices (module docstring), in the file's order."""
    lines = [x for x in FSDP_TABLE_PATH.read_text().splitlines() if not x.startswith("#")]
    out = []
    for cells in csv.DictReader(io.StringIO("\n".join(lines))):
        if cells["source_id"] not in PRICED_SOURCES:
            continue
        hardware = cells["hardware"].split(" ")[0]
        if hardware not in CLUSTERS or cells["float8"] != "no" or cells["compile"] != "no":
            continue
        out.append(FsdpRow(
            row_id=int(cells["row_id"]), source=cells["source_id"], hardware=hardware,
            gpus=int(cells["gpus"]), model=cells["model"], layers=int(cells["layers"]),
            hidden=int(cells["hidden"]), heads=int(cells["heads"]), vocab=int(cells["vocab"]),
            seq_len=int(cells["seq_len"]), micro_batch=int(cells["micro_batch_seqs"]),
            grad_accum=int(cells["grad_accum"]),
            full_recompute=cells["act_ckpt"].startswith("full"),
            tokens_per_s_per_gpu=float(cells["tokens_per_s_per_gpu"])))
    return out


def fsdp_graph(row: FsdpRow) -> LayerGraph:
    """The row's model at its global batch: two blocks captured on the meta device, repeated
    to its depth (``whatif.repeat_blocks``; its blocks are identical)."""
    cfg = GPTConfig(n_layer=2, n_head=row.heads, n_embd=row.hidden, vocab_size=row.vocab,
                    block_size=row.seq_len, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(row.global_batch, row.seq_len, dtype=torch.long, device="meta")
    graph = build_layer_graph(model, (tokens,), model_name=row.model, seq_len=row.seq_len)
    return repeat_blocks(graph, row.layers)


def fsdp_cluster(row: FsdpRow) -> Cluster:
    preset, memory_gib = CLUSTERS[row.hardware]
    cluster = Cluster.preset(preset, nodes=max(1, row.gpus // 8))
    return replace(cluster, device=replace(cluster.device, memory_bytes=memory_gib * GiB))


@dataclass(frozen=True, kw_only=True)
class FsdpPrediction:
    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    hidden_comm_s: float

    def tokens_per_s_per_gpu(self, row: FsdpRow) -> float:
        return row.global_batch * row.seq_len / self.step_time_s / row.gpus


def predict(row: FsdpRow, graph: LayerGraph | None = None) -> FsdpPrediction:
    """The cost model's step of the row's published configuration (module docstring)."""
    graph = graph if graph is not None else fsdp_graph(row)
    cluster, prec = fsdp_cluster(row), precision("bfloat16")
    mesh = Mesh(pp=1, dp=row.gpus, tp=1)
    block_class = max(graph.classes, key=lambda c: len(graph.classes[c]))
    costs = [layer_cost(layer, "fsdp+full" if row.full_recompute
                        and layer.layer_class == block_class
                        else "fsdp", mesh, cluster, prec, row.grad_accum)
             for layer in graph.layers]
    return FsdpPrediction(step_time_s=sum(c.time_s for c in costs),
                          compute_s=sum(c.compute_s for c in costs),
                          exposed_comm_s=sum(c.comm_s for c in costs),
                          hidden_comm_s=sum(c.hidden_comm_s for c in costs))
