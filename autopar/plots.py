"""Pictures of a plan (matplotlib, the optional ``report`` extra; Agg backend, no display).

- ``plot_memory``: stacked per-rank memory (parameters, gradients, optimizer states,
  activations, buffers, margin) against the device's capacity;
- ``plot_step_time``: the step split into compute, exposed communication and bubble, for
  the plan and the best alternatives the search considered;
- ``plot_schedule``: a pipeline schedule ``Timeline`` as a Gantt chart (one row per rank);
- ``plot_scaling``: modelled throughput against the number of GPUs.

Each returns the path it wrote. All numbers are the cost model's (titles say so).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from autopar.errors import ConfigError
from autopar.whatif import ScalingPoint
from cost_models.schedule import StageTimes, Timeline, simulate
from runtime.files import write_atomic
from runtime.plan import Plan
from runtime.plan_report import GiB, rank_memory, shape
from runtime.schedule_orders import runtime_orders

MEMORY_PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"),
                ("optimizer_bytes", "optimizer states"), ("activations_bytes", "activations"),
                ("buffers_bytes", "buffers"), ("margin_bytes", "allocator margin"))
ACTION_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError("plots need matplotlib: pip install 'autopar[report]'") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    # A fixed creation date keeps committed PNGs byte-stable between runs.
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)
    return write_atomic(path, buf.getvalue())


def _source(plan: Plan) -> str:
    return plan.prediction.source if plan.prediction else "modelled"


def plot_memory(plan: Plan, path: str | os.PathLike) -> Path:
    rows = rank_memory(plan)
    if not rows:
        raise ConfigError("the plan has no prediction: nothing to plot")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.5 * len(rows)))
    labels = [label for label, _ in rows]
    left = [0.0] * len(rows)
    for attr, name in MEMORY_PARTS:
        values = [getattr(m, attr) / GiB for _, m in rows]
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    cap = plan.prediction.capacity_bytes / GiB
    ax.axvline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(cap, -0.45, f"capacity {cap:.0f} GiB ", va="top", ha="right", fontsize="small")
    ax.set_xlabel("GiB per rank")
    ax.set_title(f"{plan.model}: per-rank memory [{_source(plan)}]")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize="small")
    return _save(fig, path)


def plot_step_time(plan: Plan, path: str | os.PathLike, *, top_k: int = 4) -> Path:
    p = plan.prediction
    if p is None:
        raise ConfigError("the plan has no prediction: nothing to plot")
    plt = _pyplot()
    labels = [f"this plan\n{shape(plan.mesh, plan.pipeline)}"]
    parts = [(p.compute_s, p.comm_s, p.bubble_s)]
    others = []
    if plan.rationale:
        others = [a for a in plan.rationale.alternatives
                  if a.step_time_s is not None and (a.mesh, a.pipeline) != (plan.mesh, plan.pipeline)]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * (1 + len(others[:top_k]))))
    left = [0.0]
    for i, (name, colour) in enumerate((("compute", "#4C72B0"), ("exposed communication",
                                        "#DD8452"), ("pipeline bubble", "#C44E52"))):
        values = [x[i] * 1e3 for x in parts]
        ax.barh(labels, values, left=left, label=name, color=colour)
        left = [a + b for a, b in zip(left, values, strict=True)]
    for alt in others[:top_k]:
        ax.barh([f"alternative\n{shape(alt.mesh, alt.pipeline)}"], [alt.step_time_s * 1e3],
                color="#BBBBBB")
    ax.set_xlabel("ms per step")
    ax.set_title(f"{plan.model}: step time [{_source(plan)}]")
    ax.invert_yaxis()
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    return _save(fig, path)


def plot_schedule(timeline: Timeline, path: str | os.PathLike, *, title: str = "") -> Path:
    if not timeline.slots:
        raise ConfigError("the timeline has no slots: nothing to plot")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.45 * timeline.num_ranks))
    for slot in timeline.slots:
        width = (slot.end_s - slot.start_s) * 1e3
        ax.broken_barh([(slot.start_s * 1e3, width)], (slot.rank - 0.4, 0.8),
                       facecolors=ACTION_COLOURS.get(slot.action, "grey"), edgecolor="white")
        ax.text(slot.start_s * 1e3 + width / 2, slot.rank, slot.label, ha="center",
                va="center", fontsize=6, color="white", clip_on=True)
    ax.set_yticks(range(timeline.num_ranks),
                  [f"pp rank {r}" for r in range(timeline.num_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ACTION_COLOURS.values()]
    ax.legend(handles, ["forward", "backward", "weight grad"], fontsize="small",
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    ax.set_title(title or f"{timeline.schedule}, {timeline.num_microbatches} micro-batches: "
                 f"bubble {timeline.bubble_fraction:.1%} [modelled]")
    return _save(fig, path)


def plan_timeline(plan: Plan) -> Timeline | None:
    """A simulated step of the plan's pipeline (None without pipelining).

    Stage times come from the plan's per-layer times (forward + backward), split one third
    forward, two thirds backward (backward does twice the forward's FLOPs), per micro-batch.
    """
    if plan.mesh.pp == 1 or plan.pipeline is None:
        return None
    m = plan.pipeline.num_microbatches
    per_stage = [0.0] * plan.num_stages
    for layer in plan.layers:
        per_stage[layer.stage] += (layer.time_s or 0.0) / m
    stages = [StageTimes(fwd_s=t / 3, bwd_s=2 * t / 3) for t in per_stage]
    return simulate(plan.pipeline.schedule, plan.mesh.pp, m, stages,
                    orders=runtime_orders(plan.pipeline.schedule, plan.mesh.pp,
                                          plan.pipeline.virtual_stages, m))


def plot_scaling(points: list[ScalingPoint], path: str | os.PathLike, *, title: str = "",
                 seq_len: int | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ok = [p for p in points if p.samples_per_s is not None]
    scale = seq_len or 1
    unit = "tokens/s" if seq_len else "samples/s"
    if ok:
        ax.plot([p.gpus for p in ok], [p.samples_per_s * scale for p in ok], "o-",
                label="best plan")
        base = ok[0]
        ax.plot([p.gpus for p in ok], [base.samples_per_s * scale * p.gpus / base.gpus
                                       for p in ok], ":", color="grey", label="linear")
        for p in ok:
            ax.annotate(p.shape, (p.gpus, p.samples_per_s * scale), fontsize=6,
                        textcoords="offset points", xytext=(3, -9))
    for p in points:
        if p.samples_per_s is None:
            ax.axvline(p.gpus, color="#C44E52", alpha=0.3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel(unit)
    ax.set_title(title or "throughput vs GPUs [modelled]; red: no plan fits")
    ax.legend(fontsize="small")
    return _save(fig, path)


def write_plots(plan: Plan, out_dir: str | os.PathLike, *,
                scaling: list[ScalingPoint] | None = None,
                timeline: Timeline | None = None) -> list[Path]:
    """Every picture that applies to ``plan`` into ``out_dir``; returns the paths. The
    schedule is ``timeline`` (the planner's simulation) when given, else re-simulated from
    the plan's per-layer times (``plan_timeline``, for plans loaded from a file)."""
    out = Path(out_dir)
    paths = [plot_memory(plan, out / "memory.png"), plot_step_time(plan, out / "step_time.png")]
    timeline = timeline or plan_timeline(plan)
    if timeline is not None:
        paths.append(plot_schedule(timeline, out / "schedule.png"))
    if scaling:
        paths.append(plot_scaling(scaling, out / "scaling.png", seq_len=plan.seq_len,
                                  title=f"{plan.model}, global batch {plan.global_batch}: "
                                  "throughput vs GPUs [modelled]"))
    return paths
