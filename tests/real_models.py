"""Real models for the end-to-end tests: Hugging Face architectures built from small
configs (random init, no downloads), a nanoGPT-style model with tied embeddings, a
ResNet-50 layout and a model that takes a dict batch.

Each ``RealModel`` builds its module seeded and makes seeded global batches. A batch is
the keyword arguments of the model's forward (``model(**batch)``), ``labels`` included,
so that models which compute their own loss return it. ``logits_loss`` is the same loss
computed outside the model from its output and the labels, for runs that take a
``loss_fn`` (pipeline stages, models without their own loss).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from dict_batch_model import DictBatchClassifier
from dict_batch_model import make_batch as make_dict_batch
from resnet_layout import resnet_layout

VOCAB = 128
SEQ = 16


@dataclass(frozen=True)
class RealModel:
    name: str
    make: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], dict[str, torch.Tensor]]
    logits_loss: Callable[[object, torch.Tensor], torch.Tensor]
    """The model's loss from its output (logits, or an output with ``.logits``) and labels."""
    returns_loss: bool = True
    """``model(**batch)`` returns an output whose ``.loss`` is the training loss."""
    note: str = ""

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        model = self.make()
        model.train()
        return model

    def batch(self, size: int, seed: int = 0) -> dict[str, torch.Tensor]:
        return self.make_batch(size, torch.Generator().manual_seed(seed))


def pipeline_inputs(batch: dict) -> tuple | dict:
    """The batch a pipeline trains on: the inputs without labels (the loss is the last
    stage's ``loss_fn``), positional when the model needs only its first input."""
    rest = {k: v for k, v in batch.items() if k != "labels"}
    return (next(iter(rest.values())),) if len(rest) == 1 else rest


def planning_inputs(spec: RealModel, batch: dict) -> tuple | dict:
    """What to plan with: the batch, labels included, for a model that computes its own
    loss; its inputs without labels otherwise (the loss is a loss_fn)."""
    return batch if spec.returns_loss else pipeline_inputs(batch)


def _hf():
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def _logits(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"] if isinstance(out, dict) else out.logits


def causal_lm_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: token t predicts label t + 1, mean over tokens."""
    logits = _logits(out)[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def token_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position against its own label (masked LM, seq2seq, images)."""
    logits = _logits(out).float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def _tokens(size: int, gen: torch.Generator, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, seq), generator=gen)


def _lm_batch(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _tokens(size, gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _padded_lm_batch(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every sample left-padded by the same 3 positions (each weighs the same in the
    mean loss, as slicing needs), every position labelled."""
    ids = _tokens(size, gen)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _mlm_batch(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    # Every position is labelled: a loss averaged over an equal number of tokens on each
    # rank is the global mean (an ignore_index would make per-rank counts differ).
    return {"input_ids": _tokens(size, gen), "labels": _tokens(size, gen)}


def _seq2seq_batch(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    labels = _tokens(size, gen, SEQ // 2)
    # T5's own shift of the labels (decoder_start_token_id 0), given explicitly so that the
    # decoder's inputs are there when the labels are not (a loss_fn's run).
    decoder_input_ids = torch.cat([torch.zeros(size, 1, dtype=labels.dtype), labels[:, :-1]], 1)
    return {"input_ids": _tokens(size, gen), "decoder_input_ids": decoder_input_ids,
            "labels": labels}


def _image_batch(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(size, 3, 32, 32, generator=gen),
            "labels": torch.randint(0, 10, (size,), generator=gen)}


def llama() -> nn.Module:
    t = _hf()
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False))


def mistral() -> nn.Module:
    t = _hf()
    cfg = t.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=None, use_cache=False)
    cfg._attn_implementation = "eager"  # the additive float mask every layer reads
    return t.MistralForCausalLM(cfg)


def opt() -> nn.Module:
    t = _hf()
    cfg = t.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
        use_cache=False, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    cfg._attn_implementation = "sdpa"  # q.view(b, -1, num_heads, hd): no attention split
    return t.OPTForCausalLM(cfg)


def mixtral() -> nn.Module:
    t = _hf()
    cfg = t.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, use_cache=False)
    cfg._attn_implementation = "eager"
    return t.MixtralForCausalLM(cfg)


def falcon() -> nn.Module:
    t = _hf()
    cfg = t.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=64,
        attention_dropout=0.0, hidden_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "eager"
    return t.FalconForCausalLM(cfg)


def albert() -> nn.Module:
    t = _hf()
    return t.AlbertForMaskedLM(t.AlbertConfig(
        vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def gpt2() -> nn.Module:
    t = _hf()
    return t.GPT2LMHeadModel(t.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert() -> nn.Module:
    t = _hf()
    return t.BertForMaskedLM(t.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def t5() -> nn.Module:
    t = _hf()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))


def vit() -> nn.Module:
    t = _hf()
    return t.ViTForImageClassification(t.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout: ``transformer.{wte, wpe, h, ln_f}`` and a head tied to ``wte``."""

    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, d), wpe=nn.Embedding(64, d),
            h=nn.ModuleList(NanoBlock(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        nn.init.normal_(self.lm_head.weight, std=0.02)  # nanoGPT's init of the shared matrix

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _dict_batch(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return make_dict_batch(size, SEQ, seed=gen.initial_seed())


def resnet50() -> nn.Module:
    # float64: this layout at test size is ill-conditioned in float32 (a split batch's other
    # summation order moves gradients by percents; see tests/autopar/test_capture_real.py).
    return resnet_layout(width=8).double()


def _resnet_batch(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(size, 3, 32, 32, generator=gen, dtype=torch.float64),
            "labels": torch.randint(0, 10, (size,), generator=gen)}


def sample_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(out), labels)


MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel("hf-llama", llama, _lm_batch, causal_lm_loss, note="grouped-query attention"),
    RealModel("hf-mistral-mask", mistral, _padded_lm_batch, causal_lm_loss,
              note="an attention mask (a keyword input) and rotary values every layer reads"),
    RealModel("hf-opt", opt, _lm_batch, causal_lm_loss,
              note="heads split by a literal count: tp splits the MLPs only"),
    RealModel("hf-gpt2", gpt2, _lm_batch, causal_lm_loss, note="tied embeddings"),
    RealModel("hf-bert-mlm", bert, _mlm_batch, token_loss, note="tied decoder"),
    RealModel("hf-t5", t5, _seq2seq_batch, token_loss,
              note="encoder-decoder, learned position bias, tied embeddings"),
    RealModel("hf-vit", vit, _image_batch, token_loss),
    RealModel("nanogpt-tied", NanoGPT, _lm_batch, causal_lm_loss, returns_loss=False,
              note="lm_head.weight = wte.weight"),
    RealModel("resnet50-layout", resnet50, _resnet_batch, sample_loss, returns_loss=False,
              note="3-4-6-3 Bottlenecks, BatchNorm, in-place ReLU and residual adds; float64"),
    RealModel("dict-batch", DictBatchClassifier, _dict_batch, sample_loss,
              note="model(**batch) with an attention mask, returns {'logits', 'loss'}"),
)}


META_PIPELINE_MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel("hf-mixtral", mixtral, _lm_batch, causal_lm_loss,
              note="picks its expert count's op by device type (histc is float-only on CPU)"),
    RealModel("hf-falcon", falcon, _lm_batch, causal_lm_loss,
              note="makes index constants in forward (torch.tensor([-2]))"),
    RealModel("hf-albert", albert, _mlm_batch, token_loss,
              note="one layer module run at every depth"),
)}
"""Models whose pipeline split once went wrong only when built on meta;
tests/test_real_models.py trains them under pp=2 built on meta."""
