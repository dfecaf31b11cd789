"""The report side of the ``autopar`` command: ``explain``, ``diff``, ``export``, and the
``plan`` options that write pictures (``--plot DIR``) and launch files (``--export DIR``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from autopar.diff import diff, format_diff
from autopar.explain import explain, format_explanation
from autopar.export import launch_for, slurm_script, torchrun_command, torchtitan_toml
from runtime.plan import Plan
from runtime.plan_report import alternatives_lines

EXPORT_FILES = {"torchtitan": "parallelism.toml", "torchrun": "torchrun.sh", "slurm": "job.slurm"}


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", metavar="DIR",
                   help="write PNG pictures (memory, step time, schedule, scaling) into DIR")
    p.add_argument("--export", metavar="DIR",
                   help="write parallelism.toml (torchtitan), torchrun.sh and job.slurm into DIR")
    p.add_argument("--top", type=int, default=5, help="alternatives shown in the report")


def add_commands(sub) -> None:
    e = sub.add_parser("explain", help="why a layer of a saved plan got its strategy, and "
                       "what every other option would cost")
    e.add_argument("plan", metavar="PLAN.json")
    e.add_argument("layer", nargs="?", help="module name, e.g. h.3 (omit: the alternatives)")
    e.add_argument("--top", type=int, default=10, help="alternatives listed without LAYER")
    e.set_defaults(handler=cmd_explain)

    d = sub.add_parser("diff", help="what changed between two plans (exit 1 if they differ)")
    d.add_argument("plan_a", metavar="A.json")
    d.add_argument("plan_b", metavar="B.json")
    d.set_defaults(handler=cmd_diff)

    x = sub.add_parser("export", help="print a torchtitan config block, torchrun command or "
                       "SLURM script that runs a saved plan")
    x.add_argument("plan", metavar="PLAN.json")
    x.add_argument("--format", choices=list(EXPORT_FILES), default="torchrun")
    x.add_argument("--nodes", type=int, help="default: the cluster the plan was made for")
    x.add_argument("--nproc-per-node", type=int, help="default: the cluster's devices per node")
    x.set_defaults(handler=cmd_export)


def cmd_explain(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    if args.layer is None:
        lines = alternatives_lines(plan, args.top)
        print("\n".join(lines[1:]) if lines else "the plan carries no alternatives (re-plan)")
    else:
        print(format_explanation(explain(plan, args.layer)))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    d = diff(Plan.load(args.plan_a), Plan.load(args.plan_b))
    print(format_diff(d, args.plan_a, args.plan_b))
    return 0 if d.is_empty else 1


def cmd_export(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    print(export_text(plan, args.format, args.plan, args.nodes, args.nproc_per_node), end="")
    return 0


def export_text(plan: Plan, fmt: str, plan_path: str, nodes: int | None = None,
                nproc_per_node: int | None = None) -> str:
    if fmt == "torchtitan":
        return torchtitan_toml(plan)
    launch = launch_for(plan, nodes, nproc_per_node)
    if fmt == "torchrun":
        return "#!/bin/bash\n" + torchrun_command(plan, plan_path, launch) + "\n"
    return slurm_script(plan, plan_path, launch)


def write_outputs(args: argparse.Namespace, plan: Plan, scaling=None, *,
                  timeline=None) -> list[Path]:
    """After ``autopar plan``: pictures and launch files, as the options ask; ``timeline``
    is the planner's simulated schedule of a pipeline plan."""
    written: list[Path] = []
    if getattr(args, "plot", None):
        from autopar.plots import write_plots

        written += write_plots(plan, args.plot, scaling=scaling() if scaling else None,
                               timeline=timeline)
    if getattr(args, "export", None):
        out = Path(args.export)
        out.mkdir(parents=True, exist_ok=True)
        plan_path = args.json or str(out / "plan.json")
        if not args.json:
            plan.save(plan_path)
            written.append(Path(plan_path))
        for fmt, name in EXPORT_FILES.items():
            path = out / name
            path.write_text(export_text(plan, fmt, plan_path))
            written.append(path)
    return written
