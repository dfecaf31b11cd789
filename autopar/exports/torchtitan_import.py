"""An existing torchtitan 0.3 job's command line read back into an autopar plan, to be priced
next to autopar's own plan for the same model and cluster (``compare_torchtitan``).

The job's values: its config registry function (``--module M --config C``), loaded with
torchtitan's own ``ConfigManager`` when torchtitan and that registry import here, else
torchtitan 0.3's defaults (and a note saying so); then the command line's overrides on top
(``autopar.exports.torchtitan_flags``, strict). Every layer then gets the strategy those
settings mean (the inverse of ``autopar.exports.torchtitan``), built as the equivalent
Megatron-LM job is (``plan_from_megatron``: every layer that splits is tensor-parallel,
the data-parallel sharding nearest to the job's, recomputation of every block):

- FSDP over dp_shard × cp: ZeRO-3 when parameters are freed after forward
  (``fsdp_reshard_after_forward`` ``always``, or ``default`` without pipelining), else
  ZeRO-2; hybrid (HSDP) when dp_replicate > 1 too; plain replication when nothing shards;
- pipeline stages from ``module_fqns_per_model_part``, or torchtitan's own even split
  (``_generate_llm_fqn_per_model_part`` in torchtitan/distributed/pipeline_parallel.py,
  restated in ``default_parts``);
- gradient accumulation: global / (local × dp) steps, folded into the pipeline's
  micro-batches when pp > 1 (the same samples per step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from autopar.errors import ConfigError
from autopar.exports.megatron_import import MegatronJob, blocks_of, plan_from_megatron
from autopar.exports.torchtitan_flags import SECTIONS, read_args
from cost_models.schedule import SCHEDULES
from passes.records import LayerGraph
from runtime.plan import Plan


@dataclass(frozen=True, kw_only=True)
class TorchtitanJob:
    """A torchtitan job's values for the fields autopar prices, and how they were found."""

    parallelism: dict[str, object]
    training: dict[str, object]
    activation_checkpoint: str
    world_size: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    compile: dict[str, object] = field(default_factory=dict)
    """The ``compile`` section (async TP's switch and what it needs)."""

    @property
    def async_tp(self) -> bool:
        """torchtitan runs async TP: switched on, on a compiled model, with tp > 1."""
        c = self.compile
        return bool(c.get("enable_async_tensor_parallel") and c.get("enable")
                    and "model" in (c.get("components") or ()) and self.degrees["tp"] > 1)

    @property
    def degrees(self) -> dict[str, int]:
        """dp_replicate, dp_shard (its -1 resolved), cp, tp, pp."""
        p = self.parallelism
        d = {"dp_replicate": p["data_parallel_replicate_degree"],
             "dp_shard": p["data_parallel_shard_degree"], "cp": p["context_parallel_degree"],
             "tp": p["tensor_parallel_degree"], "pp": p["pipeline_parallel_degree"]}
        others = math.prod(v for k, v in d.items() if k != "dp_shard")
        if d["dp_shard"] == -1 and others >= 1:  # torchtitan: the ranks the others leave
            d["dp_shard"] = self.world_size // others
        return d

    @property
    def dp(self) -> int:
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"]

    @property
    def global_batch(self) -> int:
        g = self.training["global_batch_size"]
        return g if g >= 0 else self.training["local_batch_size"] * self.dp

    @property
    def seq_len(self) -> int:
        return self.training["seq_len"]


def read_torchtitan_args(argv: str | Sequence[str], world_size: int) -> TorchtitanJob:
    """The job an argument list (or one shell-quoted string) describes on ``world_size``
    ranks, its degrees and batch checked as torchtitan checks them."""
    args = read_args(argv)
    notes: list[str] = []
    values = _registry(args.module, args.config, notes)
    for section, overrides in args.overrides.items():
        values[section].update(overrides)
    registry_policy = values.pop("activation_checkpoint")
    policy = args.activation_checkpoint or registry_policy
    job = TorchtitanJob(parallelism=values["parallelism"], training=values["training"],
                        compile=values["compile"], activation_checkpoint=policy,
                        world_size=world_size, notes=tuple(notes))
    _check(job)
    return job


def _registry(module: str | None, config: str | None, notes: list[str]) -> dict:
    """The registry function's values, or torchtitan 0.3's defaults."""
    defaults = {s: {k: default for k, (_, default) in table.items()}
                for s, table in SECTIONS.items()}
    defaults["activation_checkpoint"] = "selective"  # Trainer.Config's default
    if module is None or config is None:
        notes.append("no --module/--config: settings not given take torchtitan 0.3's "
                     "defaults (activation checkpointing: selective)")
        return defaults
    try:
        loaded = _load_registry(module, config)
    # The registry is the job's own code, run here to read its values; whatever stops it
    # (torchtitan not installed, a model needing a GPU library) leaves the defaults.
    except (Exception, SystemExit) as e:  # noqa: BLE001
        notes.append(f"--module {module} --config {config} could not be loaded here "
                     f"({type(e).__name__}: {e}); settings not given on the command line take "
                     "torchtitan 0.3's defaults (activation checkpointing: selective)")
        return defaults
    values = {s: {k: getattr(getattr(loaded, s), k) for k in table}
              for s, table in SECTIONS.items()}
    values["activation_checkpoint"] = _policy_of(loaded.activation_checkpoint)
    return values


def _load_registry(module: str, config: str) -> object:
    """torchtitan's ConfigManager on the registry alone, quietly: its warnings (a missing
    tokenizer folder, CUDA allocator settings) concern training, not planning, and the
    environment variables its imports set are put back."""
    from torchtitan.config import ConfigManager

    environ = dict(os.environ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            return ConfigManager().parse_args(["--module", module, "--config", config])
    finally:
        logging.disable(logging.NOTSET)
        os.environ.clear()
        os.environ.update(environ)


def _policy_of(config: object) -> str:
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC

    if config is None:
        return "none"
    if isinstance(config, MemoryBudgetAC.Config):
        return "memory-budget"
    return "full" if isinstance(config, FullAC.Config) else "selective"


def _check(job: TorchtitanJob) -> None:
    p, t = job.parallelism, job.training
    if p["data_parallel_shard_degree"] != -1 and p["data_parallel_shard_degree"] < 1:
        raise ConfigError("--parallelism.data_parallel_shard_degree must be -1 (the ranks "
                          f"left) or at least 1, got {p['data_parallel_shard_degree']}")
    d = job.degrees
    bad = {k: v for k, v in d.items() if v < 1}
    if bad or math.prod(d.values()) != job.world_size:
        product = " × ".join(f"{k} {v}" for k, v in d.items())
        raise ConfigError(f"torchtitan's degrees {product} do not multiply to the cluster's "
                          f"{job.world_size} ranks; give degrees whose product is "
                          f"{job.world_size} (dp_shard -1 takes the ranks left)")
    local = t["local_batch_size"]
    if local < 1 or job.global_batch < 1 or job.global_batch % (local * job.dp):
        raise ConfigError(f"--training.global_batch_size {job.global_batch} is not a positive "
                          f"multiple of local_batch_size {local} × data-parallel degree "
                          f"{job.dp}")
    per_stage = p["pipeline_parallel_layers_per_stage"]
    if per_stage is not None and per_stage < 1:
        raise ConfigError("--parallelism.pipeline_parallel_layers_per_stage must be at least "
                          f"1, got {per_stage}")
    _schedule_class(p["pipeline_parallel_schedule"])  # a schedule torch knows
    micro = p["pipeline_parallel_microbatch_size"]
    if d["pp"] > 1 and (micro < 1 or local % micro):
        raise ConfigError(f"--training.local_batch_size {local} is not a multiple of "
                          f"--parallelism.pipeline_parallel_microbatch_size {micro}")


def default_parts(num_stages: int, num_layers: int, input_weight: int,
                  output_weight: int) -> list[list[str]]:
    """torchtitan's even split (``_generate_llm_fqn_per_model_part``): the embedding and
    the head count as ``input_weight`` / ``output_weight`` layers; the first stages take
    one more effective layer each when they do not divide."""
    if num_stages == 1:
        return [["tok_embeddings", *(f"layers.{i}" for i in range(num_layers)), "norm",
                 "lm_head"]]
    effective = num_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0 or max(input_weight, output_weight) > per_stage:
        raise ConfigError(f"torchtitan cannot split {num_layers} layers (+ {input_weight} and "
                          f"{output_weight} for embedding and head) into {num_stages} stages")
    parts, layer = [], 0
    for s in range(num_stages):
        n = per_stage + (s < extra) - (input_weight if s == 0 else 0) \
            - (output_weight if s == num_stages - 1 else 0)
        names = [f"layers.{i}" for i in range(layer, min(layer + n, num_layers))]
        layer += len(names)
        parts.append((["tok_embeddings"] if s == 0 else []) + names
                     + (["norm", "lm_head"] if s == num_stages - 1 else []))
    return parts


def stage_parts(job: TorchtitanJob, num_layers: int) -> list[list[str]]:
    """Per stage, its modules: the job's ``module_fqns_per_model_part`` or torchtitan's
    split (``_get_pipeline_metadata``: 1 or 2 stages per rank by the schedule, or
    ``pipeline_parallel_layers_per_stage``)."""
    p = job.parallelism
    pp = job.degrees["pp"]
    single = issubclass(_schedule_class(p["pipeline_parallel_schedule"]), PipelineScheduleSingle)
    parts = p["module_fqns_per_model_part"]
    if parts is None:
        first, last = (p["pipeline_parallel_first_stage_less_layers"],
                       p["pipeline_parallel_last_stage_less_layers"])
        per_stage = p["pipeline_parallel_layers_per_stage"]
        stages = pp * (1 if single else 2) if per_stage is None else \
            math.ceil((num_layers + first + last) / per_stage)
        parts = default_parts(stages, num_layers, first, last)
    if len(parts) % pp or (single and len(parts) != pp) or (not single and len(parts) < 2 * pp):
        raise ConfigError(f"{len(parts)} pipeline stages on pp = {pp} ranks with schedule "
                          f"{p['pipeline_parallel_schedule']}: torchtitan needs "
                          f"{'one stage' if single else 'at least two stages'} per rank")
    return parts


def _schedule_class(name: str) -> type:
    try:
        return get_schedule_class(name)
    except ValueError as e:
        raise ConfigError(f"--parallelism.pipeline_parallel_schedule: {e}") from None


def layout(parts: list[list[str]], num_layers: int) -> tuple[str, ...]:
    """The stages in Megatron-LM's layout letters (E embedding, t block, L head)."""
    stages, next_block = [], 0
    for part in parts:
        letters = ""
        for name in part:
            if name == "tok_embeddings":
                letters += "E"
            elif name == f"layers.{next_block}":
                letters, next_block = letters + "t", next_block + 1
            elif name in ("norm", "lm_head"):
                letters += "" if letters.endswith("L") else "L"
            else:
                raise ConfigError(f"module_fqns_per_model_part names {name!r}: autopar reads "
                                  "tok_embeddings, layers.<k> in order, norm and lm_head")
        stages.append(letters)
    if next_block != num_layers:
        raise ConfigError(f"the stages hold {next_block} transformer layers; the model has "
                          f"{num_layers}")
    return tuple(stages)


def _schedule(name: str, virtual_stages: int, notes: list[str]) -> str:
    """autopar's schedule for torchtitan's (the nearest when autopar does not price it)."""
    if name in SCHEDULES and SCHEDULES[name].accepts(virtual_stages):
        return name
    cls = _schedule_class(name)
    nearest = "1F1B" if issubclass(cls, PipelineScheduleSingle) else \
        "ZBVZeroBubble" if "V" in name and virtual_stages == 2 else "Interleaved1F1B"
    notes.append(f"pipeline schedule {name} is priced as {nearest}, the nearest autopar prices")
    return nearest


def megatron_job(job: TorchtitanJob, num_layers: int, notes: list[str]) -> MegatronJob:
    """The same job as ``plan_from_megatron`` reads it."""
    p, t, d = job.parallelism, job.training, job.degrees
    shard = d["dp_shard"] * d["cp"]  # torchtitan's FSDP mesh: dp_shard × cp
    reshard = p["fsdp_reshard_after_forward"]
    zero = 0 if shard == 1 else 3 if reshard == "always" or (
        reshard == "default" and d["pp"] == 1) else 2
    hybrid = zero and d["dp_replicate"] > 1
    if hybrid and zero < 3:
        notes.append("hybrid sharding without resharding after forward is priced as ZeRO-2 "
                     "over every data-parallel rank (autopar's hybrid strategy is ZeRO-3)")
    parts = stage_parts(job, num_layers) if d["pp"] > 1 else None
    policy = job.activation_checkpoint
    if policy == "memory-budget":
        notes.append("memory-budget activation checkpointing (the compiler's choice) is "
                     "priced as none")
    if t["dtype"] == "bfloat16":
        notes.append("training.dtype bfloat16 (no float32 master weights) is priced as "
                     "bfloat16 mixed precision with float32 master weights")
    pp_micro = p["pipeline_parallel_microbatch_size"] if d["pp"] > 1 else t["local_batch_size"]
    steps = job.global_batch // (t["local_batch_size"] * job.dp)
    if d["pp"] > 1 and steps > 1:
        notes.append(f"{steps} accumulation steps of {t['local_batch_size'] // pp_micro} "
                     f"pipeline micro-batches are priced as one pipeline step of "
                     f"{steps * t['local_batch_size'] // pp_micro} (the same samples; torchtitan "
                     "drains the pipeline after each)")
    return MegatronJob(
        tp=d["tp"], pp=d["pp"], cp=d["cp"], dp=job.dp, ep=p["expert_parallel_degree"],
        virtual_stages=len(parts) // d["pp"] if parts else 1,
        layout=layout(parts, num_layers) if parts else None, num_layers=num_layers,
        sequence_parallel=p["enable_sequence_parallel"] and d["tp"] > 1, zero_stage=zero,
        optimizer_instances=d["dp_replicate"] if hybrid and zero == 3 else 1,
        recompute={"selective": "selective", "full": "full"}.get(policy),
        recompute_method="uniform" if policy == "full" else None,
        micro_batch=pp_micro, global_batch=job.global_batch, seq_len=job.seq_len,
        param_dtype=t["mixed_precision_param"], reduce_dtype="float32", notes=tuple(notes))


def plan_from_torchtitan(job: TorchtitanJob, graph: LayerGraph, *, model: str = "",
                         cluster: str = "") -> tuple[Plan, list[str]]:
    """The plan of ``graph`` that the job's settings describe, and notes on what autopar
    prices differently from torchtitan."""
    notes = list(job.notes)
    num_layers = len(blocks_of(graph, None))
    mj = megatron_job(job, num_layers, notes)
    plan, notes = plan_from_megatron(mj, graph, model=model, cluster=cluster)
    layers = plan.layers
    if job.training["enable_cpu_offload"]:
        from runtime.strategies import spec

        layers = tuple(dataclasses.replace(la, offload=spec(la.strategy).offloadable)
                       for la in layers)
        kept = sum(not la.offload for la in layers)
        if kept:
            notes.append(f"CPU offload is priced on the sharded layers only; {kept} layer(s) "
                         "cannot offload in autopar")
    layers = _with_async_tp(job, layers, notes)
    pipeline = plan.pipeline
    if pipeline is not None:
        pipeline = dataclasses.replace(pipeline, schedule=_schedule(
            job.parallelism["pipeline_parallel_schedule"], pipeline.virtual_stages, notes))
    return dataclasses.replace(plan, layers=layers, pipeline=pipeline), notes


def _with_async_tp(job: TorchtitanJob, layers: tuple, notes: list[str]) -> tuple:
    """The job's async TP on its sequence-parallel layers (the ones it overlaps)."""
    c = job.compile
    if c.get("enable_async_tensor_parallel") and not job.async_tp:
        notes.append("compile.enable_async_tensor_parallel is set but torchtitan runs no async "
                     "TP without compile.enable, 'model' in compile.components and tp > 1: "
                     "priced without it")
        return layers
    if not job.async_tp:
        return layers
    if not any(la.sequence_parallel for la in layers):
        notes.append("async TP without sequence parallelism fuses no collective (PyTorch's "
                      "pass overlaps SP's all-gathers and reduce-scatters): priced without it")
        return layers
    return tuple(dataclasses.replace(la, async_tp=la.sequence_parallel) for la in layers)
