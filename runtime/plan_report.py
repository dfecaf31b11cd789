"""The plan's printed form: a report a person reads before spending GPU hours on it.

Everything here is computed from the ``Plan`` alone (its prediction, solver certificate and
optional rationale), so a saved plan reports the same as a fresh one. Every number carries
its source in brackets: ``modelled`` (cost model on datasheet figures), ``calibrated``
(cost model on figures measured on the machine) or ``measured``.

Model FLOPs utilisation follows PaLM (Chowdhery et al., 2022, appendix B): the FLOPs the
model needs per step, without recomputation, divided by step time and by the peak FLOP/s
of all devices. The model FLOPs come from the layer graph (forward + backward FLOPs the
annotate pass counted, attention included), not from the 6N + 12·L·H·Q·T closed form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from runtime.plan import (
    LayerPlan,
    MemoryBreakdown,
    Mesh,
    OptionCost,
    PipelineSpec,
    Plan,
    option_label,
    parse_option,
    stage_rank,
)
from runtime.strategies import StrategySpec, spec

GiB = 1024**3


def human_bytes(n: float) -> str:
    """Bytes with a binary unit that keeps three significant figures."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            value = n / size
            return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{n:.0f} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


@dataclass(frozen=True, kw_only=True)
class Totals:
    """The plan's headline numbers, as the report prints them."""

    step_time_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float | None
    """PaLM model FLOPs utilisation; None without the layer graph's FLOPs (no rationale)."""
    peak_memory_bytes: int
    capacity_bytes: int
    source: str


def totals(plan: Plan) -> Totals | None:
    """Headline numbers of a plan with a prediction (None for a hand-written plan)."""
    p = plan.prediction
    if p is None:
        return None
    samples = plan.global_batch / p.step_time_s if p.step_time_s > 0 else 0.0
    tokens = samples * plan.seq_len if plan.seq_len else None
    mfu = None
    r = plan.rationale
    if r is not None and p.step_time_s > 0 and r.peak_flops_per_device > 0:
        mfu = r.model_flops_per_step / (p.step_time_s * plan.world_size * r.peak_flops_per_device)
    return Totals(step_time_s=p.step_time_s, compute_s=p.compute_s, comm_s=p.comm_s,
                  bubble_s=p.bubble_s, samples_per_s=samples, tokens_per_s=tokens, mfu=mfu,
                  peak_memory_bytes=p.memory.total_bytes, capacity_bytes=p.capacity_bytes,
                  source=p.source)


# -- per-layer rows -------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    first: str
    last: str
    count: int
    layer: LayerPlan


def collapse(layers: tuple[LayerPlan, ...]) -> list[Row]:
    """Merge runs of consecutive layers with the same class and strategy into one row."""
    rows: list[Row] = []
    for layer in layers:
        prev = rows[-1] if rows else None
        if (prev and prev.layer.layer_class == layer.layer_class
                and prev.layer.option == layer.option and prev.layer.stage == layer.stage):
            rows[-1] = Row(prev.first, layer.module, prev.count + 1, prev.layer)
        else:
            rows.append(Row(layer.module, layer.module, 1, layer))
    return rows


def _recompute(layer: LayerPlan) -> str:
    return "no" if layer.recompute == "none" else layer.recompute


def _strategy(layer: LayerPlan) -> str:
    """The strategy column: the strategy with +sp and +offload (recompute has its own)."""
    return option_label(layer.strategy, "none", layer.offload, layer.sequence_parallel,
                        async_tp=layer.async_tp)


def shard_degrees(layer: LayerPlan, plan: Plan) -> tuple[int, int]:
    """(tensor-parallel degree, data-parallel shards of its parameters)."""
    s, tp = layer.spec, plan.mesh.tp
    return (tp if s.tensor_parallel else 1,
            s.shard_ranks(plan.mesh.replicas, tp, plan.hsdp_shard_size))


def table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


# -- communication: what is exposed and why ------------------------------------------------

def comm_lines(plan: Plan) -> list[str]:
    """Per class of layers, the communication its option issues in a step, what hides behind
    compute and what is exposed, with why (``why_exposed``). Needs the rationale.

    A pipeline's ranks each run only their stages' layers, so there the figures are one
    rank's: the pipeline rank whose layers of that class expose the most (``n`` counts
    them), which is what a share of the step can be taken of."""
    if plan.rationale is None or plan.prediction is None:
        return []
    groups: dict[tuple[str, str], dict[int, list[OptionCost]]] = {}
    for layer in plan.layers:
        cost = option_cost(plan, layer)
        if cost is not None:
            rank = (0 if plan.pipeline is None
                    else stage_rank(layer.stage, plan.mesh.pp, plan.pipeline))
            groups.setdefault((layer.layer_class, layer.option), {}).setdefault(
                rank, []).append(cost)
    rows = [("class", "n", "option", "issued", "hidden", "exposed", "why exposed")]
    step = plan.prediction.step_time_s
    busiest = {key: max(by_rank.values(), key=lambda costs: sum(c.comm_s for c in costs))
               for key, by_rank in groups.items()}
    for (layer_class, option), costs in sorted(
            busiest.items(), key=lambda kv: -sum(c.comm_s for c in kv[1])):
        exposed = sum(c.comm_s for c in costs)
        hidden = sum(c.hidden_comm_s for c in costs)
        if exposed + hidden <= 0:
            continue
        share = f" ({exposed / step:.1%} of the step)" if step > 0 else ""
        rows.append((layer_class, str(len(costs)), option, ms(exposed + hidden), ms(hidden),
                     ms(exposed) + share, why_exposed(spec(parse_option(option)["strategy"]),
                                                      plan.mesh,
                                                      parse_option(option)["async_tp"])))
    if len(rows) == 1:
        return []
    src = plan.prediction.source
    per = ("per step" if plan.pipeline is None
           else "per step, on the pipeline rank that exposes the most of each class")
    lines = ["", f"Communication {per}  [{src}; issued = hidden + exposed; hidden time is "
             "net of the compute it slows]", *table(rows)]
    if plan.mesh.pp == 1 and any(spec(x.strategy).gather == "per_use" for x in plan.layers):
        lines.append("  not in these numbers: each micro-batch's first all-gather and the "
                     "step's last reduce-scatter have no neighbouring compute to hide behind "
                     "(priced as if they had)")
    return lines


def why_exposed(s: StrategySpec, mesh: Mesh, async_tp: bool = False) -> str:
    """Why a strategy's communication is not all hidden (costs.py's overlap conventions);
    ``async_tp``: its sequence-parallel collectives overlap its matmuls."""
    parts = []
    if async_tp:
        parts.append("async TP: what the matmuls' chunks do not hide, the last chunk, the "
                     "splitting's cost, and gradients summed over several Linears")
    elif s.tensor_parallel and mesh.tp > 1:
        parts.append("TP collectives wait (the next op needs them)")
    if s.sharded and s.gather == "per_use":
        parts.append("gathered for the first forward, reduced after the last backward: not "
                     "overlapped" if mesh.pp > 1 else
                     "2 all-gathers + 1 reduce-scatter a micro-batch, each behind one "
                     "neighbour's compute: the excess and the slowdown exposed")
    elif s.sharded:
        parts.append("gathered and reduced once a step, at the optimizer: not overlapped")
    elif mesh.replicas > 1:
        parts.append("all-reduce behind the last backward: the last bucket waits")
    return "; ".join(parts) or "-"


# -- per-rank memory ------------------------------------------------------------------------

def option_cost(plan: Plan, layer: LayerPlan) -> OptionCost | None:
    """The rationale's cost of this layer's strategy (None without a rationale)."""
    if plan.rationale is None:
        return None
    for c in plan.rationale.classes:
        if c.layer_class == layer.layer_class:
            return next((o for o in c.options if o.strategy == layer.option), None)
    return None


def rank_memory(plan: Plan) -> list[tuple[str, MemoryBreakdown]]:
    """Per pipeline rank (label, memory breakdown). Without pipelining every rank holds the
    same and the plan's own prediction is the one row."""
    pred = plan.prediction
    if pred is not None and pred.rank_memory:
        block = plan.mesh.replicas * plan.mesh.tp
        return [(f"pp rank {r} (r{r * block}–r{(r + 1) * block - 1})", m)
                for r, m in enumerate(pred.rank_memory)]
    if plan.mesh.pp == 1 or plan.rationale is None:
        if pred is None:
            return []
        label = f"r0–r{plan.world_size - 1}" if plan.world_size > 1 else "r0"
        return [(label + " (every rank)", pred.memory)]
    per_rank: dict[int, list[OptionCost]] = {}
    for layer in plan.layers:
        cost = option_cost(plan, layer)
        if cost is not None:
            per_rank.setdefault(stage_rank(layer.stage, plan.mesh.pp, plan.pipeline), []).append(cost)
    rows = []
    block = plan.mesh.replicas * plan.mesh.tp
    mu = plan.rationale.memory_margin_fraction
    for rank in sorted(per_rank):
        costs = per_rank[rank]
        params = sum(c.params_bytes for c in costs)
        grads = sum(c.grads_bytes for c in costs)
        optim = sum(c.optimizer_bytes for c in costs)
        acts = sum(c.activations_bytes for c in costs)
        buffers = max(c.buffers_bytes for c in costs)
        margin = int(mu * (params + grads + optim + acts + buffers))
        rows.append((f"pp rank {rank} (r{rank * block}–r{(rank + 1) * block - 1})",
                     MemoryBreakdown(params_bytes=params, grads_bytes=grads,
                                     optimizer_bytes=optim, activations_bytes=acts,
                                     buffers_bytes=buffers, margin_bytes=margin)))
    return rows


# -- alternatives ---------------------------------------------------------------------------

def chosen_alternative(plan: Plan) -> int | None:
    """Index of the alternative that is the plan itself: its shape and its step time (a
    shape may appear more than once, e.g. with other stage cuts or tied strategies)."""
    r, pred = plan.rationale, plan.prediction
    if r is None or pred is None:
        return None
    return next((i for i, alt in enumerate(r.alternatives)
                 if alt.mesh == plan.mesh and same_shape(alt.pipeline, plan.pipeline)
                 and alt.step_time_s is not None
                 and math.isclose(alt.step_time_s, pred.step_time_s, rel_tol=1e-9)), None)


def same_shape(a: PipelineSpec | None, b: PipelineSpec | None) -> bool:
    """Two pipeline sections with the same schedule, micro-batches and virtual stages (an
    alternative records its shape, not how its sends go)."""
    if a is None or b is None:
        return a is b
    return replace(a, scatter_sends=False) == replace(b, scatter_sends=False)


def why_lost(plan: Plan, alt, *, is_plan: bool = False) -> str:
    """One phrase: how an alternative compares with the plan (``is_plan``: it is the plan,
    ``chosen_alternative``)."""
    chosen = plan.prediction.step_time_s if plan.prediction else None
    if is_plan:
        return "chosen"
    if alt.status == "optimal" and alt.step_time_s is not None:
        if chosen is None:
            return "feasible"
        delta = alt.step_time_s - chosen
        return f"slower by {ms(delta)} (+{delta / chosen:.1%})" if delta > 0 else "ties"
    if alt.lower_bound_s is not None and chosen is not None:
        delta = alt.lower_bound_s - chosen
        return (f"slower by at least {ms(delta)} (+{delta / chosen:.1%}): its lower bound "
                "already loses")
    if alt.status == "infeasible" and alt.min_memory_bytes is not None:
        cap = plan.prediction.capacity_bytes if plan.prediction else None
        if cap is not None:
            return (f"does not fit: needs {human_bytes(alt.min_memory_bytes)} per rank, "
                    f"{human_bytes(alt.min_memory_bytes - cap)} over {human_bytes(cap)}")
        return f"does not fit: needs {human_bytes(alt.min_memory_bytes)} per rank"
    return alt.reason or alt.status


def shape(mesh, pipeline) -> str:
    text = mesh.describe(" ")
    if pipeline is not None and mesh.pp > 1:
        text += f" {pipeline.schedule} m={pipeline.num_microbatches}"
        if pipeline.virtual_stages > 1:
            text += f" v={pipeline.virtual_stages}"
    return text


def alternatives_lines(plan: Plan, top_k: int) -> list[str]:
    r = plan.rationale
    if r is None or not r.alternatives or top_k <= 0:
        return []
    src = r.cluster_provenance
    shown = r.alternatives[:top_k]
    rows = [("#", "shape", "step time", "vs this plan")]
    mine = chosen_alternative(plan)
    for i, alt in enumerate(shown, 1):
        t = (ms(alt.step_time_s) if alt.step_time_s is not None
             else f"≥ {ms(alt.lower_bound_s)}" if alt.lower_bound_s is not None else "-")
        rows.append((str(i), shape(alt.mesh, alt.pipeline), t,
                     why_lost(plan, alt, is_plan=i - 1 == mine)))
    return ["", f"Alternatives considered (best {len(shown)} of {len(r.alternatives)})  [{src}]",
            *table(rows)]


# -- the report -----------------------------------------------------------------------------

def format_report(plan: Plan, *, top_k: int = 5) -> str:
    """Model, cluster and batch; totals; per-layer and per-rank tables; alternatives."""
    lines = header_lines(plan) + totals_lines(plan) + comm_lines(plan) + layer_lines(plan)
    lines += rank_lines(plan)
    lines += alternatives_lines(plan, top_k)
    return "\n".join(lines)


def header_lines(plan: Plan) -> list[str]:
    tokens = f" ({plan.global_batch * plan.seq_len:,} tokens)" if plan.seq_len else ""
    lines = [
        f"model {plan.model or '?'} on {plan.cluster or '?'}: global batch {plan.global_batch}"
        + (f" × seq {plan.seq_len}" if plan.seq_len else "") + f"{tokens}, {plan.param_dtype}",
        f"mesh  {plan.mesh.describe()}"
        f" = {plan.world_size} ranks",
    ]
    if plan.pipeline is not None and plan.mesh.pp > 1:
        pl = plan.pipeline
        lines.append(f"pipeline {pl.schedule}: {pl.num_microbatches} micro-batches of "
                     f"{plan.global_batch // (plan.mesh.dp * pl.num_microbatches)} samples, "
                     f"{plan.num_stages} stages ({pl.virtual_stages} per rank)")
        sends = sends_line(plan)
        if sends:
            lines.append(sends)
    if plan.solver:
        s = plan.solver
        lines.append(
            f"solver {s.solver} {s.status}: objective {ms(s.objective_s)}, "
            f"lower bound {ms(s.lower_bound_s)}, gap {s.gap:.2%}, "
            f"{s.candidates} candidate(s) searched in {s.solve_time_s:.2f} s"
        )
    return lines


def sends_line(plan: Plan) -> str:
    """How stage sends use the pipeline link when tp ranks hold the same activation."""
    from runtime.pipeline_sends import sequence_sharded_boundaries  # torch.distributed

    tp = plan.mesh.tp
    if plan.pipeline is None or plan.mesh.pp == 1 or tp == 1:
        return ""
    sharded = sorted(sequence_sharded_boundaries(plan))
    shards = "" if not sharded else (
        f"; after stage(s) {', '.join(map(str, sharded))} two sequence-parallel layers meet, "
        f"and each tp rank passes on its sequence shard (1/{tp}) as it is")
    if plan.pipeline.scatter_sends:
        return (f"sends    scattered over tp={tp}: each tp rank sends 1/{tp} of a boundary "
                f"activation to the next pipeline rank, which all-gathers the slices over "
                f"its tp group ({tp - 1}/{tp} of the pipeline link's bytes saved, for one "
                f"all-gather inside the node){shards}")
    return (f"sends    whole from each of the tp={tp} ranks (pipeline.scatter_sends off; the "
            "planner leaves it off where scattering is not faster, as when the pipeline "
            f"link is NVLink too, or where a tensor's last dim does not divide by {tp})"
            f"{shards}")


def totals_lines(plan: Plan) -> list[str]:
    t = totals(plan)
    if t is None:
        return ["", "no prediction (a hand-written plan): nothing modelled"]
    src = f"[{t.source}]"
    p = plan.prediction
    bubble = f" ({p.bubble_fraction:.1%} of the step)" if p.bubble_s else ""
    lines = [
        "",
        "Totals",
        f"  predicted step time   {ms(t.step_time_s)}  {src}",
        f"    compute             {ms(t.compute_s)}",
        f"    exposed comm.       {ms(t.comm_s)}  (communication not hidden behind compute)",
        f"    pipeline bubble     {ms(t.bubble_s)}{bubble}",
        f"  throughput            {t.samples_per_s:,.1f} samples/s"
        + (f", {t.tokens_per_s:,.0f} tokens/s" if t.tokens_per_s is not None else "") + f"  {src}",
    ]
    r = plan.rationale
    if t.mfu is not None and r is not None:
        lines.append(
            f"  MFU                   {t.mfu:.1%}  {src}  (PaLM definition: model FLOPs "
            f"{r.model_flops_per_step:.3g}/step from the layer graph ÷ step time ÷ "
            f"{plan.world_size} × {r.peak_flops_per_device / 1e12:g} TFLOP/s peak)")
    else:
        lines.append("  MFU                   -  (needs the planner's rationale: re-plan)")
    used = t.peak_memory_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
    lines.append(f"  peak memory per rank  {human_bytes(t.peak_memory_bytes)} of "
                 f"{human_bytes(t.capacity_bytes)} ({used:.0%})  {src}")
    return lines


def layer_lines(plan: Plan) -> list[str]:
    src = plan.prediction.source if plan.prediction else "modelled"
    header = ("layers", "class", "n", "strategy", "tp", "shards", "stage", "recompute",
              "mem/rank", "time")
    rows = [header]
    for row in collapse(plan.layers):
        names = row.first if row.count == 1 else f"{row.first} … {row.last}"
        tp, shards = shard_degrees(row.layer, plan)
        mem = human_bytes(row.layer.memory_bytes) if row.layer.memory_bytes is not None else "-"
        time = ms(row.layer.time_s) if row.layer.time_s is not None else "-"
        rows.append((names, row.layer.layer_class, str(row.count), _strategy(row.layer), str(tp),
                     str(shards), str(row.layer.stage), _recompute(row.layer), mem, time))
    return ["", f"Layers  [{src}; mem/rank and time per layer: parameters, gradients, "
            "optimizer states and saved activations; forward + backward with communication]",
            *table(rows)]


def rank_lines(plan: Plan) -> list[str]:
    ranks = rank_memory(plan)
    if not ranks:
        return []
    cap = plan.prediction.capacity_bytes if plan.prediction else 0
    src = plan.prediction.source if plan.prediction else "modelled"
    rows = [("ranks", "params", "grads", "optimizer", "activations", "buffers", "margin",
             "total", "of capacity")]
    for label, m in ranks:
        rows.append((label, human_bytes(m.params_bytes), human_bytes(m.grads_bytes),
                     human_bytes(m.optimizer_bytes), human_bytes(m.activations_bytes),
                     human_bytes(m.buffers_bytes), human_bytes(m.margin_bytes),
                     human_bytes(m.total_bytes), f"{m.total_bytes / cap:.0%}" if cap else "-"))
    note = ""
    if plan.mesh.pp > 1 and not (plan.prediction and plan.prediction.rank_memory):
        note = "; per pipeline rank from the per-layer costs, one micro-batch in flight"
    label, top = max(ranks, key=lambda r: r[1].total_bytes)  # the fullest rank's peak event
    at = [f"  peak at {top.peak_at}" + (f" ({label.split(' (')[0]})" if len(ranks) > 1 else "")]
    return ["", f"Memory per rank  [{src}{note}]", *table(rows)] + (at if top.peak_at else [])
