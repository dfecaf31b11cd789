"""The advisor's question: how fast is the job I run now, and how much faster is autopar's
plan? Both plans are priced by the same cost model on the same layer graph and cluster:
the job's as ``autopar.planner.published.evaluate`` prices published Megatron-LM runs
(Megatron's own data parallelism, not FSDP2's copies and waits), autopar's by its search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.exports.megatron_import import plan_from_megatron, read_megatron_args
from autopar.planner.published import evaluate
from autopar.planner.search import search
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.records import LayerGraph
from runtime.plan import Plan


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """The job's plan and autopar's, each with its modelled step time."""

    job: Plan
    job_step_s: float
    job_peak_bytes: float
    """The job's fullest rank, allocator margin included (modelled)."""
    capacity_bytes: int
    ours: Plan
    ours_step_s: float
    notes: tuple[str, ...] = ()
    engine: str = "Megatron-LM"
    """The engine that runs the job, as the first line names it."""

    @property
    def speedup(self) -> float:
        """How many times faster autopar's plan steps (1.25: 25% faster)."""
        return self.job_step_s / self.ours_step_s

    @property
    def job_fits(self) -> bool:
        return self.job_peak_bytes <= self.capacity_bytes


def compare_megatron(argv: str | Sequence[str], graph: LayerGraph, cluster: Cluster, *,
                     time_limit_s: float = 10.0) -> Comparison:
    """The Megatron-LM job ``argv`` describes on ``cluster``, priced next to autopar's plan
    for the same graph (captured at the job's global batch) and precision."""
    job = read_megatron_args(argv, cluster.world_size)
    plan, notes = plan_from_megatron(job, graph, model=graph.model_name, cluster=cluster.name)
    priced = evaluate(graph, cluster, precision(job.param_dtype), plan)
    ours = search(graph, cluster, precision_name=job.param_dtype,
                  time_limit_s=time_limit_s).plan
    assert ours.prediction is not None  # the search always predicts its plan
    return Comparison(job=plan, job_step_s=priced.step_time_s,
                      job_peak_bytes=priced.peak_memory_bytes,
                      capacity_bytes=cluster.device.memory_bytes, ours=ours,
                      ours_step_s=ours.prediction.step_time_s, notes=tuple(notes))


def format_comparison(c: Comparison) -> str:
    """A few lines for the command line."""
    gib = 2**30
    fits = "fits" if c.job_fits else "does NOT fit"
    lines = [
        f"{c.engine + ' job:':<16} mesh {c.job.mesh.describe()}, step {c.job_step_s:.3f} s "
        f"(modelled), peak {c.job_peak_bytes / gib:.1f} GiB of "
        f"{c.capacity_bytes / gib:.0f} GiB ({fits})",
        f"autopar's plan:  mesh {c.ours.mesh.describe()}, step {c.ours_step_s:.3f} s "
        f"(modelled)",
        f"predicted gain:  {c.speedup:.2f}x ({1 - 1 / c.speedup:.1%} less step time)"
        if c.speedup >= 1 else
        f"predicted gain:  none (the job's configuration is {1 / c.speedup:.2f}x faster "
        "by the model than the plan the search found in its time limit)",
    ]
    lines += [f"note: {n}" for n in c.notes]
    return "\n".join(lines)
