"""Real models, planned and trained: whatever autopar plans, its runtime executes, and
the numbers match one process.

Each model of ``tests/real_models.py`` (Hugging Face Llama, Mistral with an attention
mask, OPT, GPT-2, BERT, T5, ViT from small configs, a nanoGPT with tied embeddings, a
ResNet-50 layout, a model taking a dict batch) is

- planned on ``local`` and ``dgx-a100-80g`` with 1 and 4 nodes, every candidate checked by
  the runtime's own validation of that model (tests/autopar/test_plans_run.py);
- trained 3 AdamW steps on 2 gloo ranks under the planner's plan for ``local``, and under
  forced plans: every layer fsdp, every layer zero2 with full recomputation, a mixed
  per-layer plan, tp=2 and pp=2 where the model allows them;

and each run's losses, first gradients and final parameters are compared with one process
training the same seeded model on the same global batches (float32, rtol 1e-5). Where a
forced variant cannot apply (no layer splits over tp, no cut a pipeline can take),
``autopar explain`` or the planner must say why instead.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from real_models import META_PIPELINE_MODELS, MODELS, RealModel, pipeline_inputs, planning_inputs
from reference import full_tensor, train_one_process, train_under_plan

import autopar
from autopar.explain import explain, format_explanation
from cost_models.hardware import Cluster
from runtime.batch import model_loss
from runtime.materialize import materialize
from runtime.plan import Mesh, PipelineSpec, Plan
from runtime.tied import tie_groups

SPECS = {**MODELS, **META_PIPELINE_MODELS}
STEPS = 3
SEED = 7
"""Of a model built on meta (each rank is seeded otherwise, on purpose)."""
LR = 1e-3
BATCH = 8
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
# A gradient that is exactly zero in one process (softmax's invariance to a key bias, a
# relative-position bucket no pair of tokens falls in) is rounding noise on two ranks;
# Adam turns it into an update of up to lr (see tests/runtime/test_runtime_numerics.py).
ZERO_GRAD_PARAM_TOL = dict(rtol=1e-5, atol=2e-3)
KEY_BIASES = ("k_proj.bias", "key.bias", "c_attn.bias")
"""Biases of attention keys (alone or fused with q and v), whose exact gradient is zero."""


def _loss(spec: RealModel, net, batch: dict, pipeline: bool):
    if pipeline or not spec.returns_loss:
        inputs = pipeline_inputs(batch)
        out = net(*inputs) if isinstance(inputs, tuple) else net(**inputs)
        return spec.logits_loss(out, batch["labels"])
    return model_loss(net(**batch))


def _build(spec: RealModel, meta: bool):
    """The seeded model, or (``meta``) the model built on meta: the runtime materialises
    it with seed ``SEED`` (runtime.materialize), the one-process reference here."""
    if not meta:
        return spec.build(seed=0)
    with torch.device("meta"):
        return spec.build(seed=0)


@functools.cache
def reference(name: str, pipeline: bool = False, meta: bool = False) -> dict:
    """One process, the whole batch: losses, first gradients and final parameters, under
    every name a parameter has (pipeline stages hold a tied parameter under each stage's
    own name: the head's weight where the embedding's is shared with it)."""
    spec = SPECS[name]
    net = _build(spec, meta)
    if meta:
        materialize(net, "cpu", SEED)
    named = list(net.named_parameters(remove_duplicate=False))
    result = train_one_process(
        net, lambda model, step: _loss(spec, model, spec.batch(BATCH, seed=step), pipeline),
        steps=STEPS, lr=LR, names=named)
    aliases: dict[int, set[str]] = {}
    for n, p in named:
        aliases.setdefault(id(p), set()).add(n)
    return {**result, "names": [n for n, _ in net.named_parameters()],
            "aliases": {n: aliases[id(p)] for n, p in named}}


def train_job(name: str, plan_json: str, meta: bool = False) -> dict:
    """On every rank: train STEPS steps under the plan, as a user would (``meta``: from
    the model built on meta, each rank seeded differently)."""
    import torch.distributed as dist

    from autopar.lower import make_trainer

    spec = SPECS[name]
    torch.manual_seed(100 + dist.get_rank())
    plan = Plan.from_json(plan_json)
    pipeline = plan.mesh.pp > 1
    batch0 = spec.batch(BATCH, seed=0)
    optimizer = lambda params: torch.optim.AdamW(params, lr=LR)  # noqa: E731
    if pipeline:
        trainer = make_trainer(_build(spec, meta), plan, spec.logits_loss,
                               pipeline_inputs(batch0), optimizer, seed=SEED)
    else:
        loss_fn = None if spec.returns_loss else spec.logits_loss
        trainer = make_trainer(_build(spec, meta), plan, loss_fn, batch0, optimizer, seed=SEED)

    def step_batch(step: int) -> tuple:
        batch = spec.batch(BATCH, seed=step)
        if pipeline or not spec.returns_loss:
            return pipeline_inputs(batch), batch["labels"]
        return (batch,)

    return train_under_plan(trainer, step_batch, _first_grads, steps=STEPS)


def _first_grads(trainer) -> dict:
    return {n: full_tensor(p.grad) for n, p in _named_parameters(trainer) if p.grad is not None}


def _named_parameters(trainer):
    modules = getattr(trainer, "stages", None) or [trainer.applied.model]
    return [item for m in modules for item in m.named_parameters()]


def _close(got, want, tol: dict, label: str) -> None:
    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


def assert_matches_reference(results: list[dict], name: str, pipeline: bool,
                             meta: bool = False) -> None:
    ref = reference(name, pipeline, meta)
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], LOSS_TOL, f"rank {rank} losses")
        params = got["params"]
        if pipeline:  # each stage holds its own parameters; every one is held somewhere
            ref_params = {n: ref["params"][n] for n in params}
        else:
            assert sorted(params) == sorted(ref["names"]), f"rank {rank} parameter names"
            ref_params = {n: ref["params"][n] for n in ref["names"]}
        for n, grad in got["grads"].items():
            _close(grad, ref["grads"][n], GRAD_TOL, f"rank {rank} grad of {n}")
        for n, want in ref_params.items():
            grad = ref["grads"].get(n, want)
            if grad.abs().max() < 1e-7 or n.endswith(KEY_BIASES):
                _close(params[n], want, ZERO_GRAD_PARAM_TOL, f"rank {rank} param {n}")
                continue
            # Entries whose gradient is rounding noise (Adam turns any sign into ±lr) are
            # held to the zero-gradient tolerance, the rest to PARAM_TOL.
            noise = grad.abs() < 1e-7
            _close(params[n][noise], want[noise], ZERO_GRAD_PARAM_TOL, f"rank {rank} param {n}")
            _close(params[n][~noise], want[~noise], PARAM_TOL, f"rank {rank} param {n}")
    if pipeline:
        held = set().union(*(r["params"].keys() for r in results))
        missing = [n for n in ref["names"] if not ref["aliases"][n] & held]
        assert not missing, f"no stage holds {missing} under any of its names"


# -- plans -----------------------------------------------------------------------------------


def _forced(model, plan: Plan, change, **plan_changes) -> Plan:
    """``plan`` with each layer changed by ``change(layer)`` (a dict of LayerPlan fields),
    then made what the runtime accepts for tied modules (runtime.tied): one strategy per
    tie, its first module's, and ``replicate`` for a tie with a module outside the plan
    (T5's ``shared`` embedding, which runs no op of its own)."""
    plain = dict(tp_styles={}, sequence_parallel=False, offload=False, recompute="none")
    fields = {layer.module: {**plain, **change(layer)} for layer in plan.layers}
    for tie in tie_groups(model, fields):
        lead = {"strategy": "replicate"} if "" in tie.modules else fields[tie.modules[0]]
        for module in tie.modules:
            if module:
                fields[module] = {**fields[module], "strategy": lead["strategy"]}
    layers = tuple(replace(layer, **fields[layer.module]) for layer in plan.layers)
    return replace(plan, layers=layers, gradient_accumulation=1, **plan_changes)


def _mixed(model, plan: Plan) -> Plan:
    """A different strategy for neighbouring layers."""
    cycle = ("fsdp", "replicate", "zero2")
    strategy = {layer.module: cycle[i % 3] for i, layer in enumerate(plan.layers)}
    return _forced(model, plan, lambda layer: dict(strategy=strategy[layer.module]))


@functools.cache
def _layer_graph(name: str):
    """The captured layer graph of a model at the planning batch (one capture per model)."""
    from passes.layer_graph import build_layer_graph

    spec = SPECS[name]
    return build_layer_graph(spec.build(seed=0), planning_inputs(spec, spec.batch(BATCH)))


@functools.cache
def _dp2_plan(name: str) -> Plan:
    """The planner's plan on dp = 2, which the forced variants change (planned once per model:
    capture and solve take seconds), searched on ``_layer_graph``'s capture; the "planned"
    variant trains ``autopar.plan``'s own plan."""
    spec = SPECS[name]
    return autopar.search_plans(spec.build(seed=0), Cluster.local(2),
                                planning_inputs(spec, spec.batch(BATCH)), mesh=Mesh(dp=2),
                                graph=_layer_graph(name)).plan


def _tp2(model, name: str, plan: Plan) -> Plan:
    graph = _layer_graph(name)
    splittable = {layer.name: dict(layer.tp.styles) for layer in graph.layers
                  if layer.tp is not None and all(d % 2 == 0 for d in layer.tp.divisors)}
    if not splittable:  # what `autopar explain` says of a layer on a tp = 2 mesh
        spec = SPECS[name]
        tp_plan = autopar.plan(model, Cluster.local(2), planning_inputs(spec, spec.batch(BATCH)),
                               mesh=Mesh(dp=1, tp=2))
        raise Unavailable(format_explanation(explain(tp_plan, tp_plan.layers[0].module)))
    return _forced(model, plan, lambda layer: dict(
        strategy="tp" if layer.module in splittable else "replicate",
        tp_styles=splittable.get(layer.module, {})), mesh=Mesh(dp=1, tp=2))


def _sp2(model, name: str, plan: Plan) -> Plan:
    """tp = 2 with sequence parallelism on every layer that offers it."""
    graph = _layer_graph(name)
    sp = {layer.name: dict(layer.tp.sp_styles) for layer in graph.layers
          if layer.tp is not None and layer.tp.sp_styles is not None}
    if not sp:
        raise Unavailable("no layer offers sequence parallelism")
    return _forced(model, plan, lambda layer: dict(
        strategy="tp" if layer.module in sp else "replicate",
        tp_styles=sp.get(layer.module, {}), sequence_parallel=layer.module in sp),
        mesh=Mesh(dp=1, tp=2))


class Unavailable(Exception):
    """A variant the model does not allow, with the reason a user would be told."""


@functools.cache
def variant_plan(name: str, variant: str) -> tuple[str | None, str]:
    """The plan of one variant as JSON and '', or None and why the model does not allow it."""
    spec = SPECS[name]
    model, batch = spec.build(seed=0), spec.batch(BATCH)
    inputs = planning_inputs(spec, batch)
    local = Cluster.local(2)
    try:
        if variant == "planned":
            return autopar.plan(model, local, inputs).to_json(), ""
        if variant == "pp2":
            return autopar.plan(model, local, pipeline_inputs(batch),
                                mesh=Mesh(pp=2, dp=1)).to_json(), ""
        base = _dp2_plan(name)
        plan = {
            "fsdp": lambda: _forced(model, base, lambda _: dict(strategy="fsdp")),
            "zero2_full": lambda: _forced(model, base, lambda _: dict(strategy="zero2",
                                                                      recompute="full")),
            "mixed": lambda: _mixed(model, base),
            "tp2": lambda: _tp2(model, name, base),
            "sp2": lambda: _sp2(model, name, base),
        }[variant]()
    except (Unavailable, autopar.AutoparError) as e:
        return None, str(e)
    return plan.to_json(), ""


VARIANTS = ("planned", "fsdp", "zero2_full", "mixed", "tp2", "pp2")
UNAVAILABLE: dict[tuple[str, str], str] = {
    ("resnet50-layout", "pp2"): "BatchNorm in training mode",
}
"""Variants a model does not allow, and a phrase the reason given must contain."""
CASES = [(n, v) for n in MODELS for v in VARIANTS if (n, v) not in UNAVAILABLE]


@pytest.mark.parametrize(("name", "variant"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_trains_like_one_process(pool2, name, variant):
    plan, why = variant_plan(name, variant)
    assert plan is not None, f"{name} has no {variant} plan: {why}"
    pipeline = Plan.from_json(plan).mesh.pp > 1
    assert_matches_reference(pool2.run(train_job, name, plan), name, pipeline)


T5_STAGES = {"encoder.embed_tokens": 0, "encoder.block.0": 1, "encoder.block.1": 2,
             "decoder.embed_tokens": 3}
"""Layers opening each stage; the unnamed ones join the stage before them."""


def test_t5_cut_inside_its_encoder_sends_the_decoder_token_ids(pool2):
    """T5's decoder reads its int64 token ids, a model input, through its embedding: with
    cuts inside the encoder they cross each cut before the decoder, from rank to rank.
    torch runs a later stage once on uninitialised buffers to learn its outputs, where such
    ids were out of range; the pipeline trains like one process. (A V schedule would put
    the tied embedding's copies on stages 0 and 3 on one rank, which the runtime refuses.)"""
    base = Plan.from_json(variant_plan("hf-t5", "pp2")[0])
    stage = 0
    layers = []
    for layer in base.layers:
        stage = T5_STAGES.get(layer.module, stage)
        layers.append(replace(layer, stage=stage))
    assert [la.stage for la in layers] == [0, 0, 1, 2, 2, 3, 3, 3, 3, 3, 3], layers
    plan = replace(base, layers=tuple(layers), pipeline=PipelineSpec(
        schedule="Interleaved1F1B", num_microbatches=4, virtual_stages=2))
    assert_matches_reference(pool2.run(train_job, "hf-t5", plan.to_json()), "hf-t5", True)


SPLIT_CASES = [("hf-mistral-mask", "sp2"), ("hf-bert-mlm", "sp2"), ("hf-falcon", "tp2")]
"""Sequence parallelism on Hugging Face layers: Mistral's attention is called with keywords
only and reads rotary tables and a mask made outside the layer; BERT's layers are called
with the mask as a second positional argument. Falcon's MLP under tp: its Linears compute
``x @ weight.T`` (``FalconLinear``), and its block adds attention into the MLP's
row-parallel output in place."""


@pytest.mark.parametrize(("name", "variant"), SPLIT_CASES,
                         ids=[f"{n}-{v}" for n, v in SPLIT_CASES])
def test_hugging_face_splits_train_like_one_process(pool2, name, variant):
    plan, why = variant_plan(name, variant)
    assert plan is not None, f"{name} has no {variant} plan: {why}"
    layers = Plan.from_json(plan).layers
    assert any(layer.strategy == "tp" and layer.sequence_parallel == (variant == "sp2")
               for layer in layers)
    assert_matches_reference(pool2.run(train_job, name, plan), name, False)


@pytest.mark.parametrize(("name", "variant"), list(UNAVAILABLE),
                         ids=[f"{n}-{v}" for n, v in UNAVAILABLE])
def test_unavailable_variant_says_why(name, variant):
    plan, why = variant_plan(name, variant)
    assert plan is None, f"{name} allows {variant} now: move it to the trained cases"
    assert UNAVAILABLE[name, variant] in why


META_CASES = [
    ("hf-llama", "fsdp"), ("hf-llama", "tp2"), ("hf-llama", "pp2"), ("hf-gpt2", "fsdp"),
    ("hf-gpt2", "tp2"), ("hf-bert-mlm", "pp2"), ("hf-t5", "fsdp"), ("hf-t5", "pp2"),
    ("hf-vit", "tp2"),
    ("hf-vit", "pp2"), ("nanogpt-tied", "pp2"), ("resnet50-layout", "fsdp"),
    ("dict-batch", "pp2"), ("hf-mixtral", "pp2"), ("hf-falcon", "pp2"), ("hf-albert", "pp2"),
]
"""Models built on the meta device: compile allocates each rank's shards (a pipeline
rank's stages) and initialises them as one process does. Every model, and each way the
meta path once went wrong: Hugging Face's init under FSDP2 (GPT-2), an exported stage
naming the meta device (Llama's rotary embedding), tied copies on two stages
(nanoGPT-tied) and one tensor under two names on one stage (T5's encoder and decoder
embeddings), capture from meta inputs (ViT, dict batch), TP shards (Llama, GPT-2, ViT),
and the export of a model on meta (``META_PIPELINE_MODELS``: code that branches on the
device type, constants made in ``forward``, a layer run at every depth)."""


@pytest.mark.parametrize(("name", "variant"), META_CASES, ids=[f"{n}-{v}" for n, v in META_CASES])
def test_built_on_meta_trains_like_one_process(pool2, name, variant):
    plan, _ = variant_plan(name, variant)
    pipeline = Plan.from_json(plan).mesh.pp > 1
    assert_matches_reference(pool2.run(train_job, name, plan, True), name, pipeline, meta=True)
