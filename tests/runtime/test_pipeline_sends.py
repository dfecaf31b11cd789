"""Pipeline sends scattered across the tp group (``pipeline.scatter_sends``,
runtime/pipeline_sends.py) train like one process and send 1/tp of the bytes.

pp = 2 × tp = 2 on 4 gloo ranks, at tests/runtime/test_pipeline_numerics.py's tolerances:
the zoo GPT (Megatron TP blocks, and sequence-parallel blocks, whose shards cross as they
are: tests/runtime/test_sp_stage_boundaries.py) and Hugging Face Llama (exported stages, which take no TP
layers: its layers run as identical copies on the tp ranks, so what crosses a cut is
still replicated over tp), with 1F1B and an interleaved schedule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from test_pipeline_hf import assert_matches_reference as hf_matches_reference
from test_pipeline_hf import pipeline_job as hf_pipeline_job
from test_pipeline_hf import pipeline_plan as hf_pipeline_plan
from test_pipeline_numerics import GPT6, assert_matches_reference, pipeline_job, pipeline_plan

from runtime.pipeline_sends import add_scattered_sends, scattered_boundaries
from runtime.plan import Mesh, PipelineSpec, Plan, PlanError


def scattered(plan_json: str, on: bool = True, tp: int | None = None) -> str:
    """The plan with ``pipeline.scatter_sends`` set (and mesh.tp, when given)."""
    plan = Plan.from_json(plan_json)
    mesh = plan.mesh if tp is None else dataclasses.replace(plan.mesh, tp=tp)
    return dataclasses.replace(
        plan, mesh=mesh,
        pipeline=dataclasses.replace(plan.pipeline, scatter_sends=on)).to_json()


# -- numerics ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_zoo_gpt_pp2_tp2_scattered_trains_like_one_process(pool4, schedule):
    """ZBVZeroBubble also splits backward into input and weight passes, and its middle
    boundary joins two stages of one rank, which pass the activation whole."""
    plan = scattered(pipeline_plan(schedule, pp=2, tp=2, m=2, parallel="tp"))
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan), GPT6)


def test_zoo_gpt_sequence_parallel_scattered_trains_like_one_process(pool4):
    plan = scattered(pipeline_plan("1F1B", pp=2, tp=2, m=2, parallel="tp+sp"))
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan), GPT6)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_hf_llama_pp2_tp2_scattered_trains_like_one_process(pool4, schedule):
    plan = scattered(hf_pipeline_plan("llama", schedule), tp=2)
    results = pool4.run(hf_pipeline_job, "llama", plan, timeout_s=400)
    hf_matches_reference(results, "llama")
    assert all(r["exported"] for r in results)


# -- bytes on the pipeline link ---------------------------------------------------------------


def sent_bytes_job(model: tuple, plan_json: str) -> int:
    """Bytes this rank hands to ``isend`` in one training step."""
    from test_pipeline_numerics import _spec, _trainer

    spec, (_, _, batch, seq) = _spec(model), model
    trainer = _trainer(model, Plan.from_json(plan_json))
    inputs, targets = trainer.shard_batch(*spec.make_batch(batch, seq, seed=0))
    trainer.forward_backward(inputs, targets)  # shapes inferred, buffers made
    return bytes_sent(lambda: trainer.forward_backward(inputs, targets))


def bytes_sent(step) -> int:
    """Bytes this rank hands to ``isend`` (torch's schedules batch every p2p op through
    ``batch_isend_irecv``) while ``step()`` runs."""
    import torch.distributed as dist

    sent, original = 0, dist.batch_isend_irecv

    def counting(ops):
        nonlocal sent
        sent += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        step()
    finally:
        dist.batch_isend_irecv = original
    return sent


def test_each_tp_rank_sends_one_tp_th_of_the_bytes(pool4):
    """Activations forward and their gradients backward: every rank sends half as many
    bytes with tp = 2 (the stage outputs' sizes themselves, not a model of them)."""
    whole = pipeline_plan("1F1B", pp=2, tp=2, m=2, parallel="tp")
    before = pool4.run(sent_bytes_job, GPT6, whole)
    after = pool4.run(sent_bytes_job, GPT6, scattered(whole))
    # gpt-tiny's hidden states: 2 samples × 16 tokens × 32 float32 per micro-batch
    assert all(b > 0 for b in before), before
    assert [2 * a for a in after] == before, (before, after)


# -- which boundaries, and bad input --------------------------------------------------------


def _plan(schedule: str, v: int, *, tp: int = 2, on: bool = True) -> Plan:
    return Plan(global_batch=8, mesh=Mesh(pp=2, tp=tp),
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=2, virtual_stages=v,
                                      scatter_sends=on))


def test_boundaries_between_ranks_scatter_and_same_rank_ones_do_not():
    assert scattered_boundaries(_plan("1F1B", 1)) == ({0}, {1})
    assert scattered_boundaries(_plan("Interleaved1F1B", 2)) == ({0, 1, 2}, {1, 2, 3})
    # V: stages 1 and 2 both run on pipeline rank 1
    assert scattered_boundaries(_plan("ZBVZeroBubble", 2)) == ({0, 2}, {1, 3})
    assert scattered_boundaries(_plan("1F1B", 1, on=False)) == (set(), set())


def test_scattering_without_tensor_parallelism_is_a_plan_error():
    with pytest.raises(PlanError, match="scatter_sends .* mesh.tp is 1"):
        _plan("1F1B", 1, tp=1)


def test_old_pipeline_sections_read_as_whole_sends():
    data = _plan("1F1B", 1, on=False).to_dict()
    del data["pipeline"]["scatter_sends"]
    assert Plan.from_dict(data).pipeline.scatter_sends is False


def test_a_last_dim_tp_does_not_split_is_refused_before_sending():
    """Checked on the sending stage before any collective (the group is never used)."""
    stage = nn.Linear(4, 3)
    add_scattered_sends(stage, 0, _plan("1F1B", 1), group=None, rank=0)
    with pytest.raises(PlanError, match=r"shape \(2, 3\).*3 does not split.*"
                                        r"scatter_sends false"):
        stage(torch.ones(2, 4))
