"""Tensor-parallel layers with their optimizer states (``tp_zero1``, Megatron-LM's
distributed optimizer) or also their gradients (``tp_zero2``) sharded over dp train like
one process on the global batch.

float32 cases use tests/runtime/test_runtime_numerics.py's comparison (3 AdamW steps;
losses rtol 1e-5, gradients rtol 1e-5 / atol 1e-7, parameters rtol 1e-5 / atol 1e-5; the
pipeline case the looser parameter tolerance of tests/runtime/test_pipeline_numerics.py,
where its docstring says why). Gradients are read after the whole step's micro-batches,
so accumulation is checked against one backward on the full batch. The Hugging Face Llama
uses tests/test_real_models.py's comparison.

All jobs run on the session-wide pools of ranks (tests/dist_pool.py); the pipeline case
with dp = 2 needs pp × dp × tp = 8 ranks and starts a pool of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dist_pool import DistPool
from test_pipeline_numerics import GPT6, UNITS, pipeline_job
from test_pipeline_numerics import assert_matches_reference as pipeline_matches
from test_real_models import BATCH, train_job
from test_real_models import assert_matches_reference as real_matches
from test_runtime_dims import GPT, assert_fp32_matches, dims_job
from test_runtime_numerics import BLOCK_TP, _spec
from test_sequence_parallel import BLOCK_SP

from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

# -- plans ---------------------------------------------------------------------------------


def gpt(block: str, *, dp: int = 2, tp: int = 2, recompute: str = "none", sp: bool = False,
        **fields) -> str:
    """gpt-tiny with Megatron blocks of strategy ``block`` (sequence-parallel when ``sp``),
    a vocabulary-split embedding and head (``tp``), the rest zero1 / replicate."""
    blocks = [LayerPlan(module=f"h.{i}", strategy=block, tp_styles=BLOCK_SP if sp else BLOCK_TP,
                        sequence_parallel=sp, recompute=recompute) for i in range(2)]
    layers = [
        LayerPlan(module="wte", strategy=block, tp_styles={"": "embedding_rowwise"}),
        LayerPlan(module="wpe", strategy="replicate"),
        *blocks,
        LayerPlan(module="ln_f", strategy="zero1" if fields.get("gradient_accumulation", 1) > 1
                  else "zero2"),
        LayerPlan(module="lm_head", strategy=block, tp_styles={"": "colwise_gather"}),
    ]
    return Plan(global_batch=GPT[2], mesh=Mesh(dp=dp, tp=tp), layers=tuple(layers),
                **fields).to_json()


def pipeline(block: str, *, dp: int, sp: bool = False, schedule: str = "Interleaved1F1B") -> str:
    """The 6-block gpt-tiny on pp = 2 × dp × tp = 2, interleaved (2 virtual stages): every
    block (sequence-parallel when ``sp``), the embedding and the head tensor-parallel with
    strategy ``block``."""
    pp, v = 2, 2
    per = len(UNITS) // (pp * v)
    styles = {"wte": {"": "embedding_rowwise"}, "lm_head": {"": "colwise_gather"}}
    layers = []
    for i, unit in enumerate(UNITS):
        for name in unit:
            is_block = name.startswith("h.")
            tp_styles = (BLOCK_SP if sp else BLOCK_TP) if is_block else styles.get(name)
            layers.append(LayerPlan(module=name, stage=i // per,
                                    strategy=block if tp_styles else "replicate",
                                    tp_styles=tp_styles or {}, sequence_parallel=sp and is_block))
    return Plan(global_batch=GPT6[2], mesh=Mesh(pp=pp, dp=dp, tp=2), layers=tuple(layers),
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=4,
                                      virtual_stages=v)).to_json()


def llama(block: str) -> str:
    """The Hugging Face Llama of tests/real_models.py on tp = 2 × dp = 2: every layer with
    an exact split over tp takes ``block``, the decoder layers recompute fully, two
    micro-batches per step."""
    from real_models import MODELS

    from passes.layer_graph import build_layer_graph

    spec = MODELS["hf-llama"]
    graph = build_layer_graph(spec.build(seed=0), spec.batch(BATCH))
    layers = []
    for layer in graph.layers:
        splits = layer.tp is not None and all(d % 2 == 0 for d in layer.tp.divisors)
        layers.append(LayerPlan(
            module=layer.name, strategy=block if splits else "zero1",
            tp_styles=dict(layer.tp.styles) if splits else {},
            recompute="full" if layer.layer_class and splits and ".layers." in layer.name
            else "none"))
    assert any(la.recompute == "full" for la in layers), [la.module for la in layers]
    return Plan(global_batch=BATCH, mesh=Mesh(dp=2, tp=2), layers=tuple(layers),
                gradient_accumulation=2).to_json()


# -- numerics ------------------------------------------------------------------------------

CASES_4 = {
    "tp_zero1-acc2": gpt("tp_zero1", gradient_accumulation=2),
    "tp_zero1-acc2-full": gpt("tp_zero1", recompute="full", gradient_accumulation=2),
    "tp_zero1-sp-acc2-selective": gpt("tp_zero1", sp=True, recompute="selective",
                                      gradient_accumulation=2),
    "tp_zero1-acc1": gpt("tp_zero1"),
    "tp_zero2-acc2-selective": gpt("tp_zero2", recompute="selective", gradient_accumulation=2),
    "tp_zero2-sp-acc2-full": gpt("tp_zero2", sp=True, recompute="full",
                                 gradient_accumulation=2),
}


@pytest.mark.parametrize("case", list(CASES_4))
def test_tp2_dp2_trains_like_one_process(pool4, case):
    assert_fp32_matches(pool4.run(dims_job, GPT, CASES_4[case]), GPT)


@pytest.mark.parametrize("block", ["tp_zero1", "tp_zero2"])
def test_tp2_alone_trains_like_one_process(pool2, block):
    """dp = 1: FSDP2 over a one-rank dp mesh with the strategy's per-step flags."""
    plan = gpt(block, dp=1, recompute="full", gradient_accumulation=2)
    assert_fp32_matches(pool2.run(dims_job, GPT, plan), GPT)


@pytest.mark.parametrize("block", ["tp_zero1", "tp_zero2"])
def test_hf_llama_tp2_dp2_trains_like_one_process(pool4, block):
    real_matches(pool4.run(train_job, "hf-llama", llama(block)), "hf-llama", False)


@pytest.fixture(scope="module")
def pool8() -> Iterator[DistPool]:
    pool = DistPool(8, timeout_s=240.0)
    yield pool
    pool.close()


def test_pp2_dp2_tp2_trains_like_one_process(pool8):
    """Megatron-LM's standard configuration at small scale: interleaved pipeline, tensor
    and sequence parallelism, and the distributed optimizer sharding over dp = 2. (dp = 1,
    FSDP2 over a one-rank dp mesh, is test_tp2_alone_trains_like_one_process's case.)"""
    plan = pipeline("tp_zero1", dp=2, sp=True)
    pipeline_matches(pool8.run(pipeline_job, GPT6, plan), GPT6)


# -- what each strategy holds between micro-batches, observed ------------------------------


def _mesh_dims(t) -> int:
    """Mesh dimensions of a DTensor: 2 while FSDP2 shards a TP weight over (dp, tp), 1 for
    the TP weight it has gathered; 0 for no tensor."""
    return 0 if t is None else t.device_mesh.ndim


def holdings_job(plan_json: str) -> list:
    """One step of two micro-batches; before each micro-batch's forward and after the
    step's backward, (mesh dims of h.0.mlp.fc_in's weight, of its gradient)."""
    from runtime.train import Trainer

    spec, (_, _, batch, seq) = _spec(GPT), GPT
    trainer = Trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn)
    fc = trainer.applied.model.get_submodule("h.0.mlp.fc_in")
    seen: list = []
    trainer.applied.model.get_submodule("h.0").register_forward_pre_hook(
        lambda m, args: seen.append((_mesh_dims(fc.weight), _mesh_dims(fc.weight.grad))),
        prepend=True)  # ahead of FSDP2's own pre-forward hook
    trainer.forward_backward(*trainer.shard_batch(*spec.make_batch(batch, seq, seed=0)))
    seen.append((_mesh_dims(fc.weight), _mesh_dims(fc.weight.grad)))
    return seen


def test_distributed_optimizer_holds_what_its_zero_stage_promises(pool4):
    """Before micro-batch 2: tp_zero1 keeps the gathered weight and the unsharded (TP-local)
    gradient it accumulates; tp_zero2 keeps the gathered weight, whose gradient is already
    reduce-scattered into the dp shard FSDP2 holds aside (none on the gathered one); after
    the last backward both hold the weight and its gradient sharded over dp, which is what
    the optimizer steps (its states then sharded too). tp_fsdp reshards after each use."""
    def seen(block: str) -> list:
        return pool4.run(holdings_job, gpt(block, gradient_accumulation=2))[0]

    assert seen("tp_zero1") == [(2, 0), (1, 1), (2, 2)]
    assert seen("tp_zero2") == [(2, 0), (1, 0), (2, 2)]
    assert seen("tp_fsdp") == [(2, 0), (2, 2), (2, 2)]
