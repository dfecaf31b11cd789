"""A plan as a DeepSpeed ``ds_config.json`` (the engine's JSON configuration).

DeepSpeed's ZeRO runs one stage for the whole model: the closest to the plan is the
strongest sharding any layer uses (``autopar.exports.common``). The rest it can express:
CPU offload (ZeRO-3's parameters and every stage's optimizer), hybrid sharding as ZeRO++'s
hierarchical partitioning (parameters gathered inside groups of ``hsdp_shard_size``
ranks), precision (float16 with dynamic loss scaling), the gradient reduction dtype,
tensor parallelism as AutoTP, and the batch: DeepSpeed checks
``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps ×
data-parallel ranks``. Pipeline stages, recomputation and context parallelism are the
model code's in DeepSpeed (``PipelineModule``, ``deepspeed.checkpointing``), so the
export names them in warnings and in the JSON's ``"autopar"`` note, which DeepSpeed
ignores.
"""

from __future__ import annotations

import json

from autopar.export import launch_for
from autopar.exports.common import Export, ExportFile, data_parallel, header_lines, micro_batch_size
from runtime.plan import Plan

CONFIG = "ds_config.json"
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def deepspeed_config(plan: Plan) -> tuple[dict, list[str]]:
    """The ds_config dict, and what of the plan it cannot express."""
    dp = data_parallel(plan, per_module=True)
    warnings = list(dp.warnings)
    stage = dp.zero_stage
    if plan.mesh.pp > 1 and stage > 1:
        stage = 1  # DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3
        warnings.append(f"ZeRO stage 1: DeepSpeed's pipeline engine runs stage 1 at most; "
                        f"the plan shards as stage {dp.zero_stage}")
    zero: dict = {"stage": stage}
    if stage:
        zero |= {"overlap_comm": True, "contiguous_gradients": True}
    if dp.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    if dp.hybrid and stage == 3:
        zero["zero_hpz_partition_size"] = plan.hsdp_shard_size
        warnings.append("hybrid sharding as ZeRO++ hierarchical partitioning: a second copy "
                        f"of the parameters sharded over {plan.hsdp_shard_size} ranks, so "
                        "forward and backward gather inside a node")
    config: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": micro_batch_size(plan),
        "gradient_accumulation_steps": plan.microbatches,
        "zero_optimization": zero,
    }
    if plan.param_dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif plan.param_dtype == "float16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}  # 0: dynamic loss scaling
    if plan.param_dtype != "float32":
        config["communication_data_type"] = DTYPES[plan.reduce_dtype]
    if plan.mesh.tp > 1:
        config["tensor_parallel"] = {"autotp_size": plan.mesh.tp}
    warnings += _model_code(plan)
    config["autopar"] = {"not_expressed": warnings} if warnings else {}
    return config, warnings


def _model_code(plan: Plan) -> list[str]:
    """What DeepSpeed leaves to the model's code."""
    notes = []
    if plan.mesh.pp > 1:
        stages = ", ".join(str(sum(la.stage == s for la in plan.layers))
                           for s in range(plan.num_stages))
        notes.append(f"pipeline parallelism is the model's PipelineModule(num_stages="
                     f"{plan.mesh.pp}); the plan's stages hold {stages} layer(s) with "
                     f"schedule {plan.pipeline.schedule}")
    recomputed = sum(la.recompute != "none" for la in plan.layers)
    if recomputed:
        notes.append(f"activation recomputation is the model's (deepspeed.checkpointing or "
                     f"torch.utils.checkpoint): the plan recomputes {recomputed} layer(s)")
    if plan.mesh.cp > 1:
        notes.append(f"context parallelism (cp = {plan.mesh.cp}, ring attention) has no "
                     "DeepSpeed setting; its sequence parallelism (Ulysses) is another method")
    if plan.mesh.tp > 1:
        notes.append("tensor parallelism as DeepSpeed AutoTP, which splits every linear "
                     "layer it recognises rather than the plan's per-layer choice")
    return notes


def export_deepspeed(plan: Plan, plan_path: str, *, nodes: int | None = None,
                     nproc_per_node: int | None = None) -> Export:
    """``ds_config.json``; its ``"autopar"`` entry carries the header (JSON has no comments).
    The launch shape is only checked: DeepSpeed's launcher takes it from its hostfile."""
    launch_for(plan, nodes, nproc_per_node)
    config, warnings = deepspeed_config(plan)
    config["autopar"] = {"header": header_lines(plan, plan_path, "DeepSpeed", []),
                         **config["autopar"]}
    return Export(engine="deepspeed", warnings=tuple(warnings),
                  files=(ExportFile(name=CONFIG, text=json.dumps(config, indent=2) + "\n"),))
