"""passes.split_stages: stage modules compose to the model, keep its names, and bad cuts
are refused with errors that name the layer and the fix. One process, no collectives."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from shared_module_stack import SharedActivationStack

from autopar.zoo import get_model
from passes.split_stages import layer_stages, split_pipeline, split_stages
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan, PlanError

SPEC = get_model("gpt-tiny").with_config(n_layer=4)
NAMES = ["wte", "wpe", "h.0", "h.1", "h.2", "h.3", "ln_f", "lm_head"]


def pipeline_plan(stages: dict[str, int], pp: int = 2, schedule: str = "GPipe", v: int = 1,
                  m: int = 2) -> Plan:
    return Plan(
        global_batch=8, mesh=Mesh(pp=pp),
        pipeline=PipelineSpec(schedule=schedule, num_microbatches=m, virtual_stages=v),
        layers=tuple(LayerPlan(module=n, stage=s) for n, s in stages.items()),
    )


def run_stages(stages: list[nn.Module], *inputs: torch.Tensor) -> torch.Tensor:
    out = stages[0](*inputs)
    for stage in stages[1:]:
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    return out


def test_stages_compose_to_the_model_and_keep_its_names():
    model = SPEC.build(seed=0)
    plan = pipeline_plan(dict(zip(NAMES, [0, 0, 0, 0, 1, 1, 1, 1], strict=True)))
    (x,), _ = SPEC.make_batch(4, 16)
    stages = split_stages(model, plan, (x[:2],))
    assert len(stages) == 2
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)
    names = [dict(s.named_parameters()) for s in stages]
    assert "h.2.attn.q_proj.weight" in names[1] and "wte.weight" in names[0]
    assert names[0].keys() | names[1].keys() == dict(model.named_parameters()).keys()
    assert not names[0].keys() & names[1].keys()
    # Shared, not copied: training a stage trains the user's model.
    assert names[1]["lm_head.weight"] is model.lm_head.weight
    assert stages[1].get_submodule("h.2") is model.h[2]


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.c(self.b(y)) + y


def test_values_that_skip_a_stage_are_passed_through_it():
    """`y` is made on stage 0 and used on stage 2: stage 1 receives and returns it."""
    model = Skip()
    plan = pipeline_plan({"a": 0, "b": 1, "c": 2}, pp=3, m=4)
    x = torch.randn(2, 4)
    stages = split_stages(model, plan, (x,))
    assert [n.name for n in stages[1].graph.nodes if n.op == "placeholder"] == ["a"]
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)


def test_an_integer_tensor_crosses_a_cut():
    """With wte and wpe on two stages the int64 positions cross the cut, beside the token
    embeddings, and the stages compose exactly to the model."""
    model, ((x,), _) = SPEC.build(seed=0), SPEC.make_batch(2, 16)
    stages = split_stages(model, pipeline_plan({"wte": 0, "wpe": 1}), (x,))
    sent = stages[0](x)
    assert {t.dtype for t in sent} == {torch.int64, torch.float32}
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)


def test_unplanned_layers_join_the_stage_before_them():
    model = SPEC.build("meta")
    plan = pipeline_plan({"h.0": 0, "h.2": 1})
    assert layer_stages(model, plan) == {
        "wte": 0, "wpe": 0, "h.0": 0, "h.1": 0, "h.2": 1, "h.3": 1, "ln_f": 1, "lm_head": 1}


def test_a_plan_module_above_the_layers_gives_them_its_stage():
    model = SPEC.build("meta")
    plan = pipeline_plan({"wte": 0, "h": 1})
    stages = layer_stages(model, plan)
    assert [stages[f"h.{i}"] for i in range(4)] == [1, 1, 1, 1] and stages["wpe"] == 0


def test_a_cut_through_a_layer_is_refused():
    plan = pipeline_plan({"wte": 0, "h.0.attn": 0, "h.0.mlp": 1, "h.1": 1})
    with pytest.raises(PlanError, match=r"'h.0.attn' \(stage 0\) and 'h.0.mlp' \(stage 1\) "
                                        r"splits layer 'h.0'.*same stage"):
        split_stages(SPEC.build(seed=0), plan, SPEC.example_inputs(2, 16))


def test_a_missing_module_is_named():
    plan = pipeline_plan({"wte": 0, "h.9": 1})
    with pytest.raises(PlanError, match=r"layer 'h.9': no such module in GPT.*named_modules"):
        split_stages(SPEC.build(seed=0), plan, SPEC.example_inputs(2, 16))


def test_stages_against_execution_order_are_refused():
    # Listed in stage order, but lm_head runs last: after ln_f, which joined h.0 on stage 1.
    plan = pipeline_plan({"lm_head": 0, "h.0": 1})
    with pytest.raises(PlanError, match=r"layer 'lm_head' \(stage 0\) runs after layer 'ln_f' "
                                        r"\(stage 1\); stages must follow the order"):
        split_stages(SPEC.build(seed=0), plan, SPEC.example_inputs(2, 16))


class ScaledByWidth(nn.Module):
    def __init__(self, tie: bool = False, scale: bool = True) -> None:
        super().__init__()
        self.scale = scale
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        if tie:
            self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1] if self.scale else 1  # a Python int, made before layer `a`
        return self.b(self.a(x)) * width


def test_a_non_tensor_value_across_a_cut_is_refused():
    with pytest.raises(PlanError, match=r"only tensors can be sent between pipeline stages"):
        split_stages(ScaledByWidth(), pipeline_plan({"a": 0, "b": 1}), (torch.randn(2, 4),))


def test_tied_parameters_on_two_stages_are_copied_onto_each():
    """The symbolic split shares the user's modules, so it cannot give two stages their own
    copy; 'auto' then splits the exported graph, which does."""
    model, plan, x = ScaledByWidth(tie=True, scale=False), pipeline_plan({"a": 0, "b": 1}), \
        torch.randn(2, 4)
    with pytest.raises(PlanError, match=r"'a.weight' \(stage 0\) is tied to 'b.weight' "
                                        r"\(stage 1\)"):
        split_pipeline(model, plan, (x,), method="symbolic_trace")
    split = split_pipeline(model, plan, (x,))
    assert split.method == "export" and split.tied == ({0: "a.weight", 1: "b.weight"},)
    a, b = split.modules[0].get_parameter("a.weight"), split.modules[1].get_parameter("b.weight")
    assert a is not b and a is not model.a.weight
    torch.testing.assert_close(b, model.b.weight, rtol=0, atol=0)
    torch.testing.assert_close(run_stages(split.modules, x), model(x), rtol=0, atol=0)


def test_symbolic_and_export_splits_agree():
    """Where symbolic tracing works it is kept (faster, shape-generic): both captures give
    each stage the same parameters under the same names, and the same outputs."""
    plan = pipeline_plan(dict(zip(NAMES, [0, 0, 0, 1, 1, 2, 3, 3], strict=True)), pp=2, v=2,
                         schedule="Interleaved1F1B")
    (x,), _ = SPEC.make_batch(2, 16)
    model = SPEC.build(seed=0)
    symbolic = split_pipeline(model, plan, (x,))
    exported = split_pipeline(model, plan, (x,), method="export")
    assert (symbolic.method, exported.method) == ("symbolic_trace", "export")
    for s, e in zip(symbolic.modules, exported.modules, strict=True):
        assert dict(s.named_parameters()) == dict(e.named_parameters())
    torch.testing.assert_close(run_stages(exported.modules, x), run_stages(symbolic.modules, x),
                               rtol=0, atol=0)


class IndexedLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(4, 8)
        self.table = nn.Embedding(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(self.score(x).argmax(-1))


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_an_integer_activation_is_sent_to_the_stage_that_reads_it(method):
    """An int64 value made from the input (an argmax) is sent as it is, not recomputed."""
    model, x = IndexedLookup(), torch.randn(2, 4)
    split = split_pipeline(model, pipeline_plan({"score": 0, "table": 1}), (x,), method=method)
    assert split.modules[0](x).dtype == torch.int64
    torch.testing.assert_close(run_stages(split.modules, x), model(x), rtol=0, atol=0)


def test_export_split_passes_values_through_skipped_stages():
    model = Skip()
    plan = pipeline_plan({"a": 0, "b": 1, "c": 2}, pp=3, m=4)
    x = torch.randn(2, 4)
    stages = split_stages(model, plan, (x,), method="export")
    assert [n.op for n in stages[2].graph.nodes].count("placeholder") == 2
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)


def test_untraceable_model_names_the_construct():
    from passes.trace import GraphCaptureError

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                x = -x
            return self.b(self.a(x))

    with pytest.raises(GraphCaptureError, match=r"both captures(.|\n)*symbolic_trace: Python control "
                                                r"flow(.|\n)*export: a branch(.|\n)*depends on "
                                                r"tensor values"):
        split_stages(Branchy(), pipeline_plan({"a": 0, "b": 1}), (torch.randn(2, 4),))


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        return self.b(h if shift is None else h + shift)


def test_keyword_inputs_are_exported_and_taken_by_the_first_stage():
    model, x, shift = Shifted(), torch.randn(2, 4), torch.randn(2, 4)
    split = split_pipeline(model, pipeline_plan({"a": 0, "b": 1}), (x,), {"shift": shift})
    assert split.method == "export"
    out = split.modules[1](split.modules[0](x, shift=shift))
    torch.testing.assert_close(out, model(x, shift=shift), rtol=0, atol=0)


class _Rotary(nn.Module):
    """A value made from a buffer only (Llama's rotary cos/sin): recomputed on each stage."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.arange(8.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        return torch.cos(pos[:, None] * self.freq[None, :])


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, bias, rot):
        return x + self.lin(torch.softmax(x @ x.transpose(1, 2) + bias, -1) @ (x * rot))


class _Decoder(nn.Module):
    """Hugging Face's layout: a parent module makes the mask bias and the rotary values
    that every layer reads."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.rot = _Rotary()
        self.layers = nn.ModuleList(_MaskedBlock() for _ in range(4))

    def forward(self, ids, mask):
        x = self.emb(ids)
        bias = torch.where(mask[:, None, :].bool(), 0.0, -1e9)
        rot = self.rot(x)
        for layer in self.layers:
            x = layer(x, bias, rot)
        return x


class _WithHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Decoder()
        self.head = nn.Linear(8, 16)

    def forward(self, ids, mask):
        return self.head(self.model(ids, mask))


def test_a_stage_recomputing_a_constant_and_passing_a_value_through_runs():
    """Stage 1 recomputes the rotary values (module ``model.rot``) and passes the mask
    bias on to stage 2 (a clone at the root) before its layers (``model.layers``).
    Unflattening cut the stage's ``model`` in two calls when the clone sat between the
    rotary copy and the layers, and the stage failed ("Expected positional argument")."""
    torch.manual_seed(0)
    model = _WithHead()
    plan = pipeline_plan({"model.emb": 0, "model.rot": 0, "model.layers.0": 0,
                          "model.layers.1": 1, "model.layers.2": 1, "model.layers.3": 2,
                          "head": 3}, pp=2, v=2, schedule="Interleaved1F1B")
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[:, :2] = 0
    stages = split_stages(model, plan, (ids, mask), method="export")
    torch.testing.assert_close(run_stages(stages, ids, mask), model(ids, mask), rtol=0, atol=0)


class TiedEncoderDecoder(nn.Module):
    """T5's and BART's layout: one weight held by ``shared`` (which runs nothing), by the
    encoder's and the decoder's embeddings and by the head; the model returns the
    encoder's output beside the logits (``encoder_last_hidden_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(16, 4)
        self.enc_embed, self.dec_embed = nn.Embedding(16, 4), nn.Embedding(16, 4)
        self.encoder, self.decoder = nn.Linear(4, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 16, bias=False)
        for module in (self.enc_embed, self.dec_embed, self.head):
            module.weight = self.shared.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self.encoder(self.enc_embed(src))
        out = self.decoder(self.dec_embed(tgt) + memory.mean(1, keepdim=True))
        return self.head(out), memory


def _encoder_decoder_split():
    torch.manual_seed(0)
    model = TiedEncoderDecoder()
    plan = pipeline_plan({"enc_embed": 0, "encoder": 0, "dec_embed": 0, "decoder": 0,
                          "head": 1})
    gen = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(0, 16, (2, 6), generator=gen), torch.randint(0, 16, (2, 3),
                                                                         generator=gen)
    return model, split_pipeline(model, plan, (src, tgt)), (src, tgt)


def test_an_output_made_before_the_last_stage_is_returned_by_it():
    """The pipeline returns what its last stage returns: the encoder's output, made on
    stage 0, is passed through stage 1 (which once took only the decoder's output and
    failed: "forward() takes 2 positional arguments but 3 were given")."""
    model, split, inputs = _encoder_decoder_split()
    assert split.method == "export"
    out = run_stages(split.modules, *inputs)
    assert [n.op for n in split.modules[1].graph.nodes].count("placeholder") == 2
    for got, want in zip(split.output_fn(out), model(*inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_tensor_a_stage_runs_under_two_names_is_one_parameter_there():
    """Stage 0 runs both embeddings: one parameter, or each would take only its own
    module's gradient and the two would part (T5 trained apart from one process). The
    model's name in ``shared``, a module no stage runs, is recorded for the checkpoint,
    ahead of the stage's (the optimizer state is keyed by the first)."""
    from runtime.checkpoint import merged_view
    from runtime.stage_graphs import StateAlias, state_aliases, tensor_names

    model, split, _ = _encoder_decoder_split()
    first, last = split.modules
    assert first.get_parameter("enc_embed.weight") is first.get_parameter("dec_embed.weight")
    assert split.tied == ({0: "enc_embed.weight", 1: "head.weight"},)
    assert state_aliases(first) == {"shared.weight": StateAlias("enc_embed.weight", first=True)}
    assert not state_aliases(last)
    names = ("shared.weight", "enc_embed.weight", "dec_embed.weight", "head.weight")
    assert tensor_names(last) == {"head.weight": names}
    view = merged_view([first])
    assert next(iter(view.state_dict())) == "shared.weight"
    assert view.get_parameter("shared.weight") is first.get_parameter("enc_embed.weight")
    assert set(view.state_dict()) | {"head.weight"} == set(model.state_dict())


class RootReadsTheWeight(TiedEncoderDecoder):
    """The head's product taken in the model's own forward, from ``shared``'s weight."""

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self.encoder(self.enc_embed(src))
        out = self.decoder(self.dec_embed(tgt) + memory.mean(1, keepdim=True))
        return out @ self.shared.weight.t(), memory


def test_the_planner_pipelines_a_weight_the_root_only_names_not_one_it_reads():
    """T5's ``shared`` names the embeddings' weight and runs nothing: the root holds no
    copy, so the pipeline is planned (it was refused: "a parameter the root uses is on no
    planned stage"). A root reading the weight itself still is."""
    import autopar

    _, _, inputs = _encoder_decoder_split()
    plan = autopar.plan(TiedEncoderDecoder(), autopar.Cluster.local(2), inputs,
                        mesh=Mesh(pp=2, dp=1))
    assert plan.num_stages == 2
    with pytest.raises(autopar.AutoparError, match=r"'shared.weight' = 'enc_embed.weight'.*"
                                                   r"own forward reads the shared parameter"):
        autopar.plan(RootReadsTheWeight(), autopar.Cluster.local(2), inputs,
                     mesh=Mesh(pp=2, dp=1))


class MaskedStack(nn.Module):
    """Blocks reading a boolean mask the model makes from a buffer alone, as Hugging Face
    Llama makes its causal mask and positions from the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16)
        self.register_buffer("keep", torch.arange(6 * 8).reshape(6, 8) % 3 > 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        hidden = self.keep.logical_not()
        for block in self.blocks:
            h = block(h).masked_fill(hidden, 0.0)
        return self.head(h)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_a_constant_crosses_no_cut_each_stage_remakes_it(method):
    """The boolean mask, made before the blocks and read by each, is no value to send: a
    stage may start at any block (the planner once let no stage start inside Hugging Face
    Llama's stack, whose causal mask is such a constant), and the stage remakes it."""
    from passes.layer_graph import build_layer_graph

    torch.manual_seed(0)
    model, ids = MaskedStack(), torch.randint(0, 16, (2, 6))
    graph = build_layer_graph(model, ids)
    assert [layer.name for layer in graph.layers] == ["emb", "blocks.0", "blocks.1", "blocks.2",
                                                      "head"]
    assert graph.uncuttable == frozenset()
    assert graph.boundary_bytes[:4] == (2 * 6 * 8 * 4,) * 4  # the hidden state, not the mask
    plan = pipeline_plan({"emb": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "head": 1})
    split = split_pipeline(model, plan, (ids,), method=method)
    assert [len(sends) for sends in split.sends] == [1]
    torch.testing.assert_close(run_stages(split.modules, ids), model(ids), rtol=0, atol=0)


def test_a_model_input_the_first_stage_only_passes_on_keeps_its_place():
    """With the decoder's embedding on stage 1, stage 0 only passes ``tgt`` on (its clone
    runs first); torch binds the model's arguments to stage 0's inputs by position, so
    they must stay in the model's order (``tgt`` once received ``src``'s value)."""
    torch.manual_seed(0)
    model = TiedEncoderDecoder()
    _, _, (src, tgt) = _encoder_decoder_split()
    plan = pipeline_plan({"enc_embed": 0, "encoder": 0, "dec_embed": 1, "decoder": 1,
                          "head": 1})
    split = split_pipeline(model, plan, (src, tgt))
    assert split.method == "export"
    assert [n.name for n in split.modules[0].graph.find_nodes(op="placeholder")] == [
        "src", "tgt"]
    for got, want in zip(split.output_fn(run_stages(split.modules, src, tgt)), model(src, tgt),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_value_made_early_and_used_late_is_priced_on_every_cut_it_crosses():
    """The encoder's output crosses the cuts after the decoder's embedding and after the
    decoder (it is returned, so the last stage returns it): the planner prices those sends
    as that much more than the layer's own output (``Engine._crossing``). The decoder's
    int64 token ids, a model input, cross every cut before the decoder's embedding."""
    from autopar.planner.engine import Engine
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from passes.layer_graph import build_layer_graph

    _, _, inputs = _encoder_decoder_split()
    graph = build_layer_graph(TiedEncoderDecoder(), inputs)
    names = [layer.name for layer in graph.layers]
    assert names == ["enc_embed", "encoder", "dec_embed", "decoder", "head"]
    memory, step = 2 * 6 * 4 * 4, 2 * 3 * 4 * 4  # encoder output; a decoder-side activation
    ids = 2 * 3 * 8
    assert graph.boundary_bytes[:4] == (2 * 6 * 4 * 4 + ids, memory + ids, memory + step,
                                        memory + step)
    engine = Engine(graph, Cluster.local(2), precision("float32"), 10.0)
    assert engine._crossing(2) == pytest.approx((memory + step) / graph.layers[2].output_bytes)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_a_stateless_layer_called_at_every_depth_leaves_every_cut_open(method):
    """Before, the layers between a layer's calls had to share its stage, so no stage could
    start inside this stack; now every place is open, the shared module's later calls are
    priced on their neighbours' side of a cut, and both splits run it where it is called."""
    from passes.layer_graph import build_layer_graph

    torch.manual_seed(0)
    model, ids = SharedActivationStack(), torch.randint(0, 16, (2, 6))
    graph = build_layer_graph(model, ids)
    names = [layer.name for layer in graph.layers]
    assert names == ["emb", "act", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert graph.uncuttable == frozenset()
    assert graph.boundary_bytes[2:6] == (2 * 6 * 8 * 4,) * 4  # the hidden state, once
    plan = pipeline_plan(dict(zip(names, [0, 0, 0, 1, 1, 1, 1], strict=True)))
    split = split_pipeline(model, plan, (ids,), method=method)
    assert split.method == method
    torch.testing.assert_close(run_stages(split.modules, ids), model(ids), rtol=0, atol=0)


def test_a_layer_with_state_called_again_still_keeps_its_calls_on_one_stage():
    """A module with parameters called at two depths holds one copy: cuts between its
    calls stay closed (ALBERT's shared layer)."""
    from passes.layer_graph import build_layer_graph

    class SharedLinear(SharedActivationStack):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.blocks[0](self.emb(ids))
            h = self.blocks[1](self.norm(h))
            return self.head(self.blocks[0](h))

    torch.manual_seed(0)
    graph = build_layer_graph(SharedLinear(), torch.randint(0, 16, (2, 6)))
    assert [layer.name for layer in graph.layers] == ["emb", "blocks.0", "norm", "blocks.1",
                                                      "head"]
    assert graph.uncuttable == frozenset({2, 3})
