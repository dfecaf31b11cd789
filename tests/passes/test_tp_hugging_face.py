"""Tensor- and sequence-parallel splits of Hugging Face layers, found from their graphs.

Rotary decoders (Llama, Mistral and Qwen2 here) rotate q and k by halves of
head_dim (slice, neg, cat), broadcast cos/sin made outside the layer (unsqueeze), repeat
the kv heads for grouped-query attention (unsqueeze, expand) and check dtypes at each
``.to()`` (export's ``_assert_tensor_metadata``); their attention splits by heads like
the zoo's. Their layers read more than the residual stream from outside (rotary tables,
masks), which sequence parallelism leaves whole: those layers run on sequence shards too.
The numerics of both are checked against one process in tests/test_real_models.py (tp2,
sequence_parallel) and tests/runtime/test_sequence_parallel.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from passes.layer_graph import build_layer_graph

SEQ, VOCAB = 16, 128
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               use_cache=False)
ATTENTION = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
             "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise"}
MLP = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def _decoder(name: str, attention: str, **config):
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = getattr(transformers, f"{name}Config")(**DECODER, **config)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    graph = build_layer_graph(model, (ids,))
    return next(layer for layer in graph.layers if layer.name == "model.layers.0")


@pytest.mark.parametrize(("name", "attention"), [
    ("Llama", "sdpa"), ("Llama", "eager"), ("Mistral", "eager"), ("Qwen2", "sdpa")])
def test_rotary_attention_splits_by_kv_heads_and_runs_on_sequence_shards(name, attention):
    layer = _decoder(name, attention)
    assert layer.tp.styles == {**ATTENTION, **MLP}
    assert layer.tp.divisors[0] == DECODER["num_key_value_heads"]
    assert layer.tp.sp_styles == {"input_layernorm": "sequence_parallel", **ATTENTION,
                                  "post_attention_layernorm": "sequence_parallel", **MLP}
    assert layer.tp.sp_seq_len == SEQ
    # all of attention and the MLP divide by the degree: the norms and residuals are left
    assert layer.tp.sharded_fwd_flops > 0.9 * layer.fwd_flops


def test_a_per_head_norm_weight_keeps_the_attention_whole():
    """Qwen3 normalises q and k per head with a weight of head_dim entries: each rank's
    gradient of it would sum over its own heads only, so only the MLP splits."""
    layer = _decoder("Qwen3", "sdpa", head_dim=16)
    assert layer.tp.styles == MLP


def test_encoder_layers_called_with_their_mask_run_on_sequence_shards():
    """BERT's layer takes the extended mask as a second positional argument and its
    attention reads it after the gather: the layer is sequence-parallel all the same."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    graph = build_layer_graph(model, (ids, torch.ones(2, SEQ, dtype=torch.long)))
    layer = next(la for la in graph.layers if la.name == "bert.encoder.layer.0")
    assert layer.tp.sp_styles is not None and layer.tp.sp_seq_len == SEQ
    assert {s for s, style in layer.tp.sp_styles.items() if style == "sequence_parallel"} == {
        "attention.output.dropout", "attention.output.LayerNorm", "output.dropout",
        "output.LayerNorm"}


def test_linears_computing_x_at_w_transposed_split_like_linears():
    """Falcon's ``FalconLinear`` (an nn.Linear computing ``x @ self.weight.T``): its MLP
    splits; its fused query_key_value does not."""
    import transformers

    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_kv_heads=2,
                                    new_decoder_architecture=True, use_cache=False)
    graph = build_layer_graph(transformers.FalconForCausalLM(cfg),
                              (torch.randint(0, VOCAB, (2, SEQ)),))
    layer = next(la for la in graph.layers if la.name == "transformer.h.0")
    assert layer.tp.styles == {"mlp.dense_h_to_4h": "colwise", "mlp.dense_4h_to_h": "rowwise"}
