"""Planning time: capture + layer graph + search, for built-in models on DGX A100 clusters.

    python bench/plan_speed.py            # the full table (about a minute on 2 cores)
    python bench/plan_speed.py --quick    # gpt2-small and gpt3-175b at 1,024 GPUs only
    python bench/plan_speed.py --baseline # + capture with torch.export first, same process
    python bench/plan_speed.py --quick --checked  # + the search asking the runtime's validator
    python bench/plan_speed.py --megatron # Megatron-LM Table 1 rows, 32 … 3,072 GPUs
    python bench/plan_speed.py --megatron 39.1 1008.0   # only these rows (billions of params)
    python bench/plan_speed.py --targets --against /tmp/old-tree --runs 5
                                          # the two planning-speed targets, this tree against
                                          # another checkout, runs alternating, medians

Each row builds the model on the meta device, captures it, and searches every mesh of the
cluster, pipeline configurations (pp, schedule, micro-batches, stage cuts) included. The layer graph is rebuilt per row (nothing is cached between rows), so 'total'
is what `autopar plan` spends.

The Megatron rows (Narayanan et al., SC'21, Table 1, as shipped in
autopar/data/megatron_sc21_table1.csv) are built as notebooks/03_megatron_table1.ipynb
builds them: two blocks captured, repeated to the paper's depth, fp16. The time limit bounds
the whole search (every loop stops once it passes), so the bench gives 600 s: every row's
search completes and the times compare. 'digest' is a hash of the plan without its solver report (which holds timings), so two
runs agree on the plan when it matches. 'search cpu s' is the process's CPU time, which
other jobs on a shared machine disturb less than the wall-clock 'search s'.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import time

from autopar.errors import InfeasibleError
from autopar.planner import search
from autopar.planner.published import MegatronRow, megatron_rows
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from passes.layer_graph import build_layer_graph
from runtime.validate import plan_problem

ROWS = [
    # model, global batch, precision
    ("gpt2-small", 512, "float32"),
    ("gpt2-xl", 512, "float32"),
    ("gpt3-1.3b", 512, "float32"),
    ("gpt3-175b", 128, "bfloat16"),
]
GPUS = [8, 64, 256, 1024]


def plan_once(model_name: str, batch: int, dtype: str, gpus: int) -> dict:
    spec = get_model(model_name)
    cluster = Cluster.preset("dgx-a100-80g", nodes=gpus // 8)
    t0 = time.perf_counter()
    model = spec.build("meta")
    inputs = spec.example_inputs(batch, device="meta")
    t1 = time.perf_counter()
    graph = build_layer_graph(model, inputs, model_name=model_name, seq_len=inputs[0].shape[1])
    t2 = time.perf_counter()
    try:
        result = search(graph, cluster, precision_name=dtype)
        plan = result.plan
        shape = f"pp={plan.mesh.pp} dp={plan.mesh.dp} tp={plan.mesh.tp}"
        if plan.pipeline is not None:
            shape += f" {plan.pipeline.schedule} m={plan.pipeline.num_microbatches}"
        outcome = (f"{shape}, {plan.prediction.step_time_s:.3f} s/step, "
                   f"gap {plan.solver.gap:.1%}")
    except InfeasibleError as e:
        outcome = "infeasible: " + str(e).split(": ", 1)[1].split(" (mesh")[0]
    t3 = time.perf_counter()
    return dict(model=model_name, gpus=gpus, batch=batch, dtype=dtype, build=t1 - t0,
                capture=t2 - t1, search=t3 - t2, total=t3 - t0, outcome=outcome)


SEQ, VOCAB = 2048, 51200


def plan_megatron(row: MegatronRow) -> dict:
    import torch

    from autopar.whatif import repeat_blocks
    from autopar.zoo import GPT, GPTConfig

    batch, gpus = row.global_batch, row.gpus
    cfg = GPTConfig(n_layer=2, n_head=row.heads, n_embd=row.hidden,
                    vocab_size=VOCAB, block_size=SEQ, bias=False)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
    graph = build_layer_graph(model, (torch.zeros(batch, SEQ, dtype=torch.long, device="meta"),),
                              model_name=f"gpt-{row.params_b}b", seq_len=SEQ)
    graph = repeat_blocks(graph, row.layers)
    t1, c1 = time.perf_counter(), time.process_time()
    plan = search(graph, Cluster.preset("dgx-a100-80g", nodes=gpus // 8),
                  precision_name="float16", time_limit_s=600).plan
    t2, c2 = time.perf_counter(), time.process_time()
    shape = f"pp={plan.mesh.pp} dp={plan.mesh.dp} tp={plan.mesh.tp}"
    if plan.pipeline is not None:
        shape += f" {plan.pipeline.schedule} m={plan.pipeline.num_microbatches}"
    document = json.loads(plan.to_json())
    document.pop("solver")
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:10]
    return dict(params=row.params_b, gpus=gpus, graph=t1 - t0, search=t2 - t1, cpu=c2 - c1,
                outcome=f"{shape}, {plan.prediction.step_time_s:.3f} s/step", digest=digest)


def print_megatron(only: list[str]) -> None:
    header = (f"{'params':>7} {'GPUs':>5} {'graph s':>7} {'search s':>8} {'search cpu s':>12}"
              f"  {'digest':<10}  plan")
    print(header)
    print("-" * len(header))
    for row in megatron_rows():
        if only and f"{row.params_b}" not in only:
            continue
        r = plan_megatron(row)
        print(f"{r['params']:>6}B {r['gpus']:>5} {r['graph']:>7.2f} {r['search']:>8.2f} "
              f"{r['cpu']:>12.2f}  {r['digest']:<10}  {r['outcome']}", flush=True)


TARGETS = (  # (what, target seconds, the row)
    ("GPT-3 175B, 1,024 A100: capture + search", 2.0, "gpt3-175b"),
    ("Megatron 1T row, 3,072 A100: search", 5.0, "1008.0"),
)


def measure_target(row: str) -> dict:
    """One timing of a target in this process: (seconds, CPU seconds, plan digest)."""
    if row == "gpt3-175b":
        c0 = time.process_time()
        r = plan_once("gpt3-175b", 128, "bfloat16", 1024)
        return dict(s=r["build"] + r["capture"] + r["search"], cpu=time.process_time() - c0,
                    capture=r["build"] + r["capture"], search=r["search"],
                    plan=r["outcome"].split(", gap")[0])
    (megatron,) = [m for m in megatron_rows() if f"{m.params_b}" == row]
    r = plan_megatron(megatron)
    return dict(s=r["search"], cpu=r["cpu"], plan=f"{r['outcome']} [{r['digest']}]")


def print_targets(against: str | None, runs: int) -> None:
    """Each target ``runs`` times in fresh processes, alternating this tree with the
    checkout ``against`` (same machine, same minutes), and the medians."""
    import os
    import statistics
    import subprocess
    import sys
    from pathlib import Path

    trees = {"new": str(Path(__file__).resolve().parents[1])}
    if against:
        trees["old"] = str(Path(against).resolve())
    for what, target, row in TARGETS:
        times: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(runs):
            for name, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=tree)
                out = subprocess.run(
                    [sys.executable, str(Path(trees["new"]) / "bench" / "plan_speed.py"),
                     "--measure", row], env=env, capture_output=True, text=True, check=True)
                times[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{what} (target {target:g} s), median of {runs}:")
        for name in trees:
            wall = statistics.median(t["s"] for t in times[name])
            cpu = statistics.median(t["cpu"] for t in times[name])
            parts = ""
            if "capture" in times[name][0]:  # older trees' bench may not split them
                parts = (f"capture {statistics.median(t['capture'] for t in times[name]):.2f}"
                         f" + search {statistics.median(t['search'] for t in times[name]):.2f}"
                         " s  ")
            print(f"  {name:<4} {wall:7.2f} s  ({cpu:6.2f} s CPU)  {parts}"
                  f"{times[name][0]['plan']}")
        if against:
            old = statistics.median(t["s"] for t in times["old"])
            new = statistics.median(t["s"] for t in times["new"])
            same = {t["plan"] for t in times["old"] + times["new"]}
            print(f"  ratio old/new {old / new:.2f}x; "
                  f"{'the same plan in every run' if len(same) == 1 else 'PLANS DIFFER'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--baseline", action="store_true",
                        help="also time the layer graph with torch.export tried first")
    parser.add_argument("--checked", action="store_true",
                        help="also time each search asking the runtime's validator about "
                             "every feasible candidate (what autopar.plan does), same process")
    parser.add_argument("--megatron", nargs="*", metavar="PARAMS_B",
                        help="the Megatron-LM Table 1 rows (all, or those with these "
                             "parameter counts in billions) instead of the built-in models")
    parser.add_argument("--targets", action="store_true",
                        help="the planning-speed targets (GPT-3 175B on 1,024 GPUs, the "
                             "Megatron 1T row), medians of --runs fresh processes")
    parser.add_argument("--against", metavar="TREE",
                        help="with --targets: also time this checkout (e.g. a worktree of "
                             "an older commit), runs alternating with this tree's")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one timing, as JSON
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_target(args.measure)))
        return
    if args.targets:
        print_targets(args.against, args.runs)
        return
    if args.megatron is not None:
        print_megatron(args.megatron)
        return
    rows = [(m, b, d, g) for m, b, d in ROWS for g in GPUS]
    if args.quick:
        rows = [("gpt2-small", 512, "float32", 1024), ("gpt3-175b", 128, "bfloat16", 1024)]
    header = f"{'model':<11} {'GPUs':>5} {'batch':>5} {'dtype':<8} {'build s':>7} " \
             f"{'capture s':>9} {'search s':>8} {'total s':>7}  plan"
    print(header)
    print("-" * len(header))
    for model, batch, dtype, gpus in rows:
        r = plan_once(model, batch, dtype, gpus)
        print(f"{r['model']:<11} {r['gpus']:>5} {r['batch']:>5} {r['dtype']:<8} "
              f"{r['build']:>7.2f} {r['capture']:>9.2f} {r['search']:>8.2f} {r['total']:>7.2f}"
              f"  {r['outcome']}")
    if args.checked:
        print()
        print("search alone vs search asking runtime.validate about every feasible candidate")
        print(f"{'model':<11} {'GPUs':>5} {'search s':>8} {'checked s':>9} {'ratio':>6}")
        for model, batch, dtype, gpus in rows:
            plain, checked = time_checked_search(model, batch, dtype, gpus)
            print(f"{model:<11} {gpus:>5} {plain:>8.2f} {checked:>9.2f} {checked / plain:>5.2f}×")
    if args.baseline:
        print()
        print("capture path: symbolic_trace first (default) vs torch.export first, same process")
        print(f"{'model':<11} {'batch':>5} {'trace s':>8} {'export s':>8} {'export/trace':>12}")
        for model, batch, _ in ROWS:
            trace_s = time_layer_graph(model, batch, "symbolic_trace")
            export_s = time_layer_graph(model, batch, "export")
            print(f"{model:<11} {batch:>5} {trace_s:>8.2f} {export_s:>8.2f} "
                  f"{export_s / trace_s:>11.1f}×")


def time_checked_search(model_name: str, batch: int, dtype: str, gpus: int
                        ) -> tuple[float, float]:
    spec = get_model(model_name)
    model = spec.build("meta")
    inputs = spec.example_inputs(batch, device="meta")
    graph = build_layer_graph(model, inputs, model_name=model_name, seq_len=inputs[0].shape[1])
    cluster = Cluster.preset("dgx-a100-80g", nodes=gpus // 8)
    times = []
    for check in (None, functools.partial(plan_problem, model)):
        start = time.perf_counter()
        search(graph, cluster, precision_name=dtype, check=check)
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def time_layer_graph(model_name: str, batch: int, prefer: str) -> float:
    spec = get_model(model_name)
    model = spec.build("meta")
    inputs = spec.example_inputs(batch, device="meta")
    start = time.perf_counter()
    build_layer_graph(model, inputs, model_name=model_name, prefer=prefer)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
