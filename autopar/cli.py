"""The ``autopar`` command: ``plan`` a built-in model for a cluster; ``run`` a training
script (``autopar run train.py ARGS``, torchrun semantics) or a built-in model on local ranks.

Bad input exits with status 2 and one line naming what is wrong, never a traceback.
``--log-level`` (or ``$AUTOPAR_LOG_LEVEL``) sets what autopar's loggers print (``autopar.logs``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from autopar.api import search_plans
from autopar.cli_checkpoint import (
    add_checkpoint_options,
    add_reshard_command,
    check_built_in_run,
    cmd_run_resumable,
    under_torchrun,
)
from autopar.cli_report import add_commands, add_plan_options, check_outputs, write_outputs
from autopar.cli_types import (
    node_count,
    positive_int,
    positive_ints,
    positive_seconds,
    ranks_per_node,
    seed,
)
from autopar.errors import AutoparError
from autopar.logs import LEVELS, configured_logging, default_level
from autopar.progress import SearchProgress
from autopar.report import format_plan
from autopar.zoo import MODELS, get_model
from cost_models.errors import ConfigError
from cost_models.hardware import Cluster
from cost_models.memory import PRECISIONS
from cost_models.software import software_names, with_software
from runtime.device import DEVICE_TYPES
from runtime.files import write_atomic
from runtime.plan import Plan

EXIT_BAD_INPUT = 2
DEFAULT_MODEL = "gpt-small"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(build_parser(), list(sys.argv[1:] if argv is None else argv))
    try:
        with configured_logging(args.log_level):
            return args.handler(args)
    except AutoparError as e:
        print(f"autopar {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``export PLAN --script train.py -- ARGS``: what follows ``--`` is the script's."""
    if "--" in argv:
        head = parser.parse_args(argv[:argv.index("--")])
        if head.command == "export":
            head.script_args = argv[argv.index("--") + 1:]
            return head
    return parser.parse_args(argv)


def add_log_level(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LEVELS, default=default,
                   help="what autopar logs on stderr (default: $AUTOPAR_LOG_LEVEL or WARNING)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Plan and run parallel training of PyTorch models.")
    add_log_level(parser, default_level())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a built-in model for a cluster and print the plan")
    p.add_argument("--model", default="gpt2-xl", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--cluster", default="dgx-a100-80g",
                   help=f"a preset ({', '.join(Cluster.preset_names())}, local) or a .toml file")
    p.add_argument("--nodes", type=node_count, help="override the cluster's node count")
    p.add_argument("--software", choices=software_names(), metavar="NAME",
                   help="price the plan for this software generation (cost_models/"
                        f"software.toml: {', '.join(software_names())}) instead of the "
                        "cluster's")
    p.add_argument("--batch", type=positive_int, help="global batch (samples per step)")
    p.add_argument("--seq", type=positive_int, help="sequence length (GPT models)")
    p.add_argument("--dtype", default="float32", choices=list(PRECISIONS),
                   help="parameter and compute precision to plan for")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    p.add_argument("--time-limit", type=positive_seconds, default=60.0,
                   help="search time limit, seconds: every search loop stops once it passes "
                        "and the best plan found by then is returned (status 'time limit')")
    p.add_argument("--force", action="store_true",
                   help="overwrite existing --json, --export and --plot files")
    p.add_argument("--from-megatron", metavar="ARGS",
                   help="an existing Megatron-LM job's arguments (one quoted string): print "
                        "its predicted step time next to autopar's plan, with the gain")
    p.add_argument("--from-torchtitan", metavar="ARGS",
                   help="an existing torchtitan 0.3 job's arguments (one quoted string: "
                        "--module M --config C and --section.field overrides): the same")
    add_plan_options(p)
    p.set_defaults(handler=cmd_plan)
    add_commands(sub)

    r = sub.add_parser(
        "run", help="run a training script (or a built-in model) on local ranks",
        description="autopar run [OPTIONS] train.py [ARGS...] starts the script on "
                    "--nodes x --nproc ranks with torchrun; autopar.compile in it executes "
                    "--plan. Without a script, trains a built-in --model.")
    r.add_argument("script", nargs="?", help="your training script (its arguments follow it)")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    r.add_argument("--model", help=f"built-in model, without a script: one of {', '.join(MODELS)}"
                                   f" (default {DEFAULT_MODEL})")
    r.add_argument("--nproc", type=ranks_per_node,
                   help="ranks (per node): default the plan's world size, else 2")
    r.add_argument("--nodes", type=node_count, default=1,
                   help="with a script: nodes, each running this command (torchrun --nnodes)")
    r.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="with --nodes > 1: the first node's address (c10d rendezvous)")
    r.add_argument("--device", choices=DEVICE_TYPES, default="auto",
                   help="auto: CUDA (NCCL) on LOCAL_RANK when available, else CPU (gloo)")
    r.add_argument("--steps", type=positive_int, default=3, help="optimizer steps")
    r.add_argument("--plan", metavar="PATH", help="a plan JSON (default: plan afresh)")
    r.add_argument("--batch", type=positive_int,
                   help="global batch (default: the plan's, else the model's)")
    r.add_argument("--seq", type=positive_int, help="sequence length (GPT models)")
    r.add_argument("--seed", type=seed, default=0)
    r.add_argument("--timeout", type=positive_seconds, default=300,
                   help="seconds before ranks give up")
    add_log_level(r, argparse.SUPPRESS)
    r.set_defaults(handler=cmd_run)
    add_checkpoint_options(r)
    add_reshard_command(sub)

    c = sub.add_parser("calibrate", help="measure this machine and write a cluster profile")
    c.add_argument("--nproc", type=ranks_per_node, default=2,
                   help="local ranks (at least 2; 1 with --topology)")
    c.add_argument("--out", default="calibrated.toml", help="profile to write (.toml)")
    c.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    c.add_argument("--quick", action="store_true", help="small sizes, few repeats (seconds)")
    c.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: nccl with CUDA GPUs, gloo otherwise")
    c.add_argument("--attention-shape", type=attention_shape, metavar="BH,SEQ,DIM",
                   help="fused attention's batch x heads, sequence and head dim to time "
                        "(default 8,512,64; give your model's: its rate depends on the shape)")
    c.add_argument("--loss-shape", type=loss_shape, metavar="TOKENS,VOCAB",
                   help="cross-entropy's tokens (per rank and micro-batch) and vocabulary to "
                        "time (default 2048,8192; give your model's: on CPU its rate depends "
                        "on the vocabulary)")
    c.add_argument("--topology", metavar="PRESET|PROFILE",
                   help="with --nproc 1: measure this one device, and take the nodes, devices "
                        "per node, links and overlap from this cluster (e.g. dgx-h100)")
    c.set_defaults(handler=cmd_calibrate)
    return parser


attention_shape = positive_ints("batch x heads, sequence and head dim", "8,512,64")
loss_shape = positive_ints("tokens and vocabulary", "2048,8192")


def with_chosen_software(cluster: Cluster, name: str | None) -> Cluster:
    """``cluster`` under ``--software`` (if given). A calibrated cluster measured its own
    software's share; replacing it would mix a measured device with a published stack."""
    if name is None:
        return cluster
    if cluster.provenance == "calibrated":
        raise ConfigError(
            f"cluster {cluster.name!r} is calibrated: its software_efficiency was measured "
            f"through the stack that ran it; --software {name} would replace it. Plan with "
            "the calibrated profile alone, or with a preset and --software")
    return with_software(cluster, name)


def cmd_plan(args: argparse.Namespace) -> int:
    check_outputs(args)  # before minutes of planning, not after
    spec = get_model(args.model)
    cluster = with_chosen_software(Cluster.load(args.cluster, nodes=args.nodes), args.software)
    if args.from_megatron:
        from autopar.exports.command import megatron_comparison

        print(megatron_comparison(args.from_megatron, spec.name, cluster, seq=args.seq,
                                  time_limit_s=args.time_limit))
        return 0
    if args.from_torchtitan:
        from autopar.exports.torchtitan_compare import torchtitan_comparison

        print(torchtitan_comparison(args.from_torchtitan, spec.name, cluster,
                                    time_limit_s=args.time_limit))
        return 0
    batch = args.batch or spec.default_batch
    inputs = spec.example_inputs(batch, args.seq, device="meta")
    model = spec.build("meta")
    seq = inputs[0].shape[1] if spec.kind == "gpt" else None
    progress = SearchProgress()  # a status line on a terminal, silent otherwise
    try:
        result = search_plans(model, cluster, inputs, precision=args.dtype,
                              model_name=spec.name, seq_len=seq, time_limit_s=args.time_limit,
                              progress=progress)
    finally:
        progress.close()
    if args.software:
        print(f"software: {args.software} (cost_models/software.toml), as the plan is priced")
    print(format_plan(result.plan, top_k=args.top))
    if args.json:
        write_atomic(args.json, result.plan.to_json())
        print(f"\nplan written to {args.json}")

    def scaling():
        from autopar.whatif import default_nodes, scaling_points
        from passes.layer_graph import build_layer_graph

        graph = build_layer_graph(model, inputs, model_name=spec.name, seq_len=seq)
        return scaling_points(graph, cluster, default_nodes(cluster.nodes), precision=args.dtype)

    for path in write_outputs(args, result.plan, scaling, timeline=result.timeline):
        print(f"wrote {path}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from autopar.training import describe_run, plan_for_local_run, run_local

    if args.script is not None:
        return cmd_run_script(args)
    if args.nodes > 1:
        raise AutoparError("--nodes is for a script (autopar run --nodes N train.py); a "
                           "built-in model runs on one node's --nproc ranks")
    args.model = args.model or DEFAULT_MODEL
    plan = Plan.load(args.plan) if args.plan else None
    nproc = args.nproc = args.nproc or (plan.world_size if plan is not None else 2)
    if args.ckpt_dir or args.resume or under_torchrun():
        return cmd_run_resumable(args)
    spec = get_model(args.model)
    batch = args.batch or (plan.global_batch if plan is not None else spec.default_batch)
    check_built_in_run(spec, plan, nproc, batch, args.seq)  # before any rank starts
    if plan is None:
        plan = plan_for_local_run(spec, nproc, batch, args.seq)
    losses = run_local(spec, plan, nproc=nproc, steps=args.steps, batch=batch, seq=args.seq,
                       seed=args.seed, timeout_s=args.timeout, device_type=args.device)
    print(describe_run(spec.name, plan, batch))
    for step, loss in enumerate(losses, 1):
        print(f"step {step}  loss {loss:.6f}")
    return 0


def cmd_run_script(args: argparse.Namespace) -> int:
    from autopar.launch_script import ScriptRun, launch

    zoo_only = [f"--{name.replace('_', '-')}" for name in ("model", "ckpt_dir", "resume", "batch", "seq")
                if getattr(args, name)]
    if zoo_only:
        raise AutoparError(f"{', '.join(zoo_only)} apply to a built-in model, not to a script "
                           f"({args.script}); give your script its own arguments after its path")
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    return launch(ScriptRun(script=args.script, script_args=tuple(script_args),
                            plan_path=args.plan, nodes=args.nodes, nproc_per_node=args.nproc,
                            rdzv_endpoint=args.rdzv_endpoint, device=args.device,
                            log_level=args.log_level))


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.calibrate import Settings, calibrate, check_output, format_table, write_profile

    check_output(args.out, force=args.force)  # before minutes of measuring, not after
    settings = Settings.quick() if args.quick else Settings()
    if args.attention_shape:
        settings = replace(settings, attention_shape=args.attention_shape)
    if args.loss_shape:
        settings = replace(settings, loss_shape=args.loss_shape)
    topology = Cluster.load(args.topology) if args.topology else None
    cal = calibrate(args.nproc, backend=args.backend, settings=settings, topology=topology)
    print(format_table(cal))
    cluster = write_profile(cal, args.out, force=args.force)
    print(f"\nwrote {args.out} ({cluster.name}, [{cluster.provenance}]); "
          f"use it with: autopar plan --cluster {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
