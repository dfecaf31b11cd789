"""Inputs as users write them: a tensor, positional arguments, keyword arguments (a dict
batch, Hugging Face's ``model(**batch)``), and models that return their own loss.

Each model is planned with its dict batch (``autopar.plan``) and trained for 3 AdamW
steps on 2 gloo ranks under the planner's plan for ``local``, under every layer forced to
fsdp, and under gradient accumulation, without a ``loss_fn``; every step's loss and the
final parameters match one process training on the whole batch (fp32: losses rtol 1e-5,
parameters rtol 1e-5 / atol 1e-5, as tests/runtime/test_runtime_numerics.py explains).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dict_batch_model import DictBatchClassifier, make_batch

import autopar
from cost_models.errors import ConfigError
from passes.layer_graph import build_layer_graph
from runtime.batch import Inputs, as_inputs, batch_size, model_loss, shard_rows, split_rows
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan, PlanError

STEPS = 3
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
ZERO_GRAD_PARAM_TOL = dict(rtol=1e-5, atol=1e-4)
"""Attention key biases: their exact gradient is zero, so they hold amplified rounding
noise (tests/runtime/test_runtime_numerics.py)."""
BATCH, SEQ, VOCAB = 4, 8, 64


# -- models and batches ----------------------------------------------------------------------


def _hf(name: str) -> nn.Module:
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    if name == "bert":
        # The head's weight untied from the word embeddings (a tie across layers is the
        # runtime's tied-parameter work, not this file's). Untying in transformers 5 also
        # unties the decoder's bias from `cls.predictions.bias`, leaving that unused, which
        # DDP refuses; tie it back as the default config does (both inside layer `cls`).
        cfg = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, tie_word_embeddings=False)
        model = transformers.BertForMaskedLM(cfg)
        model.cls.predictions.decoder.bias = model.cls.predictions.bias
        return model
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def build(name: str) -> nn.Module:
    if name == "dict":
        torch.manual_seed(0)
        return DictBatchClassifier()
    return _hf(name)


def batches(name: str) -> list[dict[str, torch.Tensor]]:
    """Per step: token ids, a right-padded attention mask and labels (every label real, so
    each sample weighs the same in the model's mean loss, as slicing needs)."""
    if name == "dict":
        return [make_batch(BATCH, SEQ, seed=s) for s in range(STEPS)]
    out = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 + s)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=g)
        mask = (torch.arange(SEQ) < lengths[:, None]).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
    return out


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, the model's own loss, AdamW(lr=1e-3)."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches(name):
        loss = model(**batch).loss if name != "dict" else model(**batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def planned(name: str) -> Plan:
    return autopar.plan(build(name), autopar.Cluster.local(2), batches(name)[0])


def variants(name: str) -> dict[str, str]:
    """The planner's plan, every layer forced to fsdp, and 2-way gradient accumulation."""
    plan = planned(name)
    fsdp = dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(la, strategy="fsdp", tp_styles={}, recompute="none")
        for la in plan.layers))
    return {"planner": plan.to_json(), "fsdp": fsdp.to_json(),
            "accumulation": dataclasses.replace(plan, gradient_accumulation=2).to_json()}


# -- jobs on the ranks -----------------------------------------------------------------------


def train_job(name: str, plan_json: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from runtime.train import Trainer

    trainer = Trainer(build(name), Plan.from_json(plan_json))  # no loss_fn: the model's own
    losses = [trainer.train_step(batch) for batch in batches(name)]
    return losses, trainer.full_state_dict()


def logits_loss(output: dict, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output["logits"], targets)


def compile_job() -> tuple[list[float], dict[str, torch.Tensor]]:
    """autopar.compile with a dict batch as example_inputs; the targets apart and a
    loss_fn reading the model's output dict."""
    steps = [(dict(b), b["labels"]) for b in batches("dict")]
    for inputs, _ in steps:
        del inputs["labels"]
    trainer = autopar.compile(build("dict"), "local", steps[0][0], loss_fn=logits_loss)
    losses = [trainer.train_step(x, y) for x, y in steps]
    return losses, trainer.full_state_dict()


def dict_pipeline_job(plan_json: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A dict batch (labels apart) through autopar.compile under a pipeline plan."""
    steps = [(dict(b), b["labels"]) for b in batches("dict")]
    for inputs, _ in steps:
        del inputs["labels"]
    trainer = autopar.compile(_masked_stack(), "local", steps[0][0],
                              loss_fn=logits_loss, plan=Plan.from_json(plan_json))
    losses = [trainer.train_step(x, y) for x, y in steps]
    return losses, trainer.full_state_dict()


def tensor_job(plan_json: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A bare tensor as the example and as each step's inputs (under a pipeline plan the
    stages are traced on one micro-batch of the example)."""
    from autopar.lower import make_trainer

    example = _tensor_batches()[0][0]
    trainer = make_trainer(_mlp(), Plan.from_json(plan_json), _mse, example)
    losses = [trainer.train_step(x, y) for x, y in _tensor_batches()]
    return losses, trainer.full_state_dict()


def bad_batch_job(plan_json: str) -> list[str]:
    from runtime.train import Trainer

    trainer = Trainer(build("dict"), Plan.from_json(plan_json))
    good = batches("dict")[0]
    messages = []
    for bad in ({**good, "attention_mask": good["attention_mask"].T},
                {"input_ids": torch.tensor(3), "attention_mask": torch.tensor(1), "labels": 2}):
        try:
            trainer.train_step(bad)
            messages.append("no error")
        except PlanError as e:
            messages.append(str(e))
    return messages


# -- helpers ---------------------------------------------------------------------------------


def _logits_reference(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process training ``model`` on the dict batches with ``logits_loss``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for b in batches("dict"):
        loss = logits_loss(model(b["input_ids"], b["attention_mask"]), b["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def _tensor_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
            for _ in range(STEPS)]


def _assert_matches(results: list, expected: tuple[list[float], dict[str, torch.Tensor]]):
    ref_losses, ref_params = expected
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **LOSS_TOL)
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            tol = ZERO_GRAD_PARAM_TOL if "key.bias" in name else PARAM_TOL
            torch.testing.assert_close(value, ref_params[name], **tol, msg=name)


# -- training on 2 ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dict", "bert", "llama"])
def test_model_with_its_own_loss_trains_like_one_process(pool2, name):
    expected = reference(name)
    for variant, plan_json in variants(name).items():
        results = pool2.run(train_job, name, plan_json, timeout_s=300)
        try:
            _assert_matches(results, expected)
        except AssertionError as e:
            raise AssertionError(f"{name} under the {variant} plan: {e}") from e


def test_planner_plans_dict_batches_at_their_batch_and_sequence():
    plan = planned("dict")
    assert plan.global_batch == BATCH and plan.mesh.dp == 2
    assert [la.module for la in plan.layers] == ["embed", "blocks.0", "blocks.1", "head"]


def test_compile_takes_a_dict_example_and_loss_fn_gets_the_output_as_is(pool2):
    model = build("dict")
    expected = _logits_reference(model)
    _assert_matches(pool2.run(compile_job, timeout_s=300), expected)


class _MaskedStack(nn.Module):
    """``forward(input_ids, attention_mask)``: the mask read by the first layer only, so a
    pipeline sends floating activations only."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        h = self.embed(input_ids) * attention_mask.to(torch.float32)[..., None]
        for block in self.blocks:
            h = torch.tanh(block(h))
        return {"logits": self.head(h.mean(1))}


def _masked_stack() -> _MaskedStack:
    torch.manual_seed(0)
    return _MaskedStack()


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_a_dict_batch_trains_with_two_stages_on_a_rank(pool2, schedule):
    """torch's multi-stage schedules give the model's keyword inputs to every stage a rank
    holds; only the first stage takes them (runtime.pipeline._drop_root_kwargs). Once:
    "forward() got an unexpected keyword argument 'input_ids'" on the later stage."""
    units = ["embed"] + [f"blocks.{i}" for i in range(6)] + ["head"]
    stage = {u: min(i // 2, 3) for i, u in enumerate(units)}
    plan = Plan(global_batch=BATCH, mesh=Mesh(pp=2),
                layers=tuple(LayerPlan(module=u, stage=stage[u]) for u in units),
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=2, virtual_stages=2))
    model = _masked_stack()
    expected = _logits_reference(model)
    _assert_matches(pool2.run(dict_pipeline_job, plan.to_json(), timeout_s=300), expected)


def test_bare_tensor_input_is_one_batch_not_rows(pool2):
    model = _mlp()
    x, _ = _tensor_batches()[0]
    plan = autopar.plan(model, autopar.Cluster.local(2), x)
    assert plan.global_batch == 8
    assert [la.module for la in plan.layers] == ["0", "1", "2"]
    forced = Plan(global_batch=8, mesh=Mesh(dp=2),
                  layers=tuple(LayerPlan(module=n, strategy="fsdp") for n in ("0", "1", "2")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in _tensor_batches():
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    expected = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    for plan_json in (plan.to_json(), forced.to_json()):
        _assert_matches(pool2.run(tensor_job, plan_json), expected)


def test_training_batch_without_a_batch_dimension_is_named(pool2):
    plan = Plan(global_batch=BATCH, mesh=Mesh(dp=2),
                layers=tuple(LayerPlan(module=la.module) for la in planned("dict").layers))
    for transposed, scalar in pool2.run(bad_batch_job, plan.to_json()):
        assert "'attention_mask' has 8 rows in dim 0, but the batch has 4 samples" in transposed
        assert "batch dimension cannot be found" in transposed
        assert "no input has a batch dimension" in scalar
        assert "input_ids, attention_mask, labels" in scalar


def test_pipeline_without_loss_fn_is_refused_before_any_collective():
    from autopar.lower import make_trainer
    from runtime.plan import PipelineSpec

    plan = Plan(global_batch=8, mesh=Mesh(pp=2), pipeline=PipelineSpec(schedule="GPipe"),
                layers=tuple(LayerPlan(module=n, stage=int(n) // 2) for n in ("0", "1", "2")))
    with pytest.raises(PlanError, match="mesh.pp=2: .* needs loss_fn=.*pp=1"):
        make_trainer(_mlp(), plan, None, _tensor_batches()[0][0])


# -- planning: layer graph and errors --------------------------------------------------------


def test_planning_names_an_input_whose_batch_dimension_cannot_be_found():
    good = batches("dict")[0]
    with pytest.raises(PlanError, match=r"'attention_mask' has 8 rows in dim 0, but the batch "
                                        r"has 4 samples.*batch-first"):
        autopar.plan(build("dict"), autopar.Cluster.local(2),
                     {**good, "attention_mask": good["attention_mask"].T})


@pytest.mark.parametrize("prefer", ["symbolic_trace", "export"])
def test_layer_graph_of_keyword_inputs(prefer):
    graph = build_layer_graph(build("dict"), batches("dict")[0], prefer=prefer)
    assert graph.extra["capture_method"] == prefer
    assert (graph.batch_size, graph.seq_len) == (BATCH, SEQ)


class OptionalArgs(nn.Module):
    """Optional arguments between the ones given: capture must keep the others at their
    defaults and bind the given ones by name."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x, mask=None, scale=None, labels=None):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        if scale is not None:
            h = h * scale
        out = self.b(h)
        return out if labels is None else F.cross_entropy(out, labels)


class NestedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, batch):
        return self.b(self.a(batch["x"]) * batch["m"]["w"])


@pytest.mark.parametrize("prefer", ["symbolic_trace", "export"])
def test_captures_keyword_positional_and_nested_inputs(prefer):
    """Each form plans at batch 6, and the head's float32 logits [6, 3] = 72 bytes are the
    loss's input whether the model returns them or its loss computed from them."""
    x, labels = torch.randn(6, 4), torch.randint(0, 3, (6,))
    cases = [
        (OptionalArgs(), {"x": x, "labels": labels}),
        (OptionalArgs(), Inputs((x,), {"scale": torch.tensor(2.0), "labels": labels})),
        (OptionalArgs(), x),
        (NestedBatch(), Inputs(({"x": x, "m": {"w": torch.ones(1, 4)}},))),
    ]
    for model, inputs in cases:
        graph = build_layer_graph(model, inputs, prefer=prefer)
        assert graph.extra["capture_method"] == prefer
        assert graph.batch_size == 6
        assert [(la.name, la.loss_bytes) for la in graph.layers] == [("a", 0), ("b", 72)]


def test_exported_placeholders_take_keyword_inputs_in_any_order():
    from autopar.capture import capture
    from passes.trace import placeholder_values

    x, labels = torch.randn(6, 4), torch.randint(0, 3, (6,))
    gm = capture(OptionalArgs(), {"x": x, "labels": labels})
    names = [n.target for n in gm.graph.find_nodes(op="placeholder")]
    values = dict(zip(names, placeholder_values(gm, {"labels": labels, "x": x}), strict=True))
    assert values["x"] is x and values["labels"] is labels


def test_inputs_forward_cannot_take_are_named_before_capture():
    x = torch.randn(6, 4)
    with pytest.raises(ConfigError, match="forward\\(x, mask=None.*unexpected keyword "
                                          "argument 'label'"):
        build_layer_graph(OptionalArgs(), {"x": x, "label": x})
    with pytest.raises(ConfigError, match="too many positional arguments"):
        autopar.plan(OptionalArgs(), autopar.Cluster.local(2), (x,) * 5)


@pytest.mark.parametrize("return_logits", [True, False])
def test_loss_computed_by_the_model_is_costed_on_its_logits(return_logits):
    """The head's float32 logits [4, 4 classes] = 64 bytes, counted once whether the model
    returns them beside its loss or returns the loss alone; the loss itself is no layer's."""
    model = DictBatchClassifier(return_logits=return_logits)
    graph = build_layer_graph(model, batches("dict")[0])
    assert {la.name: la.loss_bytes for la in graph.layers} == {
        "embed": 0, "blocks.0": 0, "blocks.1": 0, "head": BATCH * 4 * 4}


def test_hf_causal_lm_loss_is_costed_on_its_logits():
    graph = build_layer_graph(build("llama"), batches("llama")[0])
    loss = {la.name: la.loss_bytes for la in graph.layers if la.loss_bytes}
    assert loss == {"lm_head": BATCH * SEQ * VOCAB * 4}


# -- runtime.batch on its own ----------------------------------------------------------------


def test_as_inputs_reads_every_form():
    x = torch.ones(2, 3)
    assert as_inputs(x) == Inputs((x,))
    assert as_inputs((x, 1)) == Inputs((x, 1))
    assert as_inputs({"a": x}) == Inputs((), {"a": x})
    both = Inputs((x,), {"mask": x})
    assert as_inputs(both) is both
    with pytest.raises(PlanError, match="Inputs\\(\\(the_dict,\\), \\{\\}\\)"):
        as_inputs({1: x})
    with pytest.raises(PlanError, match="type str"):
        as_inputs("text")


def test_rows_are_sliced_nested_and_shared_tensors_broadcast():
    ids = torch.arange(12).reshape(6, 2)
    shared = torch.arange(2).reshape(1, 2)  # one row for all samples: broadcast
    inputs = Inputs((ids,), {"extra": {"pos": shared, "w": (torch.tensor(2.0), ids * 10)},
                             "flag": True})
    targets = torch.arange(6)
    (x, y) = shard_rows(inputs, targets, rank=1, ranks=3)
    assert torch.equal(x.args[0], ids[2:4]) and torch.equal(y, targets[2:4])
    assert x.kwargs["extra"]["pos"] is shared and x.kwargs["flag"] is True
    assert torch.equal(x.kwargs["extra"]["w"][1], ids[2:4] * 10)
    parts = split_rows(inputs, targets, 3, dp=1)
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(parts[2][0].kwargs["extra"]["w"][1], ids[4:] * 10)


def test_batch_size_comes_from_targets_then_first_input():
    assert batch_size(Inputs((torch.ones(()), torch.ones(5, 2)))) == 5
    assert batch_size(Inputs((torch.ones(1, 3),), {"ids": torch.ones(5, 3)})) == 5
    assert batch_size(Inputs((torch.ones(1, 3),))) == 1
    assert batch_size(Inputs((torch.ones(1, 3),)), targets=torch.ones(4)) == 4
    with pytest.raises(PlanError, match=r"input 'inputs\[0\]' has 5 rows .* 3 samples"):
        batch_size(Inputs((torch.ones(5, 2),)), torch.ones(3))
    with pytest.raises(PlanError, match=r"'w\[1\]' has 2 rows"):
        shard_rows(Inputs((), {"x": torch.ones(4), "w": (1, torch.ones(2))}), None, 0, 2)
    with pytest.raises(PlanError, match="not divisible by the data-parallel degree dp=2"):
        shard_rows(Inputs((torch.ones(5),)), None, 0, 2)
    with pytest.raises(PlanError, match="5 samples does not split into gradient_accumulation=2"):
        split_rows(Inputs((torch.ones(5),)), None, 2, dp=1)


def test_model_loss_is_read_from_what_models_return():
    loss = torch.tensor(1.5)
    assert model_loss({"loss": loss, "logits": torch.ones(2)}) is loss
    assert model_loss(type("Output", (), {"loss": loss})()) is loss
    assert model_loss(loss) is loss
    with pytest.raises(PlanError, match="returned Tensor without a loss.*loss_fn=.*labels="):
        model_loss(torch.ones(2, 3))
