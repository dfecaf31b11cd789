"""Layer graph: grouping, identical layers, costs against hand formulas, TP options."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import hf_gpt2
from torch.utils.flop_counter import FlopCounterMode

from autopar.zoo import GPT, GPTConfig, get_model, gpt_param_count
from passes import meta_keys as K
from passes.annotate import PassError, annotate_module_paths, propagate_shapes
from passes.layer_graph import build_layer_graph
from passes.trace import trace_module

F32 = 4


@pytest.fixture(scope="module")
def tiny():
    spec = get_model("gpt-tiny")
    model = spec.build("cpu")
    return model, build_layer_graph(model, spec.example_inputs(8, 16), model_name="gpt-tiny")


def _check_names_and_params(model: nn.Module, lg) -> None:
    for layer in lg.layers:
        model.get_submodule(layer.name)  # the runtime finds every layer by name
    assert lg.param_count == sum(p.numel() for p in model.parameters())
    assert [layer.index for layer in lg.layers] == list(range(len(lg.layers)))


# -- grouping ---------------------------------------------------------------------------------


def test_gpt_tiny_layers_in_execution_order_with_shared_block_class(tiny):
    model, lg = tiny
    assert [layer.name for layer in lg.layers] == ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]
    classes = [layer.layer_class for layer in lg.layers]
    assert classes[2] == classes[3] == "Block#0"
    assert len(set(classes)) == 5  # wte and wpe differ in shape: Embedding#0, Embedding#1
    _check_names_and_params(model, lg)
    assert lg.param_count == gpt_param_count(model.config)
    assert lg.batch_size == 8 and lg.seq_len == 16


def test_root_ops_join_a_neighbouring_layer():
    spec = get_model("gpt-tiny")
    model = spec.build("meta")
    inputs = spec.example_inputs(2, 16)
    gm = trace_module(model, inputs, prefer="symbolic_trace")
    annotate_module_paths(gm)
    propagate_shapes(gm, inputs)
    from passes.annotate import count_ops
    from passes.group_layers import group_layers

    count_ops(gm)
    group_layers(gm, model)
    layer_of = {n.name: n.meta[K.LAYER].name for n in gm.graph.nodes if K.LAYER in n.meta}
    assert layer_of["arange"] == "wte"  # before any layer: the next one
    assert layer_of["add"] == "wpe"  # the root's add after wpe: the previous one


def test_gpt3_175b_builds_fast_on_meta():
    spec = get_model("gpt3-175b")
    model = spec.build("meta")
    start = time.perf_counter()
    lg = build_layer_graph(model, spec.example_inputs(1536, 2048), model_name="gpt3-175b")
    elapsed = time.perf_counter() - start
    assert elapsed < 8.0, f"build_layer_graph took {elapsed:.1f} s"
    assert len(lg.layers) == 100 and len(lg.classes) == 5
    assert lg.param_count == gpt_param_count(spec.config)
    b, s, h = 1536, 2048, 12288
    block = lg.layers[2]
    assert block.fwd_flops == 2 * b * s * 12 * h * h + 4 * b * s * s * h


def test_hugging_face_gpt2_layers_are_named_by_module_and_fused_qkv_gets_no_tp():
    model = hf_gpt2()
    lg = build_layer_graph(model, (torch.randint(0, 128, (2, 16)),))
    assert lg.extra["capture_method"] == "export"
    names = [layer.name for layer in lg.layers]
    assert names == ["transformer.wte", "transformer.wpe", "transformer.drop",
                     "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"]
    h0, h1 = lg.layers[3], lg.layers[4]
    assert h0.layer_class == h1.layer_class
    assert h0.tp is None and h1.tp is None  # Conv1D with fused q/k/v
    _check_names_and_params(model, lg)
    # lm_head.weight is wte.weight: counted once (under wte), and neither is split alone.
    by_name = {layer.name: layer for layer in lg.layers}
    assert by_name["lm_head"].param_count == 0
    assert by_name["lm_head"].tp is None and by_name["transformer.wte"].tp is None


def _mlp_stack(widths: list[int], d: int = 8) -> nn.Module:
    class Block(nn.Module):
        def __init__(self, w: int) -> None:
            super().__init__()
            self.up = nn.Linear(d, w)
            self.down = nn.Linear(w, d)

        def forward(self, x):
            return x + self.down(F.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(w) for w in widths)

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return x

    return Net()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=5))
def test_blocks_share_a_class_exactly_when_their_shapes_match(widths):
    lg = build_layer_graph(_mlp_stack(widths), (torch.randn(3, 8),))
    assert [layer.name for layer in lg.layers] == [f"blocks.{i}" for i in range(len(widths))]
    # The last block returns the model's output, so it also carries the loss's memory
    # (LayerInfo.loss_bytes): a class apart from identical siblings, named after theirs.
    last = len(widths) - 1
    assert [bool(layer.loss_bytes) for layer in lg.layers] == [i == last for i in range(len(widths))]
    for i, (a, wa) in enumerate(zip(lg.layers, widths, strict=True)):
        for j, (b, wb) in enumerate(zip(lg.layers, widths, strict=True)):
            same_role = (i == last) == (j == last)
            assert (a.layer_class == b.layer_class) == (wa == wb and same_role)
            assert (a.layer_class.removesuffix("+loss") == b.layer_class.removesuffix("+loss")) \
                == (wa == wb)
    assert lg.param_count == sum((8 * w + w) + (w * 8 + 8) for w in widths)


# -- costs against hand formulas ---------------------------------------------------------------


def test_block_flops_match_hand_formula(tiny):
    _, lg = tiny
    b, s, h = 8, 16, 64
    block = lg.layers[2]
    # q, k, v, out (4h²) + fc_in, fc_out (8h²): 2·b·s·12h²; attention QKᵀ and PV: 2·2·b·s²·h.
    assert block.fwd_flops == 2 * b * s * 12 * h * h + 2 * 2 * b * s * s * h
    assert block.bwd_flops == 2 * block.fwd_flops
    assert lg.layers[-1].fwd_flops == 2 * b * s * h * 128  # lm_head
    assert lg.layers[0].fwd_flops == 0  # embeddings do no matmul


def test_flop_counter_counts_causal_attention_as_full():
    q = torch.empty(2, 4, 16, 8, device="meta")
    counts = []
    for causal in (False, True):
        with FlopCounterMode(display=False) as fc:
            F.scaled_dot_product_attention(q, q, q, is_causal=causal)
        counts.append(fc.get_total_flops())
    assert counts[0] == counts[1] == 4 * 2 * 4 * 16 * 16 * 8


def test_linear_saves_its_input_and_gelu_saves_its_input():
    batch, d_in, d_out = 5, 12, 7
    model = nn.Sequential(nn.Linear(d_in, d_out), nn.GELU())
    lg = build_layer_graph(model, (torch.randn(batch, d_in),))
    linear, gelu = lg.layers
    assert linear.saved_bytes == batch * d_in * F32  # the weight is a parameter: excluded
    assert gelu.saved_bytes == batch * d_out * F32
    assert linear.output_bytes == batch * d_out * F32
    assert linear.param_bytes == (d_in * d_out + d_out) * F32
    assert linear.mem_bytes == (batch * d_in + d_in * d_out + d_out + batch * d_out) * F32
    assert linear.num_ops == gelu.num_ops == 1


def test_block_saved_bytes_match_hand_count(tiny):
    _, lg = tiny
    b, s, h, heads = 8, 16, 64, 4
    a = b * s * h * F32
    stats = 2 * b * s * F32  # LayerNorm mean and rstd
    lse = b * heads * s * F32  # attention log-sum-exp
    # ln_1 input + stats, ln_1 out (once for q/k/v), q, k, v, attention out (also out_proj's
    # input: the fused kernel writes [b, s, heads, d] so the reshape is a view), ln_2 input +
    # stats, ln_2 out, fc_in out (gelu's input), gelu out (fc_out's input).
    expected = (a + stats) + a + 3 * a + a + lse + (a + stats) + a + 4 * a + 4 * a
    assert lg.layers[2].saved_bytes == expected


def test_export_and_symbolic_trace_give_the_same_layer_graph():
    spec = get_model("gpt-tiny")
    model, inputs = spec.build("meta"), spec.example_inputs(4, 16)
    traced = build_layer_graph(model, inputs, prefer="symbolic_trace")
    exported = build_layer_graph(model, inputs, prefer="export")
    assert exported.extra["capture_method"] == "export"
    assert traced.layers == exported.layers


def test_failing_pass_names_the_pass_and_node():
    class Bad(nn.Module):
        def forward(self, x):
            return x * x.max().item()  # .item() has no meaning on meta tensors

    gm = trace_module(Bad(), (torch.randn(2),), prefer="symbolic_trace")
    with pytest.raises(PassError, match=r"propagate_shapes failed on node 'item'"):
        propagate_shapes(gm, (torch.empty(2, device="meta"),))


# -- tensor parallelism ------------------------------------------------------------------------


def test_gpt_block_gets_megatron_attention_and_mlp_split(tiny):
    _, lg = tiny
    b, s, h, heads = 8, 16, 64, 4
    a = b * s * h * F32
    tp = lg.layers[2].tp
    assert tp is not None
    assert tp.styles == {"attn.q_proj": "colwise", "attn.k_proj": "colwise",
                         "attn.v_proj": "colwise", "attn.out_proj": "rowwise",
                         "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}
    assert tp.divisors == (heads, 4 * h)
    assert tp.sharded_fwd_flops == lg.layers[2].fwd_flops  # every matmul is split
    # q, k, v, attention out, log-sum-exp, fc_in out, gelu out; not the LayerNorm inputs.
    assert tp.sharded_saved_bytes == 3 * a + a + b * heads * s * F32 + 4 * a + 4 * a
    weights = (4 * h * h + 3 * h) + (4 * h * h + 4 * h) + 4 * h * h
    assert tp.sharded_param_bytes == weights * F32
    kinds = sorted((c.kind, c.phase, c.nbytes) for c in tp.collectives)
    # out_proj and fc_out all-reduce forward; ln_1 out (shared by q/k/v) and ln_2 out backward.
    assert kinds == [("all_reduce", "bwd", a)] * 2 + [("all_reduce", "fwd", a)] * 2


def test_embeddings_and_head_get_their_single_module_splits(tiny):
    _, lg = tiny
    b, s, h, vocab = 8, 16, 64, 128
    wte, lm_head, ln_f = lg.layers[0], lg.layers[-1], lg.layers[-2]
    assert wte.tp.styles == {"": "embedding_rowwise"} and wte.tp.divisors == (vocab,)
    assert [(c.kind, c.phase, c.nbytes) for c in wte.tp.collectives] == [
        ("all_reduce", "fwd", b * s * h * F32)]
    assert lm_head.tp.styles == {"": "colwise_gather"} and lm_head.tp.divisors == (vocab,)
    assert [(c.kind, c.phase, c.nbytes) for c in lm_head.tp.collectives] == [
        ("all_gather", "fwd", b * s * vocab * F32), ("all_reduce", "bwd", b * s * h * F32)]
    assert ln_f.tp is None


def test_mlp_model_blocks_get_the_mlp_split():
    spec = get_model("mlp")
    model = spec.build("meta")
    lg = build_layer_graph(model, spec.example_inputs(64))
    _check_names_and_params(model, lg)
    blocks = [layer for layer in lg.layers if layer.name.startswith("blocks.")]
    assert len(blocks) == 4 and len({layer.layer_class for layer in blocks}) == 1
    for layer in blocks:
        assert layer.tp.styles == {"mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}
        assert layer.tp.divisors == (4 * spec.config.d_model,)
    assert lg.layers[0].tp.styles == {"": "colwise_gather"}  # proj_in


class _SwiGLU(nn.Module):
    def __init__(self, d: int = 16, f: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        y = self.norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def _one_block(block: nn.Module, x: torch.Tensor):
    return build_layer_graph(_Wrap(block), (x,))


class _Wrap(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block])

    def forward(self, x):
        return self.blocks[0](x)


def test_swiglu_pairs_two_colwise_projections_with_one_rowwise():
    lg = _one_block(_SwiGLU(), torch.randn(2, 5, 16))
    tp = lg.layers[0].tp
    assert tp.styles == {"w1": "colwise", "w3": "colwise", "w2": "rowwise"}
    assert tp.divisors == (32,)
    assert [c.phase for c in tp.collectives] == ["fwd", "bwd"]  # w1, w3 share their input


class _BiasAfterShard(nn.Module):
    """A replicated bias added to the sharded hidden: splitting would mis-add it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(8, 16), nn.Linear(16, 8)
        self.extra = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)) + self.extra)


class _ShardEscapes(nn.Module):
    """The colwise output is also summed over its features: not exact on shards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        hid = F.relu(self.fc_in(x))
        return self.fc_out(hid) + hid.sum(-1, keepdim=True)


class _PerHeadMask(nn.Module):
    """Attention with a mask that differs per head: the mask would need sharding too."""

    def __init__(self, d: int = 16, heads: int = 4, mask_heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.register_buffer("mask", torch.ones(mask_heads, 5, 5, dtype=torch.bool))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, -1, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class _LiteralHeads(nn.Module):
    """Heads split by a literal count with the sequence length inferred, as Hugging Face
    OPT writes it (``view(b, -1, num_heads, hd)``): on a shard of the features the view
    still succeeds, with half the sequence, and mixes heads with positions."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _ScaledHeads(nn.Module):
    """Queries scaled by a learned vector shared by all heads (the shape of Qwen3's per-head
    norm weight): on head shards each rank's gradient of it sums its own heads only."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.scale = nn.Parameter(torch.ones(d // heads))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, -1, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q * self.scale, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("block", [_BiasAfterShard, _ShardEscapes, _PerHeadMask, _LiteralHeads,
                                   _ScaledHeads])
def test_no_split_offered_when_it_would_change_results(block):
    lg = _one_block(block(), torch.randn(2, 5, 8 if block in (_BiasAfterShard, _ShardEscapes)
                                          else 16))
    assert lg.layers[0].tp is None


def test_attention_with_a_mask_shared_by_heads_splits_on_heads():
    lg = _one_block(_PerHeadMask(mask_heads=1), torch.randn(2, 5, 16))
    tp = lg.layers[0].tp
    assert tp.styles == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    assert tp.divisors == (4,)


def test_config_without_bias_still_splits():
    spec = get_model("gpt-tiny").with_config(bias=False)
    lg = build_layer_graph(spec.build("meta"), spec.example_inputs(2, 16))
    assert lg.layers[2].tp.styles["attn.out_proj"] == "rowwise"
    assert isinstance(spec.config, GPTConfig)


def test_hand_written_attention_splits_by_heads_like_fused_attention():
    """Megatron's unfused attention (QKᵀ, masked softmax, dropout, ·V on [b, heads, s, s])
    is exact per head shard: the block gets the same styles as with fused SDPA, and every
    FLOP of it (projections, both attention products, MLP) divides by the degree."""
    def block(attention: str):
        cfg = GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=128, block_size=32,
                        attention=attention, dropout=0.1)
        graph = build_layer_graph(GPT(cfg), (torch.zeros(2, 32, dtype=torch.long),))
        return next(la for la in graph.layers if la.name == "h.0")
    unfused, fused = block("unfused"), block("fused")
    assert unfused.tp.styles == fused.tp.styles
    assert "attn.q_proj" in unfused.tp.styles and unfused.tp.divisors[0] % 4 == 0
    assert unfused.tp.sharded_fwd_flops == unfused.fwd_flops
    # The softmax and dropout of the s×s scores run on head shards.
    assert unfused.tp.sharded_memory_bound_bytes > 0.5 * unfused.memory_bound_bytes
