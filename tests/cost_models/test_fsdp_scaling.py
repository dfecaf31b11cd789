"""The cost model against published fully-sharded data-parallel runs
(autopar/data/fsdp_scaling.csv; which rows are priced and why: autopar.planner.fsdp_published).
Sharded data parallelism at 1,536 GPUs at a fixed global batch: test_zero3_scaling.py.

Where the model stands (python bench/published.py prints every row). Each source runs its
software generation (cost_models/software.toml): the share of the GPU's GEMM ceiling its
steps keep and, for llm-foundry's FSDP1, the host time per block and micro-batch the GPU does
not hide, fitted per device on NAMED calibration rows (``CALIBRATION``; re-fitted in
tests/cost_models/test_software.py) and checked here on the other rows, which no fit saw:
- A100 rows (torchtitan's Llama 2 and 3 on FSDP2, 2024; llm-foundry's MPT on FSDP1, 2023):
  12 held-out rows, every one within 8.5%, the median 2%. Two rows are left out with
  their reason (``UNEXPLAINED``): row 43 (MPT-70b on 64 A100-40GB, micro-batch 2) is
  published 27% below the same model on 128 GPUs at micro-batch 4, a fall no term of the
  model explains (the memory model fits it in 40 GB; the step's communication is 2% of
  it); row 48 (MPT-13b on 8 A100-40GB, 16 accumulation steps) is 11% below the model,
  and 16% below the same model on 32 GPUs with one step.
- H100 rows: 16 held out, every one within 6.5%, the median within 3%. Before the
  generations every one was predicted too fast: llm-foundry's by 13-35%, torchtitan's
  Llama 3.1 8B on power-capped (500 W) parts by 54-59%, on one 0.7 of peak tuned on
  Megatron-LM's 2021 A100 runs. With an efficiency alone, llm-foundry's rows split by
  compute per micro-batch (up to 12% off, median 8%): the published throughput grows with
  the micro-batch beyond its FLOPs, which the host time per block and micro-batch accounts
  for.
"""

from __future__ import annotations

import functools
import math
import statistics

import pytest

from autopar.planner.fsdp_published import (
    FsdpPrediction,
    FsdpRow,
    fsdp_cluster,
    fsdp_graph,
    fsdp_rows,
    predict,
)
from autopar.planner.search import search
from cost_models.hardware import GiB

UNEXPLAINED = {43: "27% below the same model at 128 GPUs; no modelled term explains it",
               48: "16% below the same model at 32 GPUs without accumulation"}
CALIBRATION = {51, 53, 40, 41, 1, 9}
"""Rows the generations' efficiencies were fitted on (cost_models/software.toml): the
smallest GPU count of each source and GPU (torchtitan's A100 table: its first row, all ran
on 64 GPUs). Checked by no test of accuracy here: they are exact by construction."""


@functools.cache
def prediction(row: FsdpRow) -> FsdpPrediction:
    return predict(row)


def predicted(row: FsdpRow) -> float:
    return prediction(row).tokens_per_s_per_gpu(row)


def rows_on(prefix: str) -> list[FsdpRow]:
    return [r for r in fsdp_rows() if r.hardware.startswith(prefix)]


def test_the_priced_rows_are_the_bf16_eager_pure_fsdp_rows():
    rows = fsdp_rows()
    assert len(rows) == 36
    assert {r.source for r in rows} == {"LF-MPT", "TT-A100-2404", "TT-H100-2412"}
    assert {r.hardware for r in rows} == {"H100-80GB", "A100-40GB", "A100-80GB",
                                          "H100-96GB-500W"}


def held_out(prefix: str) -> list[tuple[FsdpRow, float]]:
    return [(r, predicted(r) / r.tokens_per_s_per_gpu - 1) for r in rows_on(prefix)
            if r.row_id not in CALIBRATION | set(UNEXPLAINED)]


@pytest.mark.parametrize(("gpu", "rows"), [("A100", 12), ("H100", 16)])
def test_held_out_rows_within_10_percent_and_the_median_within_5(gpu, rows):
    table = held_out(gpu)
    report = "\n".join(f"{r.row_id:3} {r.label:28} {e:+.1%}" for r, e in table)
    checked = [abs(e) for _, e in table]
    assert len(checked) == rows, report
    assert max(checked) <= 0.10, report
    assert statistics.median(checked) <= 0.05, report


def test_the_calibration_rows_are_exact_in_geometric_mean():
    """Each fit's rows: predicted / published has a geometric mean of 1 (to the 4 digits
    software.toml keeps)."""
    rows = {r.row_id: r for r in fsdp_rows()}
    for group in ((51, 53), (40, 41), (1,), (9,)):
        logs = [math.log(predicted(rows[i]) / rows[i].tokens_per_s_per_gpu) for i in group]
        assert abs(sum(logs) / len(logs)) < 2e-3, group


def test_configurations_the_source_ranks_apart_are_ranked_alike():
    """Within one source and GPU, every two configurations (models, batches, recomputation,
    GPU counts) published more than 5% apart are predicted in the same order: 155 pairs.
    Closer ones are ties at the model's resolution (4 of the 20 are swapped, none by more
    than 2% published)."""
    rows = [r for r in fsdp_rows() if r.row_id not in UNEXPLAINED]
    pairs = [(a, b) for a in rows for b in rows
             if (a.source, a.hardware) == (b.source, b.hardware)
             and a.tokens_per_s_per_gpu > 1.05 * b.tokens_per_s_per_gpu]
    assert len(pairs) == 155
    wrong = [(a.label, b.label) for a, b in pairs if not predicted(a) > predicted(b)]
    assert not wrong


def test_throughput_per_gpu_falls_with_gpu_count_as_published():
    """llm-foundry's H100 table at 128, 256 and 512 GPUs keeps the per-GPU batch: published
    throughput per GPU falls with the GPU count for every model, most for MPT-7b (no
    recomputation, the least compute per byte gathered): 7.7%. The model's fall comes from
    the ring latency that grows with the ranks (cost_models.comm); it predicts the same
    order of models, with smaller falls (7b: 5.8%)."""
    falls = {}
    for model in ("MPT-7b", "MPT-13b", "MPT-30b", "MPT-70b"):
        rows = sorted((r for r in rows_on("H100") if r.model == model and r.gpus >= 128),
                      key=lambda r: r.gpus)
        assert [r.gpus for r in rows] == [128, 256, 512]
        tps = [predicted(r) for r in rows]
        assert tps[0] > tps[1] > tps[2], (model, tps)
        falls[model] = (1 - tps[2] / tps[0], 1 - rows[2].tokens_per_s_per_gpu
                        / rows[0].tokens_per_s_per_gpu)
    assert max(falls, key=lambda m: falls[m][0]) == max(falls, key=lambda m: falls[m][1])
    assert falls["MPT-7b"][0] >= falls["MPT-7b"][1] / 2, falls


def test_every_published_configuration_fits_its_gpu_by_the_memory_model():
    """They ran, so each fits its GPU by the memory model, the allocator margin included;
    else the planner could not choose it. Row 3 (Llama 2 13B on 64 A100s without
    recomputation) fits because its RMSNorms are fused as its config ran them
    (``FUSED_RMSNORM``): 72.4 GiB of 80, where unfused norms would need 86.3."""
    peaks = {r.row_id: prediction(r).peak_memory_bytes for r in fsdp_rows()}
    over = [(r.label, peaks[r.row_id] / GiB) for r in fsdp_rows()
            if peaks[r.row_id] > fsdp_cluster(r).device.memory_bytes]
    assert not over
    assert peaks[3] / GiB == pytest.approx(72.4, abs=0.05)


def test_the_published_peaks_are_below_the_prediction_by_at_most_12_percent():
    """torchtitan's H100 rows publish the caching allocator's peak reserved memory (rows 9
    and 12, Llama 3.1 8B on 8 and 128 GPUs: 82.4 and 67.0 GiB). The prediction before its
    margin is above both, by 5.7% and 11.6%: conservative. Part of that is selective
    recomputation: torchtitan's op policy recomputes every second matmul, whose outputs
    autopar's selective keeps (runtime.plan.SELECTIVE_SAVE_OPS)."""
    rows = [r for r in fsdp_rows() if r.memory_gib is not None]
    assert [r.row_id for r in rows] == [9, 12]
    for row in rows:
        margin = 1 + fsdp_cluster(row).memory_margin_fraction
        ours = prediction(row).peak_memory_bytes / margin / GiB
        assert row.memory_gib < ours <= 1.12 * row.memory_gib, (row.label, ours)


# -- the planner against the published configurations -----------------------------------------

@pytest.mark.parametrize("row_id", [r.row_id for r in fsdp_rows()])
def test_autopar_plans_at_least_as_fast_as_the_published_fsdp_configuration(row_id):
    """Same model, cluster and global batch: the planner's plan, priced by the same model, is
    no slower than the published configuration (priced with the planner's bf16 gradients,
    like for like). Every row plans in seconds (bench/published.py --plan-up-to 512).

    Every published row here runs on one stage, so the one-stage search (``pipeline=False``)
    holds the published plan: the full search answers the faster of its best one-stage plan
    and its best pipeline (search.py), so it is no slower than what is asserted here. The
    pipeline search is checked against published pipelines in test_published.py and
    test_zero3_scaling.py."""
    row = next(r for r in fsdp_rows() if r.row_id == row_id)
    graph = fsdp_graph(row)
    plan = search(graph, fsdp_cluster(row), precision_name="bfloat16", pipeline=False,
                  time_limit_s=600).plan  # the choice is under test, not the machine's speed
    published = predict(row, graph, float32_grads=False).step_time_s
    assert plan.prediction.step_time_s <= published * (1 + 1e-9)
