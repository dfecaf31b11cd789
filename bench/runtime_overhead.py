"""Runtime overhead: one plan run by autopar and by a hand-written torch-native program.

    python bench/runtime_overhead.py                    # 4 CPU ranks: DDP, FSDP2, TP, 1F1B
    python bench/runtime_overhead.py --nproc 2 --steps 30
    python bench/runtime_overhead.py --plans tp,pipeline --schedule GPipe --microbatches 8

For each plan, every rank builds two programs from the same seeded model: autopar's
(``autopar.lower.make_trainer`` with a ``runtime.plan.Plan`` fixing the strategies) and the
program a user would write against torch directly, following torchtitan's examples:

    ddp       DistributedDataParallel(model), each rank on its slice of the batch
    fsdp      fully_shard on each planned layer (embeddings, every block, final norm, head),
              then on the root, over a 1-D mesh of every rank
    tp        parallelize_module on each block: q/k/v and fc_in ColwiseParallel, out_proj
              and fc_out RowwiseParallel over a 1-D mesh of every rank (pure TP)
    pipeline  the model cut into one stage module per rank as the plan cuts it, a manual
              PipelineStage and the plan's Schedule class with its micro-batch count

Both use AdamW(lr=1e-3) and ``zero_grad(set_to_none=True)``. The hand-written step returns
its local loss tensor and syncs nothing else (torchtitan all-reduces the loss only on
logging steps); autopar's ``train_step`` returns the global mean loss as a float.

Timing: the programs take turns step by step on the same batches (A B, then B A, so
neither always runs first), each step timed from a barrier to the slowest rank's end
(all_reduce MAX), and its CPU time summed over the ranks' processes; the table gives the
medians of ``--steps`` steps per program after ``--warmup``, their ratios, and the median
of the per-step wall ratios ("paired"). CPU time leaves out waiting, so on a machine that
other jobs load it still measures each program's own work. Equal work is checked first:
every program's global loss on step 1 (same init, same batch) must agree with autopar's
to 1e-5 relative, and every later step's too (all train the same model on the same
data); a warning is printed when they do not.

``--explain`` attributes a gap: two more variants of the hand-written program join the
rotation, "+sync" (its step followed by the loss all-reduce and ``.item()`` autopar's
``train_step`` does) and "+engine+sync" (that, with the engine configured as autopar's
runtime configures it for the plan: DDP's gradients as bucket views; the FSDP2 units
autopar wraps a TP model or a pipeline stage in at dp = 1); under the TP plan also
"+repl+sync", with only the FSDP2 units of the replicated layers (embeddings, final norm,
head), whose gradients they all-reduce over the tp ranks.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

MODEL = "gpt-small"
CONFIG = dict(n_layer=6, n_head=8, n_embd=128, vocab_size=1024)
"""gpt-small with 6 blocks (8 cut units: the embeddings, 6 blocks, the head, which fill 2 or
4 pipeline stages evenly) and 8 heads (divisible by tp = 2 and 4)."""
BATCH, SEQ = 16, 64
THREADS = 1
"""Intra-op threads per rank: ranks share the machine's cores (bench/pipeline_step.py)."""
BLOCK_TP = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
            "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}
LOSS_RTOL = 1e-5
PLANS = ("ddp", "fsdp", "tp", "pipeline")


def spec():
    from autopar.zoo import get_model

    return get_model(MODEL).with_config(**CONFIG)


# -- the plans (autopar's side) ---------------------------------------------------------------

def unit_names() -> list[tuple[str, ...]]:
    """The GPT's planned layers in execution order, grouped as pipeline cut units."""
    return [("wte", "wpe")] + [(f"h.{i}",) for i in range(CONFIG["n_layer"])] + \
        [("ln_f", "lm_head")]


def make_plan(kind: str, world: int, *, schedule: str, microbatches: int) -> Plan:
    """The plan of one row: every layer's strategy fixed, the mesh all on one axis."""
    names = [n for unit in unit_names() for n in unit]
    if kind in ("ddp", "fsdp"):
        strategy = "replicate" if kind == "ddp" else "fsdp"
        return Plan(model=MODEL, cluster="local", global_batch=BATCH, seq_len=SEQ,
                    mesh=Mesh(dp=world), layers=tuple(LayerPlan(module=n, strategy=strategy)
                                                      for n in names))
    if kind == "tp":
        layers = tuple(LayerPlan(module=n, strategy="tp", tp_styles=BLOCK_TP)
                       if n.startswith("h.") else LayerPlan(module=n) for n in names)
        return Plan(model=MODEL, cluster="local", global_batch=BATCH, seq_len=SEQ,
                    mesh=Mesh(tp=world), layers=layers)
    units = unit_names()
    layers = tuple(LayerPlan(module=n, stage=i * world // len(units))
                   for i, unit in enumerate(units) for n in unit)
    return Plan(model=MODEL, cluster="local", global_batch=BATCH, seq_len=SEQ,
                mesh=Mesh(pp=world), layers=layers,
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=microbatches))


# -- the hand-written programs ------------------------------------------------------------------

@dataclass
class Program:
    """A hand-written training step: ``step(inputs, targets)`` -> this rank's loss (a 0-dim
    tensor, or None on a pipeline rank without the last stage); ``global_loss`` turns it
    into the mean over the global batch on every rank (collective; for the check only)."""

    step: Callable[[tuple, torch.Tensor], torch.Tensor | None]
    global_loss: Callable[[torch.Tensor | None], float]


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _data_parallel_step(model: nn.Module, loss_fn, optimizer) -> Program:
    """Every rank trains on its slice of the global batch; the loss is the mean of theirs."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        per = targets.size(0) // world
        rows = slice(rank * per, (rank + 1) * per)
        loss = loss_fn(model(inputs[0][rows]), targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Program(step, _mean_over_world)


def _mean_over_world(loss: torch.Tensor) -> float:
    total = loss.clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def hand_ddp(model: nn.Module, plan: Plan, loss_fn, *, engine: bool = False) -> Program:
    """``engine``: DDP as autopar configures it (gradients as views of the buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=engine)
    return _data_parallel_step(ddp, loss_fn, _adamw(ddp.parameters()))


def hand_fsdp(model: nn.Module, plan: Plan, loss_fn) -> Program:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in plan.layers:
        fully_shard(model.get_submodule(layer.module), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _data_parallel_step(model, loss_fn, _adamw(model.parameters()))


def hand_tp(model: nn.Module, plan: Plan, loss_fn, *, engine: bool = False,
            replicated_only: bool = False) -> Program:
    """Every rank runs the whole batch; the blocks' Linears are split Megatron-style.

    ``engine``: then FSDP2 units as autopar's runtime adds them for this plan (mesh dp=1):
    each block on a (1, 1) HSDP mesh sharing the tp mesh's root (nothing to communicate),
    each replicated layer and the root on a (world, 1) HSDP mesh, whose gradients are
    all-reduced over the tp ranks. ``replicated_only``: only the latter units."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    if engine:
        mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("rep", "shard", "tp"))
        tp_mesh = mesh["tp"]
    else:
        tp_mesh = init_device_mesh("cpu", (world,))
    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in model.h:
        parallelize_module(block, tp_mesh, {sub: style[s]() for sub, s in BLOCK_TP.items()})
    if engine or replicated_only:
        replicas = init_device_mesh("cpu", (world, 1), mesh_dim_names=("world", "one"))
        for layer in plan.layers:
            if layer.strategy != "tp" or not replicated_only:
                fully_shard(model.get_submodule(layer.module), reshard_after_forward=False,
                            mesh=mesh["rep", "shard"] if layer.strategy == "tp" else replicas)
    if engine:  # the root holds no parameter of its own here: every layer is planned
        fully_shard(model, mesh=replicas, reshard_after_forward=False)
    optimizer = _adamw(model.parameters())

    def step(inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Program(step, _mean_over_world)


class GPTStage(nn.Module):
    """Some blocks of the zoo GPT, with the embeddings on the first stage and the final
    norm and head on the last: torchtitan's per-stage model (the other stages' modules
    left out), written for this model's forward."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.wte, self.wpe = (model.wte, model.wpe) if first else (None, None)
        self.h = nn.ModuleList(model.h[i] for i in blocks)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h:
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def hand_pipeline(model: nn.Module, plan: Plan, loss_fn, *, engine: bool = False) -> Program:
    """One stage per rank, cut where the plan cuts; the plan's schedule and micro-batches.

    ``engine``: each of the stage's planned layers and the stage itself in an FSDP2 unit on
    a (1, 1) HSDP mesh, kept unsharded through the step, as autopar's runtime does at dp=1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [la.module for la in plan.layers if la.stage == rank]
    blocks = [int(n.split(".")[1]) for n in mine if n.startswith("h.")]
    first, last = rank == 0, rank == world - 1
    module = GPTStage(model, blocks, first, last)
    if engine:
        mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("pp", "rep", "shard"))
        for name in mine:
            fully_shard(model.get_submodule(name), mesh=mesh["rep", "shard"],
                        reshard_after_forward=False)
        fully_shard(module, mesh=mesh["rep", "shard"], reshard_after_forward=False)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[plan.pipeline.schedule]
    schedule = cls(stage, plan.pipeline.num_microbatches, loss_fn=loss_fn)
    optimizer = _adamw(module.parameters())

    def step(inputs: tuple, targets: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(inputs[0], return_outputs=False)
        elif last:
            schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if last else None

    def global_loss(loss: torch.Tensor | None) -> float:
        total = loss.clone() if loss is not None else torch.zeros(())
        dist.all_reduce(total)
        return total.item()

    return Program(step, global_loss)


HAND_WRITTEN = {"ddp": hand_ddp, "fsdp": hand_fsdp, "tp": hand_tp, "pipeline": hand_pipeline}
WITH_ENGINE = ("ddp", "tp", "pipeline")
"""Plans whose hand-written program ``engine=True`` turns into autopar's choice of engine
configuration; under the FSDP plan both programs already configure FSDP2 alike."""


def with_loss_sync(program: Program) -> Program:
    """The program's step followed by what autopar's ``train_step`` adds: the loss
    all-reduced over every rank and read back as a float."""

    def step(inputs: tuple, targets: torch.Tensor) -> torch.Tensor | None:
        loss = program.step(inputs, targets)
        program.global_loss(loss)
        return loss

    return Program(step, program.global_loss)


def programs(kind: str, plan: Plan, explain: bool) -> dict[str, Program]:
    """The hand-written program of ``kind`` and, with ``explain``, its variants that add
    autopar's extra work one piece at a time; each on a fresh model of the same seed."""
    model_spec = spec()
    build = HAND_WRITTEN[kind]
    out = {"hand": build(model_spec.build(seed=0), plan, model_spec.loss_fn)}
    if explain:
        out["+sync"] = with_loss_sync(build(model_spec.build(seed=0), plan, model_spec.loss_fn))
        if kind == "tp":
            out["+repl+sync"] = with_loss_sync(build(model_spec.build(seed=0), plan,
                                                     model_spec.loss_fn, replicated_only=True))
        if kind in WITH_ENGINE:
            out["+engine+sync"] = with_loss_sync(
                build(model_spec.build(seed=0), plan, model_spec.loss_fn, engine=True))
    return out


# -- measurement (every rank) -------------------------------------------------------------------

def timed(fn: Callable[..., object], *args: object) -> tuple[float, float, object]:
    """``fn(*args)`` started together on every rank: (the slowest rank's wall time, the CPU
    time of every rank's process summed, all threads; its result). CPU time leaves out
    waiting (for peers, and for cores other processes hold), so it measures the work a
    program does even on a machine loaded by other jobs."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    wall = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    work = torch.tensor(time.process_time() - cpu, dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(work)
    return wall.item(), work.item(), out


@dataclass(frozen=True)
class Row:
    plan: str
    mesh: str
    wall_s: dict[str, float]
    """Per program ('autopar', 'hand', with --explain '+sync', '+engine+sync'): the median
    step, slowest rank per step (measured)."""
    cpu_s: dict[str, float]
    """Per program: the median step's CPU time, summed over the ranks (measured)."""
    paired_ratio: float
    """Median over steps of autopar's wall time / the hand-written one on the same batch:
    the two ran back to back, so load that drifts over the run cancels in each pair."""
    first_losses: tuple[float, float]
    """Step 1's global loss: (autopar, hand-written)."""
    worst_loss_rel: float
    """Largest relative difference of any program's loss from autopar's, over all steps."""

    @property
    def ratio(self) -> float:
        return self.wall_s["autopar"] / self.wall_s["hand"]

    @property
    def cpu_ratio(self) -> float:
        return self.cpu_s["autopar"] / self.cpu_s["hand"]


def measure_job(kinds: list[str], plan_jsons: list[str], steps: int, warmup: int,
                explain: bool) -> list[tuple]:
    """On every rank, per plan: ({program: [(wall s, CPU s) per timed step]}, per step
    {program: global loss}). The programs take turns on each batch, in an order rotated
    every step."""
    from autopar.lower import make_trainer

    torch.set_num_threads(THREADS)
    model_spec = spec()
    out = []
    for kind, text in zip(kinds, plan_jsons, strict=True):
        plan = Plan.from_json(text)
        trainer = make_trainer(model_spec.build(seed=0), plan, model_spec.loss_fn,
                               model_spec.example_inputs(BATCH, SEQ), device_type="cpu")
        progs = {"autopar": Program(trainer.train_step, float), **programs(kind, plan, explain)}
        names = list(progs)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        losses = []
        for step in range(1 + warmup + steps):  # step 0: the equal-loss check, untimed
            inputs, targets = model_spec.make_batch(BATCH, SEQ, seed=step)
            shift = step % len(names)
            result = {}
            for name in names[shift:] + names[:shift]:
                wall, cpu, result[name] = timed(progs[name].step, inputs, targets)
                if step > warmup:
                    times[name].append((wall, cpu))
            losses.append({name: progs[name].global_loss(result[name]) for name in names})
        out.append((times, losses))
        del trainer, progs
        gc.collect()
    return out


def run(kinds: tuple[str, ...], *, nproc: int, steps: int, warmup: int, schedule: str,
        microbatches: int, explain: bool = False) -> list[Row]:
    from runtime.launch import spawn

    plans = [make_plan(k, nproc, schedule=schedule, microbatches=microbatches) for k in kinds]
    results = spawn(measure_job, nproc, list(kinds), [p.to_json() for p in plans], steps,
                    warmup, explain, timeout_s=1800)[0]
    rows = []
    for kind, plan, (times, losses) in zip(kinds, plans, results, strict=True):
        rel = max(abs(v - step["autopar"]) / abs(step["autopar"])
                  for step in losses for v in step.values())
        mesh = plan.mesh.describe(sep=" ")
        if plan.pipeline is not None:
            mesh += f" {plan.pipeline.schedule} m={plan.pipeline.num_microbatches}"
        paired = statistics.median(a[0] / h[0] for a, h in zip(times["autopar"], times["hand"],
                                                               strict=True))
        rows.append(Row(kind, mesh, {k: statistics.median(w for w, _ in v)
                                     for k, v in times.items()},
                        {k: statistics.median(c for _, c in v) for k, v in times.items()},
                        paired, (losses[0]["autopar"], losses[0]["hand"]), rel))
    return rows


def format_table(rows: list[Row]) -> str:
    """Wall-clock and CPU columns; with --explain, the variants as 'wall / CPU' ms."""
    extra = [k for k in ("+sync", "+repl+sync", "+engine+sync")
             if any(k in r.wall_s for r in rows)]
    head = (f"{'plan':<9} {'mesh':<24} {'autopar':>8} {'hand':>8} {'ratio':>6} {'paired':>6}"
            f" {'autopar CPU':>11} {'hand CPU':>9} {'ratio':>6}"
            + "".join(f"{'hand' + k:>20}" for k in extra))
    lines = [head, "-" * len(head)]
    for r in rows:
        w, c = r.wall_s, r.cpu_s
        cells = "".join(f"{f'{1e3 * w[k]:.1f} / {1e3 * c[k]:.1f}':>20}" if k in w
                        else f"{'-':>20}" for k in extra)
        lines.append(f"{r.plan:<9} {r.mesh:<24} {1e3 * w['autopar']:>8.1f} "
                     f"{1e3 * w['hand']:>8.1f} {r.ratio:>6.3f} {r.paired_ratio:>6.3f} "
                     f"{1e3 * c['autopar']:>11.1f} {1e3 * c['hand']:>9.1f} {r.cpu_ratio:>6.3f}"
                     + cells)
    return "\n".join(lines)


def format_losses(rows: list[Row]) -> str:
    return "\n".join(f"  {r.plan:<9} step-1 loss autopar {r.first_losses[0]:.6f}, hand-written "
                     f"{r.first_losses[1]:.6f}; largest relative difference of any program "
                     f"from autopar over all steps {r.worst_loss_rel:.1e}" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="CPU ranks (gloo); 2 or 4")
    parser.add_argument("--plans", default=",".join(PLANS),
                        help=f"comma-separated, from {', '.join(PLANS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per program")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedule", default="1F1B", choices=("1F1B", "GPipe"))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--explain", action="store_true",
                        help="also time the hand-written program plus autopar's loss sync, "
                             "and plus its engine configuration (FSDP2 units, DDP buckets)")
    args = parser.parse_args()
    kinds = tuple(k.strip() for k in args.plans.split(",") if k.strip())
    unknown = [k for k in kinds if k not in PLANS]
    if unknown or args.nproc not in (2, 4):
        parser.error(f"--plans from {', '.join(PLANS)} (got {unknown}); --nproc 2 or 4")
    rows = run(kinds, nproc=args.nproc, steps=args.steps, warmup=args.warmup,
               schedule=args.schedule, microbatches=args.microbatches, explain=args.explain)
    print(f"{MODEL} {CONFIG}, global batch {BATCH}, seq {SEQ}, {args.nproc} CPU ranks (gloo), "
          f"{THREADS} thread each; {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}")
    print(format_table(rows))
    print(f"(ms per step, median of {args.steps} steps per program after {args.warmup} "
          "warm-up, programs alternated on the same batches; wall: slowest rank, CPU: summed "
          "over ranks; ratio = autopar / hand-written, paired = median of per-step wall "
          "ratios)")
    print("equal work:")
    print(format_losses(rows))
    for r in rows:
        if r.worst_loss_rel > LOSS_RTOL:
            print(f"WARNING: {r.plan}: a program's loss differs from autopar's by up to "
                  f"{r.worst_loss_rel:.1e} (relative); they do not do equal work")


if __name__ == "__main__":
    main()
