"""Hugging Face models, which only torch.export captures, train in pipelines like one process.

HF ``LlamaForCausalLM`` (grouped-query attention: 4 query heads, 2 key/value heads) and
``GPT2LMHeadModel``, 4 blocks each, tiny configs, random init, ``use_cache=False``, no
dropout, untied embeddings (tied ones are split below; summing the copies' gradients is
the trainer's). ``model(input_ids)`` returns a ``ModelOutput``; the loss reads its
``.logits`` against the next tokens, as a user would write it for one process.

Each case trains 3 AdamW steps under a pp = 2 plan (GPipe, 1F1B; Interleaved1F1B with 2
stages per rank) and compares every rank with one process on the global batch, at
tests/runtime/test_pipeline_numerics.py's tolerances (loss rtol 1e-5; first gradients rtol 1e-5,
atol 1e-7; final parameters rtol 1e-5, atol 5e-5, see that file for why).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import train_one_process, train_under_plan
from test_pipeline_numerics import PARAM_TOL, _full_grads
from test_runtime_numerics import GRAD_TOL, LOSS_TOL, LR, STEPS, _close

from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan, PlanError

BATCH, SEQ, VOCAB = 8, 16, 128
BLOCKS = {"llama": "model.layers", "gpt2": "transformer.h"}
FIRST = {"llama": "model.embed_tokens", "gpt2": "transformer.wte"}
LAST = {"llama": ("model.norm", "lm_head"), "gpt2": ("transformer.ln_f", "lm_head")}


def build(name: str, tie: bool = False) -> nn.Module:
    """A seeded 4-block HF model (module-level so every rank builds the same one)."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            use_cache=False, tie_word_embeddings=tie)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(
            n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    return cls(cfg)


def next_token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(100 + step))
    return (tokens[:, :-1],), tokens[:, 1:]


def pipeline_plan(name: str, schedule: str, *, dp: int = 1, m: int = 2) -> str:
    """Blocks spread evenly over pp = 2 ranks × v stages (v = 2 for Interleaved1F1B); the
    embedding opens stage 0 and the final norm and head join the last block. Layers not
    named (Llama's rotary embedding, GPT-2's position embedding) join the stage before."""
    v = 2 if schedule.startswith("Interleaved") else 1
    stages = 2 * v
    blocks = [(f"{BLOCKS[name]}.{i}", i * stages // 4) for i in range(4)]
    named = [(FIRST[name], 0), *blocks] + [(m_, stages - 1) for m_ in LAST[name]]
    strategy = {0: "fsdp", 1: "replicate"}
    layers = tuple(LayerPlan(module=n, stage=s, strategy=strategy[i % 2])
                   for i, (n, s) in enumerate(named))
    return Plan(global_batch=BATCH, mesh=Mesh(pp=2, dp=dp), layers=layers,
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=m,
                                      virtual_stages=v)).to_json()


# -- jobs (run on every rank of a pool) and the one-process reference ----------------------


def pipeline_job(name: str, plan_json: str) -> dict:
    from autopar.lower import make_trainer

    plan = Plan.from_json(plan_json)
    example = (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),)
    trainer = make_trainer(build(name), plan, next_token_loss, example,
                           lambda params: torch.optim.AdamW(params, lr=LR))
    result = train_under_plan(trainer, batch, _full_grads, steps=STEPS)
    exported = all(any("InterpreterModule" in type(sub).__name__ for sub in m.modules())
                   for m in trainer.stages)
    return {**result, "exported": exported}


@functools.cache
def reference(name: str) -> dict:
    def step_loss(model: nn.Module, step: int) -> torch.Tensor:
        (x,), y = batch(step)
        return next_token_loss(model(x), y)

    return train_one_process(build(name), step_loss, steps=STEPS, lr=LR)


def assert_matches_reference(results: list[dict], name: str) -> None:
    ref = reference(name)
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], LOSS_TOL, f"rank {rank} losses")
        assert got["params"].keys() == ref["params"].keys(), f"rank {rank} parameter names"
        assert got["grads"].keys() == ref["grads"].keys(), f"rank {rank} gradient names"
        for param, want in ref["grads"].items():
            _close(got["grads"][param], want, GRAD_TOL, f"rank {rank} grad of {param}")
        for param, want in ref["params"].items():
            _close(got["params"][param], want, PARAM_TOL, f"rank {rank} param {param}")


# -- numerics ------------------------------------------------------------------------------

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pp2_trains_like_one_process(pool2, name, schedule):
    results = pool2.run(pipeline_job, name, pipeline_plan(name, schedule), timeout_s=300)
    assert_matches_reference(results, name)
    # The stages came from torch.export: symbolic tracing cannot capture these models.
    assert all(r["exported"] for r in results)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pp2_dp2_trains_like_one_process(pool4, name):
    """FSDP2 shards and replicates layers of exported stages over dp = 2."""
    results = pool4.run(pipeline_job, name, pipeline_plan(name, "1F1B", dp=2), timeout_s=400)
    assert_matches_reference(results, name)


# -- the split (one process) ----------------------------------------------------------------


def _compose(split, x: torch.Tensor):
    """The stages run one after the other: the model's output (via ``output_fn``)."""
    out = split.modules[0](x)
    for stage in split.modules[1:]:
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    return split.output_fn(out)


def test_llama_stages_exchange_only_hidden_states():
    """Llama builds a boolean causal mask and rotary cos/sin once, before its blocks; the
    split recomputes them on the later stages instead of sending them, so the blocks on
    stage 1 receive the hidden states alone and compose to the model's logits."""
    from passes.split_stages import split_pipeline

    model = build("llama")
    plan = Plan.from_json(pipeline_plan("llama", "GPipe"))
    (x,), _ = batch(0)
    split = split_pipeline(model, plan, (x[:4],))
    assert split.method == "export" and split.tied == ()
    inputs = [n for n in split.modules[1].graph.nodes if n.op == "placeholder"]
    assert len(inputs) == 1, inputs
    out = _compose(split, x[:4])
    torch.testing.assert_close(out.logits, model(x[:4]).logits, rtol=0, atol=0)
    names = [dict(m.named_parameters()) for m in split.modules]
    assert "model.layers.2.self_attn.k_proj.weight" in names[1]
    assert names[0].keys() | names[1].keys() == dict(model.named_parameters()).keys()
    assert not names[0].keys() & names[1].keys()
    # Moved, not copied: training a stage trains the user's model.
    assert names[1]["lm_head.weight"] is model.lm_head.weight


def test_tied_embedding_is_copied_onto_both_stages():
    """GPT-2's lm_head.weight is transformer.wte.weight: each stage holds a copy under its
    own name, and the split says which names are one parameter."""
    from passes.split_stages import split_pipeline

    model = build("gpt2", tie=True)
    plan = Plan.from_json(pipeline_plan("gpt2", "1F1B"))
    (x,), _ = batch(0)
    split = split_pipeline(model, plan, (x[:4],))
    assert split.tied == ({0: "transformer.wte.weight", 1: "lm_head.weight"},)
    first, last = (dict(m.named_parameters()) for m in split.modules)
    assert "lm_head.weight" not in first and "transformer.wte.weight" not in last
    assert first["transformer.wte.weight"] is not last["lm_head.weight"]
    torch.testing.assert_close(last["lm_head.weight"], model.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(_compose(split, x[:4]).logits, model(x[:4]).logits,
                               rtol=0, atol=0)


def test_tensor_parallel_layers_of_an_exported_model_are_refused():
    from passes.split_stages import split_pipeline

    layers = [LayerPlan(module="transformer.wte", stage=0),
              LayerPlan(module="transformer.h.2", stage=1, strategy="tp",
                        tp_styles={"mlp.c_fc": "colwise"})]
    plan = Plan(global_batch=BATCH, mesh=Mesh(pp=2, tp=2), layers=tuple(layers),
                pipeline=PipelineSpec(schedule="GPipe", num_microbatches=2))
    with pytest.raises(PlanError, match=r"\['transformer.h.2'\] are planned tensor-parallel.*"
                                        r"torch.export.*data-parallel strategy"):
        split_pipeline(build("gpt2"), plan, (batch(0)[0][0][:4],))


def test_a_cut_through_a_llama_block_is_refused():
    from passes.split_stages import split_pipeline

    layers = [LayerPlan(module="model.embed_tokens", stage=0),
              LayerPlan(module="model.layers.1.self_attn", stage=0),
              LayerPlan(module="model.layers.1.mlp", stage=1)]
    plan = Plan(global_batch=BATCH, mesh=Mesh(pp=2), layers=tuple(layers),
                pipeline=PipelineSpec(schedule="GPipe", num_microbatches=2))
    with pytest.raises(PlanError, match=r"'model.layers.1.self_attn' \(stage 0\) and "
                                        r"'model.layers.1.mlp' \(stage 1\) splits layer "
                                        r"'model.layers.1'"):
        split_pipeline(build("llama"), plan, (batch(0)[0][0][:4],))
