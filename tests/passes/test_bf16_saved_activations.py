"""What a Hugging Face Llama block saves for backward in bfloat16, against the capture.

The capture runs in float32 and the planner halves its floating saved bytes for a bf16
plan (estimators.CostContext.act_scale). Measured here: the tensors autograd really saves
(storages deduplicated, parameters and buffers excluded) in one block of a bf16
``LlamaForCausalLM`` on CPU, eager, SDPA attention, as FSDP2's bf16 compute runs it. Per
token, in bytes per hidden unit h: 45.7 measured, 50.0 captured (plus a causal mask the
capture counts in every layer and eager attention never builds: ``is_causal`` instead).

The difference, term by term (by hand from transformers' modeling_llama, and read off the
capture's per-node SAVED records):
- +8h: rotary embedding. ``apply_rotary_pos_emb`` multiplies q, k and rotate_half(q, k)
  by cos and sin. The rotary layer computes them under ``torch.no_grad``, so autograd
  saves only cos and sin; the capture hands each layer its outside inputs as fresh tensors
  that require grad (passes.annotate.run_nodes ``fresh_inputs``), so it saves the four
  [b, s, h] operands too.
- -4h: RMSNorm's float32 upcast. ``hidden_states.to(torch.float32)`` is a 4-byte copy in a
  bf16 run, saved by the pow and the mul, where a float32 capture sees the 4-byte input
  itself and halves it (two norms a block). In a float32 graph the cast is ``to(float32)``,
  as is the cast back to ``input_dtype``, so the capture cannot tell them apart.
For Llama 2 13B at 2 × 4096 tokens a rank (tests/cost_models/test_fsdp_scaling.py row 3)
the net over-count is 7.5 GiB (1.25 GiB of it the mask) of the 79 GiB of activations the
model gives it.
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
def bytes_per_token_h() -> tuple[float, float]:
    """(measured, captured) saved bytes of one block per token per hidden unit, in bf16."""
    unit = BATCH * SEQ * HIDDEN
    measured = (saved_in_bf16(2) - saved_in_bf16(1)) / unit
    with torch.device("meta"):
        model = llama(2)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    graph = build_layer_graph(model, (tokens,), seq_len=SEQ)
    block = next(x for x in graph.layers if x.name.endswith("layers.0"))
    floating = block.saved_bytes - block.saved_fixed_bytes
    return measured, floating / 2 / unit  # the capture's float32 bytes at bf16


def test_measured_block_is_what_the_modeling_code_saves(bytes_per_token_h):
    """By hand, per token: two norms (float32 input copy 4h, bf16 normalised 2h, the
    projections' input 2h) 16h; q, k, v and the attention output 8h (o_proj reads the
    kernel's output in place); SwiGLU's gate, its SiLU, up and their product 4 × 2·ffn."""
    measured, _ = bytes_per_token_h
    by_hand = 16 + 8 + 8 * FFN / HIDDEN
    assert measured == pytest.approx(by_hand, rel=0.01)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "the capture over-counts a bf16 Llama block by the rotary products (+8h) and "
    "under-counts its RMSNorm upcasts (-4h): module docstring"))
def test_captured_block_saves_what_bf16_autograd_saves(bytes_per_token_h):
    measured, captured = bytes_per_token_h
    assert captured == pytest.approx(measured, rel=0.02)


def test_captured_block_differs_by_the_rotary_products_and_the_norm_upcasts(
        bytes_per_token_h):
    measured, captured = bytes_per_token_h
    assert captured - measured == pytest.approx(8 - 4, abs=0.5)
