"""Async TP in the engine exports: torchtitan 0.3 gets ``--compile.enable
--compile.enable-async-tensor-parallel`` and reads them back, Megatron-LM's export says it
does not carry it, and a torchtitan job asking for it is priced with it only where the
cluster runs it."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from export_cases import gpt_small, plan_of
from test_export_torchtitan import parsed
from test_export_torchtitan_import import roundtrip
from torchtitan.config import CompileConfig

from autopar.errors import ConfigError
from autopar.exports.megatron import megatron_args
from autopar.exports.torchtitan import torchtitan_args
from autopar.exports.torchtitan_compare import compare_torchtitan
from autopar.exports.torchtitan_flags import BOOL, COMPILE, STR, STR_LIST
from autopar.exports.torchtitan_import import plan_from_torchtitan, read_torchtitan_args
from cost_models.hardware import Cluster
from runtime.plan import Mesh, Plan


def with_async_tp(plan: Plan, *, only: int | None = None) -> Plan:
    """``plan`` with async TP on its sequence-parallel layers (the first ``only`` of them)."""
    sp = [la.module for la in plan.layers if la.sequence_parallel][:only]
    return dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(la, async_tp=la.module in sp) for la in plan.layers))


def tp_sp_plan() -> Plan:
    return plan_of(mesh=Mesh(dp=2, tp=2), strategy="fsdp", sequence_parallel=True,
                   param_dtype="bfloat16")


def test_the_compile_table_is_torchtitans_compile_config():
    hints, defaults = typing.get_type_hints(CompileConfig), CompileConfig()
    assert list(COMPILE) == [f.name for f in dataclasses.fields(CompileConfig)]
    kinds = {bool: BOOL, str: STR, list[str]: STR_LIST}
    for name, (kind, default) in COMPILE.items():
        assert getattr(defaults, name) == default and kinds[hints[name]] == kind, name


def test_torchtitan_runs_the_plans_async_tp_and_reads_it_back():
    plan = with_async_tp(tp_sp_plan())
    config = parsed(plan, nodes=1, nproc_per_node=4)  # CompileConfig's own checks run
    assert config.compile.enable and config.compile.enable_async_tensor_parallel
    assert "model" in config.compile.components
    assert config.parallelism.enable_sequence_parallel
    back, _ = roundtrip(plan)
    assert [la.async_tp for la in back.layers] == [la.async_tp for la in plan.layers]
    assert any(la.async_tp for la in back.layers)


def test_a_plan_without_async_tp_switches_it_off_and_reads_back_without():
    plan = tp_sp_plan()
    args, _ = torchtitan_args(plan)
    assert "--compile.no-enable-async-tensor-parallel" in args  # a registry may turn it on
    assert "--compile.enable" not in args  # compilation stays the job's choice
    assert not parsed(plan, nodes=1, nproc_per_node=4).compile.enable_async_tensor_parallel
    back, _ = roundtrip(plan)
    assert not any(la.async_tp for la in back.layers)


def test_async_tp_on_some_layers_is_exported_for_all_with_a_warning():
    _, warnings = torchtitan_args(with_async_tp(tp_sp_plan(), only=1))
    assert any(re.search(r"async TP for every layer; the plan uses it on 1 of \d+ "
                         "sequence-parallel layers", w) for w in warnings), warnings


@pytest.mark.parametrize(("args", "note"), [
    ("--compile.enable-async-tensor-parallel", "without compile.enable"),
    ("--compile.enable --compile.enable-async-tensor-parallel "
     "--parallelism.no-enable-sequence-parallel", "without sequence parallelism"),
])
def test_a_job_whose_async_tp_does_nothing_is_priced_without_it(args, note):
    job = read_torchtitan_args(f"--parallelism.tensor-parallel-degree 2 --training.seq-len 64 "
                               f"{args}", 8)
    plan, notes = plan_from_torchtitan(job, gpt_small())
    assert not any(la.async_tp for la in plan.layers)
    assert any(note in n and "priced without it" in n for n in notes), notes


def test_torchtitan_0_2s_spelling_is_refused_with_0_3s():
    with pytest.raises(ConfigError, match=re.escape(
            "0.3 spells it --compile.enable --compile.enable_async_tensor_parallel")):
        read_torchtitan_args("--parallelism.enable-async-tensor-parallel", 8)


def test_megatron_lm_export_says_async_tp_is_not_carried():
    args, warnings = megatron_args(with_async_tp(tp_sp_plan()))
    assert "--sequence-parallel" in args and "--tp-comm-overlap" not in args
    assert any(w.startswith("async TP is not carried") for w in warnings), warnings
    _, plain = megatron_args(tp_sp_plan())
    assert not any("async TP" in w for w in plain)


def test_a_job_asking_for_async_tp_on_a100s_is_priced_without_it():
    argv = ("--parallelism.tensor-parallel-degree 2 --training.local-batch-size 16 "
            "--training.global-batch-size 64 --training.seq-len 64 --compile.enable "
            "--compile.enable-async-tensor-parallel activation-checkpoint:none")
    c = compare_torchtitan(argv, gpt_small(), Cluster.preset("dgx-a100-80g"), time_limit_s=5)
    assert not any(la.async_tp for la in c.job.layers)
    assert any(n.startswith("async TP is priced off: the cluster's device 'A100-SXM4-80GB' "
                            "has compute capability 8.0") for n in c.notes), c.notes
