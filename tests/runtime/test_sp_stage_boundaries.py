"""A stage boundary between two sequence-parallel layers passes each tp rank's sequence
shard as it is (runtime.pipeline_sends.sequence_sharded_boundaries): no gather at the
end of the sending stage, no slice or gather on either side, 1/tp of the activation on
the pipeline link, with or without ``pipeline.scatter_sends``.

pp = 2 × tp = 2 on 4 gloo ranks, at tests/runtime/test_pipeline_numerics.py's tolerances,
on the zoo GPT whose blocks are all sequence-parallel (its embeddings and head are not,
so the first and last stages still split and gather the stream where they meet them).
The Hugging Face models' stages come from torch.export, which takes no tensor-parallel
layers (passes.split_stages), so no HF boundary can be sequence-parallel: Llama with
scattered sends is tests/runtime/test_pipeline_sends.py's, and here its bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_pipeline_hf import pipeline_plan as hf_pipeline_plan
from test_pipeline_numerics import GPT6, assert_matches_reference, pipeline_job, pipeline_plan
from test_pipeline_sends import scattered, sent_bytes_job
from test_runtime_numerics import BLOCK_TP

from runtime.pipeline_sends import scattered_boundaries, sequence_sharded_boundaries
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan


def sp_plan(schedule: str, *, scatter: bool = False) -> str:
    plan = pipeline_plan(schedule, pp=2, tp=2, m=2, parallel="tp+sp")
    return scattered(plan, on=scatter) if scatter else plan


# -- numerics ------------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "scatter"), [
    ("1F1B", False), ("1F1B", True), ("Interleaved1F1B", True), ("ZBVZeroBubble", False)])
def test_sequence_shards_cross_stages_and_train_like_one_process(pool4, schedule, scatter):
    """ZBVZeroBubble's middle boundary joins two stages of one rank, which hand the shard
    over in memory; it also splits backward into input and weight passes."""
    plan = sp_plan(schedule, scatter=scatter)
    assert sequence_sharded_boundaries(Plan.from_json(plan))
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan), GPT6)


@pytest.mark.parametrize(("schedule", "scatter"), [("1F1B", True), ("ZBVZeroBubble", False)])
def test_one_sided_boundaries_train_like_one_process(pool4, schedule, scatter):
    """h.3 is a Megatron TP block without SP. 1F1B: it opens stage 1, stage 0's last SP
    block gathers its output whole, which the scattered send slices and stage 1 gathers.
    ZBVZeroBubble: it opens stage 2, on the rank of stage 1, whose last SP block gathers
    its output by ``DTensor.to_local``, a view, which the split-backward schedules cannot
    ``detach_()`` (runtime.pipeline._sendable)."""
    plan = Plan.from_json(sp_plan(schedule, scatter=scatter))
    layers = tuple(dataclasses.replace(la, sequence_parallel=False, tp_styles=BLOCK_TP)
                   if la.module == "h.3" else la for la in plan.layers)
    plan = dataclasses.replace(plan, layers=layers)
    opens = next(la.stage for la in plan.layers if la.module == "h.3")
    assert opens - 1 not in sequence_sharded_boundaries(plan)
    assert_matches_reference(pool4.run(pipeline_job, GPT6, plan.to_json()), GPT6)


# -- bytes on the pipeline link -------------------------------------------------------------


def test_each_rank_sends_its_sequence_shard(pool4):
    """Activations forward and their gradients backward: each tp rank sends half of what
    a Megatron TP boundary sends whole (the stage outputs' sizes themselves, not a model of
    them), and scattered sends leave the shard alone."""
    whole = pool4.run(sent_bytes_job, GPT6, pipeline_plan("1F1B", pp=2, tp=2, m=2,
                                                          parallel="tp"))
    shard = pool4.run(sent_bytes_job, GPT6, sp_plan("1F1B"))
    assert all(w > 0 for w in whole), whole
    assert [2 * s for s in shard] == whole, (whole, shard)
    assert pool4.run(sent_bytes_job, GPT6, sp_plan("1F1B", scatter=True)) == shard


def test_hf_llama_scattered_sends_are_one_tp_th(pool4):
    """No SP layer (exported stages): the replicated stream is sliced, 1/tp per rank."""
    plan = hf_pipeline_plan("llama", "1F1B")
    whole = pool4.run(hf_sent_bytes_job, scattered(plan, on=False, tp=2), timeout_s=400)
    sliced = pool4.run(hf_sent_bytes_job, scattered(plan, tp=2), timeout_s=400)
    assert all(w > 0 for w in whole), whole
    assert [2 * s for s in sliced] == whole, (whole, sliced)


def hf_sent_bytes_job(plan_json: str) -> int:
    from test_pipeline_hf import batch, build, next_token_loss
    from test_pipeline_sends import bytes_sent

    from autopar.lower import make_trainer

    plan = Plan.from_json(plan_json)
    inputs, targets = batch(0)
    trainer = make_trainer(build("llama"), plan, next_token_loss, inputs,
                           lambda p: __import__("torch").optim.AdamW(p, lr=1e-3))
    local = trainer.shard_batch(inputs, targets)
    trainer.forward_backward(*local)
    return bytes_sent(lambda: trainer.forward_backward(*local))


# -- which boundaries ----------------------------------------------------------------------


def _layers(*flags: tuple[int, bool]) -> tuple[LayerPlan, ...]:
    sp = {"ln": "sequence_parallel", "fc": "colwise"}
    return tuple(LayerPlan(module=f"h.{i}", stage=stage, strategy="tp" if on else "replicate",
                           tp_styles=sp if on else {}, sequence_parallel=on)
                 for i, (stage, on) in enumerate(flags))


def test_only_boundaries_between_two_sp_layers_are_sharded():
    # stage 0 ends SP; stage 1 opens SP and ends not; stage 2 opens not; 3 opens SP
    layers = _layers((0, True), (1, True), (1, False), (2, False), (2, True), (3, True))
    plan = Plan(global_batch=8, mesh=Mesh(pp=4, tp=2), layers=layers,
                pipeline=PipelineSpec(schedule="1F1B", num_microbatches=4, scatter_sends=True))
    assert sequence_sharded_boundaries(plan) == {0, 2}
    assert scattered_boundaries(plan) == ({0, 1, 2}, {1, 2, 3})  # per tensor: DTensors skip


def stage_output_job(model: tuple, plan_json: str) -> object:
    """On stage 0's ranks: the placements and local shape of what stage 0 returns for one
    micro-batch (the pipeline sends the local tensor of a DTensor)."""
    from test_pipeline_numerics import _spec, _trainer
    from torch.distributed.tensor import DTensor

    spec, (_, _, batch, seq) = _spec(model), model
    trainer = _trainer(model, Plan.from_json(plan_json))
    if not trainer.has_first:
        return None
    inputs, _ = trainer.shard_batch(*spec.make_batch(batch, seq, seed=0))
    out = trainer.stages[0](inputs[0][: batch // 2])
    if not isinstance(out, DTensor):
        return ("whole", tuple(out.shape))
    return ([str(p) for p in out.placements], tuple(out.to_local().shape))


def test_the_sending_stage_keeps_its_shard(pool4):
    """Stage 0 ends with SP block h.2 and stage 1 opens with h.3: its output stays a
    Shard(1) DTensor, half the sequence on each tp rank, never gathered; with h.3 not SP
    it is gathered whole (4 samples × 16 tokens × 64)."""
    shard = (["S(1)"], (4, 8, 64))
    assert pool4.run(stage_output_job, GPT6, sp_plan("1F1B", scatter=True)) == [
        shard, shard, None, None]
    plan = Plan.from_json(sp_plan("1F1B"))
    layers = tuple(dataclasses.replace(la, sequence_parallel=False, tp_styles=BLOCK_TP)
                   if la.module == "h.3" else la for la in plan.layers)
    whole = pool4.run(stage_output_job, GPT6, dataclasses.replace(plan, layers=layers).to_json())
    assert whole == [("whole", (4, 16, 64))] * 2 + [None, None]
