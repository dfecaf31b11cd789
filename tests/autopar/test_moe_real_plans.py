"""Expert-parallel plans of Hugging Face Mixtral (small configs, random init, meta device)
and of the zoo's MoE GPTs through the whole front door (capture, detect, cost, solve, validate, rationale), and
``autopar explain`` on them.

Cluster: tests/planner_cases.make_cluster (NVLink 200 GB/s and 5 µs inside a node), and a
slow network of 1 GB/s and 50 µs between one-rank nodes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from planner_cases import make_cluster

from autopar.api import search_plans
from autopar.explain import explain, format_explanation
from autopar.planner import moe_costs
from autopar.planner.costs import layer_cost
from autopar.zoo import get_model
from cost_models import moe
from cost_models.hardware import Link, MiB
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh, Plan, parse_option
from runtime.plan_report import ms

transformers = pytest.importorskip("transformers")

SLOW = replace(make_cluster(nodes=4, per_node=1),
               inter_node=Link(kind="network", bandwidth_GBps=1.0, latency_s=50e-6))


def mixtral(hidden: int, intermediate: int, experts: int = 8):
    cfg = transformers.MixtralConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=experts, num_experts_per_tok=2, use_cache=False)
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(cfg)


def tokens(batch: int, seq: int) -> dict:
    return {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta")}


@pytest.fixture(scope="module")
def wide_experts_plan():
    """Float32 (the runtime's EP runs in float32 only) throughout.
    H = 256, I = 1024: 6.3M expert weights a layer against 0.2M dense; 512 tokens. On 4
    ranks of one node, holding every expert costs each rank the optimizer step and the
    gradient all-reduce of all 8; all-to-alls of 128 tokens on NVLink cost microseconds."""
    return search_plans(mixtral(256, 1024), make_cluster(per_node=4), tokens(8, 64),
                        precision="float32", mesh=Mesh(dp=4)).plan


@pytest.fixture(scope="module")
def slow_network_plan():
    """H = I = 64: 98,304 expert weights a layer (a 0.39 MB float32 gradient: all-reduced
    across 4 nodes in 2·¾·0.39 MB/1 GB/s = 0.59 ms); 8,192 tokens, 2,048 a rank, each
    all-to-all at ep = 2 sends ½·2048·2·64·4 bytes over the network: 0.52 ms + 50 µs,
    four a micro-batch, 2.3 ms: more than EP could save."""
    return search_plans(mixtral(64, 64), SLOW, tokens(16, 512), precision="float32",
                        mesh=Mesh(dp=4)).plan


def moe_layers(model, inputs) -> set[str]:
    graph = build_layer_graph(model, inputs)
    return {x.name for x in graph.layers if x.moe}


def test_mixtral_layers_carry_their_experts():
    graph = build_layer_graph(mixtral(256, 1024), tokens(8, 64))
    layer = next(x for x in graph.layers if x.name == "model.layers.0")
    (block,) = layer.moe
    assert (block.block, block.experts) == ("mlp", "mlp.experts")
    assert block.tokens == 8 * 64
    assert block.param_count == 8 * (256 * 2048 + 1024 * 256)
    assert (block.shape.num_experts, block.shape.top_k, block.shape.gated) == (8, 2, True)
    assert not next(x for x in graph.layers if x.name == "lm_head").moe
    # Hugging Face runs the experts as grouped_mm, which PyTorch's FLOP counter does not
    # count: the capture sees none of their 2·1024·(256·2048 + 1024·256) FLOPs, which the
    # planner prices itself, at ep = 1 too.
    assert block.fwd_flops == 0
    assert moe.expert_fwd_flops(block.tokens, block.shape, 1) == 2 * 1024 * (256 * 2048
                                                                             + 1024 * 256)
    cluster, prec = make_cluster(per_node=4), precision("float32")
    whole = layer_cost(layer, "fsdp", Mesh(dp=4), cluster, prec)
    dense = layer_cost(moe_costs.dense_part(layer), "fsdp", Mesh(dp=4), cluster, prec)
    assert whole.compute_s > dense.compute_s


def test_ep_is_set_on_exactly_the_moe_layers_when_it_wins(wide_experts_plan):
    plan = wide_experts_plan
    with_ep = {x.module for x in plan.layers if x.expert_parallel > 1}
    assert with_ep == moe_layers(mixtral(256, 1024), tokens(8, 64)) == {"model.layers.0",
                                                                "model.layers.1"}
    for x in plan.layers:
        assert plan.mesh.dp % x.expert_parallel == 0
        assert 8 % x.expert_parallel == 0
    rationale = next(c for c in plan.rationale.classes
                     if c.layer_class == plan.layer("model.layers.0").layer_class)
    best = min(rationale.options, key=lambda o: o.time_s)
    assert parse_option(best.strategy)["expert_parallel"] > 1


def test_ep_is_not_chosen_across_a_slow_network(slow_network_plan):
    plan = slow_network_plan
    assert all(x.expert_parallel == 1 for x in plan.layers), [x.option for x in plan.layers]
    rationale = next(c for c in plan.rationale.classes
                     if c.layer_class == plan.layer("model.layers.0").layer_class)
    assert any("+ep" in o.strategy for o in rationale.options)  # offered, and lost


def test_explain_says_why_ep_was_chosen(wide_experts_plan):
    e = explain(wide_experts_plan, "model.layers.0")
    assert e.expert_parallel.startswith(f"chosen ({e.strategy}, ")
    best_without = min((v for v in e.options if "+ep" not in v.strategy),
                       key=lambda v: v.time_s)
    assert e.expert_parallel.endswith(
        f": the best option without it, {best_without.strategy}, takes "
        f"{ms(best_without.time_s)}")
    assert f"expert parallelism: {e.expert_parallel}" in format_explanation(e)


def test_explain_says_why_ep_was_not_chosen(slow_network_plan):
    e = explain(slow_network_plan, "model.layers.0")
    best_ep = min((v for v in e.options if "+ep" in v.strategy), key=lambda v: v.time_s)
    assert e.expert_parallel.startswith(
        f"not chosen: the best expert-parallel option, {best_ep.strategy}, takes")
    assert e.expert_parallel.endswith(f"for {e.strategy}")


def test_explain_says_why_ep_was_unavailable():
    model, inputs = mixtral(64, 64), tokens(4, 16)
    graph = build_layer_graph(model, inputs)
    one = search_plans(model, make_cluster(per_node=4), inputs, mesh=Mesh(dp=1, tp=4)).plan
    assert explain(one, "model.layers.0").expert_parallel == (
        "not available: mesh.dp is 1: no data-parallel ranks to split the experts over")
    four = search_plans(model, make_cluster(per_node=4), inputs, mesh=Mesh(dp=4)).plan
    assert explain(four, "lm_head", graph).expert_parallel == (
        "not available: no mixture-of-experts block in this layer")
    assert "no mixture-of-experts block the planner recognises" in \
        explain(four, "lm_head").expert_parallel  # a saved plan alone narrows it down
    mixed = search_plans(model, make_cluster(per_node=4), inputs, precision="bfloat16",
                         mesh=Mesh(dp=4)).plan
    assert all(x.expert_parallel == 1 for x in mixed.layers)
    float32_only = "the runtime runs expert parallelism in float32 only, not bfloat16"
    assert explain(mixed, "model.layers.0", graph).expert_parallel == \
        f"not available: {float32_only}"
    assert explain(mixed, "model.layers.0").expert_parallel == \
        f"not available in this plan: {float32_only}"
    model3 = mixtral(64, 64, experts=3)
    three = search_plans(model3, make_cluster(per_node=4), inputs, mesh=Mesh(dp=4)).plan
    assert all(x.expert_parallel == 1 for x in three.layers)
    assert explain(three, "model.layers.0", build_layer_graph(model3, inputs)).expert_parallel \
        == "not available: no divisor of mesh.dp=4 above 1 divides the experts' count (3)"


def test_zoo_moe_takes_ep_on_its_moe_blocks_when_memory_binds():
    """moe-small (4 blocks of 8 experts, top-2), batch 8 × 64, on 4 ranks of 30 MiB: FSDP
    of the whole layer gathers every expert (all 8 at once, and the next layer's
    prefetched); under fsdp+ep2 a rank gathers its 4 experts from the 2 ranks holding
    their shards, so the transient is about half and fsdp+ep2 fits where fsdp does not,
    faster than what fits without EP (recomputation)."""
    spec = get_model("moe-small")
    model, inputs = spec.build("meta"), spec.example_inputs(8, 64, device="meta")
    plan = search_plans(model, make_cluster(per_node=4, memory_bytes=30 * MiB), inputs,
                        precision="float32", mesh=Mesh(dp=4)).plan
    with_ep = {x.module for x in plan.layers if x.expert_parallel > 1}
    assert with_ep == moe_layers(model, inputs) == {f"h.{i}" for i in range(4)}
    e = explain(plan, "h.0")
    assert e.expert_parallel.startswith(f"chosen ({e.strategy}, ")
    assert "does not fit in memory" in e.expert_parallel


def test_zoo_moe_tiny_keeps_its_experts_whole_on_ample_memory():
    """moe-tiny (4 experts of 64 × 128): its expert GEMMs take microseconds, and the four
    all-to-alls a micro-batch cost more than splitting the experts saves."""
    spec = get_model("moe-tiny")
    model, inputs = spec.build("meta"), spec.example_inputs(8, 64, device="meta")
    plan = search_plans(model, make_cluster(per_node=4), inputs, precision="float32",
                        mesh=Mesh(dp=4)).plan
    assert all(x.expert_parallel == 1 for x in plan.layers)
    assert explain(plan, "h.0").expert_parallel.startswith(
        "not chosen: the best expert-parallel option, ")


def test_the_expert_estimator_counts_the_flops_the_zoo_moe_registers():
    """The zoo's grouped expert op registers its FLOPs with PyTorch's counter
    (runtime/grouped_experts.py), so its capture counts the experts' work: 512 tokens,
    top-2, H = 64, I = 128: 1024 rows × (2·64·256 + 2·128·64) = 50,331,648. The estimator
    that replaces it at ep = 1 counts the same."""
    spec = get_model("moe-tiny")
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(8, 64, device="meta"))
    (block,) = next(x for x in graph.layers if x.name == "h.0").moe
    assert block.fwd_flops == 50_331_648
    assert moe.expert_fwd_flops(block.tokens, block.shape, 1) == block.fwd_flops


def test_explain_names_ddp_when_it_beats_a_faster_ep_layer():
    """moe-small, batch 32 × 64, on 4 ranks of 80 GiB: per layer an expert-parallel option
    (zero2+ep2: its once-per-step gather hides in the forward) is a little faster than
    replicate under FSDP2, but the all-replicate plan runs on DDP, without FSDP2's host
    time, and wins on the whole; DDP runs no expert parallelism."""
    spec = get_model("moe-small")
    model, inputs = spec.build("meta"), spec.example_inputs(32, 64, device="meta")
    plan = search_plans(model, make_cluster(per_node=4), inputs, precision="float32",
                        mesh=Mesh(dp=4)).plan
    assert all(x.strategy == "replicate" and x.expert_parallel == 1 for x in plan.layers)
    text = explain(plan, "h.0").expert_parallel
    assert text.startswith("not chosen: zero2+ep2")
    assert text.endswith("the plan runs on DDP (every layer replicate, in float32), which "
                         "is faster on the whole than FSDP2 and runs no expert parallelism")


def test_a_saved_ep_plan_loads_and_explains_the_same(wide_experts_plan, tmp_path):
    path = tmp_path / "plan.json"
    wide_experts_plan.save(path)
    loaded = Plan.load(path)
    assert [x.expert_parallel for x in loaded.layers] == \
        [x.expert_parallel for x in wide_experts_plan.layers]
    assert explain(loaded, "model.layers.0") == explain(wide_experts_plan, "model.layers.0")
