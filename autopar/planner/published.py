"""Published training runs, priced by the cost model: the check that its numbers are real.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1, reports end-to-end TFLOP/s per GPU for ten GPT models on up
to 3,072 A100s. For each row ``megatron_plan`` writes the published configuration as an
autopar plan (its TP, PP and DP, micro-batch size, interleaving, full recomputation, fp16
with dynamic loss scaling, plain data parallelism: the 2021 runs kept the optimizer
unsharded; pipeline sends scattered over the TP group) and ``evaluate`` prices it exactly
as the planner prices its own plans: per-layer costs, and for pipelines the schedule
simulator. TFLOP/s per GPU are counted the paper's way
(``paper_flops``), so predicted and published figures compare directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from importlib import resources

import torch

from autopar.planner.costs import layer_costs
from autopar.planner.engine import evaluate_plan
from autopar.planner.one_stage import plan_memory
from autopar.whatif import repeat_blocks
from autopar.zoo import GPT, GPTConfig
from cost_models.calibrate import fit_software_efficiency
from cost_models.hardware import Cluster
from cost_models.memory import Precision, precision
from cost_models.software import with_software
from passes.layer_graph import build_layer_graph
from passes.records import LayerGraph
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

VOCAB = 51200
SEQ_LEN = 2048
TABLE_PATH = resources.files("autopar") / "data" / "megatron_sc21_table1.csv"
"""The published table, shipped with the package (its header cites the paper)."""


@dataclass(frozen=True, kw_only=True)
class MegatronRow:
    """One row of the published table (``TABLE_PATH``)."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float
    microbatch: int
    interleave: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each data-parallel replica."""
        return self.global_batch // (self.dp * self.microbatch)


def megatron_rows() -> list[MegatronRow]:
    """The ten rows of the published table, in its order."""
    return read_rows(TABLE_PATH.read_text())


def read_rows(text: str) -> list[MegatronRow]:
    """Rows of the published CSV (comment lines start with '#')."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    header = lines[0].split(",")
    rows = []
    for line in lines[1:]:
        cells = dict(zip(header, line.split(","), strict=True))
        rows.append(MegatronRow(
            params_b=float(cells["params_b"]), heads=int(cells["heads"]),
            hidden=int(cells["hidden"]), layers=int(cells["layers"]), tp=int(cells["tp"]),
            pp=int(cells["pp"]), gpus=int(cells["gpus"]), global_batch=int(cells["global_batch"]),
            tflops_per_gpu=float(cells["tflops_per_gpu"]), microbatch=int(cells["microbatch"]),
            interleave=int(cells["interleave"])))
    return rows


def paper_flops(row: MegatronRow) -> float:
    """FLOPs of one iteration as the paper counts them (its eq. 3: forward, backward and the
    recomputed forward): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    b, s, h, layers, v = row.global_batch, SEQ_LEN, row.hidden, row.layers, VOCAB
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


def megatron_plan(graph: LayerGraph, row: MegatronRow) -> Plan:
    """The published configuration as a plan of ``graph`` (a GPT at the row's shape).

    Transformer blocks: TP (plain data parallelism) with full recomputation; the other
    layers TP where they can be split (embedding, head), replicated otherwise, as
    Megatron-LM does. Blocks are spread evenly over pp × interleave stages; the embeddings
    sit on the first stage and the final norm and head on the last.
    """
    mesh = Mesh(pp=row.pp, dp=row.dp, tp=row.tp)
    stages = row.pp * row.interleave
    blocks = next(members for members in graph.classes.values()
                  if len(members) == row.layers)  # the transformer blocks
    first_block = graph.layers.index(blocks[0])
    per_stage = len(blocks) / stages
    layers = []
    for i, layer in enumerate(graph.layers):
        is_block = layer in blocks
        k = i - first_block
        stage = min(stages - 1, max(0, int(k // per_stage))) if is_block else (
            0 if i < first_block else stages - 1)
        splits = row.tp > 1 and layer.tp is not None and all(
            d % row.tp == 0 for d in layer.tp.divisors)
        layers.append(LayerPlan(
            module=layer.name, layer_class=layer.layer_class, stage=stage,
            strategy="tp" if splits else "replicate",
            tp_styles=dict(layer.tp.styles) if splits else {},
            recompute="full" if is_block else "none"))
    pipeline = None
    if row.pp > 1:
        # Megatron-LM scattered its pipeline sends over the TP group by default
        # (--no-scatter-gather-tensors-in-pipeline turns it off; the paper's section 4.1).
        pipeline = PipelineSpec(schedule="Interleaved1F1B" if row.interleave > 1 else "1F1B",
                                num_microbatches=row.microbatches,
                                virtual_stages=row.interleave, scatter_sends=row.tp > 1)
    return Plan(model=f"gpt-{row.params_b}b", cluster="dgx-a100-80g",
                global_batch=row.global_batch, seq_len=SEQ_LEN, mesh=mesh,
                layers=tuple(layers), param_dtype="float16", reduce_dtype="float16",
                loss_scaling="dynamic",
                gradient_accumulation=1 if pipeline else row.microbatches,
                pipeline=pipeline)


def megatron_graph(row: MegatronRow) -> LayerGraph:
    """The layer graph of what the published run trained: Megatron-LM's GPT (unfused softmax
    attention, dropout 0.1 on hidden states and attention) at the run's global batch. Two
    blocks are captured on the meta device and repeated to the run's depth
    (``whatif.repeat_blocks``): the blocks are identical, so the graph equals the
    full-depth capture but for its capture statistics (tests/autopar/test_whatif.py),
    and capturing costs two blocks, not the run's depth. Cached per shape."""
    return _graph(row.layers, row.heads, row.hidden, row.global_batch, f"gpt-{row.params_b}b")


@functools.cache
def _graph(layers: int, heads: int, hidden: int, batch: int, name: str) -> LayerGraph:
    cfg = GPTConfig(n_layer=min(layers, 2), n_head=heads, n_embd=hidden, vocab_size=VOCAB,
                    block_size=SEQ_LEN, attention="unfused", dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(batch, SEQ_LEN, dtype=torch.long, device="meta")
    graph = build_layer_graph(model, (tokens,), model_name=name)
    return repeat_blocks(graph, layers) if layers > 2 else graph


def megatron_cluster(row: MegatronRow) -> Cluster:
    """DGX A100 80GB nodes, with the 2021 runs' communication exposed: Megatron-LM
    all-reduced data-parallel gradients after backward (whichever engine autopar would run
    the layer on: DDP's 'dp' or FSDP2's 'fsdp' pattern) and waited for each pipeline
    send/recv (its schedules' blocking ``send_forward_recv_backward`` pairs). Its optimizer
    is apex's fused Adam. All three are its software generation's
    (cost_models/software.toml, megatron-lm-2021), with its fitted efficiency."""
    return with_software(Cluster.preset("dgx-a100-80g", nodes=row.gpus // 8),
                         "megatron-lm-2021")


def predicted_tflops(row: MegatronRow, step_time_s: float) -> float:
    """TFLOP/s per GPU of a step time, counted the paper's way."""
    return paper_flops(row) / step_time_s / row.gpus / 1e12


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    step_time_s: float
    peak_memory_bytes: float
    """The fullest rank, allocator margin included."""


def evaluate(graph: LayerGraph, cluster: Cluster, prec: Precision, plan: Plan) -> Evaluation:
    """The cost model's step time and peak per-rank memory of a given plan."""
    if plan.pipeline is not None:
        outcome = evaluate_plan(graph, cluster, prec, plan)
        return Evaluation(step_time_s=outcome.step_time_s,
                          peak_memory_bytes=outcome.peak_bytes())
    by_name = {layer.module: layer for layer in plan.layers}
    costs = layer_costs(graph.layers, lambda layer: by_name[layer.name].option, plan.mesh,
                        cluster, prec, plan.gradient_accumulation)
    memory = plan_memory(costs, cluster.memory_margin_fraction)
    # Megatron-LM's data parallelism is its own DDP: none of FSDP2's copies, host time or
    # per-layer waits, which the layer costs price for autopar's runtime. (Pipelined rows
    # keep FSDP2's once-per-step copies: under 0.5% of their steps.)
    ddp = sum(c.fsdp_only_s + c.fsdp_wait_s for c in costs)
    return Evaluation(step_time_s=sum(c.time_s for c in costs) - ddp,
                      peak_memory_bytes=memory.total_bytes)


def fit_software() -> float:
    """megatron-lm-2021's efficiency (cost_models/software.toml): the factor at which the
    ten rows' predicted / published TFLOP/s have a geometric mean of 1, each row's published
    plan priced in fp16 (about 20 pricings of the ten rows)."""
    rows = megatron_rows()
    graphs = [megatron_graph(row) for row in rows]
    plans = [megatron_plan(graph, row) for graph, row in zip(graphs, rows, strict=True)]
    fp16 = precision("float16")

    def ratios(efficiency: float) -> list[float]:
        out = []
        for row, graph, plan in zip(rows, graphs, plans, strict=True):
            cluster = megatron_cluster(row)
            cluster = replace(cluster, device=replace(cluster.device,
                                                      software_efficiency=efficiency))
            step = evaluate(graph, cluster, fp16, plan).step_time_s
            out.append(predicted_tflops(row, step) / row.tflops_per_gpu)
        return out

    return fit_software_efficiency(ratios, low=0.5, high=1.0, rel_tol=1e-5)
