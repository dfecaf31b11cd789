"""Tied weights under pipeline parallelism: Megatron's embedding group, planned and run.

A tie cut by a stage boundary (the embedding on the first stage, the LM head tied to it on
the last) leaves a copy of the shared weight on each stage; the copies' gradients are
all-reduced over their pipeline ranks once a step (runtime/tied.py). The planner
(autopar/planner/engine.py, ties.py) gives the copies one strategy, keeps them on
distinct pipeline ranks, and costs the copy's states and the all-reduce.

Checked here: the planner's pp=2 plans of the zoo's tied models (tests/real_models.py) on
two CPU ranks train like one process; the copy's memory and the all-reduce's time against
hand-derived numbers; a GPT-2-XL-sized nanoGPT on DGX A100s, where pipelining wins at a
small batch, never gets copies with different strategies or two copies on one rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from real_models import MODELS
from test_real_models import pipeline_inputs, reference, train_job, variant_plan
from test_tied import TiedGPT

from autopar.planner.configs import Config
from autopar.planner.engine import Engine, Outcome
from autopar.planner.search import search
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.plan import Mesh, Plan, stage_rank
from runtime.tied import Tie, tie_groups

TIED_MODELS = ("hf-gpt2", "nanogpt-tied")
TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
KEY_BIAS_TOL = dict(rtol=1e-5, atol=2e-3)
"""Attention key biases (nanoGPT's fused ``c_attn.bias``, GPT-2's ``c_attn.bias``) have a
zero exact gradient; Adam turns two ranks' rounding noise into moves of up to lr a step."""


def _tied_modules(plan: Plan, model: torch.nn.Module) -> list[tuple[str, ...]]:
    return [t.modules for t in tie_groups(model, [la.module for la in plan.layers])]


def _assert_tie_runs(plan: Plan, ties: list[tuple[str, ...]]) -> None:
    """One strategy per tie, and its copies (one per stage) on distinct pipeline ranks."""
    by_name = {la.module: la for la in plan.layers}
    for modules in ties:
        layers = [by_name[m] for m in modules]
        assert len({(la.strategy, la.offload) for la in layers}) == 1, layers
        stages = {la.stage for la in layers}
        ranks = {stage_rank(s, plan.mesh.pp, plan.pipeline) for s in stages}
        assert len(ranks) == len(stages), (plan.pipeline, stages)


def _dropout_on(name: str) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in MODELS[name].build().modules())


@pytest.mark.parametrize("name", TIED_MODELS)
def test_planned_pp2_of_a_tied_model_trains_like_one_process(pool2, name):
    """The planner's own pp=2 plan splits the tie across the two ranks (the embedding
    starts the model, the head ends it); each copy ends every step with the whole
    gradient and the same weights as one process."""
    plan_json, why = variant_plan(name, "pp2")
    assert plan_json is not None, why
    plan = Plan.from_json(plan_json)
    model = MODELS[name].build()
    ties = _tied_modules(plan, model)
    assert plan.mesh.pp == 2 and ties, (plan.mesh, ties)
    _assert_tie_runs(plan, ties)
    by_name = {la.module: la for la in plan.layers}
    assert len({stage_rank(by_name[m].stage, 2, plan.pipeline) for m in ties[0]}) == 2
    if _dropout_on(name):
        pytest.skip(f"{name} is built with dropout: no split run can match one process")
    ref = reference(name, pipeline=True)
    results = pool2.run(train_job, name, plan_json)
    copies = {n for n, _ in model.named_parameters(remove_duplicate=False)} - \
        {n for n, _ in model.named_parameters()}
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["losses"], ref["losses"], **TOL)
        for n, grad in got["grads"].items():  # each copy's, after forward_backward
            torch.testing.assert_close(grad, ref["grads"][n], **TOL, msg=f"rank {rank} {n}")
        for n, value in got["params"].items():
            tol = KEY_BIAS_TOL if n.endswith("c_attn.bias") else PARAM_TOL
            torch.testing.assert_close(value, ref["params"][n], **tol, msg=f"rank {rank} {n}")
        assert copies <= got["params"].keys(), copies  # the head's copy was trained too


# -- costs -----------------------------------------------------------------------------------


def _nanogpt_graph(batch: int = 16):
    spec = MODELS["nanogpt-tied"]
    return build_layer_graph(spec.build(), pipeline_inputs(spec.batch(batch)))


def test_the_heads_copy_and_the_all_reduce_cost_what_hand_arithmetic_says():
    """nanoGPT (d 64, vocabulary 128: a shared 8192-element matrix) on 2 DGX A100 nodes at
    pp=2 × dp=8: stage 0 on node 0, stage 1 on node 1, zero2 over 8 ranks.

    The head (which owns no parameter of its own) holds the copy as a pipelined zero2
    layer does: P + P/8 parameters, G gradient, K/8 optimizer bytes. Both it and the
    embedding all-reduce their 8192/8-element float32 gradient shard with the other
    pipeline rank, over the network (ranks 8 apart, 8 a node): a 2-rank ring,
    S/B + 2α with S = 4096 B, B = 25 GB/s, α = 10 µs, and NCCL's launch of 8.4 µs."""
    from autopar.planner.costs import layer_cost
    from autopar.planner.ties import with_copy

    graph = _nanogpt_graph()
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    prec = precision("float32")
    mesh = Mesh(pp=2, dp=8)
    config = Config(mesh=mesh, schedule="1F1B", virtual_stages=1, microbatches=2,
                            tie_strategy="zero2")
    ctx = Engine(graph, cluster, prec, 10.0)
    names = [layer.name for layer in graph.layers]
    wte, head = names.index("transformer.wte"), names.index("lm_head")
    stage_of = tuple(0 if i <= names.index("transformer.h.0") else 1 for i in range(len(names)))
    numel, shards = 128 * 64, 8
    assert graph.ties[0].numels == (numel,)
    assert graph.layers[head].param_count == 0

    plain = layer_cost(graph.layers[head], "zero2", mesh, cluster, prec, 2)
    held = ctx.costs(head, config, stage_of)["zero2"]
    assert held.params_bytes - plain.params_bytes == pytest.approx(numel * (4 + 4 / shards))
    assert held.grads_bytes - plain.grads_bytes == pytest.approx(numel * 4)
    assert held.optimizer_bytes - plain.optimizer_bytes == pytest.approx(numel * 8 / shards)

    all_reduce = numel / shards * 4 / 25e9 + 2 * 10e-6 + 8.4e-6
    copy_alone = layer_cost(with_copy(graph.layers[head], ctx.role(head, config, stage_of)[1]),
                            "zero2", mesh, cluster, prec, 2)
    assert held.step_s - copy_alone.step_s == pytest.approx(all_reduce, rel=1e-9)
    owner = ctx.costs(wte, config, stage_of)["zero2"]
    alone = layer_cost(graph.layers[wte], "zero2", mesh, cluster, prec, 2)
    assert owner.step_s - alone.step_s == pytest.approx(all_reduce, rel=1e-9)
    assert owner.states_bytes == alone.states_bytes  # the owner holds what it always did
    # The layers between hold no copy and join no all-reduce.
    h1 = names.index("transformer.h.1")
    assert ctx.costs(h1, config, stage_of) == ctx.costs(h1, config)


def test_v_schedules_get_no_cut_that_folds_both_copies_onto_one_rank():
    """ZBVZeroBubble at pp=2 runs stages 0 and 3 on rank 0: the embedding's stage and the
    head's, so no cut is offered; interleaved 1F1B puts them on ranks 0 and 1."""

    graph = _nanogpt_graph()
    ctx = Engine(graph, Cluster.local(2), precision("float32"), 10.0)
    common = dict(mesh=Mesh(pp=2, dp=1), virtual_stages=2, microbatches=2,
                  tie_strategy="replicate")
    assert ctx.cuts(Config(schedule="ZBVZeroBubble", **common)) == []
    cuts = ctx.cuts(Config(schedule="Interleaved1F1B", **common))
    assert cuts and all(c[0] % 2 != c[-1] % 2 for c in cuts)


# -- the planner's choices on a DGX ----------------------------------------------------------


def _gpt2_xl_model(batch: int):
    """nanoGPT at GPT-2 XL's size (48 × 1600, vocabulary 50304) with its head tied to the
    embedding, on meta, ``batch`` sequences of 1024 tokens."""
    with torch.device("meta"):
        model = TiedGPT(vocab=50304, d=1600, n_layer=48, seq=1024)
    return model, (torch.randint(0, 50304, (batch, 1024), device="meta"),)


def _gpt2_xl(batch: int):
    return build_layer_graph(*_gpt2_xl_model(batch))


def _outcome_keeps_the_tie(graph, outcome: Outcome) -> None:
    c = outcome.config
    owner = [stage_rank(s, c.mesh.pp, _spec(c)) for s in range(c.num_stages)]
    index = {layer.name: i for i, layer in enumerate(graph.layers)}
    for tie in graph.ties:
        members = [index[m] for m in tie.modules]
        assert {outcome.costs[i].strategy for i in members} == {c.tie_strategy}, c
        assert not any(outcome.costs[i].offload for i in members)
        stages = {outcome.stage_of_layer[i] for i in members}
        assert len({owner[s] for s in stages}) == len(stages), (c, stages)


def _spec(config: Config):
    from runtime.plan import PipelineSpec

    return PipelineSpec(schedule=config.schedule, num_microbatches=config.microbatches,
                        virtual_stages=config.virtual_stages)


@pytest.mark.parametrize("batch", [1, 2])
def test_gpt2_xl_sized_tied_model_on_dgx_pipelines_with_one_strategy_per_tie(batch):
    """At 1 and 2 sequences on 4 DGX A100 nodes pipelining beats every pp = 1 mesh for a
    GPT-2-XL-sized nanoGPT with its head tied to the embedding. Every pipeline outcome
    the search evaluated, and the plan, keep the copies on one data-parallel strategy and
    on distinct ranks; the tie costs the plan time (the untied model's plan is faster)."""
    graph = _gpt2_xl(batch)
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)
    result = search(graph, cluster)
    plan = result.plan
    assert plan.mesh.pp > 1, plan.mesh
    _assert_tie_runs(plan, [graph.ties[0].modules])
    by_name = {la.module: la for la in plan.layers}
    assert by_name["wte"].stage == 0 and by_name["lm_head"].stage == plan.num_stages - 1

    _, outcomes = Engine(graph, cluster, precision("float32"), prune=False).pipelines()
    evaluated = [o for o in outcomes if isinstance(o, Outcome)]
    assert evaluated
    for outcome in evaluated:
        _outcome_keeps_the_tie(graph, outcome)
    untied = search(dataclasses.replace(graph, ties=()), cluster).plan
    assert plan.solver.objective_s > untied.solver.objective_s


def test_explain_names_the_stages_holding_copies():
    from autopar.api import search_plans
    from autopar.explain import explain, format_explanation

    model, inputs = _gpt2_xl_model(1)
    plan = search_plans(model, Cluster.preset("dgx-a100-80g", nodes=4), inputs).plan
    last = plan.num_stages - 1
    ranks = stage_rank(last, plan.mesh.pp, plan.pipeline)
    for module in ("wte", "lm_head"):
        text = format_explanation(explain(plan, module))
        assert (f"stages 0, {last} each hold a copy, whose gradients are all-reduced across "
                f"pipeline ranks 0, {ranks} every step") in text, text


def test_every_cut_offered_keeps_the_copies_on_distinct_ranks():
    from autopar.planner.configs import pipeline_configs

    graph = _gpt2_xl(2)
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)
    ctx = Engine(graph, cluster, precision("float32"), 10.0)
    configs = pipeline_configs(graph, cluster)
    # A tie across stages is split from the exported graph, whose stages take no TP: tp = 1,
    # so batch 2 on 32 GPUs leaves pp >= 16 and dp <= 2 (no hybrid sharding, one micro-batch
    # per replica and stage: no ZeRO-1).
    assert graph.exported_stages and all(c.mesh.tp == 1 for c in configs)
    assert {c.tie_strategy for c in configs} == {"replicate", "zero2", "fsdp"}
    wte, head = 0, len(graph.layers) - 1
    for config in configs:
        owner = [stage_rank(s, config.mesh.pp, _spec(config)) for s in range(config.num_stages)]
        cuts = ctx.cuts(config)
        if config.schedule == "ZBVZeroBubble":
            assert cuts == [], config  # the V folds the last stage onto rank 0
        for cut in cuts:
            assert owner[cut[wte]] != owner[cut[head]], (config, cut)


def test_a_tie_with_a_root_reading_the_weight_is_not_pipelined():
    """The root's own ops are on no stage of the plan. A root that only names the weight
    (read by the tied layers alone: T5's ``shared``) holds no copy, and is pipelined."""
    from autopar.errors import ConfigError

    graph = _nanogpt_graph(8)
    tie = Tie(modules=("", "lm_head"), params=("w", "lm_head.weight"), numels=(8192,))
    rooted = dataclasses.replace(graph, ties=(tie,), read_by_others=frozenset({"w"}))
    with pytest.raises(ConfigError, match="own forward reads the shared parameter outside "
                                          "every planned module"):
        search(rooted, Cluster.local(2), mesh=Mesh(pp=2, dp=1))
    named = dataclasses.replace(rooted, read_by_others=frozenset())
    assert search(named, Cluster.local(2), mesh=Mesh(pp=2, dp=1)).plan.num_stages >= 2
