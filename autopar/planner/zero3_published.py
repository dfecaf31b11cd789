"""ZeRO-3 against 3D parallelism at a fixed global batch, as published (SC'21 Table 2),
priced by the cost model.

Narayanan et al., SC'21, Table 2 (autopar/data/megatron_sc21_table2.csv), ran GPT 175B and
530B under DeepSpeed's ZeRO-3 with no model parallelism, on 384 to 2,240 A100s at one
global batch: per-GPU throughput fell about 3× as the GPUs grew 4× (175B: 144, 88, 44
TFLOP/s), while Megatron-LM's tensor × pipeline × data parallelism (PTD-P) held 153 to 141.
The step stops shrinking once each rank's share of compute is shorter than the gathers and
reduce-scatters of every block, which do not shrink with the GPU count.

Each ZeRO-3 row becomes a plan: every layer ``fsdp`` on a pure data-parallel mesh of the
row's GPUs, blocks fully recomputed, fp16, one micro-batch of global batch / GPUs samples.
Its blocks are sharded as autopar's runtime would run them in the GPUs' 80 GB
(``runnable_blocks``): one FSDP2 unit a block where that fits, else one a weight matrix
(``fsdp_modules``; DeepSpeed itself gathers module by module). Only 530B on 640 GPUs needs
the latter (a block a unit: 95.8 GiB, with the margin; bench/published.py prints both).
It runs DeepSpeed's 2021 software generation (cost_models/software.toml,
``deepspeed-zero3-2021``), whose two values are fitted on two NAMED rows, one per regime
(``CALIBRATION``): its compute efficiency on 175B at 384 GPUs, where compute bounds the
step, and its collectives' bandwidth share on 175B at 768 GPUs, where they do. The other
four rows (175B at 1,536; all of 530B) check the fit (tests/cost_models/test_zero3_scaling.py).
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass
from importlib import resources

from autopar.planner.costs import LayerCost, layer_costs
from autopar.planner.one_stage import plan_memory
from autopar.planner.published import MegatronRow, megatron_graph, paper_flops
from cost_models.calibrate import fit_software_efficiency_with
from cost_models.hardware import Cluster
from cost_models.memory import precision
from cost_models.software import with_fitted_values, with_software
from passes.records import LayerGraph
from runtime.plan import Mesh

TABLE2_PATH = resources.files("autopar") / "data" / "megatron_sc21_table2.csv"
SOFTWARE = "deepspeed-zero3-2021"
CALIBRATION = {"efficiency": (174.6, 384), "fsdp_bandwidth_share": (174.6, 768)}
"""(params_b, gpus) of the rows each value of the generation is fitted on."""


@dataclass(frozen=True, kw_only=True)
class Table2Row:
    scheme: str
    """'zero3' or 'ptd-p'."""
    params_b: float
    heads: int
    hidden: int
    layers: int
    model_parallel: int
    global_batch: int
    gpus: int
    microbatch: int
    tflops_per_gpu: float

    @property
    def megatron(self) -> MegatronRow:
        """The row as Table 1's reader describes a run (shape, batch, GPUs; no TP or PP)."""
        return MegatronRow(params_b=self.params_b, heads=self.heads, hidden=self.hidden,
                           layers=self.layers, tp=1, pp=1, gpus=self.gpus,
                           global_batch=self.global_batch, tflops_per_gpu=self.tflops_per_gpu,
                           microbatch=self.microbatch, interleave=1)

    @property
    def label(self) -> str:
        return f"{self.scheme} {self.params_b:g}B ×{self.gpus}"


def table2_rows() -> list[Table2Row]:
    """The twelve rows of Table 2, in its order."""
    text = TABLE2_PATH.read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    ints = ("heads", "hidden", "layers", "model_parallel", "global_batch", "gpus", "microbatch")
    return [Table2Row(scheme=cells["scheme"], params_b=float(cells["params_b"]),
                      tflops_per_gpu=float(cells["tflops_per_gpu"]),
                      **{k: int(cells[k]) for k in ints})
            for cells in csv.DictReader(io.StringIO("\n".join(lines)))]


def zero3_rows() -> list[Table2Row]:
    return [r for r in table2_rows() if r.scheme == "zero3"]


def calibration_rows() -> list[Table2Row]:
    """The rows ``CALIBRATION`` names, efficiency's first."""
    by_key = {(r.params_b, r.gpus): r for r in zero3_rows()}
    return [by_key[key] for key in CALIBRATION.values()]


def zero3_graph(params_b: float, heads: int, hidden: int, layers: int, global_batch: int
                ) -> LayerGraph:
    """Megatron-LM's GPT at the row's shape and global batch (``megatron_graph``, which
    caches it)."""
    return megatron_graph(MegatronRow(params_b=params_b, heads=heads, hidden=hidden,
                                      layers=layers, tp=1, pp=1, gpus=1,
                                      global_batch=global_batch, tflops_per_gpu=0.0,
                                      microbatch=global_batch, interleave=1))


def zero3_cluster(row: Table2Row) -> Cluster:
    return with_software(Cluster.preset("dgx-a100-80g", nodes=row.gpus // 8), SOFTWARE)


@dataclass(frozen=True, kw_only=True)
class Zero3Prediction:
    tflops_per_gpu: float
    """Counted the paper's way (``paper_flops``)."""
    step_time_s: float
    exposed_comm_s: float
    """Per step: the gathers and reduce-scatters compute did not hide."""
    costs: tuple[LayerCost, ...]
    memory_margin: float

    @functools.cached_property
    def peak_memory_bytes(self) -> float:
        """Per rank, with the cluster's memory margin (``one_stage.plan_memory``); walked
        only when asked (the fit predicts rows many times for their speed alone)."""
        return plan_memory(self.costs, self.memory_margin).total_bytes


def predict(row: Table2Row, *, blocks: str | None = None,
            software_efficiency: float | None = None,
            fsdp_bandwidth_share: float | None = None) -> Zero3Prediction:
    """The cost model's step of a ZeRO-3 row (module docstring), its blocks sharded by the
    strategy ``blocks``: ``fsdp`` (one FSDP2 unit a block) or ``fsdp_modules`` (one a
    weight matrix, DeepSpeed's own granularity); by default the first that fits
    (``runnable_blocks``). The two keyword values replace the generation's (to fit them:
    ``fit_software``)."""
    blocks = blocks or runnable_blocks(row)
    graph = zero3_graph(row.params_b, row.heads, row.hidden, row.layers, row.global_batch)
    cluster = with_fitted_values(zero3_cluster(row), efficiency=software_efficiency,
                                 fsdp_bandwidth_share=fsdp_bandwidth_share)
    block_class = max(graph.classes, key=lambda c: len(graph.classes[c]))
    mesh = Mesh(pp=1, dp=row.gpus, tp=1)
    costs = tuple(layer_costs(graph.layers, lambda layer: f"{blocks}+full"
                              if layer.layer_class == block_class else "fsdp",
                              mesh, cluster, precision("float16")))
    step = sum(c.time_s for c in costs)
    return Zero3Prediction(tflops_per_gpu=paper_flops(row.megatron) / step / row.gpus / 1e12,
                           step_time_s=step, exposed_comm_s=sum(c.comm_s for c in costs),
                           costs=costs, memory_margin=cluster.memory_margin_fraction)


@functools.cache
def runnable_blocks(row: Table2Row) -> str:
    """How the row's blocks are sharded to fit its GPUs by the memory model: one FSDP2 unit
    a block (``fsdp``) if that fits, else one a weight matrix (``fsdp_modules``)."""
    memory = zero3_cluster(row).device.memory_bytes
    for blocks in ("fsdp", "fsdp_modules"):
        if predict(row, blocks=blocks).peak_memory_bytes <= memory:
            return blocks
    raise ValueError(f"{row.label} fits {memory / 2**30:.0f} GiB neither a block nor a "
                     "weight matrix a unit")


def fit_software() -> tuple[float, float]:
    """(software efficiency, sharded collectives' bandwidth share) that predict the
    ``CALIBRATION`` rows at their published TFLOP/s (``fit_software_efficiency_with``)."""
    rows = calibration_rows()

    def ratios(efficiency: float, share: float) -> list[float]:
        return [predict(r, software_efficiency=efficiency, fsdp_bandwidth_share=share)
                .tflops_per_gpu / r.tflops_per_gpu for r in rows]

    return fit_software_efficiency_with(ratios, 0.01, 0.5, rel_tol=1e-5)
