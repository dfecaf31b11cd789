"""Train a built-in model under a plan on local ranks (what ``autopar run --model`` does):
CPU processes with gloo, or one per CUDA device with NCCL (``device_type``, default auto)."""

from __future__ import annotations

import torch

from autopar.api import check_stage_split, search_plans
from autopar.errors import AutoparError
from autopar.lower import make_trainer
from autopar.zoo import ModelSpec, get_model
from cost_models.hardware import Cluster
from runtime.batch import as_inputs
from runtime.device import backend_for
from runtime.launch import spawn
from runtime.plan import Plan
from runtime.step_log import StepLog
from runtime.validate import check_plan


def plan_for_local_run(spec: ModelSpec, nproc: int, batch: int, seq: int | None) -> Plan:
    """Plan the model for ``nproc`` CPU processes of this machine."""
    inputs = spec.example_inputs(batch, seq, device="meta")
    seq_len = inputs[0].shape[1] if spec.kind == "gpt" else None
    return search_plans(spec.build("meta"), Cluster.local(nproc), inputs, model_name=spec.name,
                        seq_len=seq_len).plan


def run_local(spec: ModelSpec, plan: Plan, *, nproc: int, steps: int, batch: int,
              seq: int | None, seed: int = 0, timeout_s: float = 300,
              device_type: str = "auto") -> list[float]:
    """Global mean loss per step, from rank 0."""
    if plan.world_size != nproc:
        raise AutoparError(
            f"the plan is for {plan.world_size} ranks (mesh {plan.mesh.describe()})"
            f" but --nproc is {nproc}; pass --nproc {plan.world_size} or re-plan"
        )
    # Here, not as a traceback from each rank: what apply and the stage split refuse.
    model = spec.build("meta")
    check_plan(model, plan)
    if plan.mesh.pp > 1:
        check_stage_split(model, plan, as_inputs(spec.example_inputs(batch, seq, device="meta")),
                          planned=False)
    results = spawn(train_worker, nproc, spec.name, plan.to_json(), steps, batch, seq, seed,
                    device_type, backend=backend_for(device_type), timeout_s=timeout_s)
    return results[0]


def train_worker(model_name: str, plan_json: str, steps: int, batch: int, seq: int | None,
                 seed: int, device_type: str = "auto", log_every: int = 10) -> list[float]:
    """One rank: build the seeded model, apply the plan, train on seeded global batches;
    a ``runtime.step_log`` line every ``log_every`` steps."""
    torch.manual_seed(seed)
    spec = get_model(model_name)
    plan = Plan.from_json(plan_json)
    example = spec.example_inputs(batch, seq, device="meta")
    trainer = make_trainer(spec.build(seed=seed), plan, spec.loss_fn, example,
                           device_type=device_type)
    tokens = (seq or spec.default_seq) if spec.kind == "gpt" else None
    log = StepLog(trainer, every=log_every, tokens_per_sample=tokens)
    losses = []
    for step in range(steps):
        inputs, targets = spec.make_batch(batch, seq, seed=seed + 1 + step)
        losses.append(trainer.train_step(inputs, targets))
        log(step + 1, losses[-1])
    return losses


def describe_run(model_name: str, plan: Plan, batch: int) -> str:
    """The header `autopar run` prints: mesh, pipeline schedule, and each layer's strategy."""
    mesh = plan.mesh
    head = (f"{model_name} on {plan.world_size} rank(s): mesh {mesh.describe()}, "
            f"global batch {batch}")
    if plan.pipeline is not None:
        p = plan.pipeline
        head += (f", schedule {p.schedule} with {p.num_microbatches} micro-batches"
                 + (f" and {p.virtual_stages} stages per rank" if p.virtual_stages > 1 else ""))
    rows = [f"  {layer.module:<12} {layer.strategy:<10}"
            + (f" stage {layer.stage}" if plan.pipeline is not None else "")
            for layer in plan.layers]
    return "\n".join([head, *rows])

