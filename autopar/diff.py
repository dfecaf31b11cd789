"""What changed between two plans: shape, batch, schedule, and exactly the layers whose
execution differs (strategy, tensor-parallel styles, stage, recomputation).

A layer's informational numbers (modelled memory and time) are not compared: they move with
the mesh even when the layer runs the same way; the prediction is listed separately.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.plan import LayerPlan, Plan
from runtime.plan_report import human_bytes, ms

PLAN_FIELDS = ("model", "cluster", "global_batch", "seq_len", "param_dtype", "mesh", "pipeline")
LAYER_FIELDS = ("strategy", "tp_styles", "stage", "recompute")


@dataclass(frozen=True, kw_only=True)
class LayerChange:
    module: str
    changes: dict[str, tuple[object, object]]
    """Field -> (value in plan a, value in plan b)."""


@dataclass(frozen=True, kw_only=True)
class PlanDiff:
    fields: dict[str, tuple[object, object]]
    layers: tuple[LayerChange, ...]
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    prediction: dict[str, tuple[float, float]]
    """Modelled step time and peak memory, when both plans have them and they differ."""

    @property
    def is_empty(self) -> bool:
        return not (self.fields or self.layers or self.only_in_a or self.only_in_b
                    or self.prediction)

    @property
    def changed_layers(self) -> tuple[str, ...]:
        return tuple(c.module for c in self.layers)


def diff(a: Plan, b: Plan) -> PlanDiff:
    fields = {f: (getattr(a, f), getattr(b, f)) for f in PLAN_FIELDS
              if getattr(a, f) != getattr(b, f)}
    b_layers = {x.module: x for x in b.layers}
    a_names = {x.module for x in a.layers}
    changes = []
    for la in a.layers:
        lb = b_layers.get(la.module)
        if lb is None:
            continue
        changed = {f: (_get(la, f), _get(lb, f)) for f in LAYER_FIELDS if _get(la, f) != _get(lb, f)}
        if changed:
            changes.append(LayerChange(module=la.module, changes=changed))
    prediction = {}
    if a.prediction and b.prediction:
        pa, pb = a.prediction, b.prediction
        for name, va, vb in (("step_time_s", pa.step_time_s, pb.step_time_s),
                             ("peak_memory_bytes", pa.memory.total_bytes, pb.memory.total_bytes)):
            if va != vb:
                prediction[name] = (va, vb)
    return PlanDiff(fields=fields, layers=tuple(changes),
                    only_in_a=tuple(x.module for x in a.layers if x.module not in b_layers),
                    only_in_b=tuple(x.module for x in b.layers if x.module not in a_names),
                    prediction=prediction)


def _get(layer: LayerPlan, name: str) -> object:
    return getattr(layer, name, None)


def format_diff(d: PlanDiff, a_name: str = "a", b_name: str = "b") -> str:
    if d.is_empty:
        return "the plans are the same"
    lines = [f"--- {a_name}", f"+++ {b_name}"]
    for f, (va, vb) in d.fields.items():
        lines.append(f"{f}: {_short(va)} → {_short(vb)}")
    for name, (va, vb) in d.prediction.items():
        if name == "step_time_s":
            lines.append(f"predicted step time: {ms(va)} → {ms(vb)} ({(vb - va) / va:+.1%})")
        else:
            lines.append(f"peak memory per rank: {human_bytes(va)} → {human_bytes(vb)}")
    if d.layers:
        lines.append(f"{len(d.layers)} layer(s) changed:")
        for c in d.layers:
            # A new strategy implies new tp styles; print them only when they alone changed.
            shown = {f: v for f, v in c.changes.items()
                     if not (f == "tp_styles" and "strategy" in c.changes)}
            what = ", ".join(f"{f} {_short(va)} → {_short(vb)}" for f, (va, vb) in shown.items())
            lines.append(f"  {c.module}: {what}")
    for module in d.only_in_a:
        lines.append(f"  only in {a_name}: {module}")
    for module in d.only_in_b:
        lines.append(f"  only in {b_name}: {module}")
    return "\n".join(lines)


def _short(value: object) -> str:
    if hasattr(value, "pp") and hasattr(value, "tp"):
        return value.describe(" ")
    return repr(value) if isinstance(value, (dict, str)) else str(value)
