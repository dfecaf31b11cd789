"""Tied parameters end to end: the runtime shards tied modules as one FSDP2 unit and
matches one process, refuses tied modules given different strategies before any
collective, and sums a pipeline's tied copies' gradients; the planner gives tied modules
one strategy on every cluster (pipelines: tests/runtime/test_tied_pipeline.py).

Models: a nanoGPT-style model with ``lm_head.weight = wte.weight`` and Hugging Face's
``GPT2LMHeadModel`` (tiny config, random init, dropout off so ranks match one process).
Jobs run on the session's pool of 2 gloo ranks (tests/dist_pool.py).
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_runtime_numerics import _close, collectives_trapped

from runtime.plan import LayerPlan, Mesh, Plan, PlanError

STEPS = 3
LR = 1e-3
BATCH, SEQ, VOCAB = 8, 16, 64
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
KEY_BIAS_TOL = dict(rtol=1e-5, atol=STEPS * LR)
"""The key bias's true gradient is zero (softmax ignores a shift shared by every key), so
AdamW divides rounding noise by its own size and moves it by up to lr a step, either way
(seen: 2e-4). Its gradients are still compared at FP32_TOL."""
KEY_BIAS = ("qkv.bias", "c_attn.bias")
BF16_TOL = dict(rtol=2e-2, atol=2e-3)


# -- models ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TiedGPT(nn.Module):
    """nanoGPT's layout and weight tying (``lm_head.weight = wte.weight``)."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, n_layer: int = 2, seq: int = SEQ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def hf_gpt2_tied() -> nn.Module:
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=SEQ, use_cache=False, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_bert_mlm() -> nn.Module:
    """BertForMaskedLM: its word embeddings tied to the MLM head's decoder (``cls``)."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {"nanogpt": TiedGPT, "gpt2": hf_gpt2_tied, "bert": hf_bert_mlm}[name]()


def loss_fn(out, y: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (tokens[:, :-1],), tokens[:, 1:]


NAMES = {
    "nanogpt": ("wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"),
    "gpt2": ("transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
             "transformer.h.1", "transformer.ln_f", "lm_head"),
    "bert": ("bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"),
}
TIED = {"nanogpt": ("wte", "lm_head"), "gpt2": ("transformer.wte", "lm_head"),
        "bert": ("bert.embeddings", "cls")}
HEAD = {"nanogpt": "lm_head", "gpt2": "lm_head", "bert": "cls"}
INPUT_EMBEDDING = {"nanogpt": "wte", "gpt2": "transformer.wte",
                   "bert": "bert.embeddings.word_embeddings"}
HEAD_LINEAR = {"nanogpt": "lm_head", "gpt2": "lm_head", "bert": "cls.predictions.decoder"}


# -- plans -----------------------------------------------------------------------------------


def forced_plan(model: str, kind: str) -> str:
    """fsdp, zero2+full, bf16 (fsdp in bfloat16), or a mixed per-layer plan."""
    names = NAMES[model]
    dtype = "bfloat16" if kind == "bf16" else "float32"
    if kind == "mixed":
        # The tied pair sharded together; the rest one strategy each, with recomputation.
        others = ["replicate", "zero2", "fsdp", "replicate", "zero2"]
        layers, i = [], 0
        for n in names:
            if n in TIED[model]:
                layers.append(LayerPlan(module=n, strategy="fsdp", offload=True))
            else:
                layers.append(LayerPlan(module=n, strategy=others[i % len(others)],
                                        recompute="full" if ".h." in f".{n}" else "none"))
                i += 1
    else:
        strategy = "zero2" if kind == "zero2_full" else "fsdp"
        recompute = "full" if kind == "zero2_full" else "none"
        layers = [LayerPlan(module=n, strategy=strategy, recompute=recompute) for n in names]
    return Plan(global_batch=BATCH, mesh=Mesh(dp=2), layers=tuple(layers), param_dtype=dtype,
                reduce_dtype="float32").to_json()


# -- jobs and references ---------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu().float().clone()


def train_job(model: str, plan_json: str) -> dict:
    """STEPS steps under the plan: losses, every step's gradients, final parameters."""
    from runtime.train import Trainer

    trainer = Trainer(build(model), Plan.from_json(plan_json), loss_fn,
                      lambda params: torch.optim.AdamW(params, lr=LR))
    net = trainer.applied.model
    tied_together = (net.get_submodule(HEAD_LINEAR[model]).weight
                     is net.get_submodule(INPUT_EMBEDDING[model]).weight)
    losses, grads = [], []
    for step in range(STEPS):
        inputs, targets = trainer.shard_batch(*batch(step))
        losses.append(trainer.forward_backward(inputs, targets).item())
        grads.append({n: _full(p.grad) for n, p in net.named_parameters()})
        trainer.step()
    return {"losses": losses, "grads": grads, "params": trainer.full_state_dict(),
            "tied": tied_together}


@functools.cache
def reference(model: str, dtype: str = "float32") -> dict:
    """One process; with ``dtype`` bfloat16, runtime.precision's casting (float32 master
    weights, a bfloat16 copy runs forward and backward, the loss in float32), as
    tests/reference.py's mixed_precision_reference, whose output cast needs a tensor."""
    net = build(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        inputs, targets = batch(step)
        compute = net if dtype == "float32" else copy.deepcopy(net).to(getattr(torch, dtype))
        loss = loss_fn(compute(*inputs), targets)
        loss.backward()
        for p, q in zip(net.parameters(), compute.parameters(), strict=True):
            p.grad = q.grad.float()
        losses.append(loss.item())
        grads.append({n: _full(p.grad) for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: _full(p) for n, p in net.named_parameters()}}


def assert_matches(results: list[dict], model: str, dtype: str = "float32") -> None:
    ref = reference(model, dtype)
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    for rank, got in enumerate(results):
        assert got["tied"], f"rank {rank}: the tie was broken by parallelization"
        _close(got["losses"], ref["losses"], tol, f"rank {rank} losses")
        for step, (mine, want) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            assert mine.keys() == want.keys()
            for name in want:
                _close(mine[name], want[name].float(), tol, f"rank {rank} step {step} grad {name}")
        for name, want in ref["params"].items():
            ptol = PARAM_TOL if dtype == "float32" else BF16_TOL
            if name.endswith(KEY_BIAS):
                ptol = dict(rtol=ptol["rtol"], atol=KEY_BIAS_TOL["atol"])
            _close(got["params"][name], want.float(), ptol, f"rank {rank} param {name}")


# -- runtime ---------------------------------------------------------------------------------

RUNTIME_CASES = [(m, k) for m in ("nanogpt", "gpt2") for k in ("fsdp", "zero2_full", "mixed", "bf16")
                 ] + [("bert", "fsdp")]


@pytest.mark.parametrize(("model", "kind"), RUNTIME_CASES)
def test_tied_modules_train_as_one_fsdp_unit_like_one_process(pool2, model, kind):
    results = pool2.run(train_job, model, forced_plan(model, kind))
    assert_matches(results, model, "bfloat16" if kind == "bf16" else "float32")


def split_tie_job(model: str, plan_json: str) -> str:
    """Apply on rank 0 only, every way into a collective trapped (see bad_plan_job)."""
    import torch.distributed as dist

    import runtime.apply

    if dist.get_rank() != 0:
        return ""
    try:
        with collectives_trapped((runtime.apply, "build_mesh")):
            runtime.apply.apply_plan(build(model), Plan.from_json(plan_json))
    except PlanError as e:
        return str(e)
    return "accepted"


def _split_strategies(model: str) -> str:
    head, embedding = HEAD[model], TIED[model][0]
    layers = [LayerPlan(module=n, strategy="replicate" if n == head else "zero2")
              for n in NAMES[model]]
    assert any(la.module == embedding for la in layers)
    return Plan(global_batch=BATCH, mesh=Mesh(dp=2), layers=tuple(layers)).to_json()


@pytest.mark.parametrize("model", ["nanogpt", "gpt2", "bert"])
def test_tied_modules_with_different_strategies_are_refused_before_any_collective(pool2, model):
    message = pool2.run(split_tie_job, model, _split_strategies(model))[0]
    (embedding, head), params = TIED[model], (INPUT_EMBEDDING[model], HEAD_LINEAR[model])
    assert (f"'{embedding}', '{head}' share parameter '{params[0]}.weight' = "
            f"'{params[1]}.weight'") in message, message
    assert f"'{head}': replicate" in message and f"'{embedding}': zero2" in message
    assert "give them the same strategy" in message


def test_tied_modules_split_into_per_matrix_units_are_refused_before_any_collective(pool2):
    """Tied modules are one FSDP2 unit together: ``fsdp_modules``, one unit per weight
    matrix, would put the shared matrix in two."""
    plan = Plan(global_batch=BATCH, mesh=Mesh(dp=2), layers=tuple(
        LayerPlan(module=n, strategy="fsdp_modules") for n in NAMES["nanogpt"])).to_json()
    message = pool2.run(split_tie_job, "nanogpt", plan)[0]
    embedding, head = TIED["nanogpt"]
    assert f"'{embedding}', '{head}' share parameter" in message, message
    assert "'fsdp_modules' would split into their modules" in message


# -- planner ---------------------------------------------------------------------------------

CLUSTERS = [("local", None), ("dgx-a100-80g", 1), ("dgx-a100-80g", 4)]


def _cluster(name: str, nodes: int | None):
    from cost_models.hardware import Cluster

    return Cluster.local(2) if name == "local" else Cluster.preset(name, nodes=nodes)


def _assert_one_option(plan: Plan, tied: tuple[str, ...]) -> None:
    options = {la.module: la.option for la in plan.layers if la.module in tied}
    assert options.keys() == set(tied), options
    assert len(set(options.values())) == 1, options
    assert all(la.strategy not in ("tp", "tp_fsdp") for la in plan.layers if la.module in tied)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("cluster", "nodes"), CLUSTERS)
@pytest.mark.parametrize("model", ["nanogpt", "gpt2", "bert"])
def test_planner_gives_tied_modules_one_strategy(model, cluster, nodes, dtype):
    import autopar

    plan = autopar.plan(build(model), _cluster(cluster, nodes), batch(0)[0], precision=dtype)
    _assert_one_option(plan, TIED[model])
    from runtime.plan import stage_rank

    stages = {la.stage for la in plan.layers if la.module in TIED[model]}
    assert len({stage_rank(s, plan.mesh.pp, plan.pipeline) for s in stages}) == len(stages)


def gpt2_xl_sized():
    """nanoGPT at GPT-2 XL's size (48 × 1600, vocabulary 50304), on meta, batch 64 × 1024:
    alone, its embedding would be sharded and its head replicated on a DGX."""
    with torch.device("meta"):
        model = TiedGPT(vocab=50304, d=1600, n_layer=48, seq=1024)
    return model, (torch.randint(0, 50304, (64, 1024), device="meta"),)


@pytest.mark.parametrize("nodes", [1, 4])
def test_a_binding_tie_changes_the_plan_and_costs_no_less_than_the_untied_optimum(nodes):
    """The tie binds: planned as if untied the embedding and the head take different
    options; planned tied they take one, at a step time no better than the untied optimum
    and equal to the best tied assignment (the joined class's options, each priced)."""
    import dataclasses

    from autopar.planner.search import search
    from cost_models.hardware import Cluster
    from passes.layer_graph import build_layer_graph

    graph = build_layer_graph(*gpt2_xl_sized())
    cluster = Cluster.preset("dgx-a100-80g", nodes=nodes)
    untied = search(dataclasses.replace(graph, ties=()), cluster).plan
    split = {la.module: la.option for la in untied.layers if la.module in TIED["nanogpt"]}
    assert len(set(split.values())) == 2, split
    tied = search(graph, cluster).plan
    _assert_one_option(tied, TIED["nanogpt"])
    assert tied.solver.objective_s >= untied.solver.objective_s * (1 - 1e-9)
    assert tied.prediction.step_time_s == pytest.approx(tied.solver.objective_s, rel=1e-9)


def test_explain_says_why_tied_layers_have_no_tensor_parallelism():
    from autopar.api import search_plans
    from autopar.explain import explain, format_explanation
    from cost_models.hardware import Cluster

    model, inputs = gpt2_xl_sized()
    plan = search_plans(model, Cluster.preset("dgx-a100-80g", nodes=1), inputs).plan
    for module in TIED["nanogpt"]:
        text = format_explanation(explain(plan, module))
        assert ("tp: not available (tied weights: 'wte', 'lm_head' share parameter "
                "'wte.weight' = 'lm_head.weight'; tensor parallelism would split") in text, text
    untied = format_explanation(explain(plan, "h.0"))
    assert "tied weights" not in untied
    # Alone the embedding would take zero2 (test above): the tie is why it does not.
    assert "(tied weights), so they are one FSDP2 unit and take one option" in \
        explain(plan, "wte").reason


def test_planner_pipelines_tied_models_with_one_strategy_per_tie():
    """Each pipeline configuration of a tied model names the tie's strategy; a fixed
    pp = 2 mesh gets a plan whose tied modules take it, on the first and last stage."""
    from autopar.planner.configs import pipeline_configs, pipeline_problem
    from autopar.planner.search import search
    from cost_models.hardware import Cluster
    from passes.layer_graph import build_layer_graph

    graph = build_layer_graph(build("nanogpt"), batch(0)[0])
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)
    assert pipeline_problem(graph) is None
    configs = pipeline_configs(graph, cluster)
    assert configs and all(c.tie_strategy in ("replicate", "zero1", "zero2", "fsdp", "hsdp")
                           for c in configs)
    one_node = Cluster.preset("dgx-a100-80g", nodes=1)
    plan = search(graph, one_node, mesh=Mesh(pp=2, dp=4)).plan
    assert plan.mesh == Mesh(pp=2, dp=4)
    _assert_one_option(plan, TIED["nanogpt"])
    stages = {la.module: la.stage for la in plan.layers}
    assert (stages["wte"], stages["lm_head"]) == (0, plan.num_stages - 1)


def _tied_instance(seed: int):
    """A random planner instance (tests/autopar/planner/test_planner.py) whose first and last layers share
    a parameter; they may share their class with untied layers."""
    import dataclasses
    import random

    from test_planner import random_instance

    from runtime.tied import Tie

    graph, cluster = random_instance(random.Random(seed), max_layers=4)
    tie = Tie(modules=(graph.layers[0].name, graph.layers[-1].name), params=("a.w", "b.w"))
    return dataclasses.replace(graph, ties=(tie,)), cluster


def _brute_force_tied(graph, cluster) -> float:
    """Best step time over every mesh, accumulation and per-layer option with the tied
    layers on one data-parallel option (as test_planner.brute_force, plus that filter)."""
    import itertools

    from test_planner import every_option

    from autopar.planner.configs import accumulation_steps, candidate_meshes
    from autopar.planner.costs import HOST_MEMORY_BYTES, on_ddp
    from cost_models.memory import precision

    prec, best = precision("float32"), float("inf")
    first, last = 0, len(graph.layers) - 1
    for mesh, reason in candidate_meshes(cluster, graph.batch_size):
        for m in accumulation_steps(graph, mesh) if not reason else ():
            options = [every_option(layer, mesh, cluster, prec, m) for layer in graph.layers]
            for i in (first, last):
                options[i] = [c for c in options[i] if c.strategy not in ("tp", "tp_fsdp")]
            ddp = [[on_ddp(c) for c in layer if c.strategy == "replicate"] for layer in options]
            for combo in itertools.chain(itertools.product(*options), itertools.product(*ddp)):
                if combo[first].option != combo[last].option:
                    continue
                resident = sum(c.resident_bytes for c in combo)
                need = (1 + cluster.memory_margin_fraction) * (
                    resident + max(c.buffers_bytes for c in combo))
                if need > cluster.device.memory_bytes or \
                        sum(c.host_bytes for c in combo) > HOST_MEMORY_BYTES:
                    continue
                best = min(best, sum(c.time_s for c in combo))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_tied_ilp_equals_brute_force_on_small_instances(seed):
    from autopar.errors import InfeasibleError
    from autopar.planner.search import search

    graph, cluster = _tied_instance(seed)
    expected = _brute_force_tied(graph, cluster)
    if expected == float("inf"):
        with pytest.raises(InfeasibleError):
            search(graph, cluster, pipeline=False)
        return
    plan = search(graph, cluster, pipeline=False).plan
    assert plan.solver.objective_s == pytest.approx(expected, rel=1e-6)
    ends = (graph.layers[0].name, graph.layers[-1].name)
    _assert_one_option(plan, ends)


# -- pipelines: Megatron's embedding group ---------------------------------------------------


class FirstStage(nn.Module):
    """Embeddings and the first block of a TiedGPT (its modules, not copies)."""

    def __init__(self, gpt: TiedGPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.h0 = gpt.wte, gpt.wpe, gpt.h[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.h0(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))


class LastStage(nn.Module):
    """The last block, final norm and the head tied to FirstStage's wte."""

    def __init__(self, gpt: TiedGPT) -> None:
        super().__init__()
        self.h1, self.ln_f, self.lm_head = gpt.h[1], gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(self.h1(x)))


STAGE_LAYERS = (("wte", 0), ("wpe", 0), ("h0", 0), ("h1", 1), ("ln_f", 1), ("lm_head", 1))


def pipeline_plan(strategy: str, head: str | None = None) -> str:
    from runtime.plan import PipelineSpec

    layers = tuple(LayerPlan(module=n, stage=s,
                             strategy=head if head and n == "lm_head" else strategy)
                   for n, s in STAGE_LAYERS)
    return Plan(global_batch=BATCH, mesh=Mesh(pp=2), layers=layers,
                pipeline=PipelineSpec(schedule="GPipe", num_microbatches=2)).to_json()


def pipeline_job(plan_json: str) -> dict:
    """Train the two hand-built stages STEPS steps; every parameter by the reference's
    names (the head's copy under 'lm_head.weight')."""
    from runtime.pipeline import PipelineTrainer

    gpt = build("nanogpt")
    trainer = PipelineTrainer([FirstStage(gpt), LastStage(gpt)], Plan.from_json(plan_json),
                              loss_fn, lambda params: torch.optim.AdamW(params, lr=LR))
    losses = []
    for step in range(STEPS):
        losses.append(trainer.train_step(*batch(step)))
    names = {"h0.": "h.0.", "h1.": "h.1."}
    params = {}
    for name, value in trainer.full_state_dict().items():
        for short, full in names.items():
            name = full + name.removeprefix(short) if name.startswith(short) else name
        params[name] = value
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_tied_copies_on_two_stages_train_like_one_process(pool2, strategy):
    """Each stage holds its copy of the tied weight; their gradients are summed across the
    two pipeline ranks before the optimizer, so both copies follow the one-process
    weight (without the sum each copy would step on its own part of the gradient)."""
    ref = reference("nanogpt")
    for rank, got in enumerate(pool2.run(pipeline_job, pipeline_plan(strategy))):
        _close(got["losses"], ref["losses"], FP32_TOL, f"rank {rank} losses")
        want = dict(ref["params"], **{"lm_head.weight": ref["params"]["wte.weight"]})
        assert got["params"].keys() == want.keys()
        for name, value in want.items():
            tol = KEY_BIAS_TOL if name.endswith(KEY_BIAS) else PARAM_TOL
            _close(got["params"][name], value, tol, f"rank {rank} param {name}")


def test_tied_copies_on_stages_with_different_strategies_are_refused(pool2):
    messages = pool2.run(pipeline_error_job, pipeline_plan("fsdp", head="replicate"))
    for message in messages:
        assert "tied parameter 'wte.weight' has copies on stages [0, 1]" in message, message
        assert "'lm_head' (stage 1): replicate" in message and "'wte' (stage 0): fsdp" in message


def pipeline_error_job(plan_json: str) -> str:
    try:
        pipeline_job(plan_json)
    except PlanError as e:
        return str(e)
    return "accepted"


def v_schedule_job() -> str:
    """ZBVZeroBubble puts stages 0 and 3 on pipeline rank 0: both copies on one rank."""
    from runtime.mesh import build_mesh
    from runtime.plan import PipelineSpec
    from runtime.tied import TiedGradSync

    layers = tuple(LayerPlan(module=n, stage=s, strategy="fsdp")
                   for n, s in (("wte", 0), ("h0", 1), ("h1", 2), ("lm_head", 3)))
    plan = Plan(global_batch=BATCH, mesh=Mesh(pp=2), layers=layers,
                pipeline=PipelineSpec(schedule="ZBVZeroBubble", num_microbatches=2,
                                      virtual_stages=2))
    try:
        TiedGradSync([((0, "wte.weight"), (3, "lm_head.weight"))], plan,
                     build_mesh(plan.mesh, "cpu"))
    except PlanError as e:
        return str(e)
    return "accepted"


def test_two_tied_copies_on_one_pipeline_rank_are_refused(pool2):
    for message in pool2.run(v_schedule_job):
        assert "stages [0, 3] put two of its copies on one pipeline rank" in message, message


def planned_json(model: str, dtype: str) -> str:
    """The planner's plan on the local data-parallel mesh (its pipeline plans of tied
    models are trained in tests/runtime/test_tied_pipeline.py)."""
    import autopar

    return autopar.plan(build(model), _cluster("local", None), batch(0)[0],
                        precision=dtype, mesh=Mesh(dp=2)).to_json()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["nanogpt", "gpt2"])
def test_planners_local_plan_trains_like_one_process(pool2, model, dtype):
    plan_json = planned_json(model, dtype)
    assert Plan.from_json(plan_json).world_size == 2
    assert_matches(pool2.run(train_job, model, plan_json), model, dtype)


def test_autopar_run_refuses_a_split_tie_before_starting_ranks():
    """``autopar run``'s path checks the plan against the model in the parent, so a
    split tie is one PlanError line (CLI exit 2), not a traceback from every rank."""
    from types import SimpleNamespace

    from autopar.training import run_local

    spec = SimpleNamespace(name="tied", build=lambda device="cpu", seed=0: build("nanogpt"))
    plan = Plan.from_json(_split_strategies("nanogpt"))
    with pytest.raises(PlanError, match="'wte', 'lm_head' share parameter 'wte.weight'"):
        run_local(spec, plan, nproc=2, steps=1, batch=BATCH, seq=None)
