"""The cost model against every published run autopar prices: Megatron-LM's SC'21 Table 1
(autopar.planner.published), the ZeRO-3 rows of its Table 2 (autopar.planner.zero3_published)
and the FSDP runs of fsdp_scaling.csv (autopar.planner.fsdp_published), row by row: published,
predicted, error; then the presets' GEMM curves against the published GEMM timings they are
fitted to (autopar.planner.gemm_published), with and without them; each ZeRO-3 row's peak
memory and step with its blocks sharded one FSDP2 unit a block and one a weight matrix;
each FSDP row's peak memory against its GPU and the published peak; and, for rows up to
``--plan-up-to`` GPUs,
autopar's own plan for the same model, cluster and global batch, with its predicted
speed-up over the published configuration (both priced by the same model).

    python bench/published.py                    # every row; autopar plans none
    python bench/published.py --plan-up-to 64    # and plans rows of at most 64 GPUs

Megatron and ZeRO-3 rows are TFLOP/s per GPU counted the paper's way; FSDP rows tokens/s
per GPU. "(cal.)" marks a row a software generation was fitted on by name (Megatron-LM's
generation is fitted on all ten of its rows, so none is marked). The
speed-up compares like with like: a row that reduced gradients in float32 (torchtitan) is
priced with bf16 gradients there, as the planner's bf16 plans reduce them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from autopar.planner.fsdp_published import fsdp_cluster, fsdp_graph, fsdp_rows, predict
from autopar.planner.gemm_published import (
    asymptote_flops,
    fit_curves,
    fitted_gemms,
    model_time_s,
    relative_errors,
    table_for,
)
from autopar.planner.published import (
    evaluate,
    megatron_cluster,
    megatron_graph,
    megatron_plan,
    megatron_rows,
    predicted_tflops,
)
from autopar.planner.search import search
from autopar.planner.zero3_published import CALIBRATION, zero3_cluster, zero3_graph, zero3_rows
from autopar.planner.zero3_published import predict as predict_zero3
from cost_models.calibrate import fit_half_dim
from cost_models.hardware import Cluster
from cost_models.memory import precision

HEADER = (f"{'row':<30} {'unit':>6} {'published':>10} {'predicted':>10} {'error':>7} "
          f"{'exposed s':>9} {'autopar plan':<34} {'speed-up':>8} {'plan s':>6}")


def own_plan(graph, cluster, dtype: str, published_step_s: float) -> tuple[str, str, str]:
    """(shape, speed-up over the published step, planning seconds) of autopar's plan."""
    start = time.perf_counter()
    plan = search(graph, cluster, precision_name=dtype).plan
    took = time.perf_counter() - start
    shape = plan.mesh.describe(" ")
    if plan.pipeline:
        shape += f" {plan.pipeline.schedule} m={plan.pipeline.num_microbatches}"
    return shape, f"{published_step_s / plan.prediction.step_time_s:.2f}x", f"{took:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan-up-to", type=int, default=0,
                        help="also plan rows with at most this many GPUs (0: none)")
    args = parser.parse_args()
    print(HEADER)
    errors: dict[str, list[float]] = {"megatron": [], "zero3 (held out)": [], "fsdp": []}
    fp16 = precision("float16")
    for row in megatron_rows():
        graph, cluster = megatron_graph(row), megatron_cluster(row)
        ev = evaluate(graph, cluster, fp16, megatron_plan(graph, row))
        pred = predicted_tflops(row, ev.step_time_s)
        errors["megatron"].append(pred / row.tflops_per_gpu - 1)
        shape = speedup = took = "-"
        if row.gpus <= args.plan_up_to:
            shape, speedup, took = own_plan(graph, cluster, "float16", ev.step_time_s)
        print(f"{f'Megatron {row.params_b}B ×{row.gpus}':<30} {'TF/s':>6} "
              f"{row.tflops_per_gpu:>10.0f} {pred:>10.1f} {errors['megatron'][-1]:>+7.1%} "
              f"{'-':>9} {shape:<34} {speedup:>8} {took:>6}", flush=True)
    for row in zero3_rows():
        graph = zero3_graph(row.params_b, row.heads, row.hidden, row.layers, row.global_batch)
        p = predict_zero3(row)
        error = p.tflops_per_gpu / row.tflops_per_gpu - 1
        fitted = (row.params_b, row.gpus) in CALIBRATION.values()
        if not fitted:
            errors["zero3 (held out)"].append(error)
        shape = speedup = took = "-"
        if row.gpus <= args.plan_up_to:
            shape, speedup, took = own_plan(graph, zero3_cluster(row), "float16", p.step_time_s)
        label = f"ZeRO-3 {row.params_b}B ×{row.gpus}" + (" (cal.)" if fitted else "")
        print(f"{label:<30} {'TF/s':>6} {row.tflops_per_gpu:>10.0f} {p.tflops_per_gpu:>10.1f} "
              f"{error:>+7.1%} {p.exposed_comm_s:>9.2f} {shape:<34} {speedup:>8} {took:>6}",
              flush=True)
    zero3_units_table()
    for row in fsdp_rows():
        graph = fsdp_graph(row)
        p = predict(row, graph)
        pred = p.tokens_per_s_per_gpu(row)
        errors["fsdp"].append(pred / row.tokens_per_s_per_gpu - 1)
        shape = speedup = took = "-"
        if row.gpus <= args.plan_up_to:  # like for like: the planner's bf16 gradients
            shape, speedup, took = own_plan(graph, fsdp_cluster(row), "bfloat16",
                                            predict(row, graph, float32_grads=False).step_time_s)
        print(f"{f'{row.row_id} {row.label}':<30} {'tok/s':>6} "
              f"{row.tokens_per_s_per_gpu:>10.0f} {pred:>10.0f} {errors['fsdp'][-1]:>+7.1%} "
              f"{p.exposed_comm_s:>9.2f} {shape:<34} {speedup:>8} {took:>6}", flush=True)
    fsdp_memory_table()
    for name, errs in errors.items():
        absolute = [abs(e) for e in errs]
        print(f"{name}: worst |error| {max(absolute):.1%}, median {statistics.median(absolute):.1%}"
              f" over {len(errs)} rows")
    gemm_table()
    own_level_fits()


def zero3_units_table() -> None:
    """Each ZeRO-3 row's configuration with its blocks one FSDP2 unit each (``fsdp``, as the
    generation is fitted) and one unit per weight matrix (``fsdp_modules``, DeepSpeed's
    granularity): peak memory per rank, with the margin, and the step's change."""
    print(f"  {'ZeRO-3 row, blocks as':<28} {'fsdp GiB':>9} {'fsdp_modules GiB':>17} "
          f"{'step change':>12}")
    for row in zero3_rows():
        block, matrix = (predict_zero3(row, blocks=b) for b in ("fsdp", "fsdp_modules"))
        print(f"  {f'{row.params_b}B ×{row.gpus}':<28} {block.peak_memory_bytes / 2**30:>9.1f} "
              f"{matrix.peak_memory_bytes / 2**30:>17.1f} "
              f"{matrix.step_time_s / block.step_time_s - 1:>+12.1%}", flush=True)


def fsdp_memory_table() -> None:
    """Each FSDP row's published configuration: peak memory per rank by the memory model,
    before and with the allocator margin, its GPU's memory, and the peak the source
    publishes where it does (torchtitan's H100 rows: peak reserved)."""
    print(f"  {'FSDP row, peak per rank':<36} {'GiB':>6} {'+margin':>8} {'GPU':>5} "
          f"{'published':>10}")
    for row in fsdp_rows():
        cluster = fsdp_cluster(row)
        peak = predict(row).peak_memory_bytes / 2**30
        published = f"{row.memory_gib:.1f}" if row.memory_gib is not None else "-"
        print(f"  {f'{row.row_id} {row.label}':<36} "
              f"{peak / (1 + cluster.memory_margin_fraction):>6.1f} {peak:>8.1f} "
              f"{cluster.device.memory_bytes / 2**30:>5.0f} {published:>10}", flush=True)


def gemm_table() -> None:
    """Each GEMM curve on the published GEMMs it was fitted to (dgx-h100: OpenXLA's sm_90
    table; dgx-a100-80g: Vidur's A100 profiles): |relative error| of the modelled time, with
    the preset's d½ and with none (every GEMM at the best single rate: the ceiling, or the
    table's own level refitted without a curve)."""
    print(f"\n{'GEMMs':<28} {'d½':>6} {'GEMMs':>6} {'median':>7} {'worst':>7} "
          f"{'no curve: median':>17} {'worst':>7}")
    for preset in ("dgx-h100", "dgx-a100-80g"):
        device = Cluster.preset(preset).device
        table = table_for(device)
        for dtype in table.dtypes:
            cells = []
            for curve in (True, False):
                errs = [(abs(e), g) for g, e in relative_errors(device, dtype, size_effect=curve)]
                worst, g = max(errs, key=lambda x: x[0])
                cells.append((statistics.median(e for e, _ in errs), worst, len(errs),
                              f"{g.b} × {g.m}·{g.n}·{g.k}"))
            (med, worst, n, shape), (flat_med, flat_worst, _, _) = cells
            print(f"{f'{table.name} {dtype}':<28} {device.half_dim(dtype):>6.4g} {n:>6} "
                  f"{med:>7.1%} {worst:>7.1%} {flat_med:>17.1%} {flat_worst:>7.1%}   "
                  f"worst: {shape}")


def own_level_fits() -> None:
    """The A100 fit's figures (autopar.planner.gemm_published's docstring): the table's level
    against the preset's ceiling, the fit against the ceiling it does not keep, and the mean
    error by smallest dimension with and without the curve."""
    device = Cluster.preset("dgx-a100-80g").device
    table = table_for(device)
    for dtype in table.dtypes:
        rows = fitted_gemms(device, dtype)
        ceiling = asymptote_flops(device, dtype)
        best = max(g.flops_per_s[dtype] for g in table.gemms())
        large = [g.flops_per_s[dtype] for g in rows if g.min_dim >= 1024]
        level = fit_curves(device)[dtype].asymptote_flops
        print(f"\n{table.name} {dtype}: best {best / 1e12:.0f} TFLOP/s, ceiling "
              f"{ceiling / 1e12:.0f}, own level {level / 1e12:.0f}; fitted GEMMs of d ≥ 1024 "
              f"at a median {statistics.median(large) / 1e12:.0f} "
              f"({min(large) / 1e12:.0f}..{max(large) / 1e12:.0f})")
        half = fit_half_dim([g.flops for g in rows], [g.min_dim for g in rows],
                            [g.time_s(dtype) for g in rows], asymptote_flops=ceiling,
                            floor_s=device.kernel_floor_s)
        kept = replace(device, matmul_half_dim={dtype: half})
        errs = [model_time_s(g, kept, dtype) / g.time_s(dtype) - 1 for g in rows]
        large_errs = [e for g, e in zip(rows, errs, strict=True) if g.min_dim >= 1024]
        print(f"  with the ceiling kept instead: d½ {half:.0f}, median |error| "
              f"{statistics.median(map(abs, errs)):.1%}, mean error of d ≥ 1024 "
              f"{statistics.mean(large_errs):+.1%}")
        flat = fit_curves(device, size_effect=False)[dtype].asymptote_flops
        for label, curve in (("curve", True), (f"no curve, level {flat / 1e12:.0f}", False)):
            errs = relative_errors(device, dtype, size_effect=curve)
            means = [statistics.mean(e for g, e in errs if low <= g.min_dim < high)
                     for low, high in ((0, 512), (512, 1024), (1024, 2**20))]
            print(f"  mean error by d < 512, 512-1023, ≥ 1024 ({label}): "
                  + ", ".join(f"{m:+.1%}" for m in means))


if __name__ == "__main__":
    main()
