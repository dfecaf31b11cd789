"""``autopar plan --from-torchtitan ARGS``: the torchtitan job priced next to autopar's plan.

torchtitan runs FSDP2 and ``torch.distributed.pipelining``, the engines of autopar's own
runtime, so the job's plan is priced exactly as the planner prices its own plans (per-layer
costs, FSDP2's copies and waits included; the schedule simulator for pipelines), unlike a
Megatron-LM job, whose own data parallelism ``compare_megatron`` prices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopar.exports.compare import Comparison, format_comparison
from autopar.exports.torchtitan_import import plan_from_torchtitan, read_torchtitan_args
from autopar.planner.engine import evaluate_plan
from autopar.planner.search import search
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from cost_models.memory import Precision, precision
from passes.layer_graph import build_layer_graph
from passes.records import LayerGraph
from runtime import async_tp
from runtime.plan import Plan


def price(graph: LayerGraph, cluster: Cluster, prec: Precision, plan: Plan) -> tuple[float, float]:
    """The modelled step time (s) and fullest rank's memory (bytes, allocator margin
    included) of ``plan`` on autopar's engines (``Engine.evaluate``, as the search prices
    its own outcomes)."""
    outcome = evaluate_plan(graph, cluster, prec, plan)
    return outcome.step_time_s, outcome.peak_bytes()


def compare_torchtitan(argv: str | Sequence[str], graph: LayerGraph, cluster: Cluster, *,
                       time_limit_s: float = 10.0) -> Comparison:
    """The torchtitan job ``argv`` describes on ``cluster``, priced next to autopar's plan
    for the same graph (captured at the job's global batch and sequence length) and
    precision."""
    job = read_torchtitan_args(argv, cluster.world_size)
    plan, notes = plan_from_torchtitan(job, graph, model=graph.model_name, cluster=cluster.name)
    plan = _async_tp_on(cluster, plan, notes)
    step_s, peak = price(graph, cluster, precision(plan.param_dtype), plan)
    ours = search(graph, cluster, precision_name=plan.param_dtype,
                  time_limit_s=time_limit_s).plan
    assert ours.prediction is not None  # the search always predicts its plan
    return Comparison(job=plan, job_step_s=step_s, job_peak_bytes=peak,
                      capacity_bytes=cluster.device.memory_bytes, ours=ours,
                      ours_step_s=ours.prediction.step_time_s, notes=tuple(notes),
                      engine="torchtitan")


def _async_tp_on(cluster: Cluster, plan: Plan, notes: list[str]) -> Plan:
    """The job's plan, without async TP where the cluster cannot run it (said in a note)."""
    problem = async_tp.cluster_problem(cluster, plan.mesh.tp)
    if problem is None or not any(la.async_tp for la in plan.layers):
        return plan
    notes.append(f"async TP is priced off: {problem}")
    return dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(la, async_tp=False) for la in plan.layers))


def torchtitan_comparison(torchtitan_args: str, model: str, cluster: Cluster, *,
                          time_limit_s: float = 10.0) -> str:
    """The command's output for a built-in model, captured at the job's global batch and
    sequence length."""
    job = read_torchtitan_args(torchtitan_args, cluster.world_size)
    spec = get_model(model)
    inputs = spec.example_inputs(job.global_batch, job.seq_len, device="meta")
    seq_len = inputs[0].shape[1] if spec.kind == "gpt" else None
    graph = build_layer_graph(spec.build("meta"), inputs, model_name=spec.name, seq_len=seq_len)
    return format_comparison(compare_torchtitan(torchtitan_args, graph, cluster,
                                                time_limit_s=time_limit_s))
