"""Where a training step's time goes on 4 CPU ranks, by kind of work (torch.profiler).

    python bench/step_profile.py                 # every plan of bench/cost_fidelity.py
    python bench/step_profile.py DP TP --steps 3  # plans whose name starts so

The plans, model and batch are bench/cost_fidelity.py's (planned on ``Cluster.local``:
the plan's shape is forced, so the profile does not matter). After 3 warm-up steps each
rank runs ``--steps`` steps under torch.profiler; an op's self CPU time goes to the first
category whose pattern matches its name, and the table prints each category's mean over
the ranks per step; an op inside ``Optimizer.step`` counts as the optimizer's, and the
loss is log-softmax and NLL, forward and backward. 'collective wait' is the collectives'
own ops plus the self
time of FSDP2's ranges, which on CPU ranks is waiting for their gathers and reductions.
This is the profile bench/cost_fidelity.py's cost terms were checked against.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch
import torch.distributed as dist
from cost_fidelity import (
    BATCH,
    CASES,
    CONFIG,
    MODEL,
    SEQ,
    THREADS,
    build_model,
    layer_graph,
    make_plan,
)
from torch.profiler import ProfilerActivity, profile

from autopar.lower import make_trainer
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from runtime.launch import spawn
from runtime.plan import Plan

CATEGORIES = [
    ("optimizer", r"^Optimizer\.step"),
    ("loss", r"log_softmax|nll_loss"),
    ("gemm", r"^aten::(mm|addmm|bmm|baddbmm)$"),
    ("attention", r"scaled_dot_product"),
    ("collective wait", r"c10d|wait_tensor|^FSDP::"),
    ("dtensor", r"PythonSubclass|Redistribute|TorchTensor|DTensor"),
    ("elementwise", r"^aten::"),
]
"""An op's self CPU time goes to the first category matching its name or, for 'optimizer',
the name of a range it runs inside; the rest is 'other' (autograd, Python ranges)."""


def profile_job(plan_json: str, steps: int) -> tuple[float, dict[str, float]]:
    """(wall seconds per step, seconds per step by category) on this rank."""
    torch.set_num_threads(THREADS)
    spec = get_model(MODEL).with_config(**CONFIG)
    trainer = make_trainer(build_model(seed=0), Plan.from_json(plan_json), spec.loss_fn,
                           spec.example_inputs(BATCH, SEQ, device="meta"))
    batch = spec.make_batch(BATCH, SEQ, seed=0)
    for _ in range(3):
        trainer.train_step(*batch)
    dist.barrier()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.train_step(*batch)
    wall = (time.perf_counter() - start) / steps
    return wall, {k: v / steps for k, v in categorize(prof.events()).items()}


def categorize(events) -> dict[str, float]:
    """Seconds of self CPU time by category (CATEGORIES)."""
    out: dict[str, float] = {}
    for e in events:
        names = [e.name]
        parent = e.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        cat = next((c for c, p in CATEGORIES
                    if (any(re.search(p, n) for n in names) if c == "optimizer"
                        else re.search(p, e.name))), "other")
        out[cat] = out.get(cat, 0.0) + e.self_cpu_time_total / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="*", help="prefixes of cost_fidelity's plan names")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    graph, cluster = layer_graph(), Cluster.local(args.nproc)
    cases = [c for c in CASES if not args.plans or any(c.name.startswith(p) for p in args.plans)]
    print(f"{MODEL} {CONFIG}, global batch {BATCH}, seq {SEQ}, {args.nproc} CPU ranks; "
          f"ms per step, mean over ranks, {args.steps} profiled steps")
    cats = ["gemm", "attention", "elementwise", "optimizer", "loss", "dtensor",
            "collective wait", "other"]
    print(f"{'plan':<15} {'wall':>7} " + " ".join(f"{c:>10.10}" for c in cats))
    for case in cases:
        plan, _ = make_plan(graph, cluster, case)
        per_rank = spawn(profile_job, args.nproc, plan.to_json(), args.steps, timeout_s=600)
        wall = sum(w for w, _ in per_rank) / len(per_rank) * 1e3
        mean = {c: sum(r[1].get(c, 0.0) for r in per_rank) / len(per_rank) * 1e3 for c in cats}
        print(f"{case.name:<15} {wall:>7.1f} " + " ".join(f"{mean[c]:>10.1f}" for c in cats))


if __name__ == "__main__":
    main()
