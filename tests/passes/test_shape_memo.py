"""Shape propagation that reuses repeated ops (passes/shape_memo.py) builds the same layer
graph as running every node: every LayerInfo field, class, tie and activation record, and
every node's TensorMeta, on GPT-2 small, GPT-3 1.3B (meta), Hugging Face Llama and Mixtral
from small configs, the ResNet-50 layout, the test suite's other real models, and a stack
whose repeated blocks differ."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from real_models import MODELS, llama, planning_inputs
from resnet_layout import resnet_layout

import passes.annotate as annotate
import passes.layer_graph as layer_graph
from autopar.zoo import get_model
from passes import meta_keys as K
from passes.trace import placeholder_values, trace_module

TIMINGS = ("capture_s", "build_s")


def _build(model: nn.Module, inputs: object, monkeypatch, *, reuse: bool):
    """The layer graph, with every node's records, built with or without reuse."""
    graphs = []
    real_trace = layer_graph.trace_module

    def trace(*args, **kwargs):
        graphs.append(real_trace(*args, **kwargs))
        return graphs[-1]

    with monkeypatch.context() as m:
        m.setattr(layer_graph, "trace_module", trace)
        m.setattr(layer_graph, "propagate_shapes",
                  functools.partial(annotate.propagate_shapes, reuse=reuse))
        lg = layer_graph.build_layer_graph(model, inputs, model_name="m")
    nodes = [(n.name, {k: v for k, v in n.meta.items() if k.startswith("autopar.")})
             for n in graphs[0].graph.nodes]
    extra = {k: v for k, v in lg.extra.items() if k not in TIMINGS}
    return lg, extra, nodes


def _assert_same(model: nn.Module, inputs: object, monkeypatch) -> object:
    old, old_extra, old_nodes = _build(model, inputs, monkeypatch, reuse=False)
    new, new_extra, new_nodes = _build(model, inputs, monkeypatch, reuse=True)
    for before, after in zip(old.layers, new.layers, strict=True):
        assert before == after, before.name  # every field: costs, class, TP, records
    for field in ("batch_size", "seq_len", "param_dtype", "context_parallel_problem",
                  "uncuttable", "ties", "returns_loss", "exported_stages"):
        assert getattr(old, field) == getattr(new, field), field
    assert old_extra == new_extra
    assert len(old_nodes) == len(new_nodes)
    for (name, before), (_, after) in zip(old_nodes, new_nodes, strict=True):
        assert before == after, name
    return new


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


@pytest.mark.parametrize("name,batch", [("gpt2-small", 8), ("gpt3-1.3b", 4)])
def test_zoo_gpts_build_the_same_layer_graph(name, batch, monkeypatch):
    spec = get_model(name)
    lg = _assert_same(spec.build("meta"), spec.example_inputs(batch, device="meta"),
                      monkeypatch)
    assert len(lg.classes["Block#0"]) == spec.config.n_layer


def test_hf_llama_builds_the_same_layer_graph(monkeypatch):
    lg = _assert_same(llama(), {"input_ids": _tokens(2, 16)}, monkeypatch)
    assert lg.extra["capture_method"] == "export"


@pytest.mark.parametrize("name", [n for n in MODELS if n != "hf-llama"])
def test_the_real_models_build_the_same_layer_graph(name, monkeypatch):
    """BERT, T5 (a learned attention bias: efficient attention), ViT, GPT-2, a nanoGPT with
    tied weights, a model taking a dict batch."""
    spec = MODELS[name]
    _assert_same(spec.build(), planning_inputs(spec, spec.batch(4)), monkeypatch)


def test_hf_mixtral_builds_the_same_layer_graph(monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    lg = _assert_same(model, {"input_ids": _tokens(2, 16)}, monkeypatch)
    assert any(layer.moe is not None for layer in lg.layers)


def test_resnet_with_inplace_ops_builds_the_same_layer_graph(monkeypatch):
    # In-place residual adds and ReLU(inplace=True) return their input: they always run.
    lg = _assert_same(resnet_layout(width=8), torch.zeros(4, 3, 32, 32, device="meta"),
                      monkeypatch)
    assert any(layer.inplace_input_bytes for layer in lg.layers)


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, heads: int, span: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.register_buffer("mask", torch.ones(span, span, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        mask = self.mask[:t, :t]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + att.transpose(1, 2).reshape(b, t, c)
        return x + self.down(F.gelu(self.up(x)))


class Uneven(nn.Module):
    """Five blocks of one module class: h.2 is wider inside, h.3 splits into more heads
    (the same parameters), h.4 holds a longer mask buffer, cut to the same length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.h = nn.ModuleList([Block(32, 128, 4, 16), Block(32, 128, 4, 16),
                                Block(32, 64, 4, 16), Block(32, 128, 8, 16),
                                Block(32, 128, 4, 32)])
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def test_blocks_that_differ_keep_classes_of_their_own(monkeypatch):
    with torch.device("meta"):
        model = Uneven()
    lg = _assert_same(model, _tokens(2, 16), monkeypatch)
    classes = [layer.layer_class for layer in lg.layers if layer.name.startswith("h.")]
    # h.4's ops see the same shapes once its mask is cut: h.0's class, as ever; its
    # first op reads a buffer of another shape, so the op runs rather than reusing h.0's.
    assert classes == ["Block#0", "Block#0", "Block#1", "Block#2", "Block#0"]
    flops = {layer.name: layer.fwd_flops for layer in lg.layers}
    assert flops["h.2"] < flops["h.0"]  # narrower MLP
    assert flops["h.3"] == flops["h.0"]  # heads change shapes, not FLOPs


def _count_runs(gm, inputs, monkeypatch, *, reuse: bool) -> tuple[int, list]:
    runs = []
    real = annotate.execute

    def execute(gm, node, *args, **kwargs):
        runs.append(node)
        return real(gm, node, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(annotate, "execute", execute)
        annotate.propagate_shapes(gm, placeholder_values(gm, inputs), reuse=reuse)
    return len(runs), [n.meta.get(K.TENSOR) for n in gm.graph.nodes]


def test_repeated_blocks_run_once(monkeypatch):
    spec = get_model("gpt2-small")  # 12 blocks
    inputs = spec.example_inputs(8, device="meta")
    gm = trace_module(spec.build("meta"), inputs, prefer="symbolic_trace")
    every, records = _count_runs(gm, inputs, monkeypatch, reuse=False)
    reused, reused_records = _count_runs(gm, inputs, monkeypatch, reuse=True)
    assert records == reused_records
    assert every == sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
    assert reused * 6 < every  # one block's distinct ops, and the embedding and head
