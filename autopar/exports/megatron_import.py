"""An existing Megatron-LM job's arguments read back into an autopar plan, to be priced next
to autopar's own plan for the same model and cluster (``compare_megatron``).

Every layer gets the strategy the arguments mean (the inverse of
``autopar.exports.megatron``): transformer blocks, embedding and head tensor-parallel where
tp > 1 and the layer splits (Megatron-LM splits all three), with sequence parallelism when
``--sequence-parallel``; the data-parallel sharding of the distributed optimizer (ZeRO-1:
``zero1``, ``tp_zero1`` on tensor-parallel layers) or Megatron-FSDP (``optim_grads``: ZeRO-2, ``optim_grads_params``: ZeRO-3, hybrid with
several distributed-optimizer instances); recomputation as ``--recompute-granularity`` /
``--recompute-method`` / ``--recompute-num-layers`` say; stages from
``--pipeline-model-parallel-layout`` or Megatron-LM's even split. What autopar's strategies
cannot say is returned as notes.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.errors import ConfigError
from autopar.exports import megatron_flags
from autopar.planner.costs import allowed_strategies
from passes.records import LayerGraph, LayerInfo
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan
from runtime.strategies import spec

ZERO_STAGE = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
"""Megatron-FSDP's --data-parallel-sharding-strategy as a ZeRO stage."""


@dataclass(frozen=True, kw_only=True)
class MegatronJob:
    """What a Megatron-LM job's arguments say about parallelism, batch and precision."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int = 1
    virtual_stages: int = 1
    layout: tuple[str, ...] | None = None
    """Per stage (pp × virtual stages, in Megatron's order), its layers: E, t, L."""
    num_layers: int | None = None
    sequence_parallel: bool = False
    zero_stage: int = 0
    optimizer_instances: int = 1
    optimizer_offload: bool = False
    recompute: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    micro_batch: int
    global_batch: int
    seq_len: int | None = None
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)


def read_megatron_args(argv: str | Sequence[str], world_size: int) -> MegatronJob:
    """The job an argument list (or one shell-quoted string) describes on ``world_size``
    ranks. Arguments autopar does not read (model, data, optimizer) are ignored."""
    words = shlex.split(argv) if isinstance(argv, str) else list(argv)
    try:
        a, _ = megatron_flags.parser().parse_known_args(words)
    except SystemExit:  # argparse has printed which value is wrong
        raise ConfigError("Megatron-LM arguments: see the message above") from None
    if a.decoder_first_pipeline_num_layers or a.decoder_last_pipeline_num_layers:
        raise ConfigError("--decoder-first/last-pipeline-num-layers are not read; give the "
                          "same cuts as --pipeline-model-parallel-layout")
    model_parallel = a.tensor_model_parallel_size * a.pipeline_model_parallel_size * \
        a.context_parallel_size
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by tp × pp × cp = "
                          f"{model_parallel}: Megatron-LM's data-parallel degree is the "
                          "quotient; choose a cluster of a multiple of that many devices")
    dp = world_size // model_parallel
    for name in ("micro_batch_size", "global_batch_size"):
        if getattr(a, name) is None:
            raise ConfigError(f"Megatron-LM arguments: --{name.replace('_', '-')} is missing")
    if a.global_batch_size % (a.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {a.global_batch_size} is not divisible by "
                          f"--micro-batch-size × data-parallel ranks = {a.micro_batch_size} "
                          f"× {dp}")
    layout = _layout(a.pipeline_model_parallel_layout) if a.pipeline_model_parallel_layout \
        else None
    return MegatronJob(
        tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size,
        cp=a.context_parallel_size, dp=dp, ep=a.expert_model_parallel_size,
        virtual_stages=_virtual_stages(a, layout), layout=layout, num_layers=a.num_layers,
        sequence_parallel=a.sequence_parallel, zero_stage=_zero_stage(a),
        optimizer_instances=a.num_distributed_optimizer_instances,
        optimizer_offload=a.optimizer_cpu_offload,
        recompute="selective" if a.recompute_activations else a.recompute_granularity,
        recompute_method=a.recompute_method, recompute_num_layers=a.recompute_num_layers,
        micro_batch=a.micro_batch_size, global_batch=a.global_batch_size, seq_len=a.seq_length,
        **_precision(a))


def _layout(text: str) -> tuple[str, ...]:
    """Megatron-LM's layout syntax: ',' cosmetic, '(..)*n' and 'x*n' unrolled, '|' between
    stages (PipelineParallelLayerLayout.parse_str_to_list)."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = tuple(text.split("|"))
    bad = set("".join(stages)) - set("EtL")
    if bad:
        raise ConfigError(f"--pipeline-model-parallel-layout: layer kinds {sorted(bad)} are "
                          "not read (E embedding, t transformer layer, L loss)")
    return stages


def _virtual_stages(a: argparse.Namespace, layout: tuple[str, ...] | None) -> int:
    pp = a.pipeline_model_parallel_size
    if layout is not None:
        if len(layout) % pp:
            raise ConfigError(f"--pipeline-model-parallel-layout has {len(layout)} stages, "
                              f"not a multiple of --pipeline-model-parallel-size {pp}")
        return len(layout) // pp
    if a.num_virtual_stages_per_pipeline_rank:
        return a.num_virtual_stages_per_pipeline_rank
    if a.num_layers_per_virtual_pipeline_stage:
        if a.num_layers is None or a.num_layers % (pp * a.num_layers_per_virtual_pipeline_stage):
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --num-layers "
                              "divisible by it × --pipeline-model-parallel-size")
        return a.num_layers // (pp * a.num_layers_per_virtual_pipeline_stage)
    return 1


def _zero_stage(a: argparse.Namespace) -> int:
    if a.use_megatron_fsdp:
        return ZERO_STAGE[a.data_parallel_sharding_strategy]
    if a.use_torch_fsdp2:
        return 3
    return 1 if a.use_distributed_optimizer else 0


def _precision(a: argparse.Namespace) -> dict[str, str]:
    if a.bf16:
        return {"param_dtype": "bfloat16",
                "reduce_dtype": "bfloat16" if a.grad_reduce_in_bf16 else "float32"}
    if a.fp16:
        return {"param_dtype": "float16",
                "reduce_dtype": "float32" if a.accumulate_allreduce_grads_in_fp32 else "float16"}
    return {"param_dtype": "float32", "reduce_dtype": "float32"}


def blocks_of(graph: LayerGraph, num_layers: int | None) -> list[LayerInfo]:
    """The transformer blocks: the class of ``num_layers`` identical layers (the largest
    class when not given)."""
    classes = sorted(graph.classes.values(), key=len, reverse=True)
    if num_layers is None:
        return classes[0]
    for members in classes:
        if len(members) == num_layers:
            return members
    raise ConfigError(f"--num-layers {num_layers}, but the model has no class of {num_layers} "
                      f"identical layers (its largest has {len(classes[0])}); plan the "
                      "model the job trains")


@dataclass
class _Builder:
    job: MegatronJob
    graph: LayerGraph
    notes: list[str] = field(default_factory=list)

    @property
    def mesh(self) -> Mesh:
        j = self.job
        return Mesh(pp=j.pp, dp=j.dp, cp=j.cp, tp=j.tp)

    @property
    def hsdp_shard_size(self) -> int | None:
        ranks = self.mesh.replicas * self.mesh.tp
        n = self.job.optimizer_instances
        return ranks // n if n > 1 and ranks % n == 0 else None

    def strategy(self, layer: LayerInfo) -> str:
        """The strategy Megatron-LM's flags give this layer, among those it can take:
        tensor-parallel whenever it can be (Megatron-LM splits every layer it can), with
        the ZeRO stage of the flags (the distributed optimizer on a TP layer: tp_zero1), or
        else the nearest one, the more sharded of two as near: ZeRO-1 with one micro-batch
        per step is ZeRO-2's program (runtime.strategies)."""
        j = self.job
        tie = self.graph.tie_of(layer.name)
        allowed = allowed_strategies(layer, self.mesh, hsdp_shard_size=self.hsdp_shard_size,
                                     microbatches=j.microbatches,
                                     tie=tie.describe() if tie else None)
        split = any(spec(name).tensor_parallel for name in allowed)
        candidates = [name for name in allowed if spec(name).tensor_parallel == split]
        hybrid = self.hsdp_shard_size is not None and j.zero_stage == 3
        return min(candidates, key=lambda name: (abs(spec(name).zero_stage - j.zero_stage),
                                                 spec(name).hybrid != hybrid,
                                                 -spec(name).zero_stage))

    def stages(self, blocks: list[LayerInfo]) -> list[int]:
        """Stage of each layer of the graph."""
        j = self.job
        num_stages = j.pp * j.virtual_stages
        counts = [s.count("t") for s in j.layout] if j.layout else None
        if counts is None:
            if len(blocks) % num_stages:
                raise ConfigError(f"{len(blocks)} transformer layers do not split evenly over "
                                  f"{num_stages} pipeline stages; give "
                                  "--pipeline-model-parallel-layout")
            counts = [len(blocks) // num_stages] * num_stages
        if sum(counts) != len(blocks):
            raise ConfigError(f"--pipeline-model-parallel-layout places {sum(counts)} "
                              f"transformer layers; the model has {len(blocks)}")
        block_stage = [s for s, n in enumerate(counts) for _ in range(n)]
        first = self.graph.layers.index(blocks[0])
        last_stage = max(s for s, n in enumerate(counts) if n) if j.layout is None else \
            next(s for s, layers in enumerate(j.layout) if "L" in layers)
        first_stage = 0 if j.layout is None else \
            next(s for s, layers in enumerate(j.layout) if "E" in layers)
        return [first_stage if i < first else block_stage[i - first]
                if i - first < len(blocks) else last_stage
                for i in range(len(self.graph.layers))]

    def recompute(self, k: int, stage_start: int) -> str:
        """Recomputation of block ``k``, the ``k - stage_start``-th of its stage."""
        j = self.job
        if j.recompute == "selective":
            return "selective"
        if j.recompute == "full":
            if j.recompute_method == "block":
                return "full" if k - stage_start < (j.recompute_num_layers or 0) else "none"
            return "full"  # uniform: every block, in chunks of recompute_num_layers
        return "none"


def plan_from_megatron(job: MegatronJob, graph: LayerGraph, *, model: str = "",
                       cluster: str = "") -> tuple[Plan, list[str]]:
    """The plan of ``graph`` that the job's arguments describe, and notes on what autopar's
    strategies price differently from Megatron-LM."""
    b = _Builder(job, graph, list(job.notes))
    blocks = blocks_of(graph, job.num_layers)
    stages = b.stages(blocks)
    block_names = {layer.name for layer in blocks}
    layers, stage_start = [], {}
    for i, (layer, stage) in enumerate(zip(graph.layers, stages, strict=True)):
        strategy = b.strategy(layer)
        is_tp = spec(strategy).tensor_parallel
        recompute = "none"
        if layer.name in block_names:
            stage_start.setdefault(stage, i)
            recompute = b.recompute(i, stage_start[stage])
            if recompute == "selective" and not (layer.selective_saved_bytes
                                                 + layer.selective_fixed_bytes):
                recompute = "none"
        layers.append(LayerPlan(
            module=layer.name, layer_class=layer.layer_class, stage=stage, strategy=strategy,
            tp_styles=dict(layer.tp.styles) if is_tp else {}, recompute=recompute,
            sequence_parallel=job.sequence_parallel and is_tp
            and layer.tp.sp_collectives is not None))
    b.notes += _notes(job, layers)
    pipeline = None
    if job.pp > 1:
        pipeline = PipelineSpec(
            schedule="Interleaved1F1B" if job.virtual_stages > 1 else "1F1B",
            num_microbatches=job.microbatches, virtual_stages=job.virtual_stages)
    plan = Plan(model=model, cluster=cluster, global_batch=job.global_batch,
                seq_len=job.seq_len or graph.seq_len, mesh=b.mesh, layers=tuple(layers),
                param_dtype=job.param_dtype, reduce_dtype=job.reduce_dtype,
                loss_scaling="dynamic" if job.param_dtype == "float16" else "none",
                gradient_accumulation=1 if pipeline else job.microbatches,
                hsdp_shard_size=b.hsdp_shard_size if any(
                    la.strategy == "hsdp" for la in layers) else None,
                pipeline=pipeline)
    return plan, b.notes


def _notes(job: MegatronJob, layers: list[LayerPlan]) -> list[str]:
    notes = []
    if job.ep > 1:
        notes.append(f"expert parallelism (ep = {job.ep}) is not priced: autopar's planner "
                     "has no expert-parallel costs")
    if job.optimizer_offload:
        notes.append("--optimizer-cpu-offload is not priced: autopar's offload also moves "
                     "parameters and gradients, Megatron-LM's only the optimizer")
    if job.optimizer_instances > 1 and job.zero_stage < 3:
        notes.append(f"{job.optimizer_instances} distributed-optimizer instances are priced "
                     "as one: autopar shards ZeRO-1/2 over every data-parallel rank")
    mismatched = sorted({la.option for la in layers
                         if spec(la.strategy).zero_stage != job.zero_stage})
    if mismatched:
        notes.append(f"ZeRO stage {job.zero_stage} is priced as {', '.join(mismatched)}, the "
                     "nearest these layers can take on this mesh (ZeRO-1 with one micro-batch "
                     "per step is ZeRO-2's program; one data-parallel rank shards nothing)")
    return notes
