"""Take a plan elsewhere: a torchrun command, a SLURM script (the engines' own settings,
torchtitan's among them, are ``autopar.exports``).

The launch scripts (executable, written atomically) start ``nodes × nproc_per_node`` ranks
with torchrun: the user's script (``autopar.launch_script``; ``autopar.compile`` takes the
plan from ``$AUTOPAR_PLAN``) or ``autopar run`` on a built-in model. ``check_launch``
refuses a shape the plan's mesh cannot use before anything is written.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import ConfigError
from autopar.generated import comment
from runtime.files import write_atomic
from runtime.launch import PLAN_ENV
from runtime.plan import Plan

logger = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True)
class Launch:
    """Where the plan runs: ``nodes`` × ``nproc_per_node`` ranks."""

    nodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


def launch_for(plan: Plan, nodes: int | None = None, nproc_per_node: int | None = None) -> Launch:
    """The launch shape: given, or the cluster the plan was made for (its rationale);
    checked against the plan's mesh (``check_launch``)."""
    r = plan.rationale
    if nproc_per_node is None:
        nproc_per_node = r.devices_per_node if r else min(plan.world_size, 8)
    if nodes is None:
        nodes = r.nodes if r else max(1, plan.world_size // nproc_per_node)
    launch = Launch(nodes=nodes, nproc_per_node=nproc_per_node)
    check_launch(plan, launch)
    return launch


def check_launch(plan: Plan, launch: Launch) -> None:
    """Refuse a launch the plan's mesh cannot use: the world size must be the plan's, and a
    tensor-parallel group (the mesh's innermost axis: consecutive ranks) must stay inside a
    node, so ``tp`` divides the ranks per node. A context-parallel group that spans nodes
    still runs, over the network; it is logged, not refused."""
    mesh = plan.mesh
    if launch.nodes < 1 or launch.nproc_per_node < 1:
        raise ConfigError(f"nodes and ranks per node must be at least 1, got {launch.nodes} "
                          f"node(s) × {launch.nproc_per_node}")
    if launch.world_size != plan.world_size:
        raise ConfigError(
            f"{launch.nodes} node(s) × {launch.nproc_per_node} process(es) = "
            f"{launch.world_size} ranks, but the plan is for {plan.world_size} (mesh "
            f"{mesh.describe()}); launch nodes × ranks per node = {plan.world_size}, or "
            "re-plan for this cluster"
        )
    if launch.nproc_per_node % mesh.tp:
        raise ConfigError(
            f"the plan's tensor-parallel groups have {mesh.tp} ranks (mesh {mesh.describe()}), "
            f"which {launch.nproc_per_node} ranks per node cannot hold: a TP group must stay "
            f"inside a node; use a multiple of {mesh.tp} ranks per node, or re-plan"
        )
    if launch.nproc_per_node % (mesh.tp * mesh.cp):
        logger.warning("context-parallel groups (cp=%d × tp=%d) span nodes: their ring "
                       "exchange crosses the network", mesh.cp, mesh.tp)


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every rank runs: the user's ``script`` with its arguments (``autopar.compile``
    reads the plan from ``$AUTOPAR_PLAN``), or else a built-in ``model`` (``autopar run``)."""

    script: str | None = None
    script_args: tuple[str, ...] = ()
    model: str | None = None
    """Built-in model when there is no script (default: the one the plan names)."""
    steps: int | None = None
    device: str = "auto"
    """auto, cpu or cuda; cpu also hides the GPUs from a script and asks SLURM for none."""


def run_args(plan: Plan, plan_path: str, model: str | None = None, steps: int | None = None,
             device: str = "auto") -> list[str]:
    """``autopar run`` arguments that execute ``plan_path`` on a built-in model."""
    args = ["run", "--model", model or plan.model, "--plan", plan_path,
            "--batch", str(plan.global_batch)]
    if plan.seq_len:
        args += ["--seq", str(plan.seq_len)]
    if steps is not None:
        args += ["--steps", str(steps)]
    return args + ["--device", device]


# Left for the shell to expand (each script sets or checks them first), so never quoted.
ENDPOINT = "--rdzv-endpoint=$MASTER_ADDR:${MASTER_PORT:-29500}"
RDZV_ID = "--rdzv-id=${SLURM_JOB_ID:-autopar}"
SLURM_RDZV_ID = "--rdzv-id=$SLURM_JOB_ID"
SHELL_WORDS = (ENDPOINT, RDZV_ID, SLURM_RDZV_ID)


def torchrun_argv(plan: Plan, plan_path: str, launch: Launch, job: Job | None = None, *,
                  rendezvous: bool | None = None, rdzv_id: str = RDZV_ID) -> list[str]:
    """torchrun's arguments; a c10d rendezvous at ``$MASTER_ADDR`` when ``rendezvous``
    (default: more than one node), else ``--standalone``."""
    job = job or Job()
    argv = ["torchrun", f"--nnodes={launch.nodes}", f"--nproc-per-node={launch.nproc_per_node}"]
    if launch.nodes > 1 if rendezvous is None else rendezvous:
        argv += ["--rdzv-backend=c10d", ENDPOINT, rdzv_id]
    else:
        argv += ["--standalone"]
    if job.script is not None:
        return argv + ["-m", "autopar.launch_script", job.script, *job.script_args]
    if not (job.model or plan.model):
        raise ConfigError("the plan names no built-in model to run; pass --script train.py "
                          "to launch your own training script with it")
    return argv + ["-m", "autopar.cli", *run_args(plan, plan_path, job.model, job.steps,
                                                    job.device)]


def torchrun_command(plan: Plan, plan_path: str, launch: Launch, job: Job | None = None,
                     **kwargs) -> str:
    """One shell line; the rendezvous variables are left for the shell to expand."""
    return " ".join(a if a in SHELL_WORDS else shlex.quote(a)
                    for a in torchrun_argv(plan, plan_path, launch, job, **kwargs))


def _environment(plan_path: str, job: Job) -> list[str]:
    lines = ["export AUTOPAR_LOG_LEVEL=${AUTOPAR_LOG_LEVEL:-INFO}"]
    if job.script is not None:
        lines.append(f"export {PLAN_ENV}={shlex.quote(plan_path)}")
        if job.device == "cpu":
            lines.append("export CUDA_VISIBLE_DEVICES=''  # --device cpu: the script sees no GPU")
    return lines


def _header(plan: Plan, launch: Launch, job: Job) -> str:
    what = f"{job.script} {shlex.join(job.script_args)}".strip() if job.script else \
        f"built-in model {job.model or plan.model}"
    return (f"# {comment(what)}: world size {launch.world_size} = {launch.nodes} node(s) × "
            f"{launch.nproc_per_node}, mesh {plan.mesh.describe()}")


def torchrun_script(plan: Plan, plan_path: str, launch: Launch, job: Job | None = None) -> str:
    """A shell script that starts this node's ranks; run it on every node, with
    ``MASTER_ADDR`` (the first node) set when there are several."""
    job = job or Job()
    lines = ["#!/bin/bash", _header(plan, launch, job), "set -euo pipefail"]
    if launch.nodes > 1:
        lines += [': "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"']
    lines += _environment(plan_path, job)
    return "\n".join([*lines, "exec " + torchrun_command(plan, plan_path, launch, job), ""])


def slurm_script(plan: Plan, plan_path: str, launch: Launch, job: Job | None = None, *,
                 job_name: str = "autopar", time_limit: str = "01:00:00") -> str:
    """An sbatch script: one task per node, each starting torchrun for its node's ranks,
    meeting at the job's first node under the job's id."""
    job = job or Job()
    cmd = torchrun_command(plan, plan_path, launch, job, rendezvous=True, rdzv_id=SLURM_RDZV_ID)
    sbatch = [f"--job-name={job_name}", f"--nodes={launch.nodes}", "--ntasks-per-node=1",
              f"--time={time_limit}"]
    if job.device != "cpu":
        sbatch.insert(3, f"--gpus-per-node={launch.nproc_per_node}")
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {option}" for option in sbatch),
        _header(plan, launch, job),
        "set -euo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        # One port per job, so two jobs sharing a first node do not meet on one store.
        "MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}",
        "export MASTER_ADDR MASTER_PORT",
        *_environment(plan_path, job),
        f"srun {cmd}",
        "",
    ])


def write_script(path: str | os.PathLike, text: str, *, executable: bool = True) -> Path:
    """Write atomically (``runtime.files.write_atomic``), executable unless told."""
    return write_atomic(path, text, mode=0o755 if executable else 0o644)
