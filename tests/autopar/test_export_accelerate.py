"""Plan -> accelerate config + launch script -> accelerate's own code: every field arrives.

The path ``accelerate launch`` takes: ``load_config_from_file`` reads the YAML,
``_validate_launch_command`` merges it into the launch arguments, ``prepare_multi_gpu_env``
turns them into the environment of the ranks, where ``FullyShardedDataParallelPlugin`` and
``ParallelismConfig`` read it. No GPU is needed on that path.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env
from export_cases import plan_of

from autopar.exports import export_accelerate
from autopar.exports.common import autopar_version
from runtime.plan import Mesh, PipelineSpec, Plan


def launched(plan: Plan, tmp_path, monkeypatch, **launch) -> dict[str, str]:
    """The environment accelerate launch gives each rank under the exported config."""
    export_accelerate(plan, "plan.json", **launch).write(tmp_path)
    config = tmp_path / "accelerate_config.yaml"
    load_config_from_file(str(config))  # the loader `accelerate launch` uses
    args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_fsdp_offload_recompute_bf16(tmp_path, monkeypatch):
    plan = plan_of(mesh=Mesh(dp=8), strategy="fsdp", offload=True, recompute=("full",) * 4,
                   param_dtype="bfloat16", reduce_dtype="bfloat16")
    env = launched(plan, tmp_path, monkeypatch, nodes=1, nproc_per_node=8)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    fsdp = FullyShardedDataParallelPlugin()
    assert fsdp.fsdp_version == 2 and fsdp.reshard_after_forward is True  # ZeRO-3
    assert type(fsdp.cpu_offload).__name__ == "CPUOffloadPolicy"
    assert fsdp.activation_checkpointing
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (1, 8, 1, 1)
    assert pc.total_size == plan.world_size


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero1_and_zero2_keep_parameters_gathered_through_the_step(tmp_path, monkeypatch,
                                                                   strategy):
    plan = plan_of(mesh=Mesh(dp=4), strategy=strategy, gradient_accumulation=2)
    env = launched(plan, tmp_path, monkeypatch)
    fsdp = FullyShardedDataParallelPlugin()
    assert fsdp.reshard_after_forward is False and not fsdp.activation_checkpointing
    assert type(fsdp.cpu_offload).__name__ == "OffloadPolicy"  # the no-offload policy
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"


def test_hybrid_sharding_shards_inside_groups(tmp_path, monkeypatch):
    plan = plan_of(mesh=Mesh(dp=8), strategy="hsdp", hsdp_shard_size=4)
    launched(plan, tmp_path, monkeypatch, nodes=1, nproc_per_node=8)
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size) == (2, 4, 1)


def test_tensor_parallel_mesh(tmp_path, monkeypatch):
    plan = plan_of(mesh=Mesh(dp=4, tp=2), strategy="fsdp")  # tp_fsdp where layers split
    launched(plan, tmp_path, monkeypatch, nodes=1, nproc_per_node=8)
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (1, 4, 2, 1)
    assert pc.total_size == 8


def test_replicated_plan_is_ddp(tmp_path, monkeypatch):
    plan = plan_of(mesh=Mesh(dp=2), strategy="replicate", param_dtype="float16",
                   reduce_dtype="float16", loss_scaling="dynamic")
    env = launched(plan, tmp_path, monkeypatch, nodes=1, nproc_per_node=2)
    assert env.get("ACCELERATE_USE_FSDP", "false") == "false"
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp16"
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in env


def test_pipeline_and_float32_reduction_are_named(tmp_path):
    plan = plan_of(mesh=Mesh(pp=2, dp=4), strategy="fsdp", param_dtype="bfloat16",
                   stages=(0, 0, 0, 0, 1, 1, 1, 1),
                   pipeline=PipelineSpec(schedule="1F1B", num_microbatches=4))
    export = export_accelerate(plan, "plan.json", nodes=1, nproc_per_node=8)
    assert any("pipeline parallelism (pp = 2" in w for w in export.warnings)
    assert any("reduced in float32" in w for w in export.warnings)
    yaml = export.file("accelerate_config.yaml").text
    for w in export.warnings:
        assert f"#   - {w}" in yaml


def test_launch_script_passes_accumulation_and_the_users_script(tmp_path):
    """With an ``accelerate`` that prints what it got: the config beside the script, the
    node's rank and address, the training script and its arguments, and the plan's
    gradient accumulation in the environment Accelerator reads."""
    plan = plan_of(mesh=Mesh(dp=16), strategy="fsdp", gradient_accumulation=2)
    written = export_accelerate(plan, "p.json", nodes=2, nproc_per_node=8).write(tmp_path)
    script = tmp_path / "accelerate_launch.sh"
    assert script in written and script.stat().st_mode & stat.S_IXUSR
    assert not (tmp_path / "accelerate_config.yaml").stat().st_mode & stat.S_IXUSR
    assert f"autopar {autopar_version()} from plan p.json" in script.read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "accelerate"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps([sys.argv[1:], "
                    "os.environ['ACCELERATE_GRADIENT_ACCUMULATION_STEPS']]))\n")
    fake.chmod(0o755)
    # MASTER_PORT unset (an earlier test in this process may have set one): the default
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "MASTER_ADDR": "10.0.0.1",
           "NODE_RANK": "1"}
    out = subprocess.run(["bash", str(script), "my train.py", "--lr", "3e-4"], env=env,
                         check=True, capture_output=True, text=True).stdout
    argv, steps = json.loads(out)
    assert argv == ["launch", "--config_file", f"{tmp_path}/accelerate_config.yaml",
                    "--machine_rank", "1", "--main_process_ip", "10.0.0.1",
                    "--main_process_port", "29500", "my train.py", "--lr", "3e-4"]
    assert steps == "2"
