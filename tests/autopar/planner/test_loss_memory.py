"""The loss's memory in the layer costs (passes/layer_graph.py ``_loss_bytes``,
autopar/planner/loss_costs.py ``loss_bytes``): hand-derived on a tiny GPT, in the liveness walk,
and in the GPT-2 small plan whose 4 GiB devices it used to overflow.

Cross-entropy on the logits [B, S, V] in float32 keeps its log-probabilities (4·B·S·V bytes
at the captured batch) from forward to backward and holds two more copies in its backward
(8·B·S·V); a rank holds its batch shard's of each micro-batch.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from planner_cases import make_cluster
from test_liveness import ilp_sum

from autopar.planner.configs import accumulation_steps
from autopar.planner.costs import hsdp_shard_size, layer_cost, layer_options
from autopar.planner.liveness import step_liveness, uncosted_terms, uses_foreach
from autopar.planner.one_stage import runs_on_ddp
from autopar.zoo import get_model
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh, option_label

B, S = 8, 16
V = 128  # gpt-tiny's vocabulary
KEPT, TRANSIENT = 4 * B * S * V, 8 * B * S * V
FP32 = precision("float32")


@pytest.fixture(scope="module")
def tiny():
    spec = get_model("gpt-tiny")
    return build_layer_graph(spec.build("meta"), spec.example_inputs(B, S))


def lm_head(graph):
    return next(la for la in graph.layers if la.name == "lm_head")


def loss_part(layer, option: str, mesh: Mesh, microbatches: int = 1) -> tuple[float, float]:
    """(activations, buffer) bytes the loss adds to ``layer``'s cost under ``option``."""
    cluster = make_cluster(per_node=2)
    with_loss = layer_cost(layer, option, mesh, cluster, FP32, microbatches)
    without = layer_cost(replace(layer, loss_bytes=0), option, mesh, cluster, FP32,
                         microbatches)
    return (with_loss.activations_bytes - without.activations_bytes,
            with_loss.buffers_bytes - without.buffers_bytes)


def test_only_the_output_layer_records_the_float32_logits(tiny):
    assert {la.name: la.loss_bytes for la in tiny.layers if la.loss_bytes} == {"lm_head": KEPT}


@pytest.mark.parametrize("dp,m", [(2, 1), (1, 2), (2, 2)])
def test_loss_is_one_copy_per_micro_batch_kept_and_two_in_backward(tiny, dp, m):
    shards = dp * m
    for strategy in ("replicate", "fsdp"):
        option = option_label(strategy, "none", False, False)
        assert loss_part(lm_head(tiny), option, Mesh(dp=dp), m) == (KEPT / shards,
                                                                    TRANSIENT / shards)
    cost = layer_cost(lm_head(tiny), "fsdp", Mesh(dp=dp), make_cluster(per_node=2), FP32, m)
    assert cost.loss_buffer_bytes == TRANSIENT / shards


def test_recomputation_does_not_free_the_loss(tiny):
    option = option_label("replicate", "full", False, False)
    assert loss_part(lm_head(tiny), option, Mesh(dp=2)) == (KEPT / 2, TRANSIENT / 2)


def test_tensor_parallel_lm_head_holds_the_gathered_logits_whole(tiny):
    assert lm_head(tiny).tp is not None and lm_head(tiny).tp.styles == {"": "colwise_gather"}
    assert loss_part(lm_head(tiny), "tp", Mesh(dp=1, tp=2)) == (KEPT, TRANSIENT)


def test_bfloat16_plans_still_hold_float32_logits(tiny):
    cluster, mesh = make_cluster(per_node=2), Mesh(dp=2)
    bf16 = precision("bfloat16")
    with_loss = layer_cost(lm_head(tiny), "fsdp", mesh, cluster, bf16)
    without = layer_cost(replace(lm_head(tiny), loss_bytes=0), "fsdp", mesh, cluster, bf16)
    assert with_loss.activations_bytes - without.activations_bytes == KEPT / 2


def test_a_returned_block_gets_a_class_apart_from_its_identical_siblings():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    graph = build_layer_graph(Stack(), (torch.randn(4, 8, 32),))
    assert [(la.layer_class, la.loss_bytes) for la in graph.layers] == [
        ("Linear#0", 0), ("Linear#0", 0), ("Linear#0+loss", 4 * 4 * 8 * 32)]


def test_walk_holds_the_loss_at_its_own_backward_only(tiny):
    mesh, m = Mesh(dp=2), 2
    costs = [layer_cost(la, "fsdp", mesh, make_cluster(per_node=2), FP32, m)
             for la in tiny.layers]
    names = [la.name for la in tiny.layers]
    by_event = {u.event: u for u in step_liveness(costs, names, microbatches=m).timeline}
    last = costs[-1]
    fwd = by_event["forward of lm_head, micro-batch 0"]
    loss = by_event["backward of the loss, micro-batch 0"]
    bwd = by_event["backward of lm_head, micro-batch 0"]
    # The head's own buffer: nothing follows it to prefetch in forward; in backward FSDP2
    # prefetches ln_f, whose parameters are fewer than the head's.
    alone = last.buffers_bytes - TRANSIENT / 4 - last.prefetch_bytes
    assert names[-2] == "ln_f" and 0 < costs[-2].prefetch_bytes < last.prefetch_bytes
    assert fwd.buffers_bytes == alone
    assert bwd.buffers_bytes == alone + costs[-2].prefetch_bytes
    # The loss's backward runs before FSDP2 gathers the head for its own: the loss's two
    # copies, not the head's gathered parameters and unsharded gradient.
    assert loss.buffers_bytes == TRANSIENT / 4
    assert loss.grads_bytes == bwd.grads_bytes - last.grads_bytes
    # The log-probabilities until the loss's backward, the logits' gradient (the same
    # size) through the head's.
    assert loss.activations_bytes == bwd.activations_bytes >= KEPT / 4
    after = by_event["backward of ln_f, micro-batch 0"]
    assert bwd.activations_bytes - after.activations_bytes == last.activations_bytes


def test_a_pipelines_last_stage_also_keeps_the_logits(tiny):
    # PipelineStage's forward cache holds the stage's output until the micro-batch's
    # backward: one more kept copy under pipelining, none more in backward.
    cluster = make_cluster(per_node=2)
    flat = layer_cost(lm_head(tiny), "replicate", Mesh(dp=1), cluster, FP32, 2)
    piped = layer_cost(lm_head(tiny), "replicate", Mesh(pp=2, dp=1), cluster, FP32, 2)
    assert piped.activations_bytes - flat.activations_bytes == KEPT / 2
    assert piped.loss_buffer_bytes == flat.loss_buffer_bytes == TRANSIENT / 2


def test_ilp_sum_still_bounds_the_walk_with_the_loss(tiny):
    rng, cluster, names = random.Random(0), make_cluster(per_node=2), [la.name for la in tiny.layers]
    checked = 0
    for mesh in (Mesh(dp=2), Mesh(dp=1, tp=2)):
        for m in accumulation_steps(tiny, mesh):
            options = [list(layer_options(la, tiny.seq_len, mesh, cluster, FP32, m).values())
                       for la in tiny.layers]
            for _ in range(10):
                costs = [rng.choice(o) for o in options]
                ddp = runs_on_ddp(costs, FP32, mesh)
                peak = step_liveness(costs, names, microbatches=m, ddp=ddp).peak
                assert peak.total_bytes <= ilp_sum(costs) * (1 + 1e-12), (mesh, m, peak)
                checked += 1
    assert checked >= 40


# -- GPT-2 small on 4 GiB devices ---------------------------------------------------------

# Before the loss was costed this plan was dp = 8 without accumulation, reported at 3.41 GiB
# for a step whose full walk, loss included, was 5.40 GiB: it would not have fit. Costed, it
# became 2 micro-batches at 3.63 GiB, and 3.16 GiB once the loss's backward was an event of
# its own (the head's FSDP buffer and gradient are not alive yet then, as MemTracker sees).


@pytest.fixture(scope="module")
def gpt2_4gib():
    from report_cases import BATCH, SEQ, gpt2_small_plan

    from autopar.whatif import with_memory
    from cost_models.hardware import Cluster

    plan = gpt2_small_plan(memory_gib=4)
    spec = get_model("gpt2-small")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(BATCH, SEQ, device="meta"),
                              seq_len=SEQ)
    cluster = with_memory(Cluster.preset("dgx-a100-80g", nodes=1), 4)
    prec = precision(plan.param_dtype)
    by_name = {lp.module: lp for lp in plan.layers}
    hsdp = hsdp_shard_size(cluster, plan.mesh.pp)
    costs = [layer_cost(la, by_name[la.name].option, plan.mesh, cluster, prec,
                        plan.gradient_accumulation, hsdp_shard_size=hsdp) for la in graph.layers]
    return plan, graph, cluster, prec, costs


def test_gpt2_small_4gib_plan_charges_the_logits_and_fits(gpt2_4gib):
    plan, graph, cluster, prec, costs = gpt2_4gib
    assert plan.mesh.pp == 1
    mem = plan.prediction.memory
    logits = lm_head(graph).loss_bytes / (plan.mesh.replicas * plan.gradient_accumulation)
    names = [la.name for la in graph.layers]
    m, ddp = plan.gradient_accumulation, runs_on_ddp(costs, prec, plan.mesh)
    walk = step_liveness(costs, names, microbatches=m, ddp=ddp).peak
    assert abs(walk.total_bytes - (mem.total_bytes - mem.margin_bytes)) <= 8
    assert mem.peak_at.startswith("backward of the loss")
    # The three float32 copies of one micro-batch's logits are in the plan's peak.
    assert walk.activations_bytes >= logits and walk.buffers_bytes >= 2 * logits
    assert mem.total_bytes <= cluster.device.memory_bytes
    # With the terms the costs still lack (AdamW's temporaries, DDP's second copy) the
    # step still fits the device.
    full = step_liveness(costs, names, microbatches=m, ddp=ddp, uncosted=uncosted_terms(
        costs, prec, foreach=uses_foreach(cluster))).peak
    assert full.total_bytes <= cluster.device.memory_bytes
    assert walk.total_bytes <= ilp_sum(costs)
