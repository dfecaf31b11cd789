"""Cost-model fidelity here: predicted against measured step time and peak memory per rank.

    python bench/cost_fidelity.py                  # calibrate, then 5 plans on 4 ranks
    python bench/cost_fidelity.py --profile calibrated.toml   # reuse an `autopar calibrate` profile
    python bench/cost_fidelity.py --steps 8 --warmup 3

1. Calibrate: ``autopar calibrate``'s machinery (``autopar.calibrate.calibrate``, settings
   ``CALIBRATION``) on ``--nproc`` gloo ranks with one intra-op thread each, as the training runs
   below use; the profile goes to a temp file and ``Cluster.from_toml`` loads it, so the
   predictions use this machine's GEMM curve, memory-bound kernel bandwidth, fused
   attention and cross-entropy rates, kernel floor, host overheads of FSDP2/TP/DTensor,
   collective skew by message size, overlap slowdowns and per-collective α-β.
   ``--profile`` loads an existing profile instead.
2. Plan: a small GPT (``MODEL`` with ``CONFIG``) is captured into the planner's layer graph;
   for each case every layer is forced to one option on a fixed mesh (TP where the layer
   has a TP split, else ``replicate``). The numbers are the planner's own for exactly that
   plan, priced by the planner's engine (``Engine.evaluate``: at pp = 1 step time = Σ
   per-layer compute + communication and memory by the liveness walk; the pipeline plan
   through the schedule simulator) and built by ``Engine.plan``.
3. Measure: one launch of ``--nproc`` ranks runs every plan in turn on a fresh seeded model
   (``autopar.lower.make_trainer``, the ``autopar run`` path). A step is timed from a
   barrier to the slowest rank's end (all_reduce MAX); the median over ``--steps`` steps
   after ``--warmup`` is the measured step. One more step runs under PyTorch's
   ``MemTracker`` (``torch.distributed._tools.mem_tracker``): a dispatch mode that counts
   the bytes of every tensor storage alive on the rank — parameters, gradients, optimizer
   states, activations, temporaries of forward/backward/optimizer, collective buffers
   (FSDP2's resizes of unsharded parameters included) — and keeps the peak of their sum.
   It counts tensor bytes, not the allocator's: no fragmentation or caching, and nothing
   the C++ side allocates without a dispatched op (gloo's own staging buffers). Storages
   made before the tracked step are registered first: the modules' parameters, the
   optimizer's states and, under DDP, its gradient buckets (``ddp_buckets``; unregistered,
   they were missed until a gradient in them appeared, 16.3 MiB short at DDP's peak).

Predicted memory is the model's per-rank peak without its allocator margin
(``Cluster.memory_margin_fraction``), i.e. what MemTracker can see; the margin is printed
below the table. Errors are (predicted − measured) / measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from step_timing import median_step_s
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.parallel import DistributedDataParallel

from autopar.calibrate import Settings, calibrate, write_profile
from autopar.calibration_kernels import linear_op
from autopar.lower import make_trainer
from autopar.planner.costs import allowed_strategies, layer_cost
from autopar.planner.engine import Engine
from autopar.planner.stages import balanced_bounds, stage_assignment
from autopar.zoo import GPT, get_model
from cost_models.compute import gemm_efficiency
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.launch import spawn
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan, SolverReport
from runtime.strategies import spec

MODEL = "gpt-small"
CONFIG = dict(n_layer=4, n_head=8, n_embd=256, vocab_size=2048)
"""gpt-small widened so GEMMs, not per-op overhead, dominate a step (about 0.1-1 s per
step on 4 ranks of a 2-core machine)."""
BATCH, SEQ = 16, 128
THREADS = 1
"""Intra-op threads per rank, for calibration and training alike: 4 ranks share the cores
(bench/pipeline_step.py: torch's default threads spin against each other)."""
MiB = 1024**2
KiB = 1024
CALIBRATION = Settings(gemm_sizes=(256, 512, 1024), dtypes=("float32",),
                       attention_shape=(BATCH // 4 * CONFIG["n_head"], SEQ,
                                        CONFIG["n_embd"] // CONFIG["n_head"]),
                       loss_shape=(BATCH // 4 * SEQ, CONFIG["vocab_size"]),
                       message_bytes=tuple(4 * KiB * 4**i for i in range(7)), warmup=2,
                       repeats=5, timeout_s=120)
"""``autopar calibrate``'s defaults less bfloat16 (not used here) and the 2048 GEMM (time);
GEMMs up to 1024 and messages up to 16 MiB cover this model's (its MLP GEMMs have a 1024
dimension, the DP gradient all_reduce is 16 MiB), which ``Settings.quick()`` does not.
Attention is timed at the model's shape on a DP rank: 4 samples × 8 heads, seq 128, head
dim 32; cross-entropy too: 512 tokens × 2048 words (what a user calibrating for their model
passes)."""
SUSTAINED_GEMM = (1024, 2.0)
"""(n, seconds): a cross-check of the calibrated GEMM rate, every rank running an n → n
Linear's forward and backward back to back for that long at once (``sustained_gemm_flops``)."""


def build_model(device: str = "cpu", seed: int = 0) -> GPT:
    return get_model(MODEL).with_config(**CONFIG).build(device, seed=seed)


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    mesh: Mesh
    strategy: str
    """Forced on every layer that can take it; the others are ``replicate``."""
    pipeline: PipelineSpec | None = None


CASES = (
    Case(name="DP (replicate)", mesh=Mesh(dp=4), strategy="replicate"),
    Case(name="FSDP", mesh=Mesh(dp=4), strategy="fsdp"),
    Case(name="TP", mesh=Mesh(dp=2, tp=2), strategy="tp"),
    Case(name="TP+FSDP", mesh=Mesh(dp=2, tp=2), strategy="tp_fsdp"),
    Case(name="PP 1F1B", mesh=Mesh(pp=2, dp=2), strategy="replicate",
         pipeline=PipelineSpec(schedule="1F1B", num_microbatches=4)),
)


@dataclass(frozen=True)
class Predicted:
    step_s: float
    peak_bytes: float
    """The fullest rank, allocator margin excluded."""
    margin_bytes: float


@dataclass(frozen=True)
class Measured:
    step_s: float
    """Median step, slowest rank per step."""
    peak_bytes: list[int]
    """Per rank: MemTracker's peak of live tensor bytes over one step."""
    peak_parts: list[dict[str, int]]
    """Per rank: the categories at that peak (Parameter, Gradient, Optstate, Activation, ...)."""


# -- calibration and planning (this process) -----------------------------------------------

def calibrated_cluster(nproc: int, profile: str | None):
    if profile:
        return Cluster.from_toml(profile)
    cal = calibrate(nproc, settings=CALIBRATION)
    with tempfile.TemporaryDirectory() as tmp:
        return write_profile(cal, Path(tmp) / "profile.toml")


def layer_graph():
    spec = get_model(MODEL).with_config(**CONFIG)
    return build_layer_graph(build_model("meta"), spec.example_inputs(BATCH, SEQ, device="meta"),
                             model_name=MODEL, seq_len=SEQ)


def option_for(layer, case: Case) -> str:
    allowed = allowed_strategies(layer, case.mesh)
    return case.strategy if case.strategy in allowed else "replicate"


def tp_styles(layer, strategy: str) -> dict[str, str]:
    return dict(layer.tp.styles) if spec(strategy).tensor_parallel else {}


def make_plan(graph, cluster, case: Case) -> tuple[Plan, Predicted]:
    """The plan of ``case`` and the cost model's numbers for exactly that plan: a draft
    with every layer's option (and, for the pipeline, the planner's balanced cut on the
    layers' times), priced by the planner's engine (``Engine.evaluate``: per-layer sums
    at pp = 1, the schedule simulator for the pipeline) and built into a Plan."""
    prec = precision("float32")
    stage_of = [0] * len(graph.layers)
    if case.pipeline is not None:
        m = case.pipeline.num_microbatches
        weights = [layer_cost(layer, option_for(layer, case), case.mesh, cluster, prec,
                              m).time_s for layer in graph.layers]
        stages = case.mesh.pp * case.pipeline.virtual_stages
        stage_of = list(stage_assignment(len(weights),
                                    balanced_bounds(weights, stages, graph.uncuttable)))
    draft = Plan(model=MODEL, cluster=cluster.name, global_batch=BATCH, seq_len=SEQ,
                 mesh=case.mesh, pipeline=case.pipeline,
                 layers=tuple(LayerPlan(module=layer.name, strategy=option_for(layer, case),
                                        tp_styles=tp_styles(layer, option_for(layer, case)),
                                        stage=s) for layer, s in zip(graph.layers, stage_of,
                                                                     strict=True)))
    engine = Engine(graph, cluster, prec)
    outcome = engine.evaluate(draft)
    report = SolverReport(solver="fixed", status="optimal", objective_s=outcome.step_time_s,
                          lower_bound_s=outcome.lower_bound_s, gap=0.0, solve_time_s=0.0)
    plan = engine.plan(outcome, report)
    fullest = max(outcome.rank_memory, key=lambda r: r.total_bytes)
    return plan, Predicted(outcome.step_time_s, fullest.total_bytes - fullest.margin_bytes,
                           fullest.margin_bytes)


def measure_job(plan_jsons: list[str], steps: int, warmup: int) -> list:
    """On every rank: the sustained GEMM rate, then per plan: (median step s, slowest rank per step; this rank's peak
    tensor bytes over one step; the categories at that peak)."""
    torch.set_num_threads(THREADS)
    spec = get_model(MODEL).with_config(**CONFIG)
    out: list[tuple] = [(sustained_gemm_flops(*SUSTAINED_GEMM),
                         sustained_gemm_flops(*SUSTAINED_GEMM, linear=False))]
    for text in plan_jsons:
        plan = Plan.from_json(text)
        trainer = make_trainer(build_model(seed=0), plan, spec.loss_fn,
                               spec.example_inputs(BATCH, SEQ, device="meta"))
        step_s = median_step_s(trainer, lambda step: spec.make_batch(BATCH, SEQ, seed=step),
                               warmup=warmup, steps=steps)
        inputs, targets = spec.make_batch(BATCH, SEQ, seed=warmup + steps)
        peak, parts = tracked_peak(trainer, inputs, targets)
        out.append((step_s, peak, parts))
    return out


def sustained_gemm_flops(n: int, seconds: float, *, linear: bool = True) -> float:
    """FLOP/s of this rank running an n → n float32 Linear's forward and backward on n
    tokens (the calibration's GEMM) back to back for ``seconds`` while every rank does the
    same: the share of the machine a rank gets when all compute, which is what the
    calibration's per-rank GEMM rate stands for (measured). ``linear`` False: a bare
    n × n ``torch.mm`` instead, what the calibration timed before."""
    if linear:
        gemms, op = linear_op(n, torch.float32, "cpu")
    else:
        a, b = torch.randn(n, n), torch.randn(n, n)
        gemms, op = 1, lambda: torch.mm(a, b)
    op()
    dist.barrier()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        op()
        count += 1
    return gemms * 2 * n**3 * count / (time.perf_counter() - start)


def tracked_peak(trainer, inputs: tuple, targets: torch.Tensor) -> tuple[int, dict[str, int]]:
    """Peak live tensor bytes of one training step on this rank, by MemTracker, with the
    trainer's modules, optimizer states and DDP's gradient buckets registered as existing
    before it."""
    modules = list(getattr(trainer, "stages", None) or [trainer.module])
    tracker = StepTracker()
    tracker.track_external(*modules, trainer.optimizer, *ddp_buckets(trainer, inputs, targets))
    with tracker:
        trainer.train_step(inputs, targets)
    snap = tracker.get_tracker_snapshot("peak")
    cpu = next(iter(snap.values()), {})
    parts = {str(getattr(k, "value", k)): int(v) for k, v in cpu.items()}
    return parts.get("Total", 0), parts


def ddp_buckets(trainer, inputs: tuple, targets: torch.Tensor) -> list[torch.Tensor]:
    """Under DDP, the gradients of one more (untracked) step as its optimizer sees them: views
    into DDP's all-reduce buckets (``gradient_as_bucket_view=True``), which DDP allocates once
    and keeps between steps. ``zero_grad(set_to_none=True)`` drops the views, not the
    buckets, so without these MemTracker would count a bucket only once a gradient in it
    appears in backward, and miss all of them before (the loss's backward, where DDP's
    peak is). Elsewhere (FSDP2) gradients are freed with the views: nothing to add."""
    if not isinstance(trainer.module, DistributedDataParallel):
        return []
    held: list[torch.Tensor] = []

    def keep(optimizer, args, kwargs) -> None:
        held.extend(p.grad for group in optimizer.param_groups for p in group["params"]
                    if p.grad is not None)

    handle = trainer.optimizer.register_step_pre_hook(keep)
    trainer.train_step(inputs, targets)
    handle.remove()
    return held


class StepTracker(MemTracker):
    """MemTracker that lets a root module run forward more than once in one tracked region,
    as a pipeline stage does (once per micro-batch): MemTracker raises there, because its
    per-module statistics assume one iteration. Only those statistics are reset; the rank's
    peak, which is all this bench reads, is kept."""

    def _pre_fw_hook(self, module, inputs):
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


# -- the table -------------------------------------------------------------------------------

def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("nan")


def format_table(rows: list[tuple[Case, Plan, Predicted, Measured]]) -> str:
    head = (f"{'strategy':<15} {'mesh':<18} {'pred ms':>8} {'meas ms':>8} {'err':>6}   "
            f"{'pred MiB':>8} {'meas MiB':>8} {'err':>6}")
    lines = [head, "-" * len(head)]
    for case, plan, pred, meas in rows:
        peak = max(meas.peak_bytes)
        lines.append(
            f"{case.name:<15} {plan.mesh.describe():<18} {pred.step_s * 1e3:>8.1f} "
            f"{meas.step_s * 1e3:>8.1f} {error(pred.step_s, meas.step_s):>+6.0%}   "
            f"{pred.peak_bytes / MiB:>8.1f} {peak / MiB:>8.1f} "
            f"{error(pred.peak_bytes, peak):>+6.0%}")
    return "\n".join(lines)


def format_details(rows: list[tuple[Case, Plan, Predicted, Measured]]) -> str:
    lines = ["details: measured peak MiB per rank [MemTracker's categories at the fullest "
             "rank's peak]; the model's terms (fullest rank)"]
    for case, plan, _, meas in rows:
        fullest = max(range(len(meas.peak_bytes)), key=lambda r: meas.peak_bytes[r])
        parts = ", ".join(f"{k} {v / MiB:.1f}" for k, v in meas.peak_parts[fullest].items()
                          if k != "Total" and v)
        ranks = " ".join(f"{b / MiB:.1f}" for b in meas.peak_bytes)
        lines.append(f"  {case.name:<15} ranks {ranks}  [{parts}]")
        m = plan.prediction.memory if not plan.prediction.rank_memory else max(
            plan.prediction.rank_memory, key=lambda r: r.total_bytes)
        t = plan.prediction
        lines.append(f"  {'':<15} modelled time: compute {t.compute_s * 1e3:.1f} ms, "
                     f"communication {t.comm_s * 1e3:.1f} ms"
                     + (f", bubble {t.bubble_s * 1e3:.1f} ms" if t.bubble_s else ""))
        lines.append(f"  {'':<15} modelled memory: params {m.params_bytes / MiB:.1f}, grads "
                     f"{m.grads_bytes / MiB:.1f}, optimizer {m.optimizer_bytes / MiB:.1f}, "
                     f"activations {m.activations_bytes / MiB:.1f}, buffers "
                     f"{m.buffers_bytes / MiB:.1f} (+ margin {m.margin_bytes / MiB:.1f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", help="a cluster profile (.toml) instead of calibrating")
    args = parser.parse_args()
    # Every spawned rank (calibration and training) inherits this: one thread per rank.
    os.environ["OMP_NUM_THREADS"] = str(THREADS)

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    cluster = calibrated_cluster(args.nproc, args.profile)
    t_cal = time.perf_counter() - t0
    graph = layer_graph()
    planned = [(case, *make_plan(graph, cluster, case)) for case in CASES]
    per_rank = spawn(measure_job, args.nproc, [p.to_json() for _, p, _ in planned],
                     args.steps, args.warmup, timeout_s=1200)
    sustained = min(r[0][0] for r in per_rank)
    bare = min(r[0][1] for r in per_rank)
    rows = []
    for i, (case, plan, pred) in enumerate(planned):
        results = [r[i + 1] for r in per_rank]
        rows.append((case, plan, pred, Measured(step_s=results[0][0],
                                                peak_bytes=[r[1] for r in results],
                                                peak_parts=[r[2] for r in results])))
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    print(f"{MODEL} {CONFIG}, global batch {BATCH}, seq {SEQ}, float32, AdamW; "
          f"{args.nproc} CPU ranks (gloo), {THREADS} thread each; {platform.node()}, {when}")
    print(f"cluster: {cluster.source} (calibration {t_cal:.0f} s)")
    d, link = cluster.device, cluster.intra_node
    print(f"  float32 peak x eff {d.peak('float32') * gemm_efficiency(d, 'float32') / 1e9:.1f} GFLOP/s, "
          f"half_dim {d.half_dim('float32'):.0f}, memory {d.memory_bandwidth_GBps:.2f} GB/s, "
          f"kernel floor {d.kernel_floor_s * 1e6:.1f} us, attention at "
          f"{d.attention_efficiency:.2f}x the GEMM rate, loss at {d.loss_efficiency:.2f}x the "
          f"memory bandwidth, link {link.bandwidth_GBps:.3f} GB/s "
          f"+ {link.latency_s * 1e6:.0f} us (all_reduce fit)")
    print(f"  host: FSDP2 {d.fsdp_overhead_s * 1e6:.0f} us and TP {d.tp_overhead_s * 1e6:.0f} us per "
          f"module, DTensor {d.dtensor_op_overhead_s * 1e6:.0f} us per op; collective skew "
          f"{d.collective_skew_s * 1e6:.0f} us"
          + "".join(f", {t * 1e6:.0f} us at {n / MiB:g} MiB" for n, t in d.collective_skew_at))
    print(f"  cross-check: float32 Linear {SUSTAINED_GEMM[0]} forward + backward, every rank for "
          f"{SUSTAINED_GEMM[1]:.0f} s at once: {sustained / 1e9:.1f} GFLOP/s per rank "
          f"(slowest rank; measured); a bare torch.mm of that size: {bare / 1e9:.1f}")
    for kind, fit in cluster.collective_links.items():
        print(f"  {kind} link (its own fit, used for it): "
              f"{fit.bandwidth_GBps:.3f} GB/s + {fit.latency_s * 1e6:.0f} us")
    print(format_table(rows))
    print(f"(time: median of {args.steps} steps after {args.warmup} warm-up, slowest rank; "
          "memory: fullest rank, MemTracker peak of live tensor bytes over one step; "
          "predicted memory excludes the allocator margin)")
    print(format_details(rows))
    print(f"load average (1, 5, 15 min) before: {_load(load_before)}; after: "
          f"{_load(os.getloadavg())} (this bench's {args.nproc} ranks add about {args.nproc}); "
          f"total {time.perf_counter() - t0:.0f} s")


def _load(avg: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in avg)


if __name__ == "__main__":
    main()
