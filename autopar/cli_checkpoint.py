"""``autopar run`` with checkpoints (local processes or under torchrun) and ``autopar reshard``.

Kept apart from ``autopar.cli`` so the command table there stays short; ``cli`` calls
``add_checkpoint_options`` / ``add_reshard_command`` and hands ``run`` over to
``cmd_run_resumable`` when ``--ckpt-dir`` is given or torchrun started the process.
"""

from __future__ import annotations

import argparse
import os
import sys

from autopar.cli_types import nonnegative_int, positive_int
from autopar.errors import AutoparError
from autopar.training import describe_run
from autopar.zoo import MODELS, ModelSpec, get_model
from runtime.plan import Plan


def under_torchrun() -> bool:
    """torchrun's elastic agent started this process (it sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def add_checkpoint_options(run: argparse.ArgumentParser) -> None:
    g = run.add_argument_group(
        "checkpoints", "resumable training; under torchrun each process is one rank "
        "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node N "
        "--max-restarts R -m autopar.cli run ...)")
    g.add_argument("--ckpt-dir", metavar="DIR", help="checkpoint root (save / resume here)")
    g.add_argument("--ckpt-every", type=nonnegative_int, default=0, metavar="K",
                   help="save every K steps (default: only after the last step)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --ckpt-dir, resharding it "
                        "(and re-planning) if the world size changed")
    g.add_argument("--keep", type=positive_int, default=2,
                   help="checkpoints to keep (default 2, at least 1)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background thread")


def add_reshard_command(sub) -> None:
    s = sub.add_parser(
        "reshard", help="rewrite a checkpoint for another plan (offline, one process)",
        description="Check that a checkpoint fits plan B's model and write a copy labelled "
                    "with plan B, in one shard file. Any autopar checkpoint also reshards "
                    "itself when a run under another plan loads it.")
    s.add_argument("ckpt", metavar="CKPT", help="a checkpoint, or a root holding them (newest)")
    s.add_argument("--plan", required=True, metavar="B.json", help="the plan to load it under")
    s.add_argument("--out", required=True, metavar="DIR", help="new checkpoint root (must not exist)")
    s.add_argument("--model", help="built-in model to check against (default: the one named "
                                    f"in the checkpoint, else in the plan; {', '.join(MODELS)})")
    s.set_defaults(handler=cmd_reshard)


def cmd_reshard(args: argparse.Namespace) -> int:
    from runtime.checkpoint import check_reshard_out, reshard, verify

    check_reshard_out(args.out)
    plan = Plan.load(args.plan)
    _, manifest, _ = verify(args.ckpt)
    name = args.model or manifest.model or plan.model
    if not name:
        raise AutoparError("neither the checkpoint nor the plan names its model; pass --model")
    path = reshard(args.ckpt, args.out, plan, get_model(name).build("meta"))
    print(f"{name} step {manifest.step}: saved under {manifest.world_size} rank(s), written for "
          f"mesh {plan.mesh.describe()} to {path}")
    return 0


def cmd_run_resumable(args: argparse.Namespace) -> int:
    from autopar.resumable import CheckpointOptions, resumable_worker, train_resumable
    from runtime.device import backend_for
    from runtime.launch import init_from_env, spawn

    spec = get_model(args.model)
    plan = Plan.load(args.plan) if args.plan else None
    batch = args.batch or (plan.global_batch if plan is not None else spec.default_batch)
    ckpt = None
    if args.ckpt_dir:
        ckpt = CheckpointOptions(dir=args.ckpt_dir, every=args.ckpt_every, resume=args.resume,
                                 keep=args.keep, async_save=args.async_save)
    elif args.resume:
        raise AutoparError("--resume needs --ckpt-dir")
    if not under_torchrun():
        check_built_in_run(spec, plan, args.nproc, batch, args.seq)
        if args.resume:
            check_resume(args.ckpt_dir)
        result = spawn(resumable_worker, args.nproc, spec.name, plan.to_json() if plan else None,
                       args.steps, batch, args.seq, args.seed, ckpt, args.device,
                       backend=backend_for(args.device), timeout_s=args.timeout)[0]
        _report(spec.name, batch, result.plan, result.resumed_from)
        for step, loss in result.losses.items():
            print(f"step {step}  loss {loss:.10f}")
        return 0
    import torch.distributed as dist

    init_from_env(device_type=args.device, timeout_s=args.timeout)
    rank0 = dist.get_rank() == 0
    if rank0 and _restarts_may_hang():
        print("autopar run: warning: torchrun shares its rendezvous store with the ranks, and "
              "gloo ranks then fail to reconnect after a restart (pytorch#135712); set "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun", file=sys.stderr)

    def on_step(step: int, loss: float) -> None:
        if rank0:
            print(f"step {step}  loss {loss:.10f}", flush=True)

    result = train_resumable(spec, steps=args.steps, batch=batch, seq=args.seq, seed=args.seed,
                             plan=plan, ckpt=ckpt, on_step=on_step, device_type=args.device)
    if rank0:
        _report(spec.name, batch, result.plan, result.resumed_from)
    # Leave together: a rank that tears down while its peer is still inside a collective
    # aborts the peer ("terminate called without an active exception", seen after restarts).
    dist.barrier()
    dist.destroy_process_group()
    return 0


def check_built_in_run(spec: ModelSpec, plan: Plan | None, nproc: int, batch: int,
                       seq: int | None) -> None:
    """Before any rank starts: the sequence fits the model, and a given plan is for this
    world size, batch and sequence and runs on this model (``runtime.validate``)."""
    from autopar.api import check_stage_split
    from runtime.batch import as_inputs
    from runtime.validate import check_plan

    example = spec.example_inputs(batch, seq, device="meta")  # --seq beyond block_size
    if plan is None:
        return
    if plan.world_size != nproc:
        raise AutoparError(f"the plan is for {plan.world_size} ranks (mesh "
                           f"{plan.mesh.describe()}) but --nproc is {nproc}; pass --nproc "
                           f"{plan.world_size} or re-plan")
    if batch != plan.global_batch:
        raise AutoparError(f"--batch {batch}, but the plan was made for a global batch of "
                           f"{plan.global_batch}; pass --batch {plan.global_batch} or re-plan")
    if seq is not None and plan.seq_len and seq != plan.seq_len:
        raise AutoparError(f"--seq {seq}, but the plan was made for sequence length "
                           f"{plan.seq_len}; pass --seq {plan.seq_len} or re-plan")
    model = spec.build("meta")
    check_plan(model, plan)
    if plan.mesh.pp > 1:
        check_stage_split(model, plan, as_inputs(example), planned=False)


def check_resume(ckpt_dir: str) -> None:
    """Before any rank starts: the checkpoint a resume would load is sound and is data
    (``runtime.checkpoint_format.verify``); none yet is fine (the run starts fresh)."""
    from runtime.checkpoint_format import latest, verify

    found = latest(ckpt_dir)
    if found is not None:
        verify(found)


def _restarts_may_hang() -> bool:
    return (os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and dist_backend() == "gloo")


def dist_backend() -> str:
    import torch.distributed as dist

    return dist.get_backend()


def _report(name: str, batch: int, plan: Plan, resumed_from: int | None) -> None:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    lines = describe_run(name, plan, batch).split("\n")
    lines[0] += f", restart {restart}" + (
        f", resumed from step {resumed_from}" if resumed_from is not None else "")
    print("\n".join(lines))
    sys.stdout.flush()
