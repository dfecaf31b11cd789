"""The Plan: the one contract between the planner and the runtime.

A plan is a versioned JSON document that names modules by fully-qualified name. It can be
written by the planner, saved, diffed, edited by hand and executed by ``runtime`` without
the planner. Every rank executes the same plan.

Layout of the device mesh: named axes, ``AXES`` below (the one place their order is
written).

Per-layer strategies (``LayerPlan.strategy``): ``replicate``, ``zero1``, ``zero2``, ``fsdp``,
``hsdp``, ``tp``, ``tp_zero1``, ``tp_zero2``, ``tp_fsdp``; each one's whole meaning (what it shards over which ranks,
the engine that runs it, when it communicates, when it is available) is its spec in
``runtime.strategies``.

Per layer, besides its strategy: ``recompute`` (``none``; ``selective``, the attention
core recomputed in backward; ``full``, the whole layer's forward recomputed from its
input), ``offload`` (``fsdp``/``tp_fsdp`` layers keep parameters, gradients and the
optimizer step in host memory) and ``sequence_parallel`` (TP layers also split their
norms and element-wise ops along the sequence; all-reduces become reduce-scatter +
all-gather), ``async_tp`` (sequence-parallel TP layers overlap those collectives with their
matmuls: PyTorch's async TP, ``runtime.async_tp``).

Precision (``Plan.param_dtype``): the compute dtype. Master weights and optimizer states
stay float32; gradients are communicated in ``reduce_dtype``; float16 needs
``loss_scaling = "dynamic"``. ``gradient_accumulation`` micro-batches make one step when
``mesh.pp == 1`` (a pipeline's micro-batches are ``pipeline.num_microbatches``).

Pipeline parallelism (``mesh.pp > 1``, ``Plan.pipeline``): layers are cut into
``pp * virtual_stages`` contiguous stages (``LayerPlan.stage``, in execution order). Stage
``s`` runs on pipeline rank ``stage_rank(s)``, by the schedule's placement (looped or V;
the schedules are one table, ``cost_models.schedule.SCHEDULES``). Each of the ``num_microbatches`` micro-batches
holds ``global_batch / (dp * num_microbatches)`` samples. Data-parallel strategies act
within a stage's ``dp * tp`` ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from cost_models.errors import ConfigError
from cost_models.memory import MemoryTerms
from cost_models.schedule import SCHEDULES
from runtime import async_tp
from runtime.files import write_atomic
from runtime.strategies import STRATEGIES, StrategySpec, spec

PLAN_VERSION = 2
"""2: layers carry ``expert_parallel``; option costs name ``buffers_bytes``. Older versions are migrated when read
(``MIGRATIONS``)."""
AXES = ("pp", "dp", "cp", "tp")
"""The mesh's axes, outermost first. Ranks are numbered row-major over them, so the last is
innermost: a tensor-parallel group is a run of consecutive ranks (the devices of one node),
a context-parallel group ranks ``tp`` apart, a data-parallel group ranks ``cp · tp`` apart,
and each pipeline stage's ranks are contiguous. Expert parallelism
(``LayerPlan.expert_parallel``) splits a layer's dp axis as ``(dp / ep, ep)``, ep inner."""
RECOMPUTE = ("none", "selective", "full")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
LOSS_SCALING = ("none", "dynamic")
# How one submodule is split for tensor parallelism (see runtime.tensor_parallel):
#   colwise           Linear split on output features; output stays sharded on the last dim
#   rowwise           Linear split on input features; output all-reduced (replicated)
#   colwise_gather    Linear split on output features; output all-gathered (replicated)
#   embedding_rowwise Embedding split on the vocabulary; output all-reduced (replicated)
#   sequence_parallel a norm or element-wise submodule run on sequence shards (only when the
#                     layer's sequence_parallel is set; runtime.tensor_parallel)
TP_STYLES = ("colwise", "rowwise", "colwise_gather", "embedding_rowwise", "sequence_parallel")
# What ``recompute = "selective"`` keeps (torchtitan's op-level selective checkpointing):
# the outputs of these ops are saved in forward, every other op of the layer is run again
# in backward (norms, activations, dropout with its RNG state replayed, and the attention
# core: bmm / fused attention, Korthikanti et al. 2022's selective recomputation).
# Weight matmuls and TP collectives are the expensive ops, so backward repeats neither.
# Named as overload packets; runtime.recompute builds its checkpoint policy from this list
# and passes.annotate credits exactly the bytes that policy does not hold.
SELECTIVE_SAVE_OPS = (
    "aten.mm", "aten.addmm", "aten._scaled_mm", "aten._grouped_mm",
    "_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_to_all_single",
    "_c10d_functional_autograd.reduce_scatter_tensor",
    "_c10d_functional_autograd.all_gather_into_tensor",
    "_c10d_functional_autograd.all_to_all_single",
)
SPLIT_BACKWARD_SCHEDULES = tuple(name for name, s in SCHEDULES.items() if s.split_backward)
"""Schedules that split each backward (cost_models.schedule.ScheduleSpec.split_backward)."""


def option_label(strategy: str, recompute: str = "none", offload: bool = False,
                 sequence_parallel: bool = False, expert_parallel: int = 1,
                 async_tp: bool = False) -> str:
    """One layer's choice as one word, e.g. ``tp_fsdp+sp+async+full``: the strategy, then
    ``+ep<n>``, ``+sp``, ``+async``, ``+offload`` and the recompute mode when not the
    default."""
    parts = [strategy]
    if expert_parallel > 1:
        parts.append(f"ep{expert_parallel}")
    if sequence_parallel:
        parts.append("sp")
    if async_tp:
        parts.append("async")
    if offload:
        parts.append("offload")
    if recompute != "none":
        parts.append(recompute)
    return "+".join(parts)


def parse_option(label: str) -> dict[str, Any]:
    """The LayerPlan fields an option label stands for (inverse of option_label)."""
    strategy, *rest = label.split("+")
    fields: dict[str, Any] = {"strategy": strategy, "recompute": "none", "offload": False,
                              "sequence_parallel": False, "expert_parallel": 1,
                              "async_tp": False}
    for part in rest:
        if part.startswith("ep") and part[2:].isdigit():
            fields["expert_parallel"] = int(part[2:])
        elif part == "sp":
            fields["sequence_parallel"] = True
        elif part == "async":
            fields["async_tp"] = True
        elif part == "offload":
            fields["offload"] = True
        elif part in RECOMPUTE:
            fields["recompute"] = part
        else:
            raise PlanError(f"option {label!r}: unknown part {part!r}")
    return fields


class PlanError(ConfigError):
    """A plan is malformed or does not fit the model or world it is applied to."""


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """Degrees of the device mesh, outermost first: pipeline, data, context, tensor."""

    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    dp: int = 1
    """Data-parallel degree (replicas of one stage, each on its own slice of the batch)."""
    cp: int = 1
    """Context-parallel degree: ranks that split every sample's sequence (load-balanced
    chunks, ring attention). Parameters are replicated over cp like over dp, so gradients
    are reduced, and FSDP shards, over dp × cp."""
    tp: int = 1
    """Tensor-parallel degree (devices of one node that split each TP layer)."""

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"mesh.{axis} must be a positive integer, got {value!r}")
        if self.pp > 1 and self.cp > 1:
            raise PlanError(
                f"mesh {self.describe()}: context parallelism (cp > 1) does not run in "
                "pipelines yet (the stages would need ring attention and position ids passed "
                "between them); use mesh.pp = 1 or mesh.cp = 1")

    def size(self, axis: str) -> int:
        """The degree of a named axis (one of AXES)."""
        if axis not in AXES:
            raise KeyError(f"mesh axis {axis!r} is not one of {', '.join(AXES)}")
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """How many ranks apart the members of one group along ``axis`` are (the product of
        the axes inside it)."""
        return math.prod(self.size(a) for a in AXES[AXES.index(axis) + 1:])

    @property
    def world_size(self) -> int:
        return math.prod(self.size(a) for a in AXES)

    def describe(self, sep: str = " × ") -> str:
        """'pp=1 × dp=4 × tp=2'; cp shown only when it is used."""
        return sep.join(f"{a}={self.size(a)}" for a in AXES if a != "cp" or self.cp > 1)

    @property
    def replicas(self) -> int:
        """Ranks of one stage that hold the same TP shard of a parameter: dp × cp."""
        return self.dp * self.cp


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """How the stages of a pipeline-parallel plan are scheduled."""

    schedule: str = "1F1B"
    """One of SCHEDULES."""
    num_microbatches: int = 1
    """Micro-batches per optimizer step (per data-parallel replica)."""
    virtual_stages: int = 1
    """Stages per pipeline rank (v): 1, or >= 2 for interleaved and V schedules."""
    scatter_sends: bool = False
    """With mesh.tp > 1: each tp rank sends only its 1/tp slice (of the last dim) of what
    crosses to a stage on another pipeline rank, and the receiving stage all-gathers the
    slices over its tp group (Megatron-LM's scatter/gather; runtime.pipeline_sends). The
    last dim of every tensor sent must divide by tp. False: every tp rank sends the whole
    activation (plans written before this field)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"pipeline.schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}"
            )
        if not isinstance(self.scatter_sends, bool):
            raise PlanError(f"pipeline.scatter_sends must be true or false, got "
                            f"{self.scatter_sends!r}")
        for name in ("num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"pipeline.{name} must be a positive integer, got {value!r}")
        allowed = SCHEDULES[self.schedule].virtual_stages
        v = self.virtual_stages
        if not SCHEDULES[self.schedule].accepts(v):
            want = "2 or more" if allowed is None else " or ".join(map(str, allowed))
            raise PlanError(
                f"pipeline.schedule {self.schedule!r} takes virtual_stages = {want}, got {v}"
            )


def schedule_microbatch_problem(schedule: str, pp: int, m: int) -> str | None:
    """What torch.distributed.pipelining's schedules require of num_microbatches, as the
    message naming the field (None when the combination runs)."""
    if schedule == "1F1B" and m < pp:
        return (f"pipeline.num_microbatches={m} is less than mesh.pp={pp}; schedule '1F1B' "
                f"needs at least one micro-batch per stage: use num_microbatches >= {pp} "
                "or schedule 'GPipe'")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // pp)  # micro-batches advance in rounds of about pp
        if m % rounds:
            return (f"pipeline.num_microbatches={m} with schedule {schedule!r} and "
                    f"mesh.pp={pp}: the schedule runs max(1, {m} // {pp}) = {rounds} rounds "
                    f"and needs num_microbatches to be a multiple of them; use a multiple "
                    f"of {pp} or at most {pp}")
    return None


def stage_rank(stage: int, pp: int, pipeline: PipelineSpec | None) -> int:
    """The pipeline rank (coordinate on the pp axis) that runs ``stage``."""
    if pipeline is None:
        return stage % pp
    return SCHEDULES[pipeline.schedule].stage_rank(stage, pp)


@dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """What one layer (a module, by fully-qualified name) does."""

    module: str
    """Fully-qualified module name in the user's model, e.g. ``transformer.h.3``."""
    strategy: str = "replicate"
    """One of STRATEGIES."""
    tp_styles: dict[str, str] = field(default_factory=dict)
    """For TP strategies: submodule path relative to ``module`` ('' for the module itself)
    to one of TP_STYLES."""
    stage: int = 0
    """Pipeline stage that holds this layer (0 .. pp * virtual_stages - 1)."""
    layer_class: str = ""
    """Informational: the class of identical layers this one belongs to."""
    memory_bytes: int | None = None
    """Informational: modelled per-rank memory of this layer (parameters, gradients,
    optimizer states, saved activations)."""
    time_s: float | None = None
    """Informational: modelled forward + backward time of this layer, communication included."""
    recompute: str = "none"
    """One of RECOMPUTE: activations recomputed in backward instead of kept."""
    offload: bool = False
    """Keep this layer's parameters, gradients and optimizer step in host memory
    (strategies whose spec is ``offloadable``)."""
    sequence_parallel: bool = False
    """TP strategies only: norms and element-wise ops split along the sequence."""
    expert_parallel: int = 1
    """Expert-parallel degree of the mixture-of-experts blocks inside this layer: each
    block's experts are split over this many data-parallel ranks, and tokens travel to
    their experts' ranks and back by all-to-all (1: every rank holds every expert)."""
    async_tp: bool = False
    """Sequence-parallel TP layers only: PyTorch's async TP, the layer's all-gathers and
    reduce-scatters overlapped with its matmuls chunk by chunk (the layer is compiled with
    Inductor's micro-pipeline pass; CUDA GPUs of capability 9.0+ on NVLink: runtime.async_tp
    lists what it needs)."""

    def __post_init__(self) -> None:
        where = f"layer {self.module!r}"
        if not isinstance(self.module, str) or not self.module:
            raise PlanError(f"{where}: 'module' must be a non-empty module path")
        if self.strategy not in STRATEGIES:
            raise PlanError(
                f"{where}: unknown strategy {self.strategy!r}; valid: {', '.join(STRATEGIES)}"
            )
        for sub, style in self.tp_styles.items():
            if style not in TP_STYLES:
                raise PlanError(
                    f"{where}: tp_styles[{sub!r}] = {style!r} is not one of "
                    f"{', '.join(TP_STYLES)}"
                )
        tensor_parallel = self.spec.tensor_parallel
        if tensor_parallel and not self.tp_styles:
            raise PlanError(
                f"{where}: strategy {self.strategy!r} needs tp_styles naming how its "
                "submodules are split (e.g. {'fc_in': 'colwise', 'fc_out': 'rowwise'})"
            )
        if not tensor_parallel and self.tp_styles:
            raise PlanError(f"{where}: tp_styles given but strategy is {self.strategy!r}")
        if not isinstance(self.stage, int) or self.stage < 0:
            raise PlanError(f"{where}: stage must be a non-negative integer")
        if self.recompute not in RECOMPUTE:
            raise PlanError(
                f"{where}: recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if not isinstance(self.offload, bool) or not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"{where}: offload and sequence_parallel must be true or false")
        if self.offload and not self.spec.offloadable:
            raise PlanError(
                f"{where}: offload needs a fully sharded strategy "
                f"({', '.join(s for s in STRATEGIES if spec(s).offloadable)}), "
                f"got {self.strategy!r}")
        ep = self.expert_parallel
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise PlanError(f"{where}: expert_parallel must be a positive integer, got {ep!r}")
        if self.sequence_parallel and not tensor_parallel:
            raise PlanError(
                f"{where}: sequence_parallel needs a tensor-parallel strategy "
                f"({', '.join(s for s in STRATEGIES if spec(s).tensor_parallel)}), "
                f"got {self.strategy!r}")
        if not isinstance(self.async_tp, bool):
            raise PlanError(f"{where}: async_tp must be true or false, got {self.async_tp!r}")
        if self.async_tp and (problem := async_tp.layer_problem(
                tensor_parallel=tensor_parallel, sequence_parallel=self.sequence_parallel)):
            raise PlanError(f"{where} (strategy {self.strategy!r}): {problem}")

    @property
    def spec(self) -> StrategySpec:
        """What the layer's strategy means (runtime.strategies)."""
        return spec(self.strategy)

    @property
    def is_tp(self) -> bool:
        return self.spec.tensor_parallel

    @property
    def option(self) -> str:
        """The strategy with its recompute / offload / SP choices, as one label."""
        return option_label(self.strategy, self.recompute, self.offload, self.sequence_parallel,
                            self.expert_parallel, self.async_tp)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown(MemoryTerms):
    """Per-rank memory in bytes, at the step's peak: the five terms (integers here) and the
    allocator's margin."""

    margin_bytes: int = 0
    """Allocator fragmentation margin."""
    peak_at: str = ""
    """The event of the training step the peak is at (e.g. 'backward of h.11',
    'optimizer step'; autopar.planner.liveness); empty when not known."""

    @property
    def total_bytes(self) -> int:
        return int(super().total_bytes) + self.margin_bytes


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model expects of this plan, per training step."""

    step_time_s: float
    """compute_s + comm_s + bubble_s."""
    compute_s: float
    comm_s: float
    """Communication not hidden behind compute."""
    memory: MemoryBreakdown
    capacity_bytes: int
    source: str = "modelled"
    """Where the numbers came from: modelled, calibrated or measured."""
    bubble_s: float = 0.0
    """Time pipeline ranks sit idle in the schedule's fill and drain."""
    bubble_fraction: float = 0.0
    """bubble_s / step_time_s as the schedule model computes it (0 without pipelining)."""
    rank_memory: tuple[MemoryBreakdown, ...] = ()
    """Pipeline plans: the memory of each pipeline rank (``memory`` is the fullest)."""


@dataclass(frozen=True, kw_only=True)
class SolverReport:
    """The optimisation certificate: objective, lower bound and gap."""

    solver: str
    status: str
    objective_s: float
    lower_bound_s: float
    """The least step time any evaluated candidate could reach: the LP relaxation of each
    pp = 1 mesh's ILP, and for pipeline configurations the busiest rank's work plus its
    fill, drain and gradient sync under the per-rank ILP's strategies."""
    gap: float
    solve_time_s: float
    candidates: int = 1
    """Mesh shapes considered by the outer search."""


@dataclass(frozen=True, kw_only=True)
class OptionCost(MemoryTerms):
    """What one strategy would cost one layer of a class, on the plan's mesh (modelled); its
    memory terms are integers, ``buffers_bytes`` the transient (an FSDP layer's gathered
    parameters), of which the plan holds the largest, not the sum."""

    strategy: str
    compute_s: float
    comm_s: float
    """Forward + backward + optimizer step; communication not overlapped."""
    hidden_comm_s: float = 0.0
    """Per step, communication hidden behind compute (net of the slowdown overlapping
    causes): ``comm_s`` plus this is all the communication the option issues."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def resident_bytes(self) -> int:
        return int(self.states_bytes + self.activations_bytes)


@dataclass(frozen=True, kw_only=True)
class ClassCosts:
    """Every strategy the planner could give a class of identical layers, with its cost."""

    layer_class: str
    count: int
    options: tuple[OptionCost, ...]


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """Another plan the search considered (one candidate mesh / pipeline shape)."""

    mesh: Mesh
    status: str
    """'optimal' (the best plan on that shape), 'infeasible' or 'skipped'."""
    step_time_s: float | None = None
    """Modelled step time of the best plan on that shape (None when none fits)."""
    min_memory_bytes: int | None = None
    """For infeasible shapes: the least per-rank memory any plan on it needs."""
    lower_bound_s: float | None = None
    """For shapes skipped because they cannot win: a step time no plan on them beats."""
    reason: str = ""
    pipeline: PipelineSpec | None = None


@dataclass(frozen=True, kw_only=True)
class Rationale:
    """Why the plan is what it is: the machine and model as the planner saw them, the cost
    of every option per layer class, and the other shapes the search considered. Optional;
    compact (per class, not per layer). Reports, ``autopar explain`` and exports read it."""

    model_flops_per_step: float
    """Forward + backward FLOPs of one step from the layer graph (no recomputation)."""
    peak_flops_per_device: float
    """Dense peak FLOP/s of one device at the plan's compute dtype (datasheet)."""
    nodes: int
    devices_per_node: int
    memory_margin_fraction: float
    cluster_provenance: str = "modelled"
    classes: tuple[ClassCosts, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    """Best first; the chosen plan's own shape included."""
    ties: dict[str, str] = field(default_factory=dict)
    """Layer -> the tied weights it shares (runtime/tied.py): why it takes its tie's
    strategy and no tensor parallelism."""
    async_tp_unavailable: str = ""
    """Why the cluster's tp groups cannot run PyTorch's async TP, so no option had it
    (``runtime.async_tp.cluster_problem``); empty when they can, or tp is 1."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete, executable parallelization plan."""

    version: int = PLAN_VERSION
    model: str = ""
    """Name of the model the plan was made for (informational)."""
    cluster: str = ""
    """Name of the cluster the plan was made for (informational)."""
    global_batch: int
    """Samples per optimizer step, summed over data-parallel replicas."""
    seq_len: int | None = None
    mesh: Mesh = field(default_factory=Mesh)
    layers: tuple[LayerPlan, ...] = ()
    param_dtype: str = "float32"
    """Compute dtype (one of COMPUTE_DTYPES); master weights and optimizer states stay float32."""
    reduce_dtype: str = "float32"
    """Dtype of gradient communication (float32, or param_dtype)."""
    loss_scaling: str = "none"
    """One of LOSS_SCALING; float16 needs 'dynamic'."""
    gradient_accumulation: int = 1
    """Micro-batches per optimizer step when mesh.pp == 1 (pipelines use
    pipeline.num_microbatches)."""
    hsdp_shard_size: int | None = None
    """Ranks that shard an 'hsdp' layer (one node); required when a layer uses 'hsdp'."""
    pipeline: PipelineSpec | None = None
    """Required when mesh.pp > 1."""
    prediction: Prediction | None = None
    solver: SolverReport | None = None
    rationale: Rationale | None = None
    """Optional: per-class option costs and alternatives, for reports and explanations."""

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise PlanError(_unsupported(self.version))
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise PlanError(f"global_batch must be a positive integer, got {self.global_batch!r}")
        if self.global_batch % self.mesh.dp:
            raise PlanError(
                f"global_batch {self.global_batch} is not divisible by the data-parallel degree "
                f"mesh.dp={self.mesh.dp}; choose a batch that is a multiple of {self.mesh.dp}"
            )
        self._check_context_parallel()
        self._check_pipeline()
        self._check_precision()
        self._check_accumulation()
        self._check_hsdp()
        seen: set[str] = set()
        for layer in self.layers:
            if layer.module in seen:
                raise PlanError(f"layer {layer.module!r} appears twice in the plan")
            seen.add(layer.module)
            if layer.is_tp and self.mesh.tp == 1:
                raise PlanError(
                    f"layer {layer.module!r} uses {layer.strategy!r} but mesh.tp is 1; "
                    "set mesh.tp > 1 or use 'replicate'/'fsdp'"
                )
            if self.mesh.dp % layer.expert_parallel:
                raise PlanError(
                    f"layer {layer.module!r}: expert_parallel={layer.expert_parallel} must "
                    f"divide the data-parallel degree mesh.dp={self.mesh.dp} (experts are "
                    "split over data-parallel ranks)")
            if layer.stage >= self.num_stages:
                raise PlanError(
                    f"layer {layer.module!r} is on stage {layer.stage} but the plan has "
                    f"{self.num_stages} stage(s) (mesh.pp × pipeline.virtual_stages)"
                )

    def _check_pipeline(self) -> None:
        if self.mesh.pp > 1 and self.pipeline is None:
            raise PlanError("mesh.pp > 1 needs a 'pipeline' section (schedule, num_microbatches)")
        if self.pipeline is None:
            return
        self._check_schedule_microbatches()
        if self.pipeline.scatter_sends and self.mesh.tp == 1:
            raise PlanError("pipeline.scatter_sends splits stage sends over the tensor-parallel "
                            "group, but mesh.tp is 1; set scatter_sends false or mesh.tp > 1")
        m = self.pipeline.num_microbatches
        if self.global_batch % (self.mesh.dp * m):
            raise PlanError(
                f"global_batch {self.global_batch} is not divisible by dp × num_microbatches = "
                f"{self.mesh.dp} × {m}; each micro-batch needs the same number of samples"
            )
        stages = [layer.stage for layer in self.layers]
        if stages != sorted(stages):
            raise PlanError(
                "pipeline stages must be contiguous runs of layers in execution order; "
                f"got stages {stages}"
            )
        missing = sorted(set(range(self.num_stages)) - set(stages))
        if self.layers and missing:
            raise PlanError(f"pipeline stage(s) {missing} hold no layer")
        selective = [la.module for la in self.layers if la.recompute == "selective"]
        if selective and self.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:
            raise PlanError(
                f"layer {selective[0]!r} recomputes selectively, which schedule "
                f"{self.pipeline.schedule!r} cannot run: it splits each backward into input "
                "and weight passes, and selective checkpointing allows one backward; use "
                "recompute 'full' or a schedule such as 1F1B or Interleaved1F1B")

    def _check_precision(self) -> None:
        if self.param_dtype not in COMPUTE_DTYPES:
            raise PlanError(f"param_dtype {self.param_dtype!r} is not one of "
                            f"{', '.join(COMPUTE_DTYPES)}")
        if self.reduce_dtype not in ("float32", self.param_dtype):
            raise PlanError(f"reduce_dtype {self.reduce_dtype!r} must be 'float32' or the "
                            f"param_dtype {self.param_dtype!r}")
        if self.loss_scaling not in LOSS_SCALING:
            raise PlanError(f"loss_scaling {self.loss_scaling!r} is not one of "
                            f"{', '.join(LOSS_SCALING)}")
        if self.param_dtype == "float16" and self.loss_scaling != "dynamic":
            raise PlanError("param_dtype 'float16' needs loss_scaling 'dynamic': float16 "
                            "gradients underflow without it")

    def _check_accumulation(self) -> None:
        k = self.gradient_accumulation
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise PlanError(f"gradient_accumulation must be a positive integer, got {k!r}")
        if k > 1 and self.mesh.pp > 1:
            raise PlanError("gradient_accumulation > 1 with mesh.pp > 1: a pipeline "
                            "accumulates over pipeline.num_microbatches; set it there")
        if self.global_batch % (self.mesh.dp * k):
            raise PlanError(
                f"global_batch {self.global_batch} is not divisible by dp × "
                f"gradient_accumulation = {self.mesh.dp} × {k}; each micro-batch needs the "
                "same number of samples")

    def _check_context_parallel(self) -> None:
        cp = self.mesh.cp
        if cp == 1:
            return
        if self.seq_len is None:
            raise PlanError(f"mesh.cp={cp} splits the sequence, but the plan has no seq_len; "
                            "set seq_len (tokens per sample)")
        if self.seq_len % (2 * cp):
            raise PlanError(
                f"seq_len {self.seq_len} is not divisible by 2 × mesh.cp = {2 * cp}: context "
                f"parallelism gives each rank two of {2 * cp} equal chunks (one early, one "
                "late, so causal attention work is balanced); choose a sequence length that is "
                f"a multiple of {2 * cp} or a smaller cp")

    def _check_hsdp(self) -> None:
        uses = [la.module for la in self.layers if la.strategy == "hsdp"]
        size = self.hsdp_shard_size
        if size is None:
            if uses:
                raise PlanError(f"layer {uses[0]!r} uses 'hsdp' but the plan has no "
                                "hsdp_shard_size (ranks per shard group, e.g. one node)")
            return
        replicas = self.mesh.replicas * self.mesh.tp
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or replicas % size:
            raise PlanError(f"hsdp_shard_size {size!r} must be a positive divisor of the "
                            f"ranks of a stage, dp × cp × tp = {replicas}")

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel replica."""
        return self.pipeline.num_microbatches if self.pipeline else self.gradient_accumulation

    def _check_schedule_microbatches(self) -> None:
        problem = schedule_microbatch_problem(
            self.pipeline.schedule, self.mesh.pp, self.pipeline.num_microbatches)
        if problem:
            raise PlanError(problem)

    # -- lookup ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * (self.pipeline.virtual_stages if self.pipeline else 1)

    def report(self, *, top_k: int = 5) -> str:
        """The plan as a human-readable report (see runtime.plan_report)."""
        from runtime.plan_report import format_report

        return format_report(self, top_k=top_k)

    def layer(self, module: str) -> LayerPlan:
        for layer in self.layers:
            if layer.module == module:
                return layer
        raise KeyError(module)

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "plan") -> Plan:
        """A plan from its JSON object: migrated from an older version, every field checked
        (names, types, ranges, then each record's own rules), errors naming the field."""
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan must be a JSON object, got {_json_type(data)}")
        data = migrate(dict(data), source)
        _check_names(cls, data, source)
        _check_integers(data, source, "")
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise PlanError(f"{source}: {_located(str(e))}") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan") -> Plan:
        try:
            data = json.loads(text)
        except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
            raise PlanError(f"{source}: not valid JSON ({e})") from e
        return cls.from_dict(data, source=source)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash never leaves a half-written plan over a good one."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror}") from e
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PlanError(f"{path}: not a UTF-8 text file (byte {e.start} is "
                            f"{raw[e.start:e.start + 1]!r}); a plan is JSON in UTF-8") from None
        return cls.from_json(text, source=str(path))


def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 had no expert parallelism (every layer's ``expert_parallel`` is 1, the
    field's default, so layers need no change) and called an option cost's transient
    memory ``buffer_bytes`` (now ``buffers_bytes``, as every memory record names it)."""
    data = {**data, "version": 2}
    rationale = data.get("rationale")
    if isinstance(rationale, dict) and isinstance(rationale.get("classes"), list):
        data["rationale"] = {**rationale, "classes": [
            {**c, "options": [_renamed(o, "buffer_bytes", "buffers_bytes")
                              for o in c.get("options", [])]} if isinstance(c, dict) else c
            for c in rationale["classes"]]}
    return data


def _renamed(record: Any, old: str, new: str) -> Any:
    if not isinstance(record, dict) or old not in record:
        return record
    return {(new if k == old else k): v for k, v in record.items()}


MIGRATIONS = {1: _v1_to_v2}
"""Version -> the function that turns a plan of that version into the next one."""


def readable_versions() -> tuple[int, ...]:
    return (*sorted(MIGRATIONS), PLAN_VERSION)


def migrate(data: dict[str, Any], source: str = "plan") -> dict[str, Any]:
    """A plan's JSON object brought to PLAN_VERSION, one version at a time."""
    version = data.get("version", PLAN_VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise PlanError(f"{source}: 'version' must be an integer such as {PLAN_VERSION}, got "
                        f"{version!r}")
    while version in MIGRATIONS:
        data = MIGRATIONS[version](data)
        version = data["version"]
    if version != PLAN_VERSION:
        raise PlanError(f"{source}: {_unsupported(version)}")
    return data


def _unsupported(version: Any) -> str:
    return (f"plan version {version!r} is not supported (this autopar writes version "
            f"{PLAN_VERSION} and reads versions {', '.join(map(str, readable_versions()))}); "
            "re-plan with `autopar plan`")


JSON_INT_LIMIT = 2**63
"""Integers a plan may hold (the range of int64, as JSON readers in other languages take)."""


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file (docs/plan.schema.json is this, published)."""
    return msgspec.json.schema(Plan)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value),
                                                                        type(value).__name__)


def _located(message: str) -> str:
    """msgspec's 'what - at `$.a.b[0]`' as 'a.b[0]: what'."""
    what, sep, path = message.rpartition(" - at `$")
    if not sep:
        return message
    path = path.rstrip("`").lstrip(".")
    return f"{path}: {what}" if path else what


def _check_names(cls: type, data: Any, where: str) -> None:
    """Unknown field names, at every level of the plan's records, named with the valid ones
    (types are msgspec's to check)."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {unknown}; valid fields: {sorted(names)}")
    for name, value in data.items():
        record = _record_type(hints[name])
        if record is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_names(record, item, f"{where}: {name}[{i}]")
        else:
            _check_names(record, value, f"{where}: {name}")


def _record_type(hint: Any) -> type | None:
    """The dataclass a field holds (alone, optional, or as a tuple of them), if any."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if arg is not Ellipsis and dataclasses.is_dataclass(arg):
            return arg
    return None


def _check_integers(data: Any, where: str, path: str) -> None:
    if isinstance(data, dict):
        for key, value in data.items():
            _check_integers(value, where, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _check_integers(value, where, f"{path}[{i}]")
    elif isinstance(data, int) and not isinstance(data, bool) and abs(data) >= JSON_INT_LIMIT:
        raise PlanError(f"{where}: {path}: an integer of {data.bit_length()} bits is out of "
                        "range (plans hold integers below 2**63)")
