"""A plan as a Hugging Face accelerate config (``accelerate launch --config_file``) and a
launch script.

accelerate runs FSDP2 (or DDP) for the whole model with one setting: the closest to the
plan is the strongest sharding any layer uses (``autopar.exports.common``). FSDP2 keeps
gathered parameters through every micro-batch (ZeRO-1/2: ``reshard_after_forward`` off) or
frees them after each use (ZeRO-3: on), which is how autopar's own runtime runs those
strategies. The mesh goes into ``parallelism_config`` (replicate × shard × tp × cp ranks;
hybrid sharding shards inside ``hsdp_shard_size`` ranks), recomputation into FSDP's
activation checkpointing of every transformer layer, and gradient accumulation into
``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, which ``Accelerator`` reads (the launch script
sets it: the config file has no such key). accelerate has no pipeline parallelism.
"""

from __future__ import annotations

import json

from autopar.export import launch_for
from autopar.exports.common import DataParallel, Export, ExportFile, data_parallel, header_lines
from runtime.plan import Plan

CONFIG = "accelerate_config.yaml"
SCRIPT = "accelerate_launch.sh"
MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def accelerate_config(plan: Plan, nodes: int | None = None,
                      nproc_per_node: int | None = None) -> tuple[dict, list[str]]:
    """The config as a dict (the YAML's content), and what of the plan it cannot express."""
    launch = launch_for(plan, nodes, nproc_per_node)
    dp = data_parallel(plan)
    warnings = list(dp.warnings)
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if dp.zero_stage else "MULTI_GPU",
        "mixed_precision": MIXED_PRECISION[plan.param_dtype],
        "num_machines": launch.nodes,
        "num_processes": launch.world_size,
        "machine_rank": 0,
        "use_cpu": False,
    }
    if dp.zero_stage:
        config["fsdp_config"] = _fsdp(plan, dp, warnings)
    mesh = plan.mesh
    if dp.zero_stage or mesh.tp > 1 or mesh.cp > 1:
        shard = _shard_ranks(plan, dp, warnings)
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": mesh.dp // shard,
            "parallelism_config_dp_shard_size": shard,
            "parallelism_config_tp_size": mesh.tp,
            "parallelism_config_cp_size": mesh.cp,
        }
    if plan.param_dtype != "float32" and plan.reduce_dtype == "float32":
        warnings.append(f"gradients reduced in float32: accelerate's mixed precision reduces "
                        f"them in {plan.param_dtype}")
    if mesh.pp > 1:
        warnings.append(f"pipeline parallelism (pp = {mesh.pp}, schedule "
                        f"{plan.pipeline.schedule}) has no accelerate setting: run the "
                        f"{mesh.pp} stages with torchtitan, Megatron-LM or `autopar run`")
    return config, warnings


def _fsdp(plan: Plan, dp: DataParallel, warnings: list[str]) -> dict:
    recompute = {la.recompute for la in plan.layers} - {"none"}
    if "selective" in recompute:
        warnings.append("selective recomputation: accelerate's FSDP checkpoints whole "
                        "transformer layers (full recomputation)")
    if recompute and any(la.recompute == "none" for la in plan.layers):
        warnings.append("activation checkpointing for every transformer layer; the plan "
                        f"recomputes {sum(la.recompute != 'none' for la in plan.layers)} of "
                        f"{len(plan.layers)} layers")
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": dp.zero_stage == 3,
        "fsdp_offload_params": dp.offload,
        "fsdp_activation_checkpointing": bool(recompute),
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
    }


def _shard_ranks(plan: Plan, dp: DataParallel, warnings: list[str]) -> int:
    """Data-parallel ranks one state is sharded over (1 for DDP)."""
    if not dp.zero_stage:
        return 1
    if not dp.hybrid:
        return plan.mesh.dp
    assert plan.hsdp_shard_size is not None  # Plan requires it for hsdp layers
    inner = plan.mesh.cp * plan.mesh.tp  # accelerate's shard group spans dp_shard × cp
    shard = plan.hsdp_shard_size // inner if plan.hsdp_shard_size % inner == 0 else 0
    if not shard or plan.mesh.dp % shard:
        warnings.append(f"hybrid sharding over {plan.hsdp_shard_size} ranks does not fit "
                        f"accelerate's mesh (dp = {plan.mesh.dp}, cp × tp = {inner}): "
                        "sharded over every data-parallel rank")
        return plan.mesh.dp
    return shard


def to_yaml(config: dict, indent: str = "") -> list[str]:
    """Block-style YAML of a dict of scalars and dicts (strings written as JSON strings,
    which YAML reads as double-quoted scalars)."""
    lines = []
    for key, value in config.items():
        if isinstance(value, dict):
            lines += [f"{indent}{key}:", *to_yaml(value, indent + "  ")]
        else:
            lines.append(f"{indent}{key}: {json.dumps(value)}")
    return lines


def export_accelerate(plan: Plan, plan_path: str, *, nodes: int | None = None,
                      nproc_per_node: int | None = None) -> Export:
    """``accelerate_config.yaml`` and ``accelerate_launch.sh``, which launches the training
    script given to it (with its arguments) under that config on this node."""
    config, warnings = accelerate_config(plan, nodes, nproc_per_node)
    header = [f"# {line}" for line in header_lines(plan, plan_path, "accelerate", warnings)]
    yaml = "\n".join([*header, *to_yaml(config), ""])
    launch = ["accelerate", "launch", "--config_file", '"$(dirname "$0")"/' + CONFIG]
    lines = ["#!/bin/bash", *header, "set -euo pipefail",
             ': "${1:?usage: accelerate_launch.sh train.py [ARGS]}"']
    if config["num_machines"] > 1:
        lines += [': "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"',
                  ': "${NODE_RANK:?set NODE_RANK to the rank of this node (0 on the first)}"']
        launch += ['--machine_rank "$NODE_RANK"', '--main_process_ip "$MASTER_ADDR"',
                   '--main_process_port "${MASTER_PORT:-29500}"']
    lines += [f"export ACCELERATE_GRADIENT_ACCUMULATION_STEPS={plan.microbatches}",
              "exec " + " ".join(launch) + ' "$@"', ""]
    return Export(engine="accelerate", warnings=tuple(warnings), files=(
        ExportFile(name=CONFIG, text=yaml),
        ExportFile(name=SCRIPT, text="\n".join(lines), executable=True)))
