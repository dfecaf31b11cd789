"""``autopar run train.py [ARGS]``: the user's script on every rank, with torchrun semantics.

Parent side (``launch``): everything that can be wrong with the request is checked before
a process starts — the script exists, the plan parses, its world size is nodes × ranks per
node and its TP groups fit in a node — then torchrun's own launcher
(``torch.distributed.run``, in this process) starts the ranks. The plan reaches
``autopar.compile`` as ``$AUTOPAR_PLAN`` (``runtime.launch.launched_plan``).

Rank side (``python -m autopar.launch_script train.py ARGS``, what torchrun starts, here
and in the exported scripts): configure logging, run the script as ``__main__``, and when
a plan was passed but the script never called ``autopar.compile``, exit 3, which
``autopar run`` reports as bad input (exit 2) naming the script and the plan.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import AutoparError
from autopar.export import Launch, check_launch
from autopar.logs import LOG_ENV, configured_logging, default_level
from runtime.device import resolve_device_type
from runtime.launch import PLAN_ENV, compile_called
from runtime.plan import Plan

EXIT_BAD_INPUT = 2
EXIT_PLAN_UNUSED = 3
"""A rank's status when a plan was passed and the script never called ``autopar.compile``."""
_PARENT_REPORTS = "AUTOPAR_RUN_REPORTS"


@dataclass(frozen=True, kw_only=True)
class ScriptRun:
    """One ``autopar run train.py`` request."""

    script: str
    script_args: tuple[str, ...] = ()
    plan_path: str | None = None
    nodes: int = 1
    nproc_per_node: int | None = None
    """Ranks per node (default: the plan's world size over ``nodes``, else 2)."""
    rdzv_endpoint: str | None = None
    """host:port of the first node; needed with several nodes."""
    device: str = "auto"
    log_level: str | None = None
    """The ranks' logging level (default: ``$AUTOPAR_LOG_LEVEL`` or WARNING)."""


def check_request(req: ScriptRun) -> tuple[Launch, Plan | None]:
    """The launch shape and the plan, or an AutoparError naming what is wrong."""
    if not Path(req.script).is_file():
        raise AutoparError(f"script {req.script} does not exist (or is not a file); give the "
                           "path of your training script, e.g. `autopar run train.py`")
    resolve_device_type(req.device)  # --device cuda without a GPU fails here, not on a rank
    plan = Plan.load(req.plan_path) if req.plan_path else None
    nproc = req.nproc_per_node
    if nproc is None:
        nproc = max(1, plan.world_size // req.nodes) if plan is not None else 2
    launch = Launch(nodes=req.nodes, nproc_per_node=nproc)
    if plan is not None:
        check_launch(plan, launch)
    if req.nodes > 1 and not req.rdzv_endpoint:
        raise AutoparError(f"--nodes {req.nodes} needs --rdzv-endpoint HOST:PORT (the first "
                           "node's address), the same on every node")
    return launch, plan


def torchrun_argv(req: ScriptRun, launch: Launch) -> list[str]:
    """Arguments for ``torch.distributed.run`` (torchrun)."""
    argv = [f"--nnodes={launch.nodes}", f"--nproc-per-node={launch.nproc_per_node}"]
    if launch.nodes > 1:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={req.rdzv_endpoint}",
                 "--rdzv-id=autopar"]
    else:
        argv += ["--standalone"]
    return argv + ["-m", "autopar.launch_script", req.script, *req.script_args]


def launch(req: ScriptRun) -> int:
    """Check, then run the script on every rank; the exit status of the job (2 when every
    failed rank exited 2: bad input, such as a plan the script never used)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    shape, _ = check_request(req)
    env = {_PARENT_REPORTS: "1", LOG_ENV: req.log_level or default_level()}
    if req.plan_path:
        env[PLAN_ENV] = str(Path(req.plan_path).resolve())
    if req.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # "auto" in the script then means CPU
    try:
        with _environment(env):  # what the ranks inherit; this process gets its own back
            run(parse_args(torchrun_argv(req, shape)))
    except ChildFailedError as e:
        return _report_failure(req, {rank: f.exitcode for rank, f in e.failures.items()})
    return 0


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _report_failure(req: ScriptRun, codes: dict[int, int]) -> int:
    """Say which ranks failed; exit 2 when the failures were bad input (negative codes are
    ranks the launcher stopped after the first failure)."""
    exited = {code for code in codes.values() if code > 0}
    if exited == {EXIT_PLAN_UNUSED} and req.plan_path:
        print(f"autopar run: error: {_unused_plan(req.script, str(Path(req.plan_path).resolve()))}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"autopar run: {req.script} failed on rank(s) {sorted(codes)} (exit codes {codes})",
          file=sys.stderr)
    return EXIT_BAD_INPUT if exited == {EXIT_BAD_INPUT} else 1


def _unused_plan(script: str, plan: str) -> str:
    return (f"{script} ended without calling autopar.compile, so the plan {plan} was never "
            "used; call autopar.compile(model, cluster, example_inputs) in the script (it "
            f"reads the plan from ${PLAN_ENV}), or run without --plan")


def rank_main(argv: list[str]) -> int:
    """One rank: the script as ``__main__`` with its own arguments, as ``python train.py``."""
    if not argv:
        print("usage: python -m autopar.launch_script SCRIPT [ARGS...]", file=sys.stderr)
        return EXIT_BAD_INPUT
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        with configured_logging(propagate=False):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    plan = os.environ.get(PLAN_ENV)
    if plan and not compile_called():
        # Under `autopar run` the parent says it once; launched otherwise, rank 0 says it.
        if os.environ.get("RANK", "0") == "0" and _PARENT_REPORTS not in os.environ:
            print(f"autopar run: error: {_unused_plan(script, plan)}", file=sys.stderr)
        return EXIT_PLAN_UNUSED
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
