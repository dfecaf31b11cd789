"""Plain-text report of a Plan (the CLI's default output).

The rendering lives with the Plan schema (``runtime.plan_report``, so that ``Plan.report()``
works without the planner); this module is the front door's name for it.
"""

from __future__ import annotations

from runtime.plan import Plan
from runtime.plan_report import Totals, format_report, human_bytes, totals

__all__ = ["Totals", "format_plan", "format_report", "human_bytes", "totals"]


def format_plan(plan: Plan, *, top_k: int = 5) -> str:
    """The full report: totals, per-layer and per-rank tables, alternatives."""
    return format_report(plan, top_k=top_k)
