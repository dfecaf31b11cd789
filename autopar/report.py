"""Plain-text rendering of a Plan: the per-layer table and the predicted totals."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.plan import TP_STRATEGIES, LayerPlan, Plan

GiB = 1024**3


def human_bytes(n: float) -> str:
    """Bytes with a binary unit that keeps three significant figures."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            value = n / size
            return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{n:.0f} B"


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
                and prev.layer.strategy == layer.strategy and prev.layer.stage == layer.stage):
            rows[-1] = Row(prev.first, layer.module, prev.count + 1, prev.layer)
        else:
            rows.append(Row(layer.module, layer.module, 1, layer))
    return rows


def shard_degrees(layer: LayerPlan, plan: Plan) -> tuple[int, int]:
    """(tensor-parallel degree, data-parallel shards of its parameters)."""
    dp, tp = plan.mesh.dp, plan.mesh.tp
    return (
        tp if layer.strategy in TP_STRATEGIES else 1,
        {"replicate": 1, "fsdp": dp * tp, "tp": 1, "tp_fsdp": dp}[layer.strategy],
    )


def format_plan(plan: Plan) -> str:
    lines = [
        f"model {plan.model or '?'} on {plan.cluster or '?'}: global batch {plan.global_batch}"
        + (f" × seq {plan.seq_len}" if plan.seq_len else "") + f", {plan.param_dtype}",
        f"mesh  pp={plan.mesh.pp} × dp={plan.mesh.dp} × tp={plan.mesh.tp}"
        f" = {plan.world_size} ranks",
    ]
    if plan.solver:
        s = plan.solver
        lines.append(
            f"solver {s.solver} {s.status}: objective {s.objective_s * 1e3:.3f} ms, "
            f"LP lower bound {s.lower_bound_s * 1e3:.3f} ms, gap {s.gap:.2%}, "
            f"{s.candidates} mesh(es) searched in {s.solve_time_s:.2f} s"
        )
    lines.append("")
    header = ("layers", "class", "n", "strategy", "tp", "shards", "mem/rank", "time")
    table = [header]
    for row in collapse(plan.layers):
        names = row.first if row.count == 1 else f"{row.first} … {row.last}"
        tp, shards = shard_degrees(row.layer, plan)
        mem = f"{row.layer.memory_bytes / GiB:.3f} GiB" if row.layer.memory_bytes is not None else "-"
        time = f"{row.layer.time_s * 1e3:.3f} ms" if row.layer.time_s is not None else "-"
        table.append((names, row.layer.layer_class, str(row.count), row.layer.strategy,
                      str(tp), str(shards), mem, time))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    lines.append("(mem/rank and time are per layer: parameters, gradients, optimizer states and "
                 "saved activations; forward + backward with communication)")
    if plan.prediction:
        p, m = plan.prediction, plan.prediction.memory
        lines += [
            "",
            f"predicted step time   {p.step_time_s * 1e3:.3f} ms  (compute {p.compute_s * 1e3:.3f}"
            f" ms, communication {p.comm_s * 1e3:.3f} ms, not overlapped)  [{p.source}]",
            f"peak memory per rank  {m.total_bytes / GiB:.3f} GiB of {p.capacity_bytes / GiB:.1f}"
            f" GiB  [{p.source}]",
            f"  parameters {m.params_bytes / GiB:.3f}, gradients {m.grads_bytes / GiB:.3f}, "
            f"optimizer {m.optimizer_bytes / GiB:.3f}, activations {m.activations_bytes / GiB:.3f},"
            f" buffers {m.buffers_bytes / GiB:.3f}, margin {m.margin_bytes / GiB:.3f} GiB",
        ]
    return "\n".join(lines)
