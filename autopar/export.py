"""Take a plan elsewhere: a torchtitan parallelism block, a torchrun command, a SLURM script.

The torchtitan block uses the field names of torchtitan's ``JobConfig`` (``[parallelism]``
in ``torchtitan/config/job_config.py``). torchtitan applies one data-parallel style to the
whole model, while an autopar plan may mix per layer; the block takes the style that holds
most of the parameters' layers and says so in a comment. The launch commands run
``autopar run`` with the plan's JSON on ``nodes × nproc_per_node`` ranks, which must equal
the plan's world size.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass

from autopar.errors import ConfigError
from runtime.plan import Plan

SHARDED = ("fsdp", "tp_fsdp")


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Where the plan runs: ``nodes`` × ``nproc_per_node`` ranks."""

    nodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


def launch_for(plan: Plan, nodes: int | None = None, nproc_per_node: int | None = None) -> Launch:
    """The launch shape: given, or the cluster the plan was made for (its rationale)."""
    r = plan.rationale
    if nproc_per_node is None:
        nproc_per_node = r.devices_per_node if r else min(plan.world_size, 8)
    if nodes is None:
        nodes = r.nodes if r else max(1, plan.world_size // nproc_per_node)
    launch = Launch(nodes=nodes, nproc_per_node=nproc_per_node)
    if launch.world_size != plan.world_size:
        raise ConfigError(
            f"{nodes} node(s) × {nproc_per_node} process(es) = {launch.world_size} ranks, but the "
            f"plan is for {plan.world_size} (mesh {plan.mesh.describe()}); pass --nodes and --nproc-per-node whose product is "
            f"{plan.world_size}, or re-plan for this cluster"
        )
    return launch


def torchtitan_toml(plan: Plan) -> str:
    """A ``[parallelism]`` (and ``[training]``) block for a torchtitan job config."""
    mesh = plan.mesh
    styles = Counter(layer.strategy for layer in plan.layers)
    sharded = sum(n for s, n in styles.items() if s in SHARDED)
    shard = sharded * 2 >= sum(styles.values()) and mesh.dp > 1
    micro = plan.global_batch // mesh.dp
    schedule = plan.pipeline.schedule if plan.pipeline else "1F1B"
    if plan.pipeline is not None:
        micro //= plan.pipeline.num_microbatches
    splits = [layer.module for prev, layer in zip(plan.layers, plan.layers[1:], strict=False)
              if layer.stage != prev.stage]
    mix = ", ".join(f"{n} {s}" for s, n in sorted(styles.items()))
    lines = [
        f"# autopar plan for {plan.model or 'the model'} on {plan.cluster or 'the cluster'}: "
        f"{plan.world_size} ranks",
        f"# per-layer strategies in the plan: {mix}; torchtitan applies one data-parallel "
        f"style to every layer ({'FSDP' if shard else 'DDP'} here)",
        "[parallelism]",
        f"data_parallel_replicate_degree = {1 if shard else mesh.dp}",
        f"data_parallel_shard_degree = {mesh.dp if shard else 1}",
        f"context_parallel_degree = {mesh.cp}",
        f"tensor_parallel_degree = {mesh.tp}",
        f"pipeline_parallel_degree = {mesh.pp}",
        f'pipeline_parallel_schedule = "{schedule}"',
        f"pipeline_parallel_microbatch_size = {micro}",
        "pipeline_parallel_split_points = [" + ", ".join(f'"{s}"' for s in splits) + "]",
        "",
        "[training]",
        f"global_batch_size = {plan.global_batch}",
        f"local_batch_size = {plan.global_batch // mesh.dp}",
    ]
    if plan.seq_len:
        lines.append(f"seq_len = {plan.seq_len}")
    if plan.param_dtype in ("bfloat16", "float32"):
        lines.append(f'mixed_precision_param = "{plan.param_dtype}"')
    return "\n".join(lines) + "\n"


def run_args(plan: Plan, plan_path: str, model: str | None = None, steps: int | None = None
             ) -> list[str]:
    """``autopar run`` arguments that execute ``plan_path``."""
    args = ["run", "--model", model or plan.model, "--plan", plan_path,
            "--batch", str(plan.global_batch)]
    if plan.seq_len:
        args += ["--seq", str(plan.seq_len)]
    if steps is not None:
        args += ["--steps", str(steps)]
    return args


def torchrun_argv(plan: Plan, plan_path: str, launch: Launch, *, rdzv_endpoint: str =
                  "$MASTER_ADDR:29500", model: str | None = None, steps: int | None = None
                  ) -> list[str]:
    argv = ["torchrun", f"--nnodes={launch.nodes}", f"--nproc-per-node={launch.nproc_per_node}"]
    if launch.nodes > 1:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=autopar"]
    else:
        argv += ["--standalone"]
    return argv + ["-m", "autopar.cli", *run_args(plan, plan_path, model, steps)]


def torchrun_command(plan: Plan, plan_path: str, launch: Launch, **kwargs) -> str:
    """One shell line; ``$MASTER_ADDR`` is left for the shell to expand."""
    return " ".join(a if a.startswith("--rdzv-endpoint=$") else shlex.quote(a)
                    for a in torchrun_argv(plan, plan_path, launch, **kwargs))


def slurm_script(plan: Plan, plan_path: str, launch: Launch, *, job_name: str = "autopar",
                 time_limit: str = "01:00:00", **kwargs) -> str:
    """An sbatch script: one task per node, each starting torchrun for its node's ranks."""
    cmd = torchrun_command(plan, plan_path, launch, **kwargs)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={launch.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={launch.nproc_per_node}",
        f"#SBATCH --time={time_limit}",
        f"# world size {launch.world_size} = {launch.nodes} node(s) × {launch.nproc_per_node}: "
        f"mesh {plan.mesh.describe()}",
        "set -euo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_ADDR",
        f"srun {cmd}",
        "",
    ])
