"""A torchtitan job's command line read back into a plan (``autopar plan --from-torchtitan``):
the reader's table is torchtitan 0.3's own config, a plan survives export and import, the
job's registry is read with torchtitan's ConfigManager, and bad input is a clear error."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from export_cases import BATCH, SEQ, gpt_small, plan_of
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

from autopar.cli import main
from autopar.errors import ConfigError
from autopar.exports.torchtitan import torchtitan_args
from autopar.exports.torchtitan_flags import BOOL, FLOAT, INT, PARALLELISM, STR, TRAINING
from autopar.exports.torchtitan_import import (
    default_parts,
    plan_from_torchtitan,
    read_torchtitan_args,
)
from runtime.plan import Mesh, PipelineSpec, Plan

KINDS = {int: INT, float: FLOAT, str: STR, bool: BOOL}


@pytest.mark.parametrize("table,config", [(PARALLELISM, ParallelismConfig),
                                          (TRAINING, TrainingConfig)])
def test_the_flag_table_is_torchtitans_config(table, config):
    """Every field of torchtitan 0.3's section, with its default and, for a plain type or
    a Literal, its kind or choices."""
    hints = typing.get_type_hints(config)
    defaults = config()
    assert list(table) == [f.name for f in dataclasses.fields(config)]
    for name, (kind, default) in table.items():
        assert getattr(defaults, name) == default, name
        hint = hints[name]
        if typing.get_origin(hint) is typing.Literal:
            assert kind == typing.get_args(hint), name
        elif hint in KINDS:
            assert kind == KINDS[hint], name


def roundtrip(plan: Plan) -> tuple[Plan, list[str]]:
    args, _ = torchtitan_args(plan)  # warnings: what a layer cannot take (ln_f has no TP)
    job = read_torchtitan_args(["--module", "none", "--config", "none", *args],
                               plan.world_size)
    return plan_from_torchtitan(job, gpt_small(), model=plan.model, cluster=plan.cluster)


def same_choices(a: Plan, b: Plan) -> None:
    for name in ("mesh", "pipeline", "global_batch", "gradient_accumulation", "seq_len",
                 "param_dtype", "reduce_dtype", "hsdp_shard_size"):
        assert getattr(a, name) == getattr(b, name), name
    fields = ("module", "strategy", "stage", "recompute", "sequence_parallel", "offload")
    assert [[getattr(la, f) for f in fields] for la in a.layers] == \
        [[getattr(la, f) for f in fields] for la in b.layers]


ROUND_TRIPS = {
    "interleaved fsdp+tp+sp": dict(
        mesh=Mesh(pp=2, dp=2, tp=2), strategy="fsdp", recompute=("full",) * 4,
        stages=(0, 0, 0, 1, 2, 3, 3, 3), sequence_parallel=True, param_dtype="bfloat16",
        pipeline=PipelineSpec(schedule="Interleaved1F1B", num_microbatches=4,
                              virtual_stages=2)),
    "zero-bubble V": dict(
        mesh=Mesh(pp=2, dp=2), strategy="fsdp", stages=(0, 0, 0, 1, 2, 3, 3, 3),
        pipeline=PipelineSpec(schedule="ZBVZeroBubble", num_microbatches=4, virtual_stages=2)),
    "fsdp offload accumulation": dict(mesh=Mesh(dp=4), strategy="fsdp", offload=True,
                                      gradient_accumulation=2),
    "hybrid": dict(mesh=Mesh(dp=8), strategy="hsdp", hsdp_shard_size=4),
    "zero2 selective": dict(mesh=Mesh(dp=4), strategy="zero2", recompute=("selective",) * 4,
                            param_dtype="bfloat16"),
    "ddp": dict(mesh=Mesh(dp=8)),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_a_plan_survives_export_and_import(case):
    plan = plan_of(**ROUND_TRIPS[case])
    back, notes = roundtrip(plan)
    same_choices(back, plan)
    assert all("could not be loaded" in n for n in notes)  # the registry "none" only


def test_the_jobs_registry_is_read_with_torchtitans_config_manager():
    """test_export_torchtitan.job sets local batch 3, full bf16 training and GPipe, and
    leaves torchtitan's selective checkpointing on."""
    job = read_torchtitan_args(["--module", "test_export_torchtitan", "--config", "job",
                                "--parallelism.data-parallel-shard-degree", "2"], 2)
    assert job.training["local_batch_size"] == 3 and job.global_batch == 6
    assert job.activation_checkpoint == "selective" and not job.notes
    assert job.parallelism["pipeline_parallel_schedule"] == "GPipe"
    plan, notes = plan_from_torchtitan(job, gpt_small())
    assert plan.param_dtype == "bfloat16" and plan.global_batch == 6
    assert {la.recompute for la in plan.layers if la.module.startswith("h.")} == {"selective"}
    assert any("training.dtype bfloat16" in n for n in notes)


def test_defaults_when_no_registry_is_named():
    """torchtitan 0.3's defaults: dp_shard takes every rank, local batch 8, seq 2048, bf16,
    selective checkpointing."""
    job = read_torchtitan_args("--training.seq-len 64", 8)
    plan, notes = plan_from_torchtitan(job, gpt_small())
    assert plan.mesh == Mesh(dp=8) and plan.global_batch == 64 and plan.seq_len == 64
    assert plan.param_dtype == "bfloat16" and plan.reduce_dtype == "float32"
    assert {la.strategy for la in plan.layers} == {"fsdp"}
    assert any("no --module/--config" in n for n in notes)


def test_pipeline_accumulation_folds_into_micro_batches_and_schedules_map():
    job = read_torchtitan_args(
        "--parallelism.pipeline-parallel-degree 2 --parallelism.data-parallel-shard-degree 2 "
        "--parallelism.pipeline-parallel-schedule LoopedBFS --training.local-batch-size 8 "
        "--parallelism.pipeline-parallel-microbatch-size 4 --training.global-batch-size 64 "
        f"--training.seq-len {SEQ} activation-checkpoint:none", 4)
    plan, notes = plan_from_torchtitan(job, gpt_small())
    # 64 samples = 4 accumulation steps × 2 dp ranks × 8; each 8 = 2 micro-batches of 4
    assert plan.pipeline == PipelineSpec(schedule="Interleaved1F1B", num_microbatches=8,
                                         virtual_stages=2)
    assert "pipeline schedule LoopedBFS is priced as Interleaved1F1B" in " ".join(notes)
    assert "4 accumulation steps of 2 pipeline micro-batches" in " ".join(notes)
    # torchtitan's split of 4 blocks + embedding + head (1 layer each) over 4 stages: 6
    # effective layers, the first two stages one more: E+t | t t | t | L
    assert [la.stage for la in plan.layers] == [0, 0, 0, 1, 1, 2, 3, 3]
    assert {la.strategy for la in plan.layers} == {"zero2"}  # pipelined: no reshard


@pytest.mark.parametrize("stages,layers,inw,outw", [
    (1, 4, 1, 1), (2, 4, 1, 1), (4, 4, 1, 1), (4, 6, 1, 1), (3, 8, 2, 1), (8, 32, 1, 1),
    (6, 4, 1, 1), (4, 2, 2, 2)])
def test_the_default_split_is_torchtitans(stages, layers, inw, outw):
    try:
        theirs = _generate_llm_fqn_per_model_part(stages, layers, inw, outw)
    except ValueError:
        with pytest.raises(ConfigError):
            default_parts(stages, layers, inw, outw)
        return
    assert default_parts(stages, layers, inw, outw) == theirs


@pytest.mark.parametrize("args,message", [
    ("--parallelism.tensor_paralel_degree 2", "is not a field of torchtitan 0.3's "
                                              "parallelism config; its fields: data_"),
    ("--paralelism.tensor_parallel_degree 2", "is not a torchtitan 0.3 option"),
    ("--parallelism.tensor-parallel-degree 3", "do not multiply to the cluster's 8 ranks"),
    ("--parallelism.data-parallel-shard-degree 3 --parallelism.tensor-parallel-degree 2",
     "dp_replicate 1 × dp_shard 3 × cp 1 × tp 2 × pp 1 do not multiply"),
    ("--training.enable-cpu-offload True", "is a switch and takes no value"),
    ("--training.local-batch-size four", "'four' is not a number"),
    ("activation-checkpoint:op", "not a torchtitan 0.3 policy"),
    ("--training.global-batch-size 20", "not a positive multiple of local_batch_size 8 × "
                                        "data-parallel degree 8"),
    ("--training.global-batch-size 0", "global_batch_size 0 is not a positive multiple"),
    ("--training.local-batch-size 0", "not a positive multiple of local_batch_size 0"),
    ("--parallelism.tensor-parallel-degree 0", "tp 0 × pp 1 do not multiply"),
    ("--parallelism.data-parallel-shard-degree -3", "must be -1 (the ranks left) or at least"),
    ("--parallelism.pipeline-parallel-degree 2 --parallelism.data-parallel-shard-degree 4 "
     "--parallelism.pipeline-parallel-layers-per-stage 0", "layers_per_stage must be at least"),
    ("--parallelism.pipeline-parallel-degree 2 --parallelism.data-parallel-shard-degree 4 "
     "--parallelism.pipeline-parallel-schedule Zigzag", "pipeline_parallel_schedule: "),
    ("llama3", "unexpected word 'llama3'"),
])
def test_bad_arguments_are_clear_errors(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_torchtitan_args(args, 8)


def test_the_command_prints_the_comparison(capsys):
    assert main(["plan", "--model", "gpt-small", "--time-limit", "5", "--from-torchtitan",
                 "--parallelism.tensor-parallel-degree 2 --training.local-batch-size 4 "
                 f"--training.global-batch-size {BATCH} --training.seq-len {SEQ} "
                 "activation-checkpoint:none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torchtitan job:  mesh pp=1 × dp=4 × tp=2, step ")
    assert "autopar's plan:  mesh" in out and "predicted gain:" in out


def test_the_command_refuses_bad_degrees_with_status_2(capsys):
    assert main(["plan", "--model", "gpt-small", "--from-torchtitan",
                 "--parallelism.tensor-parallel-degree 3 --training.seq-len 64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar plan: error: torchtitan's degrees") and "Traceback" not in err
