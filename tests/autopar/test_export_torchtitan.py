"""Plan -> torchtitan.sh -> torchtitan 0.3's own config code: every field the plan sets
arrives.

The script's arguments are parsed as ``torchtitan.train`` parses them: by torchtitan's
``ConfigManager`` (``--module``/``--config`` naming a config registry function, then tyro
overrides, strictly: an unknown flag exits) into torchtitan's own ``TrainingConfig``,
``ParallelismConfig`` and activation-checkpointing configs, whose ``__post_init__`` checks
run. ``torchtitan.trainer`` itself imports triton (a GPU compiler CPU torch ships
without), so the registry here, ``job``, returns a ``Config`` holding the sections the
export sets, under the names and types ``Trainer.Config`` gives them, with
``Trainer.Config``'s own checks compiled from the installed trainer.py. torchtitan's own
``ParallelDims`` then checks the degrees against the world size, and its pipeline code
places the stages on ranks.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import pytest
import tyro
from export_cases import BATCH, INTERLEAVED, SEQ, gpt_small, plan_of
from torch.distributed.pipelining.schedules import get_schedule_class
from torchtitan.config import (
    CompileConfig,
    ConfigManager,
    DebugConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed.activation_checkpoint import (
    ActivationCheckpointingConfig,
    FullAC,
    MemoryBudgetAC,
    SelectiveAC,
)
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

from autopar.errors import ConfigError
from autopar.exports import export_deepspeed, export_torchtitan
from autopar.exports.common import autopar_version
from runtime.plan import Mesh, PipelineSpec, Plan, stage_rank

JOB_ARGS = ["--module", __name__, "--config", "job", "--training.steps", "7"]
"""What a user gives torchtitan.sh: the job (here the registry below) and its own flags."""


TRAINER = Path(importlib.util.find_spec("torchtitan.trainer").origin)
"""torchtitan's trainer.py, read, not imported (importing it needs triton)."""


def trainer_config_node() -> ast.ClassDef:
    trainer = next(n for n in ast.parse(TRAINER.read_text()).body
                   if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    return next(n for n in trainer.body if isinstance(n, ast.ClassDef) and n.name == "Config")


def trainer_checks() -> dict[str, Callable]:
    """``Trainer.Config.__post_init__`` and ``_validate_cuda_graphs``, compiled from the
    installed source: torchtitan's own checks of a whole config (the batch-invariant mode,
    the pipeline micro-batch size, CUDA graphs with pipelining, memory-budget checkpointing
    without compile). Their branches that read the model spec are never reached here: the
    registry has none, as torchtitan's own registry functions leave it to the trainer."""
    methods = [n for n in trainer_config_node().body if isinstance(n, ast.FunctionDef)
               and n.name in ("__post_init__", "_validate_cuda_graphs")]
    names = {"SelectiveAC": SelectiveAC, "MemoryBudgetAC": MemoryBudgetAC}
    exec(compile(ast.Module(body=methods, type_ignores=[]), str(TRAINER), "exec"), names)
    return {name: names[name] for name in ("__post_init__", "_validate_cuda_graphs")}


@dataclass(kw_only=True, slots=True)
class Config:
    """The sections of torchtitan's ``Trainer.Config`` that the export sets or its checks
    read, with the trainer's own checks."""

    model_spec: Annotated[object | None, tyro.conf.Suppress] = None
    hf_assets_path: str = "."
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointingConfig = field(
        default_factory=SelectiveAC.Config)
    compile: CompileConfig = field(default_factory=CompileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    locals().update(trainer_checks())


def job() -> Config:
    """The config registry function ``--config job`` names: torchtitan's defaults, which
    checkpoint selectively, and a job's own choices the plan must override."""
    return Config(training=TrainingConfig(local_batch_size=3, mixed_precision_param="bfloat16",
                                          dtype="bfloat16"),
                  parallelism=ParallelismConfig(pipeline_parallel_schedule="GPipe"))


def test_the_registry_mirrors_trainer_config():
    """``Config`` declares the fields of torchtitan's ``Trainer.Config`` it holds with the same
    names and types, and runs its checks."""
    declared = {n.target.id: ast.unparse(n.annotation) for n in trainer_config_node().body
                if isinstance(n, ast.AnnAssign)}
    mine = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "model_spec"}
    assert {name: declared[name] for name in mine} == {
        "hf_assets_path": "str", "training": "TrainingConfig",
        "parallelism": "ParallelismConfig",
        "activation_checkpoint": "ActivationCheckpointingConfig",
        "compile": "CompileConfig", "debug": "DebugConfig"} == mine
    assert "tyro.conf.Suppress" in declared["model_spec"]
    with pytest.raises(ValueError, match="CUDA graphs do not support pipeline parallelism"):
        Config(parallelism=ParallelismConfig(pipeline_parallel_degree=2))


def exported_args(plan: Plan, **launch) -> list[str]:
    """The AUTOPAR_ARGS array of the script, as the shell splits it."""
    text = export_torchtitan(plan, "plan.json", **launch).file("torchtitan.sh").text
    return shlex.split(re.search(r"AUTOPAR_ARGS=\(\n(.*?)\n\)", text, re.S).group(1))


def parsed(plan: Plan, **launch) -> Config:
    """The config torchtitan.train builds from the job's arguments and then the plan's;
    its degrees checked by torchtitan's ParallelDims for the plan's world size."""
    config = ConfigManager().parse_args([*JOB_ARGS, *exported_args(plan, **launch)])
    assert config.training.steps == 7  # the job's own flag survives
    ParallelDims.from_config(config.parallelism, plan.world_size)  # asserts the product
    return config


def accumulation(config: Config) -> int:
    """torchtitan's gradient accumulation steps (trainer.py's formula)."""
    t, p = config.training, config.parallelism
    batch_degree = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    assert t.global_batch_size % (t.local_batch_size * batch_degree) == 0
    return t.global_batch_size // (t.local_batch_size * batch_degree)


def test_interleaved_tp_sp_plan_arrives_whole():
    plan = plan_of(**INTERLEAVED)
    c = parsed(plan, nodes=1, nproc_per_node=8)
    p, t = c.parallelism, c.training
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
            p.context_parallel_degree, p.tensor_parallel_degree,
            p.pipeline_parallel_degree) == (1, 2, 1, 2, 2)
    assert p.fsdp_reshard_after_forward == "never"  # ZeRO-1: gathered once per step
    assert p.enable_sequence_parallel and p.expert_parallel_degree == 1
    assert p.pipeline_parallel_schedule == "Interleaved1F1B"
    # gpt-small's layers: wte, wpe, h.0-h.3, ln_f, lm_head; stages 0,0,0,1,2,3,3,3
    assert p.module_fqns_per_model_part == [
        ["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"],
        ["layers.3", "norm", "lm_head"]]
    assert t.local_batch_size // p.pipeline_parallel_microbatch_size == 4  # micro-batches
    assert t.local_batch_size == BATCH // 2 and accumulation(c) == 1
    assert (t.seq_len, t.dtype, t.mixed_precision_param, t.mixed_precision_reduce) == \
        (SEQ, "float32", "bfloat16", "float32")
    assert not t.enable_cpu_offload and t.disable_cuda_graphs  # Trainer.Config requires it
    assert isinstance(c.activation_checkpoint, FullAC.Config)


@pytest.mark.parametrize("schedule,v", [("Interleaved1F1B", 2), ("ZBVZeroBubble", 2),
                                        ("1F1B", 1)])
def test_torchtitan_places_each_stage_on_the_plans_rank(schedule, v):
    stages = (0, 0, 0, 1, 2, 3, 3, 3) if v == 2 else (0, 0, 0, 0, 1, 1, 1, 1)
    plan = plan_of(mesh=Mesh(pp=2, dp=2), stages=stages,
                   pipeline=PipelineSpec(schedule=schedule, num_microbatches=4,
                                         virtual_stages=v))
    p = parsed(plan).parallelism
    get_schedule_class(p.pipeline_parallel_schedule)  # a schedule torch knows
    parts = p.module_fqns_per_model_part
    assert len(parts) == plan.num_stages
    for rank in range(2):
        for s in _get_pp_rank_to_stage_indices_mapping(rank, 2, schedule, len(parts)):
            assert stage_rank(s, 2, plan.pipeline) == rank


def test_scattered_pipeline_sends_are_named_as_what_torchtitan_does_not_do():
    fields = dict(INTERLEAVED, pipeline=dataclasses.replace(INTERLEAVED["pipeline"],
                                                            scatter_sends=True))
    export = export_torchtitan(plan_of(**fields), "plan.json", nodes=1, nproc_per_node=8)
    assert any("scatters pipeline sends over tp = 2" in w and "whole activation" in w
               for w in export.warnings), export.warnings
    plain = export_torchtitan(plan_of(**INTERLEAVED), "plan.json", nodes=1, nproc_per_node=8)
    assert not any("scatters" in w for w in plain.warnings)


def test_fsdp_with_offload_and_accumulation_and_no_recompute():
    """The plan recomputes nothing: torchtitan's default (and the job's) selective
    checkpointing is switched off, not left on."""
    plan = plan_of(mesh=Mesh(dp=4), strategy="fsdp", offload=True, gradient_accumulation=2)
    export = export_torchtitan(plan, "plan.json", nodes=1, nproc_per_node=4)
    c = parsed(plan, nodes=1, nproc_per_node=4)
    p, t = c.parallelism, c.training
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (1, 4)
    assert p.fsdp_reshard_after_forward == "always" and p.pipeline_parallel_degree == 1
    assert not p.enable_sequence_parallel and p.tensor_parallel_degree == 1
    assert t.local_batch_size == BATCH // (4 * 2) and accumulation(c) == 2
    assert t.enable_cpu_offload and t.mixed_precision_param == "float32"
    assert t.dtype == "float32"  # the job's full-bf16 training overridden
    assert c.activation_checkpoint is None
    assert not export.warnings


def test_ddp_reduces_per_accumulation_step_and_says_so():
    plan = plan_of(mesh=Mesh(dp=4), gradient_accumulation=2)
    export = export_torchtitan(plan, "plan.json")
    p = parsed(plan).parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (4, 1)
    assert export.warnings == (
        "torchtitan reduces gradients after each of the 2 accumulation steps; the plan "
        "accumulates them and reduces once per step",)


def test_hybrid_sharding_shards_inside_the_shard_group():
    plan = plan_of(mesh=Mesh(dp=8), strategy="hsdp", hsdp_shard_size=4,
                   param_dtype="bfloat16", reduce_dtype="bfloat16")
    export = export_torchtitan(plan, "plan.json")
    c = parsed(plan)
    p = c.parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (2, 4)
    assert p.fsdp_reshard_after_forward == "always"
    assert c.training.mixed_precision_reduce == "float32"
    assert any("reduces in float32 only" in w for w in export.warnings)


def test_float16_is_bfloat16_with_a_warning_never_silently():
    plan = plan_of(mesh=Mesh(dp=2), strategy="zero2", param_dtype="float16",
                   reduce_dtype="float16", loss_scaling="dynamic")
    export = export_torchtitan(plan, "plan.json")
    assert parsed(plan).training.mixed_precision_param == "bfloat16"
    assert any(w.startswith("float16 compute") and "exported as bfloat16" in w
               for w in export.warnings)
    assert any("reduces in float32 only" in w for w in export.warnings)


def test_selective_recompute_and_a_mixed_plan_say_what_differs():
    plan = plan_of(mesh=Mesh(dp=2, tp=4), recompute=("selective",) * 2 + ("none",) * 2,
                   sequence_parallel=True, overrides={"wte": "fsdp"})
    export = export_torchtitan(plan, "plan.json")
    c = parsed(plan)
    assert isinstance(c.activation_checkpoint, SelectiveAC.Config)
    assert c.parallelism.enable_sequence_parallel and c.parallelism.tensor_parallel_degree == 4
    assert any("2 block(s) none, 2 block(s) selective" in w for w in export.warnings)
    assert any("keeps the attention output" in w for w in export.warnings)
    assert any("splits every layer over tp = 4" in w for w in export.warnings)
    text = export.file("torchtitan.sh").text
    for warning in export.warnings:
        assert f"#   - {warning}" in text


def test_context_parallel_replicated_plan_warns_that_torchtitan_shards_over_cp():
    plan = plan_of(mesh=Mesh(dp=2, cp=2))
    export = export_torchtitan(plan, "plan.json")
    p = parsed(plan).parallelism
    assert (p.context_parallel_degree, p.data_parallel_replicate_degree) == (2, 2)
    assert any("spans the 2 context-parallel ranks" in w for w in export.warnings)


def test_a_stage_torchtitan_cannot_name_is_refused():
    """Stage 1 holds only wpe, which torchtitan's embedding (on stage 0) includes."""
    plan = plan_of(mesh=Mesh(pp=3), stages=(0, 1, 2, 2, 2, 2, 2, 2),
                   pipeline=PipelineSpec(schedule="GPipe", num_microbatches=4))
    with pytest.raises(ConfigError, match=r"stage\(s\) \[1\] .* hold only part of the "
                                          "embedding"):
        export_torchtitan(plan, "plan.json")


HOSTILE = "x\ntouch pwned; $(id)"


def test_script_is_executable_headed_and_quoted(tmp_path):
    """Run the script with a torchrun that prints its arguments: torchtitan.train gets the
    job's words, then exactly the exported ones; a hostile model name stays a comment."""
    plan = dataclasses.replace(plan_of(**INTERLEAVED), model=HOSTILE)
    path, = export_torchtitan(plan, "plans/my plan.json", nodes=1,
                              nproc_per_node=8).write(tmp_path)
    assert path.stat().st_mode & stat.S_IXUSR
    text = path.read_text()
    assert f"autopar {autopar_version()} from plan plans/my plan.json" in text.splitlines()[1]
    assert "# model x touch pwned; $(id) on test" in text  # the line break made a space
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(path), *JOB_ARGS], env=env, check=True, cwd=tmp_path,
                         capture_output=True, text=True).stdout
    argv = json.loads(out)
    assert argv[:5] == ["--nnodes=1", "--nproc-per-node=8", "--standalone", "-m",
                        "torchtitan.train"]
    assert argv[5:] == [*JOB_ARGS, *exported_args(plan, nodes=1, nproc_per_node=8)]
    assert not (tmp_path / "pwned").exists()
    missing = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and "--module MODULE --config CONFIG" in missing.stderr


def test_two_nodes_meet_at_the_first():
    plan = plan_of(mesh=Mesh(dp=4, tp=2), strategy="fsdp")
    text = export_torchtitan(plan, "p.json", nodes=2, nproc_per_node=4).file(
        "torchtitan.sh").text
    assert "--nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d" in text
    assert "MASTER_ADDR:?" in text


def test_the_planners_own_plan_exports():
    from autopar.planner.search import search
    from cost_models.hardware import Cluster

    plan = search(gpt_small(), Cluster.preset("dgx-a100-80g"), precision_name="bfloat16",
                  time_limit_s=5).plan
    c = parsed(plan)
    p = c.parallelism
    assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree == plan.mesh.dp
    assert c.training.local_batch_size * plan.mesh.dp * accumulation(c) == BATCH


def test_the_command_writes_the_script_and_prints_the_warnings(tmp_path, capsys):
    from autopar.cli import main

    plan_path = tmp_path / "plan.json"
    plan_of(mesh=Mesh(dp=2), strategy="zero2", param_dtype="float16", reduce_dtype="float16",
            loss_scaling="dynamic").save(plan_path)
    assert main(["export", str(plan_path), "--format", "torchtitan", "--nodes", "1",
                 "--nproc-per-node", "2", "--out", str(tmp_path / "job")]) == 0
    out, err = capsys.readouterr()
    assert out == f"wrote {tmp_path}/job/torchtitan.sh\n"
    assert "autopar export: warning: float16 compute" in err
    text = (tmp_path / "job" / "torchtitan.sh").read_text()
    assert f"from plan {plan_path}" in text and "--training.mixed-precision-param bfloat16" in text


def _with_experts(plan: Plan, ep: int) -> Plan:
    """The blocks' experts split over ``ep`` data-parallel ranks."""
    return dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(la, expert_parallel=ep) if la.module.startswith("h.") else la
        for la in plan.layers))


def test_expert_parallelism_takes_ranks_torchtitan_can_give():
    """torchtitan borrows the expert-parallel ranks from dp_shard × cp × tp: under FSDP they
    are there; under plain replication (dp_shard 1) there are none to borrow."""
    sharded = _with_experts(plan_of(mesh=Mesh(dp=4), strategy="fsdp"), 2)
    assert parsed(sharded).parallelism.expert_parallel_degree == 2
    assert not export_torchtitan(sharded, "plan.json").warnings
    replicated = _with_experts(plan_of(mesh=Mesh(dp=4)), 2)
    assert parsed(replicated).parallelism.expert_parallel_degree == 1
    assert export_torchtitan(replicated, "plan.json").warnings == (
        "expert parallelism (ep = 2) left out: torchtitan takes its ranks from dp_shard × cp "
        "× tp = 1, which ep does not divide",)


def test_per_matrix_units_are_sharded_per_block_and_said():
    """torchtitan wraps each block in one FSDP unit: blocks planned one unit per weight
    matrix (``fsdp_modules``) export as FSDP, with the memory they then gather said;
    DeepSpeed gathers module by module, as planned, and says nothing of it."""
    blocks = {f"h.{i}": "fsdp_modules" for i in range(4)}
    plan = plan_of(mesh=Mesh(dp=4), strategy="fsdp", overrides=blocks)
    assert sum(la.strategy == "fsdp_modules" for la in plan.layers) == 4
    p = parsed(plan, nodes=1, nproc_per_node=4).parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (1, 4)
    assert p.fsdp_reshard_after_forward == "always"
    assert export_torchtitan(plan, "plan.json", nodes=1, nproc_per_node=4).warnings == (
        "one FSDP unit per layer: the plan shards 4 layer(s) one unit per weight matrix "
        "(fsdp_modules), which then hold a whole layer's parameters gathered at a time, "
        "more memory than planned",)
    assert not export_deepspeed(plan, "plan.json").warnings
