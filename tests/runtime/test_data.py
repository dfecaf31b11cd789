"""The data helper (runtime/data.py): each rank loads only its share of a map-style Dataset,
and a user's loop on those local batches trains like one process on the global batches.

Each case trains gpt-tiny for two shuffled epochs of a 24-sample dataset (3 global
batches of 8 each) on 2 gloo ranks, with an LR scheduler and gradient clipping, and
compares every step's loss with one process reading the same permutation
(``DistributedSampler`` with one replica and the same seed) in global batches
(fp32, rtol 1e-5). The plans cover dp with gradient accumulation, FSDP, tp (both ranks
one replica: the same samples), cp (the same samples, split sequences) and a pipeline
(inputs only on the first stage, targets only on the last).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from test_clip import pipeline_plan
from test_runtime_numerics import GPT, _spec, gpt_all, gpt_tp
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from runtime.data import data_loader
from runtime.plan import LayerPlan, Mesh, Plan, PlanError

SAMPLES, BATCH, SEQ, EPOCHS, SEED, LR, MAX_NORM = 24, 8, 16, 2, 7, 1e-2, 0.5
TOL = dict(rtol=1e-5, atol=1e-6)


def _with(plan_json: str, **changes) -> str:
    return dataclasses.replace(Plan.from_json(plan_json), **changes).to_json()


def _cp_plan() -> str:
    layers = tuple(LayerPlan(module=m, strategy="replicate")
                   for m in ("wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"))
    return Plan(global_batch=BATCH, seq_len=SEQ, mesh=Mesh(cp=2), layers=layers).to_json()


CASES = {
    "dp-accumulation": _with(gpt_all("replicate", dp=2), gradient_accumulation=2),
    "fsdp": gpt_all("fsdp", dp=2),
    "tp": gpt_tp(dp=1, tp=2),
    "cp": _cp_plan(),
    "pp2": pipeline_plan(),
}


def dataset() -> TensorDataset:
    (x,), y = _spec(GPT).make_batch(SAMPLES, SEQ, seed=123)
    return TensorDataset(x, y)


def _scheduler(opt: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def reference() -> list[float]:
    """One process: the global batches of the same permutation, the same loop."""
    spec, data = _spec(GPT), dataset()
    net = spec.build(seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    sched = _scheduler(opt)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True):
            loss = spec.loss_fn(net(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def loop_job(plan_json: str) -> dict:
    """A user's loop: the loader's local batches, clipping, the scheduler."""
    from autopar.lower import make_trainer

    spec = _spec(GPT)
    plan = Plan.from_json(plan_json)
    trainer = make_trainer(spec.build(seed=0), plan, spec.loss_fn,
                           spec.example_inputs(BATCH, SEQ, device="meta"),
                           lambda params: torch.optim.AdamW(params, lr=LR),
                           lr_scheduler_factory=_scheduler)
    loader = data_loader(trainer, dataset(), seed=SEED)
    losses, shapes, lrs = [], [], []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            shapes.append((None if x is None else tuple(x.shape),
                           None if y is None else tuple(y.shape)))
            loss = trainer.forward_backward(x, y)
            trainer.clip_grad_norm_(MAX_NORM)
            trainer.step()
            losses.append(loss.item())
            lrs.append(trainer.optimizer.param_groups[0]["lr"])
    return {"losses": losses, "shapes": shapes, "lrs": lrs, "steps": len(loader),
            "scheduler_steps": trainer.lr_scheduler.last_epoch}


EXPECTED_SHAPES = {  # per rank: (inputs, targets) of each local batch
    "dp-accumulation": [((4, SEQ), (4, SEQ))] * 2,
    "fsdp": [((4, SEQ), (4, SEQ))] * 2,
    "tp": [((8, SEQ), (8, SEQ))] * 2,
    "cp": [((8, SEQ // 2), (8, SEQ // 2))] * 2,
    "pp2": [((8, SEQ), None), (None, (8, SEQ))],
}


@pytest.mark.parametrize("case", CASES)
def test_local_batches_train_like_one_process_on_the_global_batches(pool2, case):
    want = reference()
    steps = EPOCHS * SAMPLES // BATCH
    for rank, got in enumerate(pool2.run(loop_job, CASES[case])):
        torch.testing.assert_close(got["losses"], want, **TOL, msg=f"rank {rank}")
        assert got["steps"] == SAMPLES // BATCH
        assert got["shapes"] == [EXPECTED_SHAPES[case][rank]] * steps
        assert got["scheduler_steps"] == steps
        assert got["lrs"] == pytest.approx([LR / (2 + s) for s in range(steps)])


# -- without ranks: what each rank reads, and bad input ------------------------------------


class CountingDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size, self.reads = size, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        self.reads += 1
        return torch.tensor([float(i)]), torch.tensor(i)


def _fake_trainer(plan: Plan, *, dp_rank: int = 0, first: bool = True, last: bool = True):
    def local_batch(inputs, targets):
        return inputs, targets

    return SimpleNamespace(plan=plan, dp_rank=dp_rank, loss_fn=lambda o, y: o,
                           has_first=first, has_last=last, local_batch=local_batch)


def _plan(dp: int = 2, pp: int = 1, batch: int = 8) -> Plan:
    if pp == 1:
        return Plan(global_batch=batch, mesh=Mesh(dp=dp))
    return Plan.from_json(_with(pipeline_plan(), global_batch=batch,
                                mesh=Mesh(pp=pp, dp=dp)))


def test_each_dp_rank_reads_only_its_half_and_together_the_global_batches():
    plan = _plan(dp=2)
    seen = []
    for rank in range(2):
        data = CountingDataset(20)
        batches = list(data_loader(_fake_trainer(plan, dp_rank=rank), data, shuffle=False))
        # 10 of the 20 samples fall to each rank: two local batches of 4, 2 left over
        assert data.reads == 8
        seen.append([x.flatten().tolist() for x, _ in batches])
    for step in range(2):  # global batch k = samples [8k, 8k + 8), interleaved over the ranks
        assert sorted(seen[0][step] + seen[1][step]) == list(range(8 * step, 8 * step + 8))


def test_a_middle_pipeline_stage_reads_nothing_and_steps_as_often():
    data = CountingDataset(24)
    loader = data_loader(_fake_trainer(_plan(dp=1, pp=2), first=False, last=False), data)
    assert list(loader) == [(None, None)] * 3
    assert data.reads == 0


def test_a_first_stage_gets_no_targets_and_a_last_stage_no_inputs():
    plan = _plan(dp=1, pp=2)
    first = list(data_loader(_fake_trainer(plan, last=False), CountingDataset(8)))
    last = list(data_loader(_fake_trainer(plan, first=False), CountingDataset(8)))
    assert first[0][1] is None and first[0][0].shape == (8, 1)
    assert last[0][0] is None and last[0][1].shape == (8,)


def test_the_same_seed_gives_every_rank_one_permutation_and_epochs_reshuffle():
    plan = _plan(dp=2)
    orders = {}
    for rank in range(2):
        loader = data_loader(_fake_trainer(plan, dp_rank=rank), CountingDataset(16), seed=3)
        for epoch in range(2):
            loader.set_epoch(epoch)
            orders[rank, epoch] = [int(v) for x, _ in loader for v in x.flatten()]
    for epoch in range(2):  # disjoint halves covering every sample
        assert sorted(orders[0, epoch] + orders[1, epoch]) == list(range(16))
    assert orders[0, 0] != orders[0, 1]


@pytest.mark.parametrize(("plan", "size", "kwargs", "message"), [
    (_plan(dp=2), 1, {}, r"1 sample\(s\), fewer than the plan's 2 data-parallel replicas"),
    (_plan(dp=2), 6, {}, r"6 sample\(s\), less than one global batch of 8"),
    (_plan(dp=2), 16, {"global_batch": 7},
     r"global batch 7 does not split over the plan's dp=2 replicas.*multiple of dp × "
     r"gradient_accumulation = 2"),
    (_plan(dp=1, pp=2), 16, {"global_batch": 3},
     r"pipeline.num_microbatches=2 equal micro-batches.*= 2"),
    (_plan(dp=1, pp=2), 16, {"drop_last": False}, r"pipeline.*use drop_last=True"),
    (_plan(dp=2), 11, {"drop_last": False, "global_batch": 8},
     r"last local batch has 2 samples"),
])
def test_bad_input_is_a_plan_error_before_any_collective(plan, size, kwargs, message):
    if "drop_last" in kwargs and plan.mesh.pp == 1:
        plan = dataclasses.replace(plan, gradient_accumulation=4)
    with pytest.raises(PlanError, match=message):
        data_loader(_fake_trainer(plan), CountingDataset(size), **kwargs)
    assert not dist.is_initialized()


def test_an_iterable_dataset_is_refused_with_the_remedy():
    with pytest.raises(PlanError, match="map-style Dataset"):
        data_loader(_fake_trainer(_plan()), iter(range(8)))


class DictDataset(Dataset):
    """Hugging Face style: each item is the model's keyword arguments, labels included."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.full((3,), i), "labels": torch.full((3,), -i)}


def test_without_a_loss_fn_items_are_the_models_inputs_and_targets_are_none():
    trainer = _fake_trainer(_plan(dp=2, batch=4), dp_rank=1)
    trainer.loss_fn = None
    batches = list(data_loader(trainer, DictDataset(), shuffle=False))
    assert [targets for _, targets in batches] == [None, None]
    assert [b["input_ids"][:, 0].tolist() for b, _ in batches] == [[1, 3], [5, 7]]
    assert all(torch.equal(b["labels"], -b["input_ids"]) for b, _ in batches)


def test_with_a_loss_fn_an_item_that_is_no_pair_is_refused():
    with pytest.raises(PlanError, match=r"\(inputs, targets\) pair, but a batch came as dict"):
        list(data_loader(_fake_trainer(_plan(dp=2, batch=4)), DictDataset()))
