"""Why a plan is what it is: the rationale the planner attaches, per-layer explanations, diffs.

Where the numbers come from: ``attach_rationale`` prices every strategy the planner may give
each class of identical layers on the chosen mesh with the planner's own cost function
(``autopar.planner.engine.class_options`` → ``costs.layer_cost``), and keeps the best other
shapes the outer search tried (``SearchResult.candidates``). Both are stored in the plan
(``Plan.rationale``, per class, not per layer), so ``explain`` works from a saved plan
file without re-planning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.planner.costs import module_unit_count
from autopar.planner.estimators import ANALYTIC, Estimators
from autopar.planner.moe_costs import ep_problem, runtime_problem
from autopar.planner.one_stage import class_options
from autopar.planner.search import SearchResult
from autopar.planner.ties import describe_tie, with_tied_choices
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.records import LayerGraph
from runtime import async_tp
from runtime.data_parallel import uses_ddp
from runtime.plan import (
    Alternative,
    ClassCosts,
    OptionCost,
    PipelineSpec,
    Plan,
    Rationale,
    option_label,
    parse_option,
)
from runtime.plan_report import human_bytes, ms
from runtime.strategies import STRATEGIES, spec

ALTERNATIVES_KEPT = 10
"""Other shapes stored with the plan (the best first); enough for a top-k report."""


# -- the rationale the planner attaches ----------------------------------------------------

def attach_rationale(result: SearchResult, graph: LayerGraph, cluster: Cluster,
                     precision_name: str, estimators: Estimators = ANALYTIC) -> SearchResult:
    """``result`` with ``Plan.rationale`` filled in from the search and the cost model
    (``estimators``: those the search priced options with)."""
    plan = dataclasses.replace(result.plan, rationale=build_rationale(
        result, graph, cluster, precision_name, estimators))
    return dataclasses.replace(result, plan=plan)


def build_rationale(result: SearchResult, graph: LayerGraph, cluster: Cluster,
                    precision_name: str, estimators: Estimators = ANALYTIC) -> Rationale:
    prec = precision(precision_name)
    classes = tuple(
        ClassCosts(layer_class=o.name, count=o.count,
                   options=tuple(_option(c) for c in o.costs.values()))
        for o in with_tied_choices(
            class_options(graph, result.plan.mesh, cluster, prec, result.plan.microbatches,
                          estimators),
            graph, result.plan, cluster, prec, estimators)
    )
    return Rationale(
        model_flops_per_step=float(sum(x.fwd_flops + x.bwd_flops for x in graph.layers)),
        peak_flops_per_device=cluster.device.peak(prec.compute_dtype),
        nodes=cluster.nodes,
        devices_per_node=cluster.devices_per_node,
        memory_margin_fraction=cluster.memory_margin_fraction,
        cluster_provenance=cluster.provenance,
        classes=classes,
        alternatives=ranked_alternatives(result)[:ALTERNATIVES_KEPT],
        ties={m: describe_tie(tie, result.plan) for tie in graph.ties for m in tie.modules if m},
        async_tp_unavailable=(async_tp.cluster_problem(cluster, result.plan.mesh.tp) or ""
                              if result.plan.mesh.tp > 1 else ""),
    )


def _option(cost) -> OptionCost:
    """The plan's record of one option; its parameters include FSDP2's gathered copy
    (``LayerCost.gathered_bytes``), so its resident bytes are the ILP's."""
    return OptionCost(strategy=cost.option, compute_s=cost.compute_s, comm_s=cost.comm_s,
                      hidden_comm_s=cost.hidden_comm_s,
                      params_bytes=int(cost.params_bytes + cost.gathered_bytes),
                      grads_bytes=int(cost.grads_bytes),
                      optimizer_bytes=int(cost.optimizer_bytes),
                      activations_bytes=int(cost.activations_bytes),
                      buffers_bytes=int(cost.buffers_bytes))


def ranked_alternatives(result: SearchResult) -> tuple[Alternative, ...]:
    """Feasible shapes fastest first, then those that do not fit (least memory first), then
    the skipped ones."""
    alts = []
    for c in result.candidates:
        feasible = c.status == "optimal"
        need = getattr(c, "min_memory_bytes", None)
        alts.append(Alternative(
            mesh=c.mesh, status=c.status,
            step_time_s=c.objective_s if feasible else None,
            min_memory_bytes=int(need) if need is not None and not feasible else None,
            lower_bound_s=(c.lower_bound_s if c.status == "skipped"
                           and c.lower_bound_s < float("inf") else None),
            reason=c.reason, pipeline=_pipeline_of(c)))
    def rank(a: Alternative) -> tuple:
        if a.status == "optimal":
            return (0, a.step_time_s or 0.0)
        if a.lower_bound_s is not None:  # could not win: ranked by its bound
            return (1, a.lower_bound_s)
        return (2 if a.status == "infeasible" else 3, a.min_memory_bytes or 0)
    return tuple(sorted(alts, key=rank))


# -- explain one layer ---------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class OptionVerdict:
    strategy: str
    time_s: float
    delta_time_s: float
    """Per-layer time minus the chosen option's (negative: faster)."""
    memory_bytes: int
    """Resident per-rank memory of this layer under this option."""
    peak_if_switched_bytes: int
    """The plan's per-rank peak if this one layer took this option instead."""
    fits: bool
    chosen: bool


@dataclass(frozen=True, kw_only=True)
class Explanation:
    module: str
    layer_class: str
    class_size: int
    strategy: str
    class_mix: dict[str, int]
    """How many layers of the class take each strategy in this plan."""
    options: tuple[OptionVerdict, ...]
    unavailable: dict[str, str]
    """Strategies the planner could not offer this layer, with the reason."""
    reason: str
    source: str
    expert_parallel: str = ""
    """Why the layer's mixture-of-experts blocks were or were not split over ranks (its
    best expert-parallel option against its best other one), or why expert parallelism
    was not available to it."""
    async_tp: str = ""
    """Why the layer does or does not overlap its sequence-parallel collectives with its
    matmuls (PyTorch's async TP), or why that was not available to it."""


def explain(plan: Plan, module: str, graph: LayerGraph | None = None) -> Explanation:
    """Why ``module`` got its strategy, and what every other option would cost. ``graph``
    (the layer graph the plan was made from, when at hand) lets the expert-parallel part
    name exactly why EP was unavailable; a saved plan alone narrows it down."""
    from autopar.errors import ConfigError

    try:
        layer = plan.layer(module)
    except KeyError:
        names = ", ".join(x.module for x in plan.layers[:8])
        raise ConfigError(f"the plan has no layer {module!r}; its layers: {names}"
                          + (", …" if len(plan.layers) > 8 else "")) from None
    if plan.rationale is None or plan.prediction is None:
        raise ConfigError("this plan carries no rationale (a hand-written or older plan); "
                          "re-plan with `autopar plan --json PATH` to explain it")
    costs = next((c for c in plan.rationale.classes if c.layer_class == layer.layer_class), None)
    if costs is None:
        raise ConfigError(f"the plan's rationale has no costs for class {layer.layer_class!r}")
    by_strategy = {o.strategy: o for o in costs.options}
    chosen = by_strategy[layer.option]
    verdicts = tuple(_verdict(plan, chosen, o) for o in costs.options)
    mix: dict[str, int] = {}
    for x in plan.layers:
        if x.layer_class == layer.layer_class:
            mix[x.option] = mix.get(x.option, 0) + 1
    present = {parse_option(o)["strategy"] for o in by_strategy}
    # A layer has an exact TP split when one of its priced options is tensor-parallel (an
    # option the planner offers only for such a split), or when the graph says so.
    info = next((x for x in graph.layers if x.name == module), None) if graph else None
    tp_split = any(spec(s).tensor_parallel for s in present) or (
        info is not None and info.tp is not None
        and all(d % plan.mesh.tp == 0 for d in info.tp.divisors))
    module_units = module_unit_count(info) if info is not None else 0
    unavailable = {s: _why_unavailable(s, plan, module, tp_split, module_units)
                   for s in STRATEGIES if s not in present}
    return Explanation(module=module, layer_class=layer.layer_class, class_size=costs.count,
                       strategy=layer.option, class_mix=mix, options=verdicts,
                       unavailable=unavailable, reason=_tie_reason(plan, module, verdicts)
                       or _reason(plan, verdicts, mix),
                       source=plan.prediction.source,
                       expert_parallel=_expert_parallel(plan, module, verdicts, graph),
                       async_tp=_async_tp(plan, verdicts))


def _verdict(plan: Plan, chosen: OptionCost, option: OptionCost) -> OptionVerdict:
    assert plan.prediction is not None and plan.rationale is not None
    mu = plan.rationale.memory_margin_fraction
    buffers = [_cost_of(plan, x).buffers_bytes for x in plan.layers]
    current_buffer = max(buffers, default=0)
    # The largest buffer if this layer's own buffer were replaced (a bound: the largest
    # other buffer or the new one).
    others = sorted(buffers)[:-1] if chosen.buffers_bytes == current_buffer else buffers
    new_buffer = max([*others, option.buffers_bytes], default=0)
    delta = (option.resident_bytes - chosen.resident_bytes) + (new_buffer - current_buffer)
    peak = int(plan.prediction.memory.total_bytes + (1 + mu) * delta)
    return OptionVerdict(strategy=option.strategy, time_s=option.time_s,
                         delta_time_s=option.time_s - chosen.time_s,
                         memory_bytes=option.resident_bytes, peak_if_switched_bytes=peak,
                         fits=peak <= plan.prediction.capacity_bytes,
                         chosen=option.strategy == chosen.strategy)


def _cost_of(plan: Plan, layer) -> OptionCost:
    assert plan.rationale is not None
    for c in plan.rationale.classes:
        if c.layer_class == layer.layer_class:
            for o in c.options:
                if o.strategy == layer.option:
                    return o
    raise AssertionError(f"no cost for {layer.module} {layer.option}")


def _why_unavailable(strategy: str, plan: Plan, module: str, tp_split: bool,
                     module_units: int | None) -> str:
    """The spec's reason (runtime.strategies); a strategy available on the mesh but absent
    from the rationale lost to another option on every term."""
    tie = plan.rationale.ties.get(module) if plan.rationale else None
    mesh = plan.mesh
    reason = spec(strategy).unavailable(
        replicas=mesh.replicas, tp=mesh.tp, microbatches=plan.microbatches,
        hsdp_shard_size=plan.hsdp_shard_size, tp_split=tp_split, tie=tie,
        module_units=module_units)
    return reason or "another option is at least as fast and needs no more memory (dominated)"


def _expert_parallel(plan: Plan, module: str, verdicts: tuple[OptionVerdict, ...],
                     graph: LayerGraph | None) -> str:
    """The expert-parallel sentence of ``Explanation``."""
    def degree(v: OptionVerdict) -> int:
        return parse_option(v.strategy)["expert_parallel"]

    with_ep = [v for v in verdicts if degree(v) > 1]
    if with_ep:
        return _ep_verdict(plan, verdicts, with_ep, [v for v in verdicts if degree(v) == 1])
    where = dict(precision=plan.param_dtype, microbatches=plan.gradient_accumulation)
    layer = next((x for x in graph.layers if x.name == module), None) if graph else None
    if layer is not None:
        why = ep_problem(layer, plan.mesh, **where)
        return f"not available: {why}" if why else "not available"
    if plan.mesh.dp == 1:
        return "not available: mesh.dp is 1: no data-parallel ranks to split the experts over"
    runtime = runtime_problem(plan.mesh, **where)
    if runtime:
        return f"not available in this plan: {runtime}"
    return ("not available: this layer holds no mixture-of-experts block the planner "
            "recognises (runtime/moe_blocks.py), or no divisor of mesh.dp="
            f"{plan.mesh.dp} above 1 divides its experts' count")


def _ep_verdict(plan: Plan, verdicts: tuple[OptionVerdict, ...],
                with_ep: list[OptionVerdict], without: list[OptionVerdict]) -> str:
    chosen = next(v for v in verdicts if v.chosen)
    if chosen in with_ep:
        return _ep_chosen(chosen, without)
    best_ep = min(with_ep, key=lambda v: v.time_s)
    if best_ep.time_s >= chosen.time_s:
        return (f"not chosen: the best expert-parallel option, {best_ep.strategy}, takes "
                f"{ms(best_ep.time_s)} per layer against {ms(chosen.time_s)} for "
                f"{chosen.strategy}")
    head = (f"not chosen: {best_ep.strategy} would be {ms(chosen.time_s - best_ep.time_s)} "
            "faster per layer, but ")
    if not best_ep.fits:
        return head + "does not fit in memory"
    if plan.mesh.pp == 1 and uses_ddp(list(plan.layers),
                                      mixed_precision=plan.param_dtype != "float32"):
        return (head + "the plan runs on DDP (every layer replicate, in float32), which is "
                "faster on the whole than FSDP2 and runs no expert parallelism")
    return head + "loses on the whole plan"


def _ep_chosen(chosen: OptionVerdict, without: list[OptionVerdict]) -> str:
    """Why an expert-parallel option won: against the fastest option without EP, and, if
    that one does not fit, the fastest without EP that does."""
    head = f"chosen ({chosen.strategy}, {ms(chosen.time_s)} per layer)"
    if not without:
        return f"{head}: no option without expert parallelism was priced"
    fastest = min(without, key=lambda v: v.time_s)
    fitting = [v for v in without if v.fits]
    best_fit = min(fitting, key=lambda v: v.time_s) if fitting else None
    if fastest.time_s >= chosen.time_s:
        return f"{head}: the best option without it, {fastest.strategy}, takes {ms(fastest.time_s)}"
    if fastest.fits:
        return (f"{head}: {fastest.strategy} without it takes {ms(fastest.time_s)} and would "
                "fit, but loses on the whole plan")
    rest = (f"the fastest that fits, {best_fit.strategy}, takes {ms(best_fit.time_s)}"
            if best_fit else "none without it fits")
    return (f"{head}: the fastest option without it, {fastest.strategy} at "
            f"{ms(fastest.time_s)}, does not fit in memory; {rest}")


def _async_tp(plan: Plan, verdicts: tuple[OptionVerdict, ...]) -> str:
    """The async-TP sentence of ``Explanation``: its best option against the chosen one, or
    why no option had it (the cluster, the mesh, or no sequence-parallel split)."""
    def overlaps(v: OptionVerdict) -> bool:
        return parse_option(v.strategy)["async_tp"]

    chosen = next(v for v in verdicts if v.chosen)
    with_async = [v for v in verdicts if overlaps(v)]
    if overlaps(chosen):
        twin = option_label(**{**parse_option(chosen.strategy), "async_tp": False})
        plain = next((v for v in verdicts if v.strategy == twin), None)
        if plain is None:
            return (f"chosen ({chosen.strategy}): {twin}, the same without it, is no faster in "
                    "any term and needs no less memory (dominated)")
        return (f"chosen ({chosen.strategy}): it hides {ms(plain.time_s - chosen.time_s)} per "
                f"layer of the sequence-parallel collectives that {twin} exposes")
    if with_async:
        best = min(with_async, key=lambda v: v.time_s)
        if best.time_s >= chosen.time_s:
            return (f"not chosen: the best async-TP option, {best.strategy}, takes "
                    f"{ms(best.time_s)} per layer against {ms(chosen.time_s)} for "
                    f"{chosen.strategy} (at these sizes splitting the matmuls costs more than "
                    "it hides)")
        head = f"not chosen: {best.strategy} would be {ms(chosen.time_s - best.time_s)} faster per layer, but "
        return head + ("does not fit in memory" if not best.fits else "loses on the whole plan")
    why = plan.rationale.async_tp_unavailable if plan.rationale else ""
    if plan.mesh.tp == 1:
        why = "the mesh has tp = 1"
    elif not why and not any(parse_option(v.strategy)["sequence_parallel"] for v in verdicts):
        why = ("this layer has no sequence-parallel option, and async TP overlaps sequence "
               "parallelism's all-gathers and reduce-scatters")
    return f"not available: {why}" if why else "not available"


def _tie_reason(plan: Plan, module: str, verdicts: tuple[OptionVerdict, ...]) -> str | None:
    """A tied layer whose own fastest option would fit was given its tie's choice."""
    tie = plan.rationale.ties.get(module) if plan.rationale else None
    if not tie or not any(v.delta_time_s < 0 and v.fits for v in verdicts):
        return None
    chosen = next(v for v in verdicts if v.chosen)
    return (f"{tie} (tied weights), so they are one FSDP2 unit and take one option: "
            f"{chosen.strategy} is the fastest for them together within memory, though not "
            "for this layer alone.")


def _reason(plan: Plan, verdicts: tuple[OptionVerdict, ...], mix: dict[str, int]) -> str:
    chosen = next(v for v in verdicts if v.chosen)
    faster = sorted((v for v in verdicts if v.delta_time_s < 0), key=lambda v: v.delta_time_s)
    if not faster:
        rivals = sorted((v for v in verdicts if not v.chosen), key=lambda v: v.delta_time_s)
        nxt = f"; next best {rivals[0].strategy}, slower by {ms(rivals[0].delta_time_s)}" \
            if rivals else ""
        return f"{chosen.strategy} is the fastest option for this layer{nxt}."
    best = faster[0]
    cap = plan.prediction.capacity_bytes if plan.prediction else 0
    if not best.fits:
        return (f"{best.strategy} would be {ms(-best.delta_time_s)} faster per layer, but the "
                f"plan would need {human_bytes(best.peak_if_switched_bytes)} per rank, "
                f"{human_bytes(best.peak_if_switched_bytes - cap)} more than the device's "
                f"{human_bytes(cap)}: memory binds, so the planner trades time for memory here.")
    if len(mix) > 1:
        return (f"the class is mixed ({_mix_text(mix)}): {best.strategy} is faster and one more "
                "layer of it fits, but not the whole class; the ILP chose the split that is "
                "fastest overall within memory.")
    return (f"{best.strategy} is faster per layer and would fit; the planner's objective also "
            "weighs the whole step (e.g. pipeline stage balance), which this per-layer view omits.")


def _mix_text(mix: dict[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in mix.items())


def format_explanation(e: Explanation) -> str:
    lines = [f"{e.module}: {e.strategy}  (class {e.layer_class}, {e.class_size} layer(s)"
             + (f"; class mix {_mix_text(e.class_mix)}" if len(e.class_mix) > 1 else "") + ")",
             f"why: {e.reason}", "",
             f"options for this layer on the plan's mesh  [{e.source}]"]
    rows = [("strategy", "time", "vs chosen", "mem/rank", "plan peak if switched", "")]
    for v in sorted(e.options, key=lambda v: v.time_s):
        note = "chosen" if v.chosen else ("fits" if v.fits else "does not fit")
        rows.append((v.strategy, ms(v.time_s), "-" if v.chosen else f"{v.delta_time_s * 1e3:+.3f} ms",
                     human_bytes(v.memory_bytes), human_bytes(v.peak_if_switched_bytes), note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    for s, why in e.unavailable.items():
        lines.append(f"  {s}: not available ({why})")
    if e.expert_parallel:
        lines.append(f"expert parallelism: {e.expert_parallel}")
    if e.async_tp:
        lines.append(f"async TP: {e.async_tp}")
    return "\n".join(lines)


def _pipeline_of(candidate) -> PipelineSpec | None:
    """The pipeline section of a pipeline candidate (None for pp = 1 meshes)."""
    if candidate.schedule is None:
        return None
    return PipelineSpec(schedule=candidate.schedule, num_microbatches=candidate.microbatches,
                        virtual_stages=candidate.virtual_stages)

