"""What a Hugging Face Llama block saves for backward in bfloat16, against the capture.

Measured here: the tensors autograd really saves (storages deduplicated, parameters and
buffers excluded) in one block of a bf16 ``LlamaForCausalLM`` on CPU, eager, SDPA
attention, as FSDP2's bf16 compute runs it. Per token, in bytes per hidden unit h: 45.7.

The capture (float32) gets it right only with two things a float32 run hides:
- the rotary tables: ``apply_rotary_pos_emb`` multiplies q, k and rotate_half(q, k) by cos
  and sin, which the rotary layer computes under ``torch.no_grad``, so autograd saves only
  cos and sin. The capture hands each layer its outside inputs as fresh tensors that
  require grad only where the model's do (``passes.annotate.needs_grad``); when every
  floating input required grad, the four [b, s, h] operands were saved too (+8h).
- RMSNorm's float32 upcast: ``hidden_states.to(torch.float32)`` is a 4-byte copy in a bf16
  run, saved by the pow and the mul, where a float32 capture sees the 4-byte input itself
  and halves it (-4h over two norms); in a float32 graph the cast is ``to(float32)``, as is
  the cast back to ``input_dtype``. The graph casts up, so the layer graph captures the
  model once more in bf16 (passes/low_precision.py) and counts ``LayerInfo.saved_low``
  there.
A causal mask the capture counts in every layer (bool, 1.6 B/token/h at this shape), which
eager SDPA never builds (``is_causal`` instead), is left: it is not floating.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from passes.layer_graph import build_layer_graph

HIDDEN, FFN, HEADS, SEQ, BATCH, VOCAB = 320, 864, 5, 512, 2, 1000


def llama(layers: int):
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="sdpa"))


def saved_in_bf16(layers: int) -> int:
    """Bytes autograd saves in one bf16 forward of the model (storages counted once)."""
    torch.manual_seed(0)
    model = llama(layers).to(torch.bfloat16)
    held = {StorageWeakRef(t.untyped_storage())
            for t in [*model.parameters(), *model.buffers()]}
    seen: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in held:
            seen.setdefault(ref, t.untyped_storage().nbytes())
        return t

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(seen.values())


@pytest.fixture(scope="module")
def bytes_per_token_h() -> tuple[float, float, float]:
    """(measured, captured at 16 bits, float32 capture halved): saved floating bytes of one
    block per token per hidden unit, in bf16."""
    unit = BATCH * SEQ * HIDDEN
    measured = (saved_in_bf16(2) - saved_in_bf16(1)) / unit
    with torch.device("meta"):
        model = llama(2)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    graph = build_layer_graph(model, (tokens,), seq_len=SEQ)
    block = next(x for x in graph.layers if x.name.endswith("layers.0"))
    assert block.saved_low is not None
    halved = (block.saved_bytes - block.saved_fixed_bytes) / 2
    return measured, block.saved_low.floating / unit, halved / unit


def test_measured_block_is_what_the_modeling_code_saves(bytes_per_token_h):
    """By hand, per token: two norms (float32 input copy 4h, bf16 normalised 2h, the
    projections' input 2h) 16h; q, k, v and the attention output 8h (o_proj reads the
    kernel's output in place); SwiGLU's gate, its SiLU, up and their product 4 × 2·ffn."""
    measured = bytes_per_token_h[0]
    by_hand = 16 + 8 + 8 * FFN / HIDDEN
    assert measured == pytest.approx(by_hand, rel=0.01)


def test_captured_block_saves_what_bf16_autograd_saves(bytes_per_token_h):
    measured, at_16_bits, _ = bytes_per_token_h
    assert at_16_bits == pytest.approx(measured, rel=0.02)


def test_the_float32_capture_halved_misses_the_norm_upcasts(bytes_per_token_h):
    """Why the 16-bit capture: halving the float32 one leaves out the two norms' 4-byte
    copies (2h each beyond their halved inputs)."""
    measured, _, halved = bytes_per_token_h
    assert halved - measured == pytest.approx(-4, abs=0.5)


def test_a_fused_rms_norm_saves_4h_less_per_norm(bytes_per_token_h):
    """``nn.RMSNorm`` is captured as CUDA runs it, the fused ``aten._fused_rms_norm``
    (passes.annotate): each norm saves its 16-bit input (2h) and a 1/RMS per row, where
    Llama's saves a float32 copy of the input (4h) and its bf16 normalised value (2h)
    beside the same statistic: 4h less a norm, 8h a block. (torchtitan's Triton RMSNorm
    saves the same: autopar.planner.fsdp_published.FUSED_RMSNORM.)"""
    from autopar.planner.fsdp_published import fuse_rms_norms

    with torch.device("meta"):
        model = fuse_rms_norms(llama(2))
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    graph = build_layer_graph(model, (tokens,), seq_len=SEQ)
    block = next(x for x in graph.layers if x.name.endswith("layers.0"))
    fused = block.saved_low.floating / (BATCH * SEQ * HIDDEN)
    assert bytes_per_token_h[1] - fused == pytest.approx(8, abs=0.05)


@pytest.mark.parametrize("affine", [True, False])
def test_the_fused_rms_norm_differentiates_like_the_composite(affine):
    """What the capture runs in its place also trains like ``F.rms_norm``."""
    from passes.annotate import _fused_rms_norm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    weight = torch.randn(8, requires_grad=True) if affine else None
    leaves = [x, weight] if affine else [x]
    out = _fused_rms_norm(torch.nn.functional.rms_norm, (x, (8,), weight, 1e-5), {})
    ours = torch.autograd.grad(out.pow(2).sum(), leaves)
    reference = torch.nn.functional.rms_norm(x, (8,), weight, 1e-5)
    theirs = torch.autograd.grad(reference.pow(2).sum(), leaves)
    torch.testing.assert_close(out, reference)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_a_norm_whose_weight_dtype_differs_runs_the_composite():
    """ATen fuses RMSNorm only when the weight's dtype is the input's; otherwise the
    composite runs on GPUs too, and saves its float32 copies."""
    from passes.annotate import _fused_rms_norm

    def saved(weight_dtype: torch.dtype) -> int:
        x = torch.randn(4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.ones(16, dtype=weight_dtype, requires_grad=True)
        sizes: dict[StorageWeakRef, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t is not weight:
                sizes.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _fused_rms_norm(torch.nn.functional.rms_norm, (x, (16,), weight, 1e-5), {})
        return sum(sizes.values())

    rows = 4 * 8
    assert saved(torch.bfloat16) == rows * 16 * 2 + rows * 4  # the input and 1/RMS
    assert saved(torch.float32) > rows * 16 * 4  # float32 copies of the input and more
