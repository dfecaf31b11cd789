"""Sharded data parallelism at a fixed global batch as the GPU count grows: the cost model
against SC'21 Table 2 (autopar/data/megatron_sc21_table2.csv; autopar.planner.zero3_published).

Published: DeepSpeed's ZeRO-3 without model parallelism fell from 144 to 44 TFLOP/s per GPU
(175B, 384 → 1,536 A100s at batch 1,536) and from 138 to 48 (530B, 640 → 2,240), below
Megatron-LM's 3D parallelism at every size. Its generation (deepspeed-zero3-2021) is fitted
on two named rows, one per regime (``zero3_published.CALIBRATION``); the four others are
predicted within 10%: 175B on 1,536 GPUs -3.4%, 530B +5.4%, -9.5%, -9.3%. Each row's
blocks are sharded as they fit 80 GB (``zero3_published.runnable_blocks``): one FSDP2 unit
a block, but for 530B on 640 GPUs one a weight matrix (per block: +7.2%).

autopar's own runtime (FSDP2 on NCCL's rings, torch-eager) is predicted to fall only about
11% over the same GPUs: its collectives run at the rails' bandwidth and hide behind the
recomputed backward even at one sample a rank (test at the end).
"""

from __future__ import annotations

import functools

import pytest

from autopar.explain import attach_rationale
from autopar.planner.costs import layer_cost
from autopar.planner.published import (
    MegatronRow,
    evaluate,
    megatron_cluster,
    megatron_plan,
    paper_flops,
)
from autopar.planner.search import search
from autopar.planner.zero3_published import (
    CALIBRATION,
    SOFTWARE,
    TABLE2_PATH,
    calibration_rows,
    predict,
    table2_rows,
    zero3_cluster,
    zero3_graph,
    zero3_rows,
)
from cost_models.hardware import Cluster
from cost_models.memory import precision
from cost_models.software import software
from runtime.plan import Mesh
from runtime.plan_report import comm_lines

SECONDS_PER_DAY = 86400


@functools.cache
def predicted(params_b: float, gpus: int) -> float:
    row = next(r for r in zero3_rows() if (r.params_b, r.gpus) == (params_b, gpus))
    return predict(row).tflops_per_gpu


def test_table2_is_vendored_whole_and_consistent_with_the_papers_training_times():
    """Twelve rows; each row's training time for 300B tokens is the paper's eq. 4,
    8·T·P / (n·X), from its own TFLOP/s (within the 5% the equation's approximations
    leave): a mistyped figure would show."""
    rows = table2_rows()
    assert [r.scheme for r in rows] == ["zero3"] * 6 + ["ptd-p"] * 6
    lines = [x for x in TABLE2_PATH.read_text().splitlines() if x and not x.startswith("#")]
    days = [float(x.split(",")[-1]) for x in lines[1:]]
    for row, published_days in zip(rows, days, strict=True):
        seconds = 8 * 300e9 * row.params_b * 1e9 / (row.gpus * row.tflops_per_gpu * 1e12)
        assert seconds / SECONDS_PER_DAY == pytest.approx(published_days, rel=0.05), row


def test_the_generations_two_values_reproduce_their_calibration_rows():
    """Two values fitted on two rows: the fit is the values at which both rows are
    predicted as published (software.toml keeps 4 digits)."""
    assert 0 < software(SOFTWARE).fsdp_bandwidth_share < 1
    for row in calibration_rows():
        assert predict(row).tflops_per_gpu == pytest.approx(row.tflops_per_gpu, rel=3e-3)


def test_the_held_out_zero3_rows_within_10_percent():
    held_out = [r for r in zero3_rows() if (r.params_b, r.gpus) not in CALIBRATION.values()]
    errors = {r.label: predicted(r.params_b, r.gpus) / r.tflops_per_gpu - 1 for r in held_out}
    assert len(errors) == 4
    assert max(abs(e) for e in errors.values()) <= 0.10, errors


def test_zero3_falls_as_published_at_a_fixed_global_batch():
    """175B at batch 1,536, 384 → 1,536 GPUs: published 144 → 44 TFLOP/s (3.3×), predicted
    3.4×; 530B at batch 2,240, 1,120 → 2,240 GPUs: 98 → 48 (2.0×), predicted 2.0× (its
    640-GPU row ran a larger batch). Each fall within 10%; the exposed communication grows
    with the GPUs."""
    for params, small, large in ((174.6, 384, 1536), (529.6, 1120, 2240)):
        rows = {r.gpus: r for r in zero3_rows() if r.params_b == params}
        assert rows[small].global_batch == rows[large].global_batch
        published = rows[small].tflops_per_gpu / rows[large].tflops_per_gpu
        fall = predicted(params, small) / predicted(params, large)
        assert fall == pytest.approx(published, rel=0.10), (params, fall, published)
        exposed = [predict(rows[n]).exposed_comm_s for n in sorted(rows)]
        assert exposed == sorted(exposed)


def gpt3_graph():
    """175B at batch 1,536: every 175B run of the table trains this graph."""
    return zero3_graph(174.6, 96, 12288, 96, 1536)


@functools.cache
def three_d(gpus: int) -> float:
    """GPT 175B as Megatron-LM ran it in Table 2: TP 8 × PP 12 (model-parallel size 96),
    micro-batch 1, two virtual stages a rank, its 2021 software."""
    row = MegatronRow(params_b=174.6, heads=96, hidden=12288, layers=96, tp=8, pp=12,
                      gpus=gpus, global_batch=1536, tflops_per_gpu=0.0, microbatch=1,
                      interleave=2)
    graph = gpt3_graph()
    step = evaluate(graph, megatron_cluster(row), precision("float16"),
                    megatron_plan(graph, row)).step_time_s
    return paper_flops(row) / step / gpus / 1e12


def test_3d_parallelism_beats_zero3_at_every_size():
    """Predicted for 175B (3D priced with its own generation, megatron-lm-2021); for 530B,
    predicted ZeRO-3 against the published 3D rows, whose pipelines of 35 stages the test
    does not simulate."""
    for gpus in (384, 768, 1536):
        assert three_d(gpus) > predicted(174.6, gpus)
    ptdp = {r.gpus: r.tflops_per_gpu for r in table2_rows()
            if r.scheme == "ptd-p" and r.params_b == 529.6}
    assert predicted(529.6, 640) < ptdp[560]
    assert predicted(529.6, 1120) < ptdp[1120] and predicted(529.6, 2240) < ptdp[2240]


def test_the_report_shows_the_exposed_gathers_of_a_1536_gpu_zero3_plan():
    """The planner on 175B × 1,536 GPUs under DeepSpeed's generation: most of the step is
    the blocks' exposed gathers and reduce-scatters, and the report says so, and why."""
    row = next(r for r in zero3_rows() if (r.params_b, r.gpus) == (174.6, 1536))
    graph = zero3_graph(row.params_b, row.heads, row.hidden, row.layers, row.global_batch)
    cluster = zero3_cluster(row)
    result = search(graph, cluster, precision_name="float16",
                    mesh=Mesh(pp=1, dp=row.gpus, tp=1), pipeline=False)
    plan = attach_rationale(result, graph, cluster, "float16").plan
    assert plan.prediction.comm_s > 0.5 * plan.prediction.step_time_s
    lines = comm_lines(plan)
    blocks = next(line for line in lines if line.lstrip().startswith("Block#0"))
    assert "fsdp" in blocks and "each behind one neighbour's compute" in blocks
    share = float(blocks.split("(")[1].split("%")[0])
    assert share > 50


def test_autopars_own_fsdp2_falls_little_over_the_same_gpus():
    """autopar's runtime on the same model and GPUs (torch-eager, FSDP2 at NCCL's ring
    cost: 21.8 ms a block's all-gather at 384 ranks, 33.3 at 1,536, behind the recomputed
    backward): 190 → 183 → 169 TFLOP/s, about 11% (a share of it the smaller GEMMs of fewer
    samples a rank: the A100 GEMM curve), more than 3D's fall (5%) but nothing like
    DeepSpeed's 2021 ZeRO-3."""
    def tflops(gpus: int) -> float:
        row = MegatronRow(params_b=175, heads=96, hidden=12288, layers=96, tp=1, pp=1,
                          gpus=gpus, global_batch=1536, tflops_per_gpu=0.0,
                          microbatch=1536 // gpus, interleave=1)
        graph = gpt3_graph()
        cluster = Cluster.preset("dgx-a100-80g", nodes=gpus // 8)
        blocks = next(c for c, m in graph.classes.items() if len(m) == 96)
        costs = [layer_cost(layer, "fsdp+full" if layer.layer_class == blocks else "fsdp",
                            Mesh(pp=1, dp=gpus, tp=1), cluster, precision("bfloat16"))
                 for layer in graph.layers]
        return paper_flops(row) / sum(c.time_s for c in costs) / gpus / 1e12

    ours = {n: tflops(n) for n in (384, 768, 1536)}
    assert ours[384] > ours[768] > ours[1536]
    fall = 1 - ours[1536] / ours[384]
    assert fall == pytest.approx(0.11, abs=0.02)
    assert fall > 1 - three_d(1536) / three_d(384)


def test_530b_on_640_gpus_fits_80_gb_only_with_a_unit_per_weight_matrix():
    """DeepSpeed ran 530B on 640 A100s of 80 GB at 4 samples a rank, gathering a block's
    weight matrices one by one. Sharded a block at a time (``fsdp``) that configuration
    needs more than 80 GB by the memory model: a block's 10 GB gathered, the next one
    prefetched and its unsharded gradient. One FSDP2 unit per weight matrix
    (``fsdp_modules``) holds the largest matrix's instead (4h² + 4h parameters, a third of
    the block's), 3 × (P − Pᵤ) fewer bytes with the margin on top, and fits.
    ``python bench/published.py`` prints both peaks."""
    row = next(r for r in zero3_rows() if (r.params_b, r.gpus) == (529.6, 640))
    graph = zero3_graph(row.params_b, row.heads, row.hidden, row.layers, row.global_batch)
    cluster, fp16 = zero3_cluster(row), precision("float16")
    blocks = next(c for c, m in graph.classes.items() if len(m) == row.layers)
    peak = {b: predict(row, blocks=b).peak_memory_bytes for b in ("fsdp", "fsdp_modules")}

    block = next(la for la in graph.layers if la.layer_class == blocks)
    h = row.hidden
    assert max(block.module_units) == 4 * h * h + 4 * h  # the MLP's first Linear
    saved = 3 * (block.param_count - max(block.module_units)) * fp16.param_bytes
    assert peak["fsdp"] - peak["fsdp_modules"] == pytest.approx(
        saved * (1 + cluster.memory_margin_fraction), rel=1e-6)
    assert peak["fsdp"] > cluster.device.memory_bytes >= peak["fsdp_modules"]


def test_the_planner_shards_530b_blocks_per_weight_matrix_on_640_ranks():
    """On DeepSpeed's mesh (dp = 640, one stage) no block fits as one FSDP2 unit, whatever
    else it does (the largest transient is a layer's, not a sum), so the planner must
    shard every block one unit per weight matrix."""
    row = next(r for r in zero3_rows() if (r.params_b, r.gpus) == (529.6, 640))
    graph = zero3_graph(row.params_b, row.heads, row.hidden, row.layers, row.global_batch)
    plan = search(graph, zero3_cluster(row), precision_name="float16",
                  mesh=Mesh(dp=row.gpus), pipeline=False).plan
    blocks = next(c for c, m in graph.classes.items() if len(m) == row.layers)
    chosen = {la.strategy for la in plan.layers if la.layer_class == blocks}
    assert chosen == {"fsdp_modules"}, chosen


@pytest.mark.parametrize("key", [(174.6, 1536), (529.6, 640)])
def test_autopar_plans_at_least_as_fast_as_the_published_zero3_configuration(key):
    """Same model, cluster, software and global batch: autopar's plan is no slower, by the
    same model, than the published ZeRO-3 run, its blocks sharded as they fit
    (``runnable_blocks``). Here the two ends of the table: the 1,536-GPU row and the row
    where ZeRO-3 does best (530B on 640 GPUs), which fits only a weight matrix a unit (a
    block a unit would need 95.8 GiB: ``python bench/published.py``).

    The published runs are one stage, so the one-stage search (``pipeline=False``, under a
    second) holds them; the full search answers the faster of its one-stage best and its
    pipeline best (tests/autopar/planner/test_pipeline_planner.py), so it is no slower, and
    here faster still: on the 1,536-GPU row the one-stage plan is DP 192 × TP 8, the full
    search's PP 12 × DP 16 × TP 8, interleaved, 4.1× faster than ZeRO-3.
    ``python bench/published.py --plan-up-to 2240`` plans all six with the full search."""
    row = next(r for r in zero3_rows() if (r.params_b, r.gpus) == key)
    graph = zero3_graph(row.params_b, row.heads, row.hidden, row.layers, row.global_batch)
    plan = search(graph, zero3_cluster(row), precision_name="float16", pipeline=False,
                  time_limit_s=600).plan  # the choice is under test, not the machine's speed
    assert plan.prediction.step_time_s <= predict(row).step_time_s * (1 + 1e-9)
