"""The cost model against Megatron-LM's published throughput (Narayanan et al., SC'21,
Table 1), row by row; and autopar's own plan for the same model, cluster and batch.

    python bench/megatron_table.py               # every row; autopar plans up to 256 GPUs
    python bench/megatron_table.py --plan-up-to 3072

'published config' is the paper's configuration (TP, PP, DP, micro-batch, interleaving,
full recomputation, fp16, unsharded optimizer) priced by autopar's cost model
(autopar.planner.published); TFLOP/s per GPU are counted with the paper's formula, so the
error column compares like with like. 'autopar plan' is what `autopar plan` chooses for
the same model, cluster and batch, priced by the same model (its own shape in brackets).
The table ships with the package (autopar/data/megatron_sc21_table1.csv).
"""

from __future__ import annotations

import argparse
import statistics
import time

from autopar.planner.published import (
    evaluate,
    megatron_cluster,
    megatron_graph,
    megatron_plan,
    megatron_rows,
    predicted_tflops,
)
from autopar.planner.search import search
from cost_models.memory import precision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan-up-to", type=int, default=256,
                        help="also plan rows with at most this many GPUs")
    args = parser.parse_args()
    fp16 = precision("float16")
    print(f"{'model':>8} {'gpus':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'published':>10} "
          f"{'predicted':>10} {'error':>7} {'peak GiB':>9} {'autopar plan':>13} "
          f"{'plan shape':<28} {'plan s':>6}")
    errors = []
    for row in megatron_rows():
        graph, cluster = megatron_graph(row), megatron_cluster(row)
        ev = evaluate(graph, cluster, fp16, megatron_plan(graph, row))
        predicted = predicted_tflops(row, ev.step_time_s)
        errors.append(predicted / row.tflops_per_gpu - 1)
        own, shape, took = "-", "", ""
        if row.gpus <= args.plan_up_to:
            start = time.perf_counter()
            plan = search(graph, cluster, precision_name="float16").plan
            took = f"{time.perf_counter() - start:.1f}"
            own = f"{predicted_tflops(row, plan.prediction.step_time_s):.1f}"
            shape = plan.mesh.describe(" ")
            if plan.pipeline:
                shape += f" {plan.pipeline.schedule} m={plan.pipeline.num_microbatches}"
        print(f"{row.params_b:>7}B {row.gpus:>5} {row.tp:>3} {row.pp:>3} {row.dp:>3} "
              f"{row.tflops_per_gpu:>10.0f} {predicted:>10.1f} {errors[-1]:>+7.1%} "
              f"{ev.peak_memory_bytes / 2**30:>9.1f} {own:>13} {shape:<28} {took:>6}",
              flush=True)
    absolute = [abs(e) for e in errors]
    print(f"\nworst |error| {max(absolute):.1%}, median |error| {statistics.median(absolute):.1%}"
          " (targets: 10% and 5%)")


if __name__ == "__main__":
    main()
