"""Measured training-step time of each pipeline schedule on 4 local CPU ranks (gloo).

    python bench/pipeline_step.py                    # pp=4, gpt-small with 6 blocks
    python bench/pipeline_step.py --pp 2 --dp 2      # pp=2 × dp=2 (FSDP2 replicate)
    python bench/pipeline_step.py --steps 10 --microbatches 8

One launch of the ranks runs every schedule in turn on a fresh seeded model. A step is
timed from a barrier to the slowest rank's end (all_reduce MAX of the per-rank times);
the table gives the median over ``--steps`` steps after ``--warmup`` steps (the first step
also infers the stages' activation shapes, so it is never timed).

Prediction column: ``run(..., predict=fn)`` with ``fn(plan) -> float | None`` (seconds per
step, e.g. the planner's simulator) adds ``predicted_s`` next to each measurement; the
default (None) leaves it out.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from step_timing import median_step_s

from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
MODEL = "gpt-small"
N_LAYER = 6
"""Blocks: with the embeddings and the head as one unit each, 8 cut units fill 8 stages
(pp=4 × v=2) and keep the integer positions inside stage 0."""


@dataclass(frozen=True)
class Row:
    schedule: str
    plan: Plan
    measured_s: float
    """Median step time, seconds (measured)."""
    predicted_s: float | None = None
    """What ``predict(plan)`` says (modelled), when a predictor is given."""


def make_plan(schedule: str, *, pp: int, dp: int, microbatches: int, batch: int) -> Plan:
    """gpt-small (N_LAYER blocks) cut evenly into pp × v stages, every layer replicated."""
    v = 2 if schedule.startswith("Interleaved") or schedule == "ZBVZeroBubble" else 1
    units = [("wte", "wpe")] + [(f"h.{i}",) for i in range(N_LAYER)] + [("ln_f", "lm_head")]
    stages = pp * v
    layers = [LayerPlan(module=name, stage=i * stages // len(units))
              for i, unit in enumerate(units) for name in unit]
    return Plan(model=MODEL, cluster="local", global_batch=batch, mesh=Mesh(pp=pp, dp=dp),
                layers=tuple(layers),
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=microbatches,
                                      virtual_stages=v))


def measure_job(plan_jsons: list[str], seq: int, steps: int, warmup: int,
                threads: int = 1) -> list[float]:
    """On every rank: median step time of each plan, slowest rank per step."""
    import torch

    from autopar.lower import make_trainer
    from autopar.zoo import get_model

    # 4 ranks share this machine's cores: one intra-op thread each, or they spin
    # against each other (seen on 2 cores: 6.6 s/step instead of 0.4 with torch's default).
    torch.set_num_threads(threads)
    spec = get_model(MODEL).with_config(n_layer=N_LAYER)
    medians = []
    for text in plan_jsons:
        plan = Plan.from_json(text)
        batch = plan.global_batch
        trainer = make_trainer(spec.build(seed=0), plan, spec.loss_fn,
                               spec.example_inputs(batch, seq, device="meta"))
        medians.append(median_step_s(
            trainer, lambda step, batch=batch: spec.make_batch(batch, seq, seed=step),
            warmup=warmup, steps=steps))
    return medians


def run(*, pp: int = 4, dp: int = 1, microbatches: int = 8, batch: int = 16, seq: int = 64,
        steps: int = 5, warmup: int = 2, schedules: tuple[str, ...] = SCHEDULES,
        predict: Callable[[Plan], float | None] | None = None) -> list[Row]:
    from runtime.launch import spawn

    plans = [make_plan(s, pp=pp, dp=dp, microbatches=microbatches, batch=batch)
             for s in schedules]
    medians = spawn(measure_job, pp * dp, [p.to_json() for p in plans], seq, steps, warmup,
                    timeout_s=1200)[0]
    return [Row(p.pipeline.schedule, p, t, predict(p) if predict else None)
            for p, t in zip(plans, medians, strict=True)]


def format_table(rows: list[Row], *, steps: int) -> str:
    with_prediction = any(r.predicted_s is not None for r in rows)
    head = f"{'schedule':<22} {'v':>2} {'m':>3}  {'measured s/step':>15}"
    head += f"  {'predicted_s':>11}" if with_prediction else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        pl = r.plan.pipeline
        line = f"{r.schedule:<22} {pl.virtual_stages:>2} {pl.num_microbatches:>3}  " \
               f"{r.measured_s:>15.4f}"
        if with_prediction:
            line += f"  {r.predicted_s:>11.4f}" if r.predicted_s is not None else f"  {'-':>11}"
        lines.append(line)
    lines.append(f"(measured: median of {steps} steps after warm-up, slowest rank per step)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-predict", action="store_true",
                        help="leave out the simulator's prediction")
    args = parser.parse_args()
    predict = None if args.no_predict else simulator(args.pp * args.dp, args.batch, args.seq)
    rows = run(pp=args.pp, dp=args.dp, microbatches=args.microbatches, batch=args.batch,
               seq=args.seq, steps=args.steps, warmup=args.warmup, predict=predict)
    print(f"{MODEL} ({N_LAYER} blocks), pp={args.pp} × dp={args.dp}, global batch "
          f"{args.batch}, seq {args.seq}, {args.pp * args.dp} CPU ranks (gloo)")
    print(format_table(rows, steps=args.steps))
    if predict is not None:
        print("(predicted: the planner's schedule simulator on Cluster.local, uncalibrated "
              "defaults; ratio = measured / predicted)")
        for r in rows:
            print(f"  {r.schedule:<22} ratio {r.measured_s / r.predicted_s:.2f}")


def simulator(world: int, batch: int, seq: int) -> Callable[[Plan], float]:
    """The planner's prediction of a plan's step on this machine's CPU ranks (modelled)."""
    from autopar.planner.engine import evaluate_plan
    from autopar.zoo import get_model
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from passes.layer_graph import build_layer_graph

    spec = get_model(MODEL).with_config(n_layer=N_LAYER)
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(batch, seq, device="meta"))
    cluster = Cluster.local(world)
    return lambda plan: evaluate_plan(graph, cluster, precision("float32"), plan).step_time_s


if __name__ == "__main__":
    main()
