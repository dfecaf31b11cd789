"""Captured activation memory and recomputation costs against Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al. 2022),
Section 4.1, counts the bytes one Megatron-LM GPT layer keeps for backward, with 16-bit
activations, 1-byte dropout masks and no tensor or sequence parallelism:

    attention 11sbh + 5as²b,  MLP 19sbh,  layer norms 4sbh,  total sbh(34 + 5as/h)   (eq. 1)

s sequence, b batch, h hidden size, a heads. Selective recomputation (Section 5) recomputes
the attention core and frees its 5as²b; full recomputation keeps each layer's input, 2sbh.
autopar's selective mode (``runtime.recompute``, torchtitan's policy) keeps only the layer's
input and the outputs of the weight matmuls and recomputes everything else, the attention
core included; what that frees beyond the paper's 5as²b is written out at its test.

The capture runs in float32, so each test converts: floating bytes × 2/4 + fixed bytes
(bool masks stay 1 byte). What the capture counts for the zoo's Megatron-shaped block
(``GPTConfig(attention="unfused", dropout > 0)``), term by term:

attention, 11sbh + 5as²b
    QKV input 2sbh: ln_1's output, saved once for the q, k and v projections (storages are
    deduplicated). QKᵀ 4sbh: q and k; ``torch.matmul`` copies the head-transposed views into
    contiguous [b·a, s, d] batches and bmm saves the copies. Softmax 2as²b: ``_softmax``
    saves its output. Softmax dropout as²b: the bool mask. Attention over V 2as²b + 2sbh:
    the dropped-out probabilities and matmul's copy of v. Output projection 2sbh: the
    attention output, copied back to [b, s, h] by reshape. Attention dropout sbh: the mask
    after the output projection. The 1/√d scaling (a Python scalar) saves nothing, and
    ``masked_fill`` saves only the causal mask, a buffer: excluded like parameters, as
    Megatron's mask is an input shared by every layer.
MLP, 19sbh
    fc_in's input 2sbh (ln_2's output), GELU's input 8sbh (fc_in's output), fc_out's input
    8sbh (GELU's output), dropout mask sbh.
layer norms, 4sbh
    each norm's input 2sbh (the block input; the residual sum after attention), plus what the
    paper leaves out: each norm's mean and reciprocal std, [b, s] float32 each. Converted like
    other floating bytes that is 2 norms × 2 × sb × 2 = 8sb, the only residual:
    8sb / sbh(34 + 5as/h) = 8 / (34h + 5as) < 0.3 % here. The tests assert the formula plus
    this residual exactly, and the formula alone to 1 %.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.planner.costs import allowed_options
from autopar.zoo import GPT, GPTConfig
from passes import meta_keys as K
from passes.annotate import annotate_module_paths, count_ops, propagate_shapes
from passes.group_layers import group_layers
from passes.layer_graph import annotate_layer, build_layer_graph
from passes.records import LayerInfo
from passes.trace import inputs_to_meta, to_meta, trace_module
from runtime.plan import Mesh

SEQ, BATCH, HIDDEN, HEADS = 32, 2, 64, 4  # s, b, h, a: sbh = 4,096 and as²b = 8,192
SBH = SEQ * BATCH * HIDDEN
AS2B = HEADS * SEQ * SEQ * BATCH
LN_STATS = 8 * SEQ * BATCH  # 16-bit bytes of both norms' mean and rstd (module docstring)
F32 = 4


def _megatron(**overrides: object) -> GPTConfig:
    cfg = dict(n_layer=1, n_head=HEADS, n_embd=HIDDEN, vocab_size=128, block_size=SEQ,
               dropout=0.1, attention="unfused")
    return GPTConfig(**(cfg | overrides))


def _tokens() -> tuple[torch.Tensor]:
    return (torch.zeros(BATCH, SEQ, dtype=torch.long),)


def _block(cfg: GPTConfig, prefer: str = "symbolic_trace") -> LayerInfo:
    lg = build_layer_graph(GPT(cfg), _tokens(), prefer=prefer)
    (block,) = [layer for layer in lg.layers if layer.name == "h.0"]
    return block


def _sixteen_bit(floating: int, fixed: int) -> int:
    """Bytes with 16-bit activations: the float32 capture's floating bytes halved."""
    assert floating % 2 == 0
    return floating * 2 // 4 + fixed


def _annotated_block_nodes(cfg: GPTConfig) -> list[torch.fx.Node]:
    """Block h.0's nodes, annotated as ``build_layer_graph`` annotates a representative."""
    model = to_meta(GPT(cfg))
    inputs = inputs_to_meta(_tokens())
    gm = trace_module(model, inputs, prefer="symbolic_trace")
    annotate_module_paths(gm)
    env = propagate_shapes(gm, inputs)
    count_ops(gm)
    (group,) = [g for g in group_layers(gm, model) if g.name == "h.0"]
    annotate_layer(gm, model, group, env)
    return group.nodes


def _part(node: torch.fx.Node) -> str:
    child = node.meta[K.MODULE_PATH].removeprefix("h.0.").split(".")[0]
    return {"ln_1": "ln", "ln_2": "ln"}.get(child, child)


def _saved_by_part(cfg: GPTConfig) -> dict[str, int]:
    """16-bit saved bytes of block h.0 per part (attention, MLP, norms), summed over the
    nodes that save them."""
    parts = {"attn": 0, "mlp": 0, "ln": 0}
    for node in _annotated_block_nodes(cfg):
        saved: K.SavedBytes | None = node.meta.get(K.SAVED)
        if saved is not None and saved.nbytes:
            parts[_part(node)] += _sixteen_bit(saved.nbytes - saved.fixed_nbytes,
                                               saved.fixed_nbytes)
    return parts


@pytest.fixture(scope="module")
def megatron_block() -> LayerInfo:
    return _block(_megatron())


# -- eq. 1, per part and in total ------------------------------------------------------------


def test_block_saved_bytes_per_part_match_korthikanti():
    parts = _saved_by_part(_megatron())
    assert parts == {"attn": 11 * SBH + 5 * AS2B, "mlp": 19 * SBH, "ln": 4 * SBH + LN_STATS}


def test_block_saved_bytes_are_sbh_34_plus_5as_over_h(megatron_block):
    block = megatron_block
    floating = block.saved_bytes - block.saved_fixed_bytes
    measured = _sixteen_bit(floating, block.saved_fixed_bytes)
    formula = SBH * 34 + 5 * AS2B  # sbh(34 + 5as/h)
    assert measured == formula + LN_STATS
    assert abs(measured - formula) / formula < 0.01
    # The masks: softmax dropout as²b, attention and MLP dropout sbh each, 1 byte per element.
    assert block.saved_fixed_bytes == AS2B + 2 * SBH


# -- what recomputation frees, reruns and keeps ----------------------------------------------


def _freed_by_part(cfg: GPTConfig) -> dict[str, int]:
    """16-bit bytes selective recomputation frees in block h.0, per part, as
    ``_saved_by_part`` counts what none keeps."""
    parts = {"attn": 0, "mlp": 0, "ln": 0}
    for node in _annotated_block_nodes(cfg):
        saved: K.SavedBytes | None = node.meta.get(K.SAVED)
        if saved is not None and (saved.selective_nbytes or saved.selective_fixed_nbytes):
            parts[_part(node)] += _sixteen_bit(saved.selective_nbytes,
                                               saved.selective_fixed_nbytes)
    return parts


def test_selective_recompute_frees_the_attention_core_and_all_but_the_matmul_outputs():
    """Selective keeps the block input (2sbh) and the weight matmuls' outputs: q, k, v
    (6sbh), the attention output projection (2sbh), fc_in (8sbh), fc_out (2sbh): 20sbh,
    though autograd saves only two of them (the input, for ln_1; fc_in's output, for GELU).
    So against eq. 1, term by term:

    attention: frees the paper's core 5as²b (softmax output 2as²b, its dropout mask as²b,
        the dropped-out probabilities 2as²b) and 11sbh more (the QKV input, matmul's copies
        of q, k and v, the output projection's input, the attention dropout mask), and
        holds the four projections' outputs (8sbh) instead: 5as²b + 3sbh.
    MLP: frees fc_in's input, GELU's output, the mask (11sbh), holds fc_out's output
        (2sbh): 9sbh.
    norms: ln_2's input (2sbh, the residual sum) and both norms' statistics; ln_1's input
        is the block input, kept.
    """
    assert _freed_by_part(_megatron()) == {"attn": 5 * AS2B + 3 * SBH, "mlp": 9 * SBH,
                                           "ln": 2 * SBH + LN_STATS}


def test_selective_recompute_keeps_20sbh_of_the_34sbh_plus_5as2b(megatron_block):
    block = megatron_block
    assert block.selective_fixed_bytes == block.saved_fixed_bytes == AS2B + 2 * SBH
    freed = _sixteen_bit(block.selective_saved_bytes, block.selective_fixed_bytes)
    assert freed == 5 * AS2B + 14 * SBH + LN_STATS
    total = _sixteen_bit(block.saved_bytes - block.saved_fixed_bytes, block.saved_fixed_bytes)
    assert total - freed == 20 * SBH


def test_selective_recompute_reruns_the_attention_matmuls(megatron_block):
    """QKᵀ and PV are bmm's of 2·(b·a)·s·s·(h/a) FLOPs each: 2·2·b·s²·h. Softmax, masking
    and dropout count 0 (FlopCounterMode counts matmul-like ops only); the projections and
    the MLP (2·b·s·12h²) are not recomputed."""
    block = megatron_block
    core = 2 * 2 * BATCH * SEQ * SEQ * HIDDEN
    assert block.selective_fwd_flops == core
    assert block.fwd_flops - block.selective_fwd_flops == 2 * BATCH * SEQ * 12 * HIDDEN**2


def test_full_recompute_keeps_the_block_input(megatron_block):
    assert _sixteen_bit(megatron_block.input_bytes, 0) == 2 * SBH  # sbh elements, 16-bit


def test_fused_attention_frees_what_the_kernel_and_the_elementwise_ops_made():
    """The default zoo GPT (fused SDPA, no dropout): flash attention already recomputes the
    s×s scores, so of the attention only the kernel's outputs are freed: the output [b, s, h]
    (out_proj's saved input is a view of it) and the log-sum-exp [b, a, s]. Besides: ln_1's
    and ln_2's outputs, the residual sum and GELU's output (1 + 1 + 1 + 4 sbh) and the norm
    statistics [b, s] × 4. Held though autograd does not save them: the output projection's
    and fc_out's outputs (2sbh). q, k and v are the projections' outputs: kept. Recomputing
    reruns the kernel's 4·b·a·s²·(h/a) FLOPs, all float32 here."""
    block = _block(_megatron(attention="fused", dropout=0.0))
    stats = 4 * BATCH * SEQ
    assert block.selective_saved_bytes == (6 * SBH + BATCH * HEADS * SEQ + stats) * F32
    assert block.selective_fixed_bytes == block.saved_fixed_bytes == 0
    assert block.saved_bytes - block.selective_saved_bytes == 10 * SBH * F32
    assert block.selective_fwd_flops == 4 * BATCH * SEQ * SEQ * HIDDEN


def test_export_and_symbolic_trace_agree_on_recompute_fields(megatron_block):
    exported = _block(_megatron(), prefer="export")
    assert exported == megatron_block


# -- the rules for what is freed -------------------------------------------------------------


class _Scores(nn.Module):
    """bmm saves its inputs, views of the layer input: kept (a checkpoint holds its
    inputs). masked_fill saves a mask made by triu, softmax its output: both recomputed by
    selective, so freed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        return torch.softmax(torch.bmm(x, x.transpose(1, 2)).masked_fill(future, 0.0), -1)


class _Scaled(nn.Module):
    """A projection whose consumer saves nothing: autograd keeps only x, selective keeps
    x and the matmul's output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * 2.0


class _One(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


class _Fed(nn.Module):
    """A block behind a projection: its input needs a gradient, as inside a network."""

    def __init__(self, block: nn.Module, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.blocks = nn.ModuleList([block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.proj(x))


def test_a_parameter_free_layer_on_the_model_inputs_saves_nothing():
    """Nothing before or in it needs a gradient, so autograd records nothing there."""
    b, n, d = 3, 5, 8
    (layer,) = build_layer_graph(_One(_Scores()), (torch.randn(b, n, d),)).layers
    assert layer.saved_bytes == 0


def test_selective_frees_all_but_the_inputs_and_matmul_outputs():
    b, n, d = 3, 5, 8
    graph = build_layer_graph(_Fed(_Scores(), d), (torch.randn(b, n, d),))
    layer = next(x for x in graph.layers if x.name == "blocks.0")
    assert layer.saved_bytes == b * n * d * F32 + n * n + b * n * n * F32
    assert layer.saved_fixed_bytes == n * n
    assert layer.selective_saved_bytes == b * n * n * F32
    assert layer.selective_fixed_bytes == n * n
    assert layer.input_bytes == b * n * d * F32


def test_selective_that_would_hold_more_is_negative_and_not_offered():
    b, n, d = 3, 5, 8
    (layer,) = build_layer_graph(_One(_Scaled(d)), (torch.randn(b, n, d),)).layers
    assert layer.saved_bytes == b * n * d * F32
    assert layer.selective_saved_bytes == -b * n * d * F32
    assert layer.selective_fwd_flops == 0
    options = allowed_options(layer, Mesh(dp=2))
    assert "replicate+full" in options and "replicate+selective" not in options


# -- the zoo's unfused attention -------------------------------------------------------------


def test_unfused_attention_computes_what_fused_attention_does():
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    outs = []
    for attention in ("fused", "unfused"):
        torch.manual_seed(0)
        outs.append(GPT(_megatron(attention=attention, dropout=0.0))(tokens))
    torch.testing.assert_close(outs[0], outs[1])


def test_dropout_at_every_megatron_site_trains_and_is_off_in_eval():
    torch.manual_seed(0)
    model = GPT(_megatron())
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    model(tokens).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), model(tokens))
