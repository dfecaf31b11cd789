"""Plan -> ds_config.json -> DeepSpeed's own DeepSpeedConfig: every field the plan sets arrives.

DeepSpeedConfig reads the data-parallel world size from the ``mpu`` it is given (Megatron's
interface, ``get_data_parallel_world_size``), but only after asking ``deepspeed.comm`` for
the rank; with no process group that fails and it falls back to one rank, ignoring the mpu.
The tests answer that one question (rank 0) and give it an mpu of the plan's dp; all else
is DeepSpeed's own parsing and checking (its batch assertion included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import deepspeed.comm
import pytest
from deepspeed.runtime.config import DeepSpeedConfig
from export_cases import plan_of

from autopar.exports import export_deepspeed
from autopar.exports.common import autopar_version
from runtime.plan import Mesh, PipelineSpec, Plan


@dataclass
class DataParallelOnly:
    """The piece of Megatron's mpu interface DeepSpeedConfig reads."""

    dp: int

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch):
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)


def loaded(plan: Plan, tmp_path) -> tuple[dict, DeepSpeedConfig]:
    """The written file, and DeepSpeed's config read from that path."""
    path, = export_deepspeed(plan, "runs/plan.json").write(tmp_path)
    return json.loads(path.read_text()), DeepSpeedConfig(str(path), mpu=DataParallelOnly(plan.mesh.dp))


def test_zero3_offload_bf16_with_accumulation(tmp_path):
    plan = plan_of(mesh=Mesh(dp=8), strategy="fsdp", offload=True, param_dtype="bfloat16",
                   reduce_dtype="float32", gradient_accumulation=2)
    raw, ds = loaded(plan, tmp_path)
    assert ds.world_size == 8
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu,
            ds.gradient_accumulation_steps) == (64, 4, 2)
    assert ds.zero_enabled and ds.zero_optimization_stage == 3
    assert ds.zero_config.offload_param.device == "cpu"
    assert ds.zero_config.offload_optimizer.device == "cpu"
    assert ds.bfloat16_config.enabled and not ds.float16_config.enabled
    assert str(ds.communication_data_type) == "torch.float32"
    assert raw["autopar"]["header"][0] == (f"DeepSpeed settings written by autopar "
                                           f"{autopar_version()} from plan runs/plan.json")
    assert "not_expressed" not in raw["autopar"]  # everything above is DeepSpeed's


@pytest.mark.parametrize("strategy,stage", [("replicate", 0), ("zero1", 1), ("zero2", 2)])
def test_zero_stage_of_the_plans_strategy(tmp_path, strategy, stage):
    plan = plan_of(mesh=Mesh(dp=4), strategy=strategy, gradient_accumulation=4)
    _, ds = loaded(plan, tmp_path)
    assert ds.zero_optimization_stage == stage and ds.zero_enabled == bool(stage)
    assert ds.zero_config.offload_optimizer is None
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (4, 4)


def test_float16_uses_dynamic_loss_scaling(tmp_path):
    plan = plan_of(mesh=Mesh(dp=2), strategy="zero2", param_dtype="float16",
                   reduce_dtype="float16", loss_scaling="dynamic")
    _, ds = loaded(plan, tmp_path)
    assert ds.float16_config.enabled and ds.float16_config.loss_scale == 0  # 0: dynamic
    assert str(ds.communication_data_type) == "torch.float16"


def test_hybrid_sharding_is_zeropp_hierarchical_partitioning(tmp_path):
    plan = plan_of(mesh=Mesh(dp=8), strategy="hsdp", hsdp_shard_size=4)
    _, ds = loaded(plan, tmp_path)
    assert ds.zero_optimization_stage == 3 and ds.zero_config.zero_hpz_partition_size == 4


def test_tensor_parallel_is_autotp_and_the_batch_counts_data_parallel_ranks(tmp_path):
    plan = plan_of(mesh=Mesh(dp=2, tp=4), strategy="fsdp")
    raw, ds = loaded(plan, tmp_path)
    assert ds.tensor_parallel_config.autotp_size == 4
    assert ds.train_micro_batch_size_per_gpu * ds.world_size == plan.global_batch


def test_what_deepspeed_leaves_to_the_model_is_said(tmp_path):
    plan = plan_of(mesh=Mesh(pp=2, dp=4), strategy="zero2", recompute=("full",) * 4,
                   stages=(0, 0, 0, 0, 1, 1, 1, 1),
                   pipeline=PipelineSpec(schedule="1F1B", num_microbatches=4))
    raw, ds = loaded(plan, tmp_path)
    notes = raw["autopar"]["not_expressed"]
    assert any("PipelineModule(num_stages=2)" in n and "4, 4 layer(s)" in n for n in notes)
    assert any("stage 1 at most" in n for n in notes) and ds.zero_optimization_stage == 1
    assert any("recomputes 4 layer(s)" in n for n in notes)
    assert ds.gradient_accumulation_steps == 4 and ds.train_micro_batch_size_per_gpu == 4
