"""The report side of the ``autopar`` command: ``explain``, ``diff``, ``export``, and the
``plan`` options that write pictures (``--plot DIR``) and launch files (``--export DIR``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar.cli_types import node_count, nonnegative_int, positive_int, ranks_per_node
from autopar.diff import diff, format_diff
from autopar.errors import ConfigError
from autopar.explain import explain, format_explanation
from autopar.export import Job, launch_for, slurm_script, torchrun_script, write_script
from autopar.exports import EXPORTERS
from runtime.device import DEVICE_TYPES
from runtime.files import check_output, check_output_dir, write_atomic
from runtime.plan import Plan
from runtime.plan_report import alternatives_lines

EXPORT_FILES = {"torchrun": "torchrun.sh", "slurm": "job.slurm"}
TORCHTITAN_FILE = "torchtitan.sh"
"""``plan --export`` also writes the torchtitan launch script (``autopar.exports``)."""


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", metavar="DIR",
                   help="write PNG pictures (memory, step time, schedule, scaling) into DIR")
    p.add_argument("--export", metavar="DIR",
                   help="write torchrun.sh, job.slurm and torchtitan.sh into DIR")
    p.add_argument("--top", type=nonnegative_int, default=5, help="alternatives shown in the report")


def add_commands(sub) -> None:
    e = sub.add_parser("explain", help="why a layer of a saved plan got its strategy, and "
                       "what every other option would cost")
    e.add_argument("plan", metavar="PLAN.json")
    e.add_argument("layer", nargs="?", help="module name, e.g. h.3 (omit: the alternatives)")
    e.add_argument("--top", type=positive_int, default=10, help="alternatives listed without LAYER")
    e.set_defaults(handler=cmd_explain)

    d = sub.add_parser("diff", help="what changed between two plans (exit 1 if they differ)")
    d.add_argument("plan_a", metavar="A.json")
    d.add_argument("plan_b", metavar="B.json")
    d.set_defaults(handler=cmd_diff)

    x = sub.add_parser("export", help="print a torchrun or SLURM script that runs a saved "
                       "plan, or an engine's settings for it (torchtitan, Megatron-LM, "
                       "DeepSpeed, accelerate)",
                       description="autopar export PLAN.json --format slurm --script train.py "
                                   "-- ARGS: the script's own arguments follow --")
    x.add_argument("plan", metavar="PLAN.json")
    x.add_argument("--format", choices=[*EXPORT_FILES, *EXPORTERS], default="torchrun",
                   help="megatron, deepspeed, accelerate, torchtitan: the engine's own settings "
                        "(with --out, a directory for its files)")
    x.add_argument("--nodes", type=node_count, help="default: the cluster the plan was made for")
    x.add_argument("--nproc-per-node", type=ranks_per_node,
                   help="default: the cluster's devices per node")
    x.add_argument("--script", help="your training script (default: autopar run on the "
                                    "built-in model the plan names)")
    x.add_argument("--steps", type=positive_int, help="without --script: steps of `autopar run`")
    x.add_argument("--device", choices=DEVICE_TYPES, default="auto",
                   help="cpu: ask SLURM for no GPUs and hide them from the ranks")
    x.add_argument("--out", metavar="PATH", help="write an executable file instead of printing")
    x.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    x.set_defaults(handler=cmd_export, script_args=[])


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
    if args.format in EXPORTERS:
        return cmd_engine_export(args)
    if args.out:
        check_output(args.out, force=args.force, what="--out")
    plan = Plan.load(args.plan)
    if args.script is not None and not Path(args.script).is_file():
        raise ConfigError(f"script {args.script} does not exist (or is not a file)")
    if args.script is not None and args.steps is not None:
        raise ConfigError("--steps is for the built-in model; pass your script's own "
                          "arguments after --")
    if args.script is None and args.script_args:
        raise ConfigError(f"arguments {args.script_args} after -- need --script to pass them to")
    job = Job(script=args.script and str(Path(args.script).resolve()),
              script_args=tuple(args.script_args), steps=args.steps, device=args.device)
    text = export_text(plan, args.format, args.plan, args.nodes, args.nproc_per_node, job)
    if args.out:
        print(f"wrote {write_script(args.out, text)}")
    else:
        print(text, end="")
    return 0


def cmd_engine_export(args: argparse.Namespace) -> int:
    from autopar.exports.command import engine_export, export_output

    if args.script is not None or args.script_args or args.steps is not None:
        raise ConfigError(f"--script, --steps and script arguments are for torchrun and "
                          f"slurm; the {args.format} files take the job's own arguments "
                          "when launched")
    export = engine_export(args.format, args.plan, nodes=args.nodes,
                           nproc_per_node=args.nproc_per_node)
    if args.out:
        check_output_dir(args.out, [f.name for f in export.files], force=args.force,
                         what="--out")
    for warning in export.warnings:
        print(f"autopar export: warning: {warning}", file=sys.stderr)
    print("\n".join(export_output(export, args.out)))
    return 0


def export_text(plan: Plan, fmt: str, plan_path: str, nodes: int | None = None,
                nproc_per_node: int | None = None, job: Job | None = None) -> str:
    """The file for ``fmt``; launch files name the plan by its absolute path, so they run
    from any directory (sbatch runs a copy of the script, elsewhere)."""
    launch = launch_for(plan, nodes, nproc_per_node)
    plan_path = str(Path(plan_path).resolve())
    if fmt == "torchrun":
        return torchrun_script(plan, plan_path, launch, job)
    return slurm_script(plan, plan_path, launch, job)


PLOT_FILES = ("memory.png", "step_time.png", "schedule.png", "scaling.png")


def check_outputs(args: argparse.Namespace) -> None:
    """Before ``autopar plan`` works: every output it was asked for can be written, and
    none exists unless ``--force`` (a hand-edited job.slurm is not lost)."""
    force = getattr(args, "force", False)
    if getattr(args, "json", None):
        check_output(args.json, force=force, what="--json")
    if getattr(args, "export", None):
        names = [*EXPORT_FILES.values(), TORCHTITAN_FILE,
                 *([] if args.json else ["plan.json"])]
        check_output_dir(args.export, names, force=force, what="--export directory")
    if getattr(args, "plot", None):
        check_output_dir(args.plot, PLOT_FILES, force=force, what="--plot directory")


def write_outputs(args: argparse.Namespace, plan: Plan, scaling=None, *,
                  timeline=None) -> list[Path]:
    """After ``autopar plan``: pictures and launch files, as the options ask (checked by
    ``check_outputs`` before the planning); ``timeline`` is the planner's simulated
    schedule of a pipeline plan. Every file is written atomically."""
    written: list[Path] = []
    if getattr(args, "plot", None):
        from autopar.plots import write_plots

        Path(args.plot).mkdir(exist_ok=True)
        written += write_plots(plan, args.plot, scaling=scaling() if scaling else None,
                               timeline=timeline)
    if getattr(args, "export", None):
        out = Path(args.export)
        out.mkdir(exist_ok=True)
        plan_path = args.json or str(out / "plan.json")
        if not args.json:
            write_atomic(plan_path, plan.to_json())
            written.append(Path(plan_path))
        for fmt, name in EXPORT_FILES.items():
            written.append(write_script(out / name, export_text(plan, fmt, plan_path)))
        written += _write_torchtitan(plan, plan_path, out)
    return written


def _write_torchtitan(plan: Plan, plan_path: str, out: Path) -> list[Path]:
    """torchtitan.sh (what torchtitan cannot express of the plan on stderr), unless the
    plan's model is not one torchtitan's decoder can name (its blocks not one run of
    identical layers): then a line on stderr says why."""
    from autopar.exports.torchtitan import export_torchtitan

    try:
        export = export_torchtitan(plan, str(Path(plan_path).resolve()))
    except ConfigError as e:
        print(f"autopar plan: {TORCHTITAN_FILE} not written: {e}", file=sys.stderr)
        return []
    for warning in export.warnings:
        print(f"autopar plan: warning: {TORCHTITAN_FILE}: {warning}", file=sys.stderr)
    return export.write(out)
