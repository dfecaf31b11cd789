"""A training loop that checkpoints, resumes, and survives a lost rank (``autopar run --ckpt-dir``).

One function runs on every rank of an initialised process group, under ``autopar run``
(local processes) or under torchrun::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m autopar.cli run \\
        --model gpt-small --steps 1000 --ckpt-dir ckpts --ckpt-every 50 --resume

(torch 2.13's torchrun shares its rendezvous store with the ranks by default, and gloo
ranks restarted on it fail to connect, reading the previous attempt's addresses:
pytorch#135712. The variable turns the sharing off; ``autopar run`` warns without it.)

When a rank dies, torchrun's elastic agent stops the others and restarts the group; the
new ranks find the newest committed checkpoint under ``--ckpt-dir`` and continue from
it, so a failure costs at most the steps since that checkpoint. The plan: ``--plan`` if
given; else the checkpoint's own plan when the world size is unchanged (so a resumed run
computes exactly what the interrupted one would have); else a new plan for the new world
size (``Cluster.local(world)``, planned on rank 0), and the checkpoint is resharded as
it loads. The data position is the step: batch ``n`` is drawn from seed ``seed + n``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.lower import make_trainer
from autopar.training import plan_for_local_run
from autopar.zoo import ModelSpec, get_model
from runtime import checkpoint
from runtime.checkpoint_format import Manifest
from runtime.plan import Plan

StepCallback = Callable[[int, float], None]


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where and how often ``train_resumable`` checkpoints."""

    dir: str
    """Checkpoint root (``runtime.checkpoint_format``)."""
    every: int = 0
    """Save after every ``every`` steps (0: only after the last step)."""
    resume: bool = False
    """Continue from the newest checkpoint under ``dir`` if there is one."""
    keep: int | None = 2
    """Committed checkpoints to keep (None: all)."""
    async_save: bool = False
    """Write in a background thread while training continues."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {self.keep}")


@dataclass(frozen=True)
class RunResult:
    plan: Plan
    resumed_from: int | None
    """The step of the checkpoint the run continued from, if any."""
    resharded: bool
    losses: dict[int, float] = field(default_factory=dict)
    """Global mean loss of each step this run computed (1-based steps)."""


def _from_rank0(make: Callable[[], object]) -> object:
    """``make()`` on rank 0, shared with every rank; an AutoparError is re-raised everywhere."""
    payload: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            payload = [make()]
        except AutoparError as e:
            payload = [e]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], AutoparError):
        raise payload[0]
    return payload[0]


def choose_plan(spec: ModelSpec, plan: Plan | None, manifest: Manifest | None, *, batch: int,
                seq: int | None) -> Plan:
    """``plan``; else the checkpoint's at the same world size; else a new one for this world."""
    world = dist.get_world_size()
    if plan is not None:
        if plan.world_size != world:
            raise AutoparError(
                f"the plan is for {plan.world_size} ranks but {world} are running; drop --plan "
                "to re-plan for this world size"
            )
        return plan
    if manifest is not None and manifest.world_size == world:
        saved = manifest.get_plan()
        if saved.global_batch == batch:
            return saved
    text = _from_rank0(lambda: plan_for_local_run(spec, world, batch, seq).to_json())
    return Plan.from_json(str(text), source="plan from rank 0")


def train_resumable(spec: ModelSpec | str, *, steps: int, batch: int, seq: int | None = None,
                    seed: int = 0, plan: Plan | None = None, ckpt: CheckpointOptions | None,
                    on_step: StepCallback | None = None, device_type: str = "auto"
                    ) -> RunResult:
    """Train ``steps`` steps on every rank, resuming and checkpointing as ``ckpt`` says
    (``None``: no checkpoints), on ``device_type`` (``runtime.device``: auto is CUDA on
    ``LOCAL_RANK`` under an NCCL group, else CPU).

    ``on_step(step, loss)`` runs on every rank after each step (after its checkpoint).
    """
    spec = get_model(spec) if isinstance(spec, str) else spec
    found = _from_rank0(lambda: _newest(ckpt)) if ckpt and ckpt.resume else None
    manifest = Manifest.read(Path(str(found))) if found else None
    plan = choose_plan(spec, plan, manifest, batch=batch, seq=seq)
    torch.manual_seed(seed)
    example = spec.example_inputs(batch, seq, device="meta")
    trainer = make_trainer(spec.build(seed=seed), plan, spec.loss_fn, example,
                           device_type=device_type)
    start, resharded = 0, False
    if found:
        restored = checkpoint.load(trainer, str(found))
        start = int(restored.loader_state.get("next_step", restored.step))
        resharded = restored.resharded
    losses: dict[int, float] = {}
    for index in range(start, steps):
        inputs, targets = spec.make_batch(batch, seq, seed=seed + 1 + index)
        step = index + 1
        losses[step] = trainer.train_step(inputs, targets)
        if ckpt and ((ckpt.every and step % ckpt.every == 0) or step == steps):
            checkpoint.save(trainer, ckpt.dir, step=step, loader_state={"next_step": step},
                            model_name=spec.name, keep=ckpt.keep, async_save=ckpt.async_save)
        if on_step is not None:
            on_step(step, losses[step])
    checkpoint.wait_pending()
    return RunResult(plan, start if found else None, resharded, losses)


def _newest(ckpt: CheckpointOptions) -> str | None:
    path = checkpoint.latest(ckpt.dir)
    return None if path is None else str(path)


def resumable_worker(model_name: str, plan_json: str | None, steps: int, batch: int,
                     seq: int | None, seed: int, ckpt: CheckpointOptions | None,
                     device_type: str = "auto") -> RunResult:
    """For ``runtime.launch.spawn``: one rank of ``autopar run --ckpt-dir`` on local processes."""
    plan = Plan.from_json(plan_json) if plan_json else None
    return train_resumable(model_name, steps=steps, batch=batch, seq=seq, seed=seed, plan=plan,
                           ckpt=ckpt, device_type=device_type)
