"""Plan -> Megatron-LM script -> Megatron's own checks: every field the plan sets arrives.

The arguments are parsed with the flag table of ``autopar.exports.megatron_flags`` (names,
destinations and kinds as megatron/training/arguments.py declares them; that module is not
in the megatron-core package), strictly: an unknown flag fails. What megatron-core itself
checks, it checks here: the stage layout (``PipelineParallelLayerLayout``) and the
parallelism and recomputation settings (``TransformerConfig``, built from the arguments the
way Megatron-LM's ``core_transformer_config_from_args`` does: every field of the same name).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest
import torch
from export_cases import INTERLEAVED, SEQ, gpt_small, plan_of
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import TransformerConfig

from autopar.errors import ConfigError
from autopar.exports import export_megatron
from autopar.exports.common import autopar_version
from autopar.exports.megatron_flags import parser
from runtime.plan import Mesh, PipelineSpec, Plan

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def exported_args(plan: Plan, **launch) -> list[str]:
    """The AUTOPAR_ARGS array of the script, as the shell splits it."""
    text = export_megatron(plan, "plan.json", **launch).file("megatron.sh").text
    return shlex.split(re.search(r"AUTOPAR_ARGS=\(\n(.*?)\n\)", text, re.S).group(1))


def parsed(plan: Plan, **launch):
    return parser().parse_args(exported_args(plan, **launch))  # unknown flags: SystemExit


def transformer_config(args, plan: Plan, layout: PipelineParallelLayerLayout | None):
    """megatron-core's TransformerConfig of the arguments (its __post_init__ validates)."""
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    dtype = DTYPES[plan.param_dtype]
    return TransformerConfig(
        **{k: v for k, v in vars(args).items() if k in names}, hidden_size=128,
        num_attention_heads=4, params_dtype=dtype, pipeline_dtype=dtype,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size
        if layout and layout.virtual_pipeline_model_parallel_size > 1 else None)


def test_interleaved_tp_sp_plan_arrives_whole():
    plan = plan_of(**INTERLEAVED)
    a = parsed(plan, nodes=1, nproc_per_node=8)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
            a.context_parallel_size) == (2, 2, 1)
    assert a.num_layers == 4 and a.sequence_parallel
    assert a.micro_batch_size == 64 // (2 * 4) and a.global_batch_size == 64
    assert a.seq_length == SEQ and a.bf16 and not a.fp16
    assert a.accumulate_allreduce_grads_in_fp32  # the plan reduces in float32
    assert a.use_distributed_optimizer and not a.use_megatron_fsdp  # ZeRO-1
    assert a.overlap_grad_reduce and a.overlap_param_gather
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == \
        ("full", "uniform", 1)
    layout = PipelineParallelLayerLayout(a.pipeline_model_parallel_layout, 2)
    layout.validate_layer_layout(a.num_layers, None)
    assert layout.virtual_pipeline_model_parallel_size == 2
    # Megatron's stage (pp rank r, virtual stage v) is the plan's stage v·pp + r.
    blocks = [sum(la.stage == s and la.module.startswith("h.") for la in plan.layers)
              for s in range(4)]
    assert [[layout.layout[r][v].count(LayerType.decoder) for v in range(2)]
            for r in range(2)] == [[blocks[0], blocks[2]], [blocks[1], blocks[3]]]
    config = transformer_config(a, plan, layout)
    assert config.recompute_granularity == "full" and config.sequence_parallel


def test_the_distributed_optimizer_is_zero1_tensor_parallel_or_not():
    """tp_zero1 blocks and zero1 embeddings are one setting (the spec's ZeRO stage 1):
    --use-distributed-optimizer, nothing said to differ; plain tp does not shard."""
    plan = plan_of(**INTERLEAVED)
    assert {la.strategy for la in plan.layers} == {"tp_zero1", "zero1"}
    export = export_megatron(plan, "plan.json")
    a = parsed(plan)
    assert a.use_distributed_optimizer and not a.use_megatron_fsdp
    assert not any("data-parallel setting" in w for w in export.warnings), export.warnings
    plain = plan_of(**{**INTERLEAVED, "strategy": "replicate"})
    assert {la.strategy for la in plain.layers} == {"tp", "replicate"}
    assert not parsed(plain).use_distributed_optimizer


@pytest.mark.parametrize("strategy,sharding", [("zero2", "optim_grads"),
                                               ("fsdp", "optim_grads_params")])
def test_zero2_and_zero3_are_megatron_fsdp(strategy, sharding):
    plan = plan_of(mesh=Mesh(dp=8), strategy=strategy, param_dtype="float16",
                   reduce_dtype="float16", loss_scaling="dynamic", gradient_accumulation=2)
    a = parsed(plan)
    assert a.use_megatron_fsdp and a.use_distributed_optimizer
    assert a.data_parallel_sharding_strategy == sharding
    assert a.ckpt_format == "fsdp_dtensor"  # Megatron-FSDP's validate_args requires it
    assert a.fp16 and not a.accumulate_allreduce_grads_in_fp32  # reduced in float16
    assert a.micro_batch_size == 64 // (8 * 2) and a.global_batch_size == 64
    assert a.pipeline_model_parallel_layout is None and a.recompute_granularity is None
    transformer_config(a, plan, None)


def test_hybrid_sharding_keeps_one_optimizer_instance_per_shard_group():
    plan = plan_of(mesh=Mesh(dp=8), strategy="hsdp", hsdp_shard_size=4, param_dtype="bfloat16",
                   reduce_dtype="bfloat16")
    a = parsed(plan)
    assert a.num_distributed_optimizer_instances == 2
    assert a.data_parallel_sharding_strategy == "optim_grads_params" and a.grad_reduce_in_bf16


def test_block_recompute_takes_the_first_blocks_of_each_stage():
    plan = plan_of(mesh=Mesh(pp=2, dp=4), recompute=("full", "none", "full", "none"),
                   stages=(0, 0, 0, 0, 1, 1, 1, 1),
                   pipeline=PipelineSpec(schedule="1F1B", num_microbatches=4))
    export = export_megatron(plan, "plan.json")
    a = parsed(plan)
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == \
        ("full", "block", 1)
    assert a.pipeline_model_parallel_layout == "Et*2|t*2L"
    assert not export.warnings  # replicate, 1F1B, first block of each stage: all expressible
    layout = PipelineParallelLayerLayout(a.pipeline_model_parallel_layout, 2)
    transformer_config(a, plan, layout)


def test_scattered_sends_are_said_not_carried_without_sequence_parallelism():
    """Megatron-LM has no scatter/gather of pipeline tensors: a plan that scatters them is
    warned about unless its layers are sequence-parallel (whose sends are the 1/tp shards)."""
    base = dict(mesh=Mesh(pp=2, dp=2, tp=2), stages=(0, 0, 0, 0, 1, 1, 1, 1))
    pipeline = PipelineSpec(schedule="1F1B", num_microbatches=4, scatter_sends=True)
    whole = export_megatron(plan_of(**base, pipeline=pipeline), "plan.json")
    assert any("scatters pipeline sends over tp = 2" in w for w in whole.warnings)
    sp = export_megatron(plan_of(**base, pipeline=pipeline, sequence_parallel=True), "plan.json")
    assert not any("scatters pipeline sends" in w for w in sp.warnings)
    unscattered = dataclasses.replace(pipeline, scatter_sends=False)
    assert not any("scatters pipeline sends" in w
                   for w in export_megatron(plan_of(**base, pipeline=unscattered),
                                            "plan.json").warnings)


def test_selective_recompute_is_megatrons_selective():
    plan = plan_of(mesh=Mesh(dp=2, tp=4), recompute=("selective",) * 4, sequence_parallel=True)
    a = parsed(plan)
    assert a.recompute_granularity == "selective" and a.recompute_method is None
    assert transformer_config(a, plan, None).recompute_granularity == "selective"


def test_a_mixed_plan_gets_the_strongest_sharding_and_says_what_differs():
    plan = plan_of(mesh=Mesh(dp=8), strategy="fsdp", offload=True,
                   overrides={"wte": "replicate", "wpe": "replicate"})
    export = export_megatron(plan, "plan.json")
    a = parsed(plan)
    assert a.data_parallel_sharding_strategy == "optim_grads_params"
    assert a.optimizer_cpu_offload and a.use_precision_aware_optimizer
    text = export.file("megatron.sh").text
    assert any("2 layer(s) replicate" in w for w in export.warnings)
    assert any("optimizer states" in w for w in export.warnings)
    for warning in export.warnings:
        assert f"#   - {warning}" in text


def test_script_is_executable_headed_and_quoted(tmp_path):
    """Run the script with a torchrun that prints its arguments: the shell hands
    pretrain_gpt.py exactly the exported words, then the job's own."""
    plan = plan_of(**INTERLEAVED)
    path, = export_megatron(plan, "plans/my plan.json", nodes=1, nproc_per_node=8).write(tmp_path)
    assert path.stat().st_mode & stat.S_IXUSR
    text = path.read_text()
    assert f"autopar {autopar_version()} from plan plans/my plan.json" in text.splitlines()[1]
    # validate_args asserts it for tp > 1 without Megatron-FSDP (and its absence with it)
    assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in text
    fsdp = export_megatron(plan_of(mesh=Mesh(dp=2, tp=4), strategy="fsdp"), "p.json")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in fsdp.file("megatron.sh").text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MEGATRON_LM": "/opt/m lm"}
    out = subprocess.run(["bash", str(path), "--hidden-size", "128"], env=env, check=True,
                         capture_output=True, text=True).stdout
    argv = json.loads(out)
    assert argv[:4] == ["--nnodes=1", "--nproc-per-node=8", "--standalone",
                        "/opt/m lm/pretrain_gpt.py"]
    assert argv[4:] == [*exported_args(plan, nodes=1, nproc_per_node=8), "--hidden-size", "128"]


def test_a_plan_without_layer_classes_is_refused():
    plan = plan_of(mesh=Mesh(dp=2))
    bare = dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(la, layer_class="") for la in plan.layers))
    with pytest.raises(ConfigError, match="names no layer classes"):
        export_megatron(bare, "plan.json")


def test_the_planners_own_plan_exports():
    from autopar.planner.search import search
    from cost_models.hardware import Cluster

    plan = search(gpt_small(), Cluster.preset("dgx-a100-80g"), precision_name="bfloat16",
                  time_limit_s=5).plan
    a = parsed(plan)
    assert a.tensor_model_parallel_size * a.pipeline_model_parallel_size * \
        a.context_parallel_size * plan.mesh.dp == 8
    assert a.micro_batch_size * plan.mesh.dp * plan.microbatches == a.global_batch_size
