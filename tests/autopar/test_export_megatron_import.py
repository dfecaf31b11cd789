"""Megatron-LM arguments -> plan: the inverse of the export, the published SC'21 runs read
from their arguments, and the job priced next to autopar's own plan."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace

import pytest
from export_cases import gpt_small, plan_of

from autopar.errors import ConfigError
from autopar.exports import export_megatron
from autopar.exports.compare import compare_megatron, format_comparison
from autopar.exports.megatron_import import plan_from_megatron, read_megatron_args
from autopar.planner.published import (
    evaluate,
    megatron_cluster,
    megatron_graph,
    megatron_plan,
    megatron_rows,
)
from cost_models.hardware import Cluster
from cost_models.memory import precision
from runtime.plan import Mesh, PipelineSpec, Plan

ROUND_TRIPS = {
    "interleaved tp+sp, full recompute, bf16": dict(
        mesh=Mesh(pp=2, dp=2, tp=2), recompute=("full",) * 4, stages=(0, 0, 0, 1, 2, 3, 3, 3),
        sequence_parallel=True, param_dtype="bfloat16",
        pipeline=PipelineSpec(schedule="Interleaved1F1B", num_microbatches=4, virtual_stages=2)),
    "fsdp fp16 with accumulation": dict(
        mesh=Mesh(dp=8), strategy="fsdp", param_dtype="float16", reduce_dtype="float16",
        loss_scaling="dynamic", gradient_accumulation=2),
    "1F1B, first block of each stage recomputed, hsdp": dict(
        mesh=Mesh(pp=2, dp=4), strategy="hsdp", hsdp_shard_size=2,
        recompute=("full", "none", "full", "none"), stages=(0, 0, 0, 0, 1, 1, 1, 1),
        pipeline=PipelineSpec(schedule="1F1B", num_microbatches=4)),
    "interleaved, distributed optimizer on tp+sp layers": dict(
        mesh=Mesh(pp=2, dp=2, tp=2), strategy="zero1", stages=(0, 0, 0, 1, 2, 3, 3, 3),
        sequence_parallel=True, param_dtype="bfloat16",
        pipeline=PipelineSpec(schedule="Interleaved1F1B", num_microbatches=4, virtual_stages=2)),
    "tp_zero2 with accumulation": dict(
        mesh=Mesh(dp=4, tp=2), strategy="zero2", param_dtype="bfloat16",
        gradient_accumulation=2),
    "selective, zero2, bf16 reduced in bf16": dict(
        mesh=Mesh(dp=8), strategy="zero2", recompute=("selective",) * 4,
        param_dtype="bfloat16", reduce_dtype="bfloat16", gradient_accumulation=2),
}


def exported_args(plan: Plan) -> list[str]:
    text = export_megatron(plan, "plan.json").file("megatron.sh").text
    return shlex.split(re.search(r"AUTOPAR_ARGS=\(\n(.*?)\n\)", text, re.S).group(1))


def essentials(plan: Plan) -> tuple:
    layers = tuple((la.module, la.strategy, la.stage, la.recompute, la.sequence_parallel,
                    tuple(sorted(la.tp_styles.items()))) for la in plan.layers)
    return (plan.mesh, plan.pipeline, plan.global_batch, plan.param_dtype, plan.reduce_dtype,
            plan.loss_scaling, plan.gradient_accumulation, plan.hsdp_shard_size, layers)


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_exported_arguments_read_back_into_the_same_plan(case):
    plan = plan_of(**ROUND_TRIPS[case])
    job = read_megatron_args(exported_args(plan), plan.world_size)
    back, notes = plan_from_megatron(job, gpt_small())
    assert essentials(back) == essentials(plan)
    assert not notes


def test_the_distributed_optimizer_with_tp_reads_as_tp_zero1():
    args = ("--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer "
            "--micro-batch-size 2 --global-batch-size 64 --bf16")
    plan, notes = plan_from_megatron(read_megatron_args(args, 8), gpt_small())
    blocks = [la for la in plan.layers if la.module.startswith("h.")]
    assert {(la.strategy, la.sequence_parallel) for la in blocks} == {("tp_zero1", True)}
    assert plan.gradient_accumulation == 8 and not notes
    # One micro-batch per step: ZeRO-1 is ZeRO-2's program, and the plan says so.
    args = args.replace("--global-batch-size 64", "--global-batch-size 8")
    plan, notes = plan_from_megatron(read_megatron_args(args, 8), gpt_small())
    assert {la.strategy for la in plan.layers if la.module.startswith("h.")} == {"tp_zero2"}
    assert any("ZeRO-2's program" in n for n in notes), notes


def test_even_split_over_virtual_stages_without_a_layout():
    job = read_megatron_args("--pipeline-model-parallel-size 2 --num-layers 4 "
                             "--num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 2 "
                             "--global-batch-size 64 --hidden-size 128 --lr 1e-4", 8)
    plan, _ = plan_from_megatron(job, gpt_small())
    assert plan.mesh == Mesh(pp=2, dp=4)
    assert plan.pipeline == PipelineSpec(schedule="Interleaved1F1B", num_microbatches=8,
                                         virtual_stages=2)
    # wte wpe | h.0 | h.1 | h.2 | h.3 | ln_f lm_head, one block per stage
    assert [la.stage for la in plan.layers] == [0, 0, 0, 1, 2, 3, 3, 3]


@pytest.mark.parametrize("index", [1, 5])
def test_published_runs_read_from_their_arguments_price_as_published(index):
    """SC'21 Table 1 written as Megatron-LM arguments reads back into the plan
    ``published.megatron_plan`` writes for that row, priced the same, but for its pipeline
    sends: the 2021 runs scattered them over tp, today's Megatron-LM (whose flags the
    importer reads) has no scatter/gather and sends them whole without sequence parallelism."""
    row = megatron_rows()[index]
    args = (f"--tensor-model-parallel-size {row.tp} --pipeline-model-parallel-size {row.pp} "
            f"--num-layers {row.layers} --hidden-size {row.hidden} "
            f"--num-attention-heads {row.heads} --seq-length 2048 "
            f"--micro-batch-size {row.microbatch} --global-batch-size {row.global_batch} "
            "--fp16 --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1")
    if row.interleave > 1:
        args += f" --num-layers-per-virtual-pipeline-stage {row.layers // (row.pp * row.interleave)}"
    graph = megatron_graph(row)
    cluster = megatron_cluster(row)
    plan, notes = plan_from_megatron(read_megatron_args(args, row.gpus), graph)
    published = megatron_plan(graph, row)
    if published.pipeline is not None:
        assert published.pipeline.scatter_sends and not plan.pipeline.scatter_sends
        published = replace(published, pipeline=replace(published.pipeline, scatter_sends=False))
    assert essentials(plan) == essentials(published)
    fp16 = precision("float16")
    assert evaluate(graph, cluster, fp16, plan) == evaluate(graph, cluster, fp16, published)


def test_the_job_is_priced_next_to_autopars_plan():
    cluster = Cluster.preset("dgx-a100-80g")
    args = "--micro-batch-size 8 --global-batch-size 64 --bf16 --num-layers 4"
    c = compare_megatron(args, gpt_small(), cluster, time_limit_s=5)
    assert c.job.mesh == Mesh(dp=8)
    assert {la.strategy for la in c.job.layers} == {"replicate"}
    assert c.job_step_s == evaluate(gpt_small(), cluster, precision("bfloat16"),
                                    c.job).step_time_s
    # plain data parallelism is in autopar's search space: its plan is no slower
    assert c.speedup >= 1 - 1e-9 and c.job_fits
    text = format_comparison(c)
    assert "Megatron-LM job: mesh pp=1 × dp=8 × tp=1" in text and "predicted gain:" in text


@pytest.mark.parametrize("args,world,message", [
    ("--tensor-model-parallel-size 3 --micro-batch-size 1 --global-batch-size 8", 8,
     "not divisible by tp × pp × cp = 3"),
    ("--global-batch-size 64", 8, "--micro-batch-size is missing"),
    ("--micro-batch-size 3 --global-batch-size 64", 8, "not divisible by --micro-batch-size"),
    ("--num-layers 6 --micro-batch-size 1 --global-batch-size 8", 8, "no class of 6"),
    ("--pipeline-model-parallel-size 3 --micro-batch-size 1 --global-batch-size 6", 6,
     "do not split evenly over 3"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*2|tmL "
     "--micro-batch-size 1 --global-batch-size 8", 8, "layer kinds"),
])
def test_arguments_that_name_no_plan_are_refused_with_the_reason(args, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_from_megatron(read_megatron_args(args, world), gpt_small())
