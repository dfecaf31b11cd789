"""Checkpoints: round trips across plans and world sizes, async save, crashes, bad input.

Plans: DDP, FSDP2, TP and their mixes from tests/runtime/test_runtime_numerics.py, and pipeline
plans (one stage per rank, with FSDP2 or TP inside) from tests/runtime/test_pipeline_numerics.py.

Jobs run on the session-wide rank pools (tests/dist_pool.py); checkpoints live in pytest's
tmp_path, which every local rank sees. "Bit-identical" is ``torch.equal`` on every full
(unsharded) parameter and optimizer-state tensor and ``==`` on every hyper-parameter.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_pipeline_numerics import GPT6, pipeline_plan
from test_runtime_numerics import GPT, MLP, _spec, gpt_all, gpt_mixed, gpt_tp, mlp_all, mlp_mixed

from runtime.checkpoint_format import (
    LATEST,
    MANIFEST,
    CheckpointCorruptError,
    CheckpointError,
    Manifest,
    commit,
    latest,
    prune,
    verify,
)
from runtime.plan import LayerPlan, Mesh, Plan

# -- jobs (every rank) ---------------------------------------------------------------------


def _trainer(model: tuple, plan_json: str, seed: int = 0):
    """Trainer, or PipelineTrainer for pp > 1 (autopar.lower.make_trainer)."""
    from autopar.lower import make_trainer

    spec, (_, _, batch, seq) = _spec(model), model
    return make_trainer(spec.build(seed=seed), Plan.from_json(plan_json), spec.loss_fn,
                        spec.example_inputs(batch, seq, device="meta"))


def full_state(trainer) -> dict:
    """Every model and optimizer entry, unsharded, by FQN, gathered from every rank (a
    pipeline rank holds only its stages'). Collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    from runtime.checkpoint import _parts

    mine = {}
    for module, optimizer in _parts(trainer):
        msd, osd = get_state_dict(module, optimizer,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
        for key, value in [*(("model." + k, v) for k, v in msd.items()),
                           *(("optim." + k, v) for k, v in osd.items())]:
            if isinstance(value, DTensor):
                value = value.full_tensor()
            mine[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in part.items()}


def train(trainer, model: tuple, steps: int, first: int = 0) -> list[float]:
    spec, (_, _, batch, seq) = _spec(model), model
    return [trainer.train_step(*spec.make_batch(batch, seq, seed=first + s)) for s in range(steps)]


def train_save_job(model: tuple, plan_json: str, root: str, steps: int = 2) -> dict:
    from runtime import checkpoint

    trainer = _trainer(model, plan_json)
    train(trainer, model, steps)
    torch.manual_seed(1234)
    checkpoint.save(trainer, root, step=steps, loader_state={"next_batch": steps, "epoch": 0},
                    model_name=model[0])
    rng_draw = torch.rand(4)
    return {"state": full_state(trainer), "rng_draw": rng_draw}


def load_job(model: tuple, plan_json: str, src: str, dst: str | None = None) -> dict:
    """A differently seeded trainer loads ``src`` (then saves to ``dst``)."""
    from runtime import checkpoint

    trainer = _trainer(model, plan_json, seed=7)
    restored = checkpoint.load(trainer, src)
    rng_draw = torch.rand(4)
    state = full_state(trainer)
    if dst:
        checkpoint.save(trainer, dst, step=restored.step, loader_state=restored.loader_state)
    return {"state": state, "rng_draw": rng_draw, "step": restored.step,
            "loader_state": restored.loader_state, "resharded": restored.resharded,
            "rng_restored": restored.rng_restored}


def assert_identical(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys(), f"{label}: keys differ: {sorted(set(got) ^ set(want))[:5]}"
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{label}: {key}"
        else:
            assert got[key] == value, f"{label}: {key}: {got[key]!r} != {value!r}"


# -- round trips ---------------------------------------------------------------------------

def _gpt6_fsdp4() -> str:
    names = ("wte", "wpe", *(f"h.{i}" for i in range(6)), "ln_f", "lm_head")
    return Plan(global_batch=GPT6[2], mesh=Mesh(dp=4),
                layers=tuple(LayerPlan(module=n, strategy="fsdp") for n in names)).to_json()


def _gpt6_ddp2() -> str:
    return Plan(global_batch=GPT6[2], mesh=Mesh(dp=2)).to_json()


# (model, plan A on 4 ranks, plan B on 2 ranks); pipeline plans as tests/test_pipeline_numerics
# makes them (v = 2 for the interleaved and V schedules: two stages per rank).
ROUND_TRIPS = {
    "gpt fsdp_modules4 -> tp+fsdp+replicate 1x2 -> back": (GPT, gpt_all("fsdp_modules", 4),
                                                           gpt_mixed(1, 2)),
    "gpt mixed 2x2 -> ddp2 -> back": (GPT, gpt_mixed(2, 2), gpt_all("replicate", 2)),
    "gpt tp2 x dp2 -> fsdp2 -> back": (GPT, gpt_tp(2, 2), gpt_all("fsdp", 2)),
    "mlp mixed 2x2 -> fsdp2 -> back": (MLP, mlp_mixed(2, 2), mlp_all("fsdp", 2)),
    "gpt6 pipeline pp2 x dp2 -> pipeline pp2 -> back": (GPT6, pipeline_plan("1F1B", pp=2, dp=2),
                                                      pipeline_plan("GPipe", pp=2)),
    "gpt6 fsdp4 -> pipeline pp2 -> back": (GPT6, _gpt6_fsdp4(), pipeline_plan("1F1B", pp=2)),
    "gpt6 pipeline pp2 x tp2 -> ddp2 -> back": (GPT6, pipeline_plan("1F1B", pp=2, tp=2, parallel="tp"),
                                                _gpt6_ddp2()),
    "gpt6 interleaved pp2 x dp2 -> zbv pp2 -> back": (
        GPT6, pipeline_plan("Interleaved1F1B", pp=2, dp=2), pipeline_plan("ZBVZeroBubble", pp=2)),
    "gpt6 fsdp4 -> interleaved zero-bubble pp2 -> back": (
        GPT6, _gpt6_fsdp4(), pipeline_plan("InterleavedZeroBubble", pp=2)),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_round_trip_across_plans_and_world_sizes_is_bit_identical(pool4, pool2, tmp_path, case):
    model, plan_a, plan_b = ROUND_TRIPS[case]
    a, b, a2 = (str(tmp_path / n) for n in ("a", "b", "a2"))
    saved = pool4.run(train_save_job, model, plan_a, a)[0]
    on_b = pool2.run(load_job, model, plan_b, a, b)
    for rank, got in enumerate(on_b):
        assert_identical(got["state"], saved["state"], f"{case}: plan B rank {rank}")
        assert got["step"] == 2 and got["loader_state"] == {"next_batch": 2, "epoch": 0}
        assert got["resharded"] and not got["rng_restored"]  # 4 -> 2 ranks: RNG not restored
    back = pool4.run(load_job, model, plan_a, b)
    for rank, got in enumerate(back):
        assert_identical(got["state"], saved["state"], f"{case}: back on plan A rank {rank}")


def test_same_world_restores_rng_and_trains_on_identically(pool2, tmp_path):
    root = str(tmp_path / "c")
    saved = pool2.run(train_save_job, GPT, gpt_all("fsdp", 2), root)
    got = pool2.run(load_job, GPT, gpt_tp(1, 2), root)
    for rank in range(2):
        assert got[rank]["rng_restored"]
        assert torch.equal(got[rank]["rng_draw"], saved[rank]["rng_draw"])
    continued = pool2.run(continue_job, GPT, gpt_all("fsdp", 2), root)
    assert continued[0]["after_load"] == continued[0]["uninterrupted"]


def continue_job(model: tuple, plan_json: str, root: str) -> dict:
    """Two more steps after loading equal two more steps of the run that saved (exactly)."""
    from runtime import checkpoint

    trainer = _trainer(model, plan_json, seed=3)
    checkpoint.load(trainer, root)
    after_load = train(trainer, model, 2, first=2)
    reference = _trainer(model, plan_json)
    train(reference, model, 2)
    return {"after_load": after_load, "uninterrupted": train(reference, model, 2, first=2)}


# -- asynchronous save ---------------------------------------------------------------------


def async_save_job(model: tuple, plan_json: str, root: str) -> dict:
    from runtime import checkpoint

    trainer = _trainer(model, plan_json)
    train(trainer, model, 1)
    snapshot = full_state(trainer)
    pending = checkpoint.save(trainer, root, step=1, async_save=True)
    train(trainer, model, 1, first=1)  # trains on while the save is written
    path = pending.wait()
    fresh = _trainer(model, plan_json, seed=5)
    checkpoint.load(fresh, root)
    return {"path": str(path), "snapshot": snapshot, "loaded": full_state(fresh)}


def test_async_save_writes_the_state_of_when_it_was_called(pool2, tmp_path):
    root = tmp_path / "c"
    results = pool2.run(async_save_job, GPT, gpt_mixed(1, 2), str(root))
    for got in results:
        assert got["path"] == str(root / "step_00000001")
        assert_identical(got["loaded"], got["snapshot"], "async save")
    assert (root / LATEST).read_text().strip() == "step_00000001"


# -- a failing or crashing save leaves the last good checkpoint ----------------------------


def failing_save_job(model: tuple, plan_json: str, root: str) -> str:
    """Save step 1, then make step 2's save fail on rank 1 after rank 0 wrote its data."""
    import torch.distributed.checkpoint as dcp

    from runtime import checkpoint

    trainer = _trainer(model, plan_json)
    train(trainer, model, 1)
    checkpoint.save(trainer, root, step=1)
    original = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):
        if torch.distributed.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = broken
    try:
        checkpoint.save(trainer, root, step=2)
    except CheckpointError as e:
        return str(e)
    finally:
        dcp.FileSystemWriter.write_data = original
    return "no error"


def test_a_save_that_fails_on_one_rank_raises_everywhere_and_keeps_the_last(pool2, tmp_path):
    root = tmp_path / "c"
    messages = pool2.run(failing_save_job, GPT, gpt_all("fsdp", 2), str(root))
    assert all("saving step 2" in m and "No space left" in m for m in messages), messages
    assert latest(root).name == "step_00000001"
    assert not (root / "step_00000002").exists()
    verify(root)


def crash_in_save_job(root: str) -> None:
    """Save step 1, then die hard (os._exit: no cleanup) in the middle of step 2's save:
    every rank has written its shard file, nobody has written the metadata or committed."""
    import torch.distributed.checkpoint as dcp

    from runtime import checkpoint

    trainer = _trainer(GPT, gpt_all("fsdp", 2))
    train(trainer, GPT, 1)
    checkpoint.save(trainer, root, step=1, loader_state={"next_batch": 1})
    original = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        original(self, plan, planner).wait()
        os._exit(3)

    dcp.FileSystemWriter.write_data = write_then_die
    train(trainer, GPT, 1, first=1)
    checkpoint.save(trainer, root, step=2)


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(pool2, tmp_path):
    from runtime.launch import LaunchError, spawn

    root = tmp_path / "c"
    with pytest.raises(LaunchError, match="exited without a result"):
        spawn(crash_in_save_job, 2, str(root), timeout_s=30)
    partial = root / ".tmp-step_00000002"
    assert any(partial.glob("*.distcp")), "the crash should come after data was written"
    assert latest(root).name == "step_00000001"
    got = pool2.run(load_job, GPT, gpt_all("fsdp", 2), str(root))
    assert got[0]["step"] == 1 and got[0]["loader_state"] == {"next_batch": 1}
    reference = pool2.run(train_save_job, GPT, gpt_all("fsdp", 2), str(tmp_path / "ref"), 1)
    assert_identical(got[0]["state"], reference[0]["state"], "after crash")
    # The next save commits and clears the debris.
    pool2.run(train_save_job, GPT, gpt_all("fsdp", 2), str(root), 3)
    assert latest(root).name == "step_00000003" and not partial.exists()


# -- bad input: a clear error, nothing changed ---------------------------------------------


def bad_load_job(model: tuple, plan_json: str, root: str) -> dict:
    from runtime import checkpoint

    trainer = _trainer(model, plan_json, seed=9)
    before = full_state(trainer)
    trainer.optimizer.state.clear()  # full_state initialised it; a fresh optimizer has none
    try:
        checkpoint.load(trainer, root)
        error = "no error"
    except CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    fresh = not trainer.optimizer.state
    return {"error": error, "unchanged": _same(before, full_state(trainer)),
            "optimizer_fresh": fresh}


def _same(a: dict, b: dict) -> bool:
    try:
        assert_identical(a, b, "")
    except AssertionError:
        return False
    return True


def _damage(root: Path, how: str) -> None:
    ckpt = latest(root)
    if how == "missing shard":
        (ckpt / "__1_0.distcp").unlink()
    elif how == "truncated shard":
        with open(ckpt / "__0_0.distcp", "r+b") as f:
            f.truncate(1000)
    elif how == "missing metadata":
        (ckpt / ".metadata").unlink()
    elif how == "missing manifest":
        (ckpt / MANIFEST).unlink()


BAD = {
    "wrong model": (None, ["CheckpointMismatchError", "different model", "not in it"]),
    "missing shard": ("missing shard", ["CheckpointCorruptError", "__1_0.distcp is missing"]),
    "truncated shard": ("truncated shard", ["CheckpointCorruptError", "__0_0.distcp is truncated"]),
    "missing metadata": ("missing metadata", ["CheckpointCorruptError", ".metadata is missing"]),
    "missing manifest": ("missing manifest", ["CheckpointCorruptError", "autopar.json is missing"]),
}


@pytest.fixture(scope="module")
def saved_gpt(pool2, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good") / "c"
    pool2.run(train_save_job, GPT, gpt_all("fsdp", 2), str(root))
    return root


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_gives_a_clear_error_and_changes_nothing(pool2, saved_gpt, tmp_path, case):
    import shutil

    damage, phrases = BAD[case]
    root = tmp_path / "c"
    shutil.copytree(saved_gpt, root)
    model, plan = (MLP, mlp_all("fsdp", 2)) if damage is None else (GPT, gpt_mixed(1, 2))
    if damage:
        _damage(root, damage)
    for got in pool2.run(bad_load_job, model, plan, str(root)):
        for phrase in phrases:
            assert phrase in got["error"], (phrase, got["error"])
        assert got["unchanged"] and got["optimizer_fresh"]


def test_optimizer_state_mismatch_is_named_and_rolled_back(pool2, saved_gpt):
    got = pool2.run(sgd_load_job, str(saved_gpt))[0]
    assert "has no optimizer state" in got["error"] and "another optimizer" in got["error"]
    assert got["unchanged"] and got["optimizer_fresh"]


def sgd_load_job(root: str) -> dict:
    from runtime import checkpoint
    from runtime.train import Trainer

    spec = _spec(GPT)
    trainer = Trainer(spec.build(seed=1), Plan.from_json(gpt_all("fsdp", 2)), spec.loss_fn,
                      lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    before = full_state(trainer)
    trainer.optimizer.state.clear()  # full_state initialised it; a fresh optimizer has none
    try:
        checkpoint.load(trainer, root)
        error = "no error"
    except CheckpointError as e:
        error = str(e)
    fresh = not trainer.optimizer.state
    return {"error": error, "unchanged": _same(before, full_state(trainer)),
            "optimizer_fresh": fresh}


# -- local: layout, pointer, pruning (no ranks) --------------------------------------------


def _fake_commit(root: Path, step: int) -> Path:
    tmp = root / f".tmp-step_{step:08d}"
    tmp.mkdir(parents=True)
    (tmp / "data").write_bytes(b"x" * step)
    final = root / f"step_{step:08d}"
    commit(tmp, final, Manifest(step=step, world_size=1, plan={"global_batch": 1}))
    return final


def test_commit_is_a_rename_and_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        current = _fake_commit(tmp_path, step)
        prune(tmp_path, 2, current)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_00000002", "step_00000003"]
    assert latest(tmp_path).name == "step_00000003"
    assert Manifest.read(current).files == {"data": 3}
    (tmp_path / LATEST).unlink()  # a lost pointer: the highest step is found
    assert latest(tmp_path).name == "step_00000003"


def test_missing_checkpoint_and_bad_manifest_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        verify(tmp_path / "nope")
    ckpt = _fake_commit(tmp_path, 1)
    (ckpt / MANIFEST).write_text('{"version": 99}')
    with pytest.raises(CheckpointCorruptError, match="format version 99 is not supported"):
        verify(ckpt)


# -- autopar reshard (offline) -------------------------------------------------------------


def test_reshard_cli_writes_a_checkpoint_plan_b_loads_bit_identically(pool2, saved_gpt, tmp_path, capsys):
    from autopar.cli import main

    plan_b = tmp_path / "b.json"
    plan_b.write_text(gpt_tp(1, 2))
    out = tmp_path / "out"
    assert main(["reshard", str(saved_gpt), "--plan", str(plan_b), "--out", str(out)]) == 0
    assert "gpt-tiny step 2" in capsys.readouterr().out
    ckpt, manifest, _ = verify(out)
    assert manifest.get_plan() == Plan.from_json(gpt_tp(1, 2))
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp"]
    want = pool2.run(load_job, GPT, gpt_tp(1, 2), str(saved_gpt))[0]["state"]
    got = pool2.run(load_job, GPT, gpt_tp(1, 2), str(out))
    assert not got[0]["resharded"]  # labelled with plan B now
    assert_identical(got[0]["state"], want, "resharded offline")


def test_reshard_cli_refuses_bad_input_with_exit_2_and_overwrites_nothing(saved_gpt, tmp_path, capsys):
    import shutil

    from autopar.cli import main

    plan_b = tmp_path / "b.json"
    plan_b.write_text(gpt_tp(1, 2))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    damaged = tmp_path / "damaged"
    shutil.copytree(saved_gpt, damaged)
    _damage(damaged, "truncated shard")
    cases = [
        (["--out", str(existing)], "exists; choose a new --out"),
        (["--out", str(tmp_path / "o1"), "--model", "mlp"], "different model"),
        (["--out", str(tmp_path / "o2"), "--model", "gpt-small"], "different model"),
    ]
    for extra, message in cases:
        assert main(["reshard", str(saved_gpt), "--plan", str(plan_b), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert main(["reshard", str(damaged), "--plan", str(plan_b), "--out", str(tmp_path / "o3")]) == 2
    assert "truncated" in capsys.readouterr().err
    assert (existing / "keep.txt").read_text() == "mine" and len(list(existing.iterdir())) == 1
    assert not any((tmp_path / n).exists() for n in ("o1", "o2", "o3"))
    assert not list(tmp_path.glob(".tmp-*"))
