"""The report says what communication is exposed and why: a sharded-data-parallel plan of
GPT-3 175B on 1,536 A100s at global batch 1,536 (one sample a rank)."""

from __future__ import annotations

import collections
import functools

import pytest

from autopar.explain import attach_rationale
from autopar.planner.published import MegatronRow, megatron_graph
from autopar.planner.search import search
from cost_models.comm import Group, all_gather_s
from cost_models.hardware import Cluster
from runtime.plan import Mesh, Plan, stage_rank
from runtime.plan_report import comm_lines, format_report


@functools.cache
def sharded_plan(gpus: int = 1536) -> Plan:
    row = MegatronRow(params_b=175, heads=96, hidden=12288, layers=96, tp=1, pp=1, gpus=gpus,
                      global_batch=1536, tflops_per_gpu=0.0, microbatch=1, interleave=1)
    graph = megatron_graph(row)
    cluster = Cluster.preset("dgx-a100-80g", nodes=gpus // 8)
    result = search(graph, cluster, precision_name="bfloat16",
                    mesh=Mesh(pp=1, dp=gpus, tp=1), pipeline=False)
    return attach_rationale(result, graph, cluster, "bfloat16").plan


def test_the_report_splits_each_class_s_communication_into_hidden_and_exposed():
    plan = sharded_plan()
    blocks = [x for x in plan.layers if x.layer_class == "Block#0"]
    # 175B on 1,536 ranks: sharded, all but the one block that fits under ZeRO-2 beside
    # the others' shards (its whole bf16 parameters, 3.6 GB, stay gathered)
    strategies = collections.Counter(x.strategy for x in blocks)
    assert strategies["fsdp"] >= len(blocks) - 2 and set(strategies) <= {"fsdp", "zero2"}
    lines = comm_lines(plan)
    assert lines[1].startswith("Communication per step")
    assert lines[-1].startswith("  not in these numbers: each micro-batch's first all-gather")
    rows = [line.split() for line in lines[3:-1]]
    exposed_total = 0.0
    for cells in rows:
        issued, hidden, exposed = (float(cells[i]) for i in (3, 5, 7))  # "x ms" columns
        assert issued == pytest.approx(hidden + exposed, abs=2e-3)
        exposed_total += exposed
    # every layer's exposed communication is in the plan's total
    assert exposed_total == pytest.approx(plan.prediction.comm_s * 1e3, rel=1e-4)
    fsdp_rows = [line for line in lines if " fsdp" in line]
    assert fsdp_rows and all("2 all-gathers + 1 reduce-scatter" in line for line in fsdp_rows)
    assert "Communication per step" in format_report(plan)


def test_the_sharded_blocks_issue_their_collectives_at_nccl_s_ring_cost_and_hide_them():
    """A block (12·h² + 13·h = 1.81e9 parameters, 3.62 GB in bf16) under FSDP issues two
    all-gathers and one reduce-scatter (bf16 gradients) a step: 3 × 33.4 ms on a 1,536-rank
    ring (cost_models/comm.py); under ZeRO-2, at one micro-batch, one all-gather and one
    reduce-scatter. At one sample a rank they still hide behind its compute (about 130 ms):
    what is exposed is the slowdown of the compute beside them, issued · (1 − 1/σ) with
    σ = 1.1 (cost_models/overlap.py)."""
    plan = sharded_plan()
    cluster = Cluster.preset("dgx-a100-80g", nodes=192)
    h = 12288
    gather = all_gather_s((12 * h * h + 13 * h) * 2, Group(1536), cluster)
    assert gather == pytest.approx(33.4e-3, rel=1e-2)
    opts = {o.strategy: o for c in plan.rationale.classes if c.layer_class == "Block#0"
            for o in c.options}
    for option in {x.option for x in plan.layers if x.layer_class == "Block#0"}:
        o = opts[option]
        issued = o.comm_s + o.hidden_comm_s
        collectives = 3 if o.strategy.startswith("fsdp") else 2
        assert issued == pytest.approx(collectives * gather, rel=1e-3)
        assert o.comm_s == pytest.approx(issued * (1 - 1 / cluster.overlap.fsdp_slowdown))


def test_a_pipeline_s_communication_is_one_rank_s():
    """Each pipeline rank runs only its stages' blocks: the table's figures are the rank
    whose blocks of a class expose the most (n of them), a share of the step that can be
    taken, not the whole model's sum."""
    row = MegatronRow(params_b=1.7, heads=24, hidden=2304, layers=24, tp=2, pp=4, gpus=64,
                      global_batch=512, tflops_per_gpu=0.0, microbatch=1, interleave=1)
    graph = megatron_graph(row)
    cluster = Cluster.preset("dgx-a100-80g", nodes=8)
    result = search(graph, cluster, precision_name="bfloat16", mesh=Mesh(pp=4, dp=8, tp=2))
    plan = attach_rationale(result, graph, cluster, "bfloat16").plan
    assert plan.pipeline is not None
    lines = comm_lines(plan)
    assert lines[1].startswith("Communication per step, on the pipeline rank")
    block_rows = [line.split() for line in lines[3:] if line.split()[0] == "Block#0"]
    assert block_rows
    per_rank = collections.Counter(
        (stage_rank(x.stage, plan.mesh.pp, plan.pipeline), x.option)
        for x in plan.layers if x.layer_class == "Block#0")
    for cells in block_rows:
        n, option, exposed = int(cells[1]), cells[2], float(cells[7])
        assert n == max(count for (_, o), count in per_rank.items() if o == option)
        assert n < sum(count for (_, o), count in per_rank.items() if o == option)
        cost = next(o for c in plan.rationale.classes if c.layer_class == "Block#0"
                    for o in c.options if o.strategy == option)
        assert exposed == pytest.approx(n * cost.comm_s * 1e3, abs=2e-3)
        assert exposed <= plan.prediction.step_time_s * 1e3
