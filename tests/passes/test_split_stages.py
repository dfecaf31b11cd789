"""passes.split_stages: stage modules compose to the model, keep its names, and bad cuts
are refused with errors that name the layer and the fix. One process, no collectives."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

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


def test_an_integer_tensor_across_a_cut_is_refused():
    """With wte and wpe on two stages the int64 positions would cross the cut."""
    plan = pipeline_plan({"wte": 0, "wpe": 1})
    with pytest.raises(PlanError, match=r"sends 'arange', a torch.int64 tensor.*\('wpe'\)"):
        split_stages(SPEC.build(seed=0), plan, SPEC.example_inputs(2, 16))


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
def test_an_integer_activation_across_a_cut_is_refused(method):
    """An int64 value made from the input cannot be recomputed on the next stage."""
    with pytest.raises(PlanError, match=r"cut after stage 0 sends .*torch.int64"):
        split_pipeline(IndexedLookup(), pipeline_plan({"score": 0, "table": 1}),
                       (torch.randn(2, 4),), method=method)


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
