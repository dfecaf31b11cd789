"""Models built on the meta device: each rank allocates and initialises only its own
shards, the same on every rank whatever its seed, equal to one process
(``runtime.materialize``); models built with real weights train rank 0's.

Every distributed case seeds its ranks differently on purpose, and compares the
initial weights and three training steps with one process materialising the same meta
model with the same seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from reference import full_tensor, hf_gpt2, train_one_process
from test_runtime_numerics import BLOCK_TP

from autopar.zoo import get_model
from runtime.materialize import check_initializable, first_names, materialize, on_meta
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan, PlanError

SEED = 7
STEPS = 3
LR = 1e-3
BATCH, SEQ = 8, 16


# -- one process ---------------------------------------------------------------------------


class NoInit(nn.Module):
    """A module with a bare parameter and no way to initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Net(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.fc(x))


def _meta(build):
    with torch.device("meta"):
        return build()


def test_values_depend_on_the_seed_and_names_only():
    a, b = get_model("gpt-tiny").build("meta"), get_model("gpt-tiny").build("meta")
    torch.manual_seed(1)
    materialize(a, "cpu", SEED)
    torch.manual_seed(2)  # the caller's generator plays no part
    materialize(b, "cpu", SEED)
    assert not on_meta(a)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    # the model's own init_weights ran: GPT-2's std 0.02 on Linear weights, zero biases
    assert 0.015 < a.h[0].mlp.fc_in.weight.std().item() < 0.025
    assert torch.count_nonzero(a.h[0].mlp.fc_in.bias) == 0
    c = get_model("gpt-tiny").build("meta")
    materialize(c, "cpu", SEED + 1)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_materialize_leaves_the_callers_generator_alone():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    materialize(get_model("gpt-tiny").build("meta"), "cpu", SEED)
    assert torch.equal(torch.rand(3), expected)


def test_tied_weights_stay_tied_and_unfused_masks_are_rebuilt():
    spec = get_model("gpt-tiny-tied").with_config(attention="unfused")
    model = spec.build("meta")
    materialize(model, "cpu", SEED)
    assert model.lm_head.weight is model.wte.weight
    mask = model.h[0].attn.future
    assert torch.equal(mask, torch.ones_like(mask).triu(1))


def test_reset_parameters_when_there_is_no_init_weights():
    model = _meta(lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8)))
    materialize(model, "cpu", SEED)
    bound = 1 / 8 ** 0.5
    assert model[0].weight.abs().max() <= bound and model[0].weight.std() > 0.1
    assert torch.equal(model[1].weight, torch.ones(8))
    assert torch.equal(model[2].running_var, torch.ones(8))
    assert int(model[2].num_batches_tracked) == 0


def test_a_meta_parameter_without_initialisation_is_named():
    model = _meta(lambda: Net(NoInit()))
    with pytest.raises(PlanError, match=r"'inner' \(NoInit\) holds 'scale'.*init_weights"):
        check_initializable(model)
    with pytest.raises(PlanError, match="'inner'"):
        materialize(model, "cpu", SEED)
    assert on_meta(model)  # refused before anything was allocated


def test_hugging_face_model_from_meta():
    import transformers

    cfg = hf_gpt2().config
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    materialize(model, "cpu", SEED)
    assert not on_meta(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert abs(std - cfg.initializer_range) < 0.005
    assert torch.equal(model.transformer.ln_f.weight, torch.ones(cfg.n_embd))


def test_first_names_map_every_alias_of_a_tied_weight():
    names = first_names(get_model("gpt-tiny-tied").build("meta"))
    assert names["lm_head.weight"] == "wte.weight"
    assert names["h.0.ln_1.weight"] == "h.0.ln_1.weight"


# -- on ranks ------------------------------------------------------------------------------


NAMES = ("wte", "wpe", "h.0", "h.1", "ln_f", "lm_head")


def _plan(kind: str) -> Plan:
    if kind in ("fsdp", "replicate", "zero2"):
        return Plan(global_batch=BATCH, mesh=Mesh(dp=2),
                    layers=tuple(LayerPlan(module=n, strategy=kind) for n in NAMES))
    if kind == "tp_fsdp":  # tp=2 with one sharded block and one plain TP block
        return Plan(global_batch=BATCH, mesh=Mesh(dp=1, tp=2), layers=(
            LayerPlan(module="wte", strategy="tp", tp_styles={"": "embedding_rowwise"}),
            LayerPlan(module="wpe", strategy="replicate"),
            LayerPlan(module="h.0", strategy="tp_fsdp", tp_styles=BLOCK_TP),
            LayerPlan(module="h.1", strategy="tp", tp_styles=BLOCK_TP),
            LayerPlan(module="ln_f", strategy="fsdp"),
            LayerPlan(module="lm_head", strategy="tp", tp_styles={"": "colwise_gather"})))
    assert kind == "pp"
    stage = {"wte": 0, "wpe": 0, "h.0": 0, "h.1": 1, "ln_f": 1, "lm_head": 1}
    return Plan(global_batch=BATCH, mesh=Mesh(pp=2, dp=1),
                layers=tuple(LayerPlan(module=n, strategy="fsdp", stage=stage[n]) for n in NAMES),
                pipeline=PipelineSpec(schedule="1F1B", num_microbatches=2))


def train_meta_job(model_name: str, kind: str) -> dict:
    """On each rank, seeded differently: compile the meta model under the plan, report
    the initial full weights, each rank's local parameter bytes, and STEPS losses."""
    import torch.distributed as dist

    from autopar.lower import make_trainer

    torch.manual_seed(1000 + dist.get_rank())
    spec = get_model(model_name)
    trainer = make_trainer(spec.build("meta"), _plan(kind), spec.loss_fn,
                           spec.example_inputs(BATCH, SEQ), seed=SEED,
                           optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=LR))
    modules = trainer.stages if hasattr(trainer, "stages") else [trainer.applied.model]
    local = sum(_local_bytes(p) for m in modules for p in m.parameters())
    init = trainer.full_state_dict()
    losses = [trainer.train_step(*spec.make_batch(BATCH, SEQ, seed=1 + step))
              for step in range(STEPS)]
    return {"init": init, "losses": losses, "local_bytes": local}


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def _one_process(model_name: str) -> tuple[dict, list[float], int]:
    spec = get_model(model_name)
    model = spec.build("meta")
    materialize(model, "cpu", SEED)
    init = {n: full_tensor(p) for n, p in model.named_parameters(remove_duplicate=False)}
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    def step_loss(m, step):
        inputs, targets = spec.make_batch(BATCH, SEQ, seed=1 + step)
        return spec.loss_fn(m(*inputs), targets)

    ref = train_one_process(model, step_loss, steps=STEPS, lr=LR)
    return init, ref["losses"], size


@pytest.mark.parametrize("model_name,kind", [
    ("gpt-tiny", "fsdp"), ("gpt-tiny", "tp_fsdp"), ("gpt-tiny", "replicate"),
    ("gpt-tiny", "pp"), ("gpt-tiny-tied", "fsdp"), ("gpt-tiny-tied", "pp"),
])
def test_meta_model_trains_like_one_process(pool2, model_name, kind):
    init, losses, size = _one_process(model_name)
    results = pool2.run(train_meta_job, model_name, kind, timeout_s=120)
    for rank, res in enumerate(results):
        assert res["init"].keys() <= init.keys()
        for name, value in res["init"].items():
            torch.testing.assert_close(value, init[name], rtol=0, atol=0,
                                       msg=f"rank {rank} {name}")
        torch.testing.assert_close(res["losses"], losses, rtol=1e-5, atol=1e-6)
    if kind in ("fsdp", "pp"):  # each rank holds about half the weights, never all
        for res in results:
            assert res["local_bytes"] < 0.75 * size


class Padded(nn.Module):
    """Embeddings whose padding row the initialisation zeroes through a view of the
    weight (row 0 on the first rank's shard, row 9 on the second's)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 8, padding_idx=0)
        self.pos = nn.Embedding(16, 8, padding_idx=9)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(ids) + self.pos(ids))


class HFPadded(Padded):
    """Initialised as Hugging Face's ``_init_weights`` does, plus writes into rows of
    either rank's shard: an item assignment across both, a row copied from another."""

    def init_weights(self) -> None:
        for m in (self.tok, self.pos):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.weight[m.padding_idx])  # transformers 5
        self.pos.weight.data[self.pos.padding_idx].zero_()  # transformers 4
        self.pos.weight[5:9] = 0.5
        self.tok.weight[12].copy_(self.pos.weight[3])
        self.head.reset_parameters()


def _padded_plan(kind: str) -> Plan:
    if kind == "fsdp":
        return Plan(global_batch=BATCH, mesh=Mesh(dp=2), layers=tuple(
            LayerPlan(module=n, strategy="fsdp") for n in ("tok", "pos", "head")))
    return Plan(global_batch=BATCH, mesh=Mesh(dp=1, tp=2), layers=tuple(
        LayerPlan(module=n, strategy="tp", tp_styles={"": "embedding_rowwise"})
        for n in ("tok", "pos")) + (LayerPlan(module="head", strategy="fsdp"),))


def padded_job(cls: type, kind: str) -> dict:
    import torch.distributed as dist

    from autopar.lower import make_trainer

    torch.manual_seed(1000 + dist.get_rank())
    ids = torch.arange(16).repeat(BATCH, 1)
    trainer = make_trainer(_meta(cls), _padded_plan(kind), lambda out, y: out.mean(),
                           (ids,), seed=SEED)
    return trainer.full_state_dict()


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize("cls", [Padded, HFPadded])
def test_writes_into_part_of_a_sharded_weight_land(pool2, cls, kind):
    """``weight[padding_idx].fill_(0)`` and the like write into a view that DTensor makes
    by gathering the rows; on the ranks they must reach the shards as in one process."""
    ref = _meta(cls)
    materialize(ref, "cpu", SEED)
    assert torch.count_nonzero(ref.pos.weight[9]) == 0
    for rank, state in enumerate(pool2.run(padded_job, cls, kind)):
        for name, value in ref.named_parameters():
            assert torch.equal(state[name], value.detach()), f"rank {rank} {name}"


def real_weights_job(plan_json: str) -> dict:
    """Ranks build the model with real weights from different seeds."""
    import torch.distributed as dist

    from autopar.lower import make_trainer

    spec = get_model("gpt-tiny")
    trainer = make_trainer(spec.build(seed=dist.get_rank()), Plan.from_json(plan_json),
                           spec.loss_fn, spec.example_inputs(BATCH, SEQ))
    return trainer.full_state_dict()


@pytest.mark.parametrize("kind", ["fsdp", "tp_fsdp", "pp"])
def test_real_weights_seeded_differently_train_rank_zeros(pool2, kind):
    rank0 = dict(get_model("gpt-tiny").build(seed=0).named_parameters())
    for rank, state in enumerate(pool2.run(real_weights_job, _plan(kind).to_json())):
        for name, value in state.items():
            assert torch.equal(value, rank0[name].detach()), f"rank {rank} {name}"


# -- weights read straight into the shards -------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A Hugging Face GPT-2 saved as safetensors (lm_head tied: saved once)."""
    path = tmp_path_factory.mktemp("gpt2")
    hf_gpt2().save_pretrained(path)
    return path


def _meta_gpt2():
    import transformers

    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(hf_gpt2().config)


def test_safetensors_load_into_one_process(gpt2_dir):
    from runtime.weights import load_weights

    saved = hf_gpt2()
    model = _meta_gpt2()
    first = first_names(model)
    materialize(model, "cpu", SEED)
    load_weights([model], gpt2_dir, first)
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert model.lm_head.weight is model.transformer.wte.weight


def test_weights_of_another_model_are_refused(gpt2_dir):
    from runtime.checkpoint_format import CheckpointError
    from runtime.weights import check_source, load_weights

    model = get_model("gpt-tiny").build()
    with pytest.raises(CheckpointError, match=r"no weights for 37 tensor.*'h.0.attn.k_proj.bias'.*another model"):
        load_weights([model], gpt2_dir)
    with pytest.raises(CheckpointError, match="no such file"):
        load_weights([model], gpt2_dir / "missing")
    with pytest.raises(CheckpointError, match="no such file"):
        check_source(gpt2_dir / "missing")  # what make_trainer asks before sharding


def hf_weights_job(path: str) -> dict:
    import torch.distributed as dist

    from autopar.lower import make_trainer

    torch.manual_seed(dist.get_rank())
    plan = Plan(global_batch=4, mesh=Mesh(dp=2), layers=tuple(
        LayerPlan(module=f"transformer.h.{i}", strategy="fsdp") for i in range(2)))
    model = _meta_gpt2()
    ids = torch.zeros(4, 8, dtype=torch.long)
    trainer = make_trainer(model, plan, None, {"input_ids": ids, "labels": ids}, weights=path)
    local = sum(_local_bytes(p) for p in trainer.applied.model.transformer.h.parameters())
    return {"state": trainer.full_state_dict(), "local": local}


def test_safetensors_load_into_fsdp_shards(pool2, gpt2_dir):
    saved = dict(hf_gpt2().named_parameters())
    blocks = sum(p.numel() * 4 for n, p in saved.items() if n.startswith("transformer.h."))
    for res in pool2.run(hf_weights_job, str(gpt2_dir)):
        assert res["local"] == blocks // 2  # each rank read only its half of the blocks
        for name, value in res["state"].items():
            assert torch.equal(value, saved[name].detach()), name


def checkpoint_roundtrip_job(root: str) -> dict:
    """Save a real-weight model under FSDP, then read it into a meta model under a
    pipeline plan."""
    from autopar.lower import make_trainer
    from runtime.checkpoint import save

    spec = get_model("gpt-tiny-tied")
    src = make_trainer(spec.build(seed=3), _plan("fsdp"), spec.loss_fn, spec.example_inputs(BATCH, SEQ))
    save(src, root, step=1)
    dst = make_trainer(spec.build("meta"), _plan("pp"), spec.loss_fn,
                       spec.example_inputs(BATCH, SEQ), weights=root)
    return dst.full_state_dict()


def test_autopar_checkpoint_loads_into_pipeline_stages(pool2, tmp_path):
    saved = dict(get_model("gpt-tiny-tied").build(seed=3).named_parameters(remove_duplicate=False))
    states = pool2.run(checkpoint_roundtrip_job, str(tmp_path / "ckpt"))
    assert {"wte.weight", "lm_head.weight"} <= set(states[0]) | set(states[1])
    for state in states:
        for name, value in state.items():
            assert torch.equal(value, saved[name].detach()), name
