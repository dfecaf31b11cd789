"""Published fully-sharded data-parallel runs (autopar/data/fsdp_scaling.csv), priced by the
cost model as the planner prices its own plans.

Rows priced: fully sharded data parallelism alone (no TP, PP or HSDP), bf16, eager (no
float8, no ``torch.compile``), on the presets' GPUs:

- llm-foundry's MPT table (LF-MPT; FSDP1 ``FULL_SHARD``) on A100-40GB, A100-80GB and
  H100-80GB. MPT is the zoo's GPT (multi-head attention, a 4·d GELU MLP, no biases;
  ALiBi's bias adds no matmul FLOPs).
- torchtitan's April 2024 A100 table (TT-A100-2404) and the eager bf16 rows of its
  December 2024 H100 table (TT-H100-2412, Llama 3.1 8B on 8 and 128 GPUs; FSDP2
  ``fully_shard``): Llama captured from Hugging Face transformers' ``LlamaForCausalLM`` at
  the row's shape (grouped-query attention, SwiGLU, RoPE, SDPA attention), its RMSNorms
  fused where the row's config fused them (``FUSED_RMSNORM``). torchtitan reduces
  gradients in float32 (its ``MixedPrecisionPolicy``): 4-byte gradients. Its H100s are
  96 GB / 500 W parts: the grand-teton-h100 preset.

Each source runs its own software generation (``SOFTWARE``; cost_models/software.toml): the
share of the GPU's GEMM ceiling its steps keep (and, for llm-foundry's FSDP1, the host time
per block and micro-batch the GPU does not hide), fitted on named calibration rows of that
source and checked on the others (tests/cost_models/test_software.py).

Not priced, and why: the other torchtitan rows and fms-fsdp's use ``torch.compile``, float8
or TP/PP/HSDP, which a bf16 model of eager kernels on a pure data-parallel mesh does not
describe; PTB-FP8-2411 states no batch size.

Each row's configuration becomes a plan: every layer ``fsdp`` on a pure data-parallel mesh
of the row's GPU count, the row's recomputation of every block (none, selective or full),
its micro-batch and gradient accumulation. Throughput is tokens per second per GPU, as
the sources report it (cluster tokens/s ÷ GPUs; the same for pure data parallelism).
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass, replace
from importlib import resources

import torch

from autopar.planner.costs import LayerCost, layer_costs
from autopar.planner.one_stage import plan_memory
from autopar.whatif import repeat_blocks
from autopar.zoo import GPT, GPTConfig
from cost_models.calibrate import fit_software_efficiency, fit_software_efficiency_with
from cost_models.hardware import Cluster, GiB
from cost_models.memory import precision
from cost_models.software import with_fitted_values, with_software
from passes.layer_graph import build_layer_graph
from passes.records import LayerGraph
from runtime.plan import Mesh

FSDP_TABLE_PATH = resources.files("autopar") / "data" / "fsdp_scaling.csv"
PRICED_SOURCES = ("LF-MPT", "TT-A100-2404", "TT-H100-2412")
SOFTWARE = {"LF-MPT": "llm-foundry-2023", "TT-A100-2404": "torchtitan-2024",
            "TT-H100-2412": "torchtitan-2024"}
"""Source -> the software generation that ran it (cost_models/software.toml)."""
FUSED_RMSNORM = {("TT-A100-2404", "Llama 3 8B"), ("TT-A100-2404", "Llama 2 13B")}
"""(source, model) of the rows whose configs set ``norm_type = "fused_rmsnorm"``:
torchtitan's Triton RMSNorm, which saves its bf16 input and a reciprocal RMS per row for
backward, as ``nn.RMSNorm`` does on CUDA (passes.annotate), where the unfused norm saves
float32 copies of the input and of its normalised value: 4h bytes more per token and
norm (h the hidden size). pytorch/torchtitan train_configs/llama_13b.toml @395a5262 (the commit that published
the Llama 2 rows) and llama3_8b.toml @1ea476e9; llama_70b.toml @395a5262,
llama3_70b.toml @1ea476e9 and llama3_8b.toml @9dec370 (the H100 rows) set ``rmsnorm``."""
CLUSTERS = {"H100-80GB": ("dgx-h100", 80), "A100-40GB": ("dgx-a100-80g", 40),
            "A100-80GB": ("dgx-a100-80g", 80), "H100-96GB-500W": ("grand-teton-h100", 96)}
"""Hardware (``hardware_name``) -> (preset, memory GiB). llm-foundry's A100 tables state
1,600 Gb/s per node (RoCE): 25 GB/s per GPU, the dgx-a100-80g preset's network.
torchtitan's H100s are Grand Teton parts (96 GB of HBM2e at 2.4 TB/s, power capped at
500 W): the grand-teton-h100 preset."""


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
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    recompute: str
    """'none', 'selective' or 'full' (runtime.plan.RECOMPUTE), every block."""
    float32_grads: bool
    """Gradients reduced in float32 (torchtitan), not bf16."""
    fused_norm: bool
    """RMSNorm run as a fused kernel (``FUSED_RMSNORM``)."""
    tokens_per_s_per_gpu: float
    memory_gib: float | None = None
    """Peak memory the source reports, where it does (torchtitan's H100 table: the caching
    allocator's peak reserved bytes, in GiB)."""

    @property
    def llama(self) -> bool:
        return self.model.startswith("Llama")

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
        hardware = hardware_name(cells["hardware"])
        if hardware not in CLUSTERS or cells["float8"] != "no" or cells["compile"] != "no":
            continue
        out.append(FsdpRow(
            row_id=int(cells["row_id"]), source=cells["source_id"], hardware=hardware,
            gpus=int(cells["gpus"]), model=cells["model"], layers=int(cells["layers"]),
            hidden=int(cells["hidden"]), heads=int(cells["heads"]),
            kv_heads=int(cells["kv_heads"]), ffn=int(cells["ffn_hidden"]),
            vocab=int(cells["vocab"]),
            seq_len=int(cells["seq_len"]), micro_batch=int(cells["micro_batch_seqs"]),
            grad_accum=int(cells["grad_accum"]),
            recompute=_recompute(cells["act_ckpt"]),
            float32_grads="fp32 grad reduce" in cells["precision"],
            fused_norm=(cells["source_id"], cells["model"]) in FUSED_RMSNORM,
            tokens_per_s_per_gpu=float(cells["tokens_per_s_per_gpu"]),
            memory_gib=float(cells["memory_gib"]) if cells["memory_gib"] else None))
    return out


def hardware_name(published: str) -> str:
    """The key of CLUSTERS for a row's hardware column."""
    if published.startswith("H100 SXM, 96GB"):
        return "H100-96GB-500W"
    return published.split(" ")[0]


def _recompute(act_ckpt: str) -> str:
    for mode in ("none", "selective", "full"):
        if act_ckpt.startswith(mode):
            return mode
    raise ValueError(f"fsdp_scaling.csv: unknown act_ckpt {act_ckpt!r}")


def fsdp_graph(row: FsdpRow) -> LayerGraph:
    """The row's model at its global batch: two blocks captured on the meta device, repeated
    to its depth (``whatif.repeat_blocks``; its blocks are identical)."""
    return _graph(row.llama, row.layers, row.hidden, row.heads, row.kv_heads, row.ffn,
                  row.vocab, row.seq_len, row.global_batch, row.model, row.fused_norm)


@functools.cache
def _graph(llama: bool, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
           vocab: int, seq_len: int, batch: int, name: str, fused_norm: bool) -> LayerGraph:
    with torch.device("meta"):
        model = _llama(hidden, heads, kv_heads, ffn, vocab, seq_len, fused_norm) if llama else GPT(
            GPTConfig(n_layer=2, n_head=heads, n_embd=hidden, vocab_size=vocab,
                      block_size=seq_len, bias=False))
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    graph = build_layer_graph(model, (tokens,), model_name=name, seq_len=seq_len)
    return repeat_blocks(graph, layers)


def _llama(hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq_len: int,
           fused_norm: bool):
    import transformers  # imported here: only the Llama rows need it

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len, use_cache=False, attn_implementation="sdpa"))
    return fuse_rms_norms(model) if fused_norm else model


def fuse_rms_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each of transformers' ``LlamaRMSNorm`` replaced, in place, by
    ``nn.RMSNorm`` of the same size and epsilon, which the capture prices as the fused kernel
    (``FUSED_RMSNORM``)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norms = [(name, m) for name, m in model.named_modules() if isinstance(m, LlamaRMSNorm)]
    for name, norm in norms:
        model.set_submodule(name, torch.nn.RMSNorm(norm.weight.shape, eps=norm.variance_epsilon,
                                                   device=norm.weight.device))
    return model


def fsdp_cluster(row: FsdpRow) -> Cluster:
    preset, memory_gib = CLUSTERS[row.hardware]
    cluster = Cluster.preset(preset, nodes=max(1, row.gpus // 8))
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=memory_gib * GiB))
    return with_software(cluster, SOFTWARE[row.source])


@dataclass(frozen=True, kw_only=True)
class FsdpPrediction:
    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    costs: tuple[LayerCost, ...]
    memory_margin: float

    @functools.cached_property
    def peak_memory_bytes(self) -> float:
        """Per rank, with the cluster's memory margin (``one_stage.plan_memory``); walked
        only when asked: the fits predict rows a thousand times for their speed alone."""
        return plan_memory(self.costs, self.memory_margin).total_bytes

    def tokens_per_s_per_gpu(self, row: FsdpRow) -> float:
        return row.global_batch * row.seq_len / self.step_time_s / row.gpus


def predict(row: FsdpRow, graph: LayerGraph | None = None, *,
            float32_grads: bool | None = None,
            software_efficiency: float | None = None,
            fsdp_host_s: float | None = None) -> FsdpPrediction:
    """The cost model's step of the row's published configuration (module docstring).
    ``float32_grads``: reduce gradients in float32 (default: as the row ran); False prices
    it as the planner's bf16 plans run, to compare with them like for like.
    ``software_efficiency``, ``fsdp_host_s``: instead of its generation's efficiency and
    unhidden FSDP host time on the row's device (to fit them, ``fit_software``)."""
    graph = graph if graph is not None else fsdp_graph(row)
    cluster = with_fitted_values(fsdp_cluster(row), efficiency=software_efficiency,
                                 fsdp_host_s=fsdp_host_s)
    prec = precision("bfloat16")
    if row.float32_grads if float32_grads is None else float32_grads:
        prec = replace(prec, grad_bytes=4)
    mesh = Mesh(pp=1, dp=row.gpus, tp=1)
    block_class = max(graph.classes, key=lambda c: len(graph.classes[c]))
    block = "fsdp" if row.recompute == "none" else f"fsdp+{row.recompute}"
    costs = layer_costs(graph.layers, lambda layer: block if layer.layer_class == block_class
                        else "fsdp", mesh, cluster, prec, row.grad_accum)
    return FsdpPrediction(step_time_s=sum(c.time_s for c in costs),
                          compute_s=sum(c.compute_s for c in costs),
                          exposed_comm_s=sum(c.comm_s for c in costs),
                          hidden_comm_s=sum(c.hidden_comm_s for c in costs),
                          costs=tuple(costs), memory_margin=cluster.memory_margin_fraction)


def fit_software(rows: list[FsdpRow]) -> float:
    """The software efficiency at which ``rows`` (calibration rows of one generation on one
    device) are predicted at their published throughput, in geometric mean
    (``cost_models.calibrate.fit_software_efficiency``)."""
    graphs = [fsdp_graph(r) for r in rows]

    def ratios(s: float) -> list[float]:
        return [predict(r, g, software_efficiency=s).tokens_per_s_per_gpu(r)
                / r.tokens_per_s_per_gpu for r, g in zip(rows, graphs, strict=True)]

    return fit_software_efficiency(ratios, rel_tol=1e-5)  # software.toml keeps 4 digits


def fit_software_and_host(rows: list[FsdpRow]) -> tuple[float, float]:
    """The software efficiency and unhidden FSDP host time (s per wrapped module per
    micro-batch) that predict ``rows`` (calibration rows of one generation on one device)
    at their published throughput (``cost_models.calibrate.fit_software_efficiency_with``)."""
    graphs = [fsdp_graph(r) for r in rows]

    def ratios(s: float, host: float) -> list[float]:
        return [predict(r, g, software_efficiency=s, fsdp_host_s=host).tokens_per_s_per_gpu(r)
                / r.tokens_per_s_per_gpu for r, g in zip(rows, graphs, strict=True)]

    return fit_software_efficiency_with(ratios, 0.0, 0.02, rel_tol=1e-5)
