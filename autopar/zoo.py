"""Built-in models, selectable by name, built from configs with random init.

GPT follows nanoGPT's blocks with two changes that keep tensor parallelism exact:
separate q/k/v projections (a fused qkv weight split column-wise would mix q with k), and
head counts read from tensor shapes, so a head-aligned shard runs unchanged. Embeddings
and the LM head are untied (Megatron's default), so each can be sharded on its own.

``GPTConfig(attention="unfused", dropout=p)`` is the block of Megatron-LM's GPT as
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
count its activations: explicit softmax(QKᵀ/√d + causal mask)·V with dropout on the
probabilities, and dropout after the attention output projection and after the MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from cost_models.errors import ConfigError
from runtime.grouped_experts import grouped_swiglu

ATTENTION = ("fused", "unfused")
"""GPTConfig.attention choices."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int = 12
    """Transformer blocks."""
    n_head: int = 12
    """Attention heads per block."""
    n_embd: int = 768
    """Hidden size."""
    vocab_size: int = 50304
    """Vocabulary (GPT-2's 50257 padded to a multiple of 64, as nanoGPT does)."""
    block_size: int = 1024
    """Longest sequence (learned position embeddings)."""
    bias: bool = True
    dropout: float = 0.0
    """Dropout probability in training, at Megatron's three sites of a block: the attention
    probabilities, after the attention output projection, after the MLP. 0 adds no op."""
    attention: str = "fused"
    """'fused': ``F.scaled_dot_product_attention`` (flash attention on GPUs: the s×s scores
    are recomputed in backward, never stored). 'unfused': the explicit product, masked
    softmax and dropout, whose s×s intermediates autograd stores (Megatron-LM's GPT)."""
    tie_embeddings: bool = False
    """The LM head's weight is the token embedding's (GPT-2's and nanoGPT's tying)."""
    n_expert: int = 0
    """Experts per MoE block; 0: every block's MLP is dense. With experts, each block's MLP
    is a dropless top-k mixture of SwiGLU experts (``MoE``) in HF Mixtral's layout."""
    top_k: int = 2
    """Experts each token is routed to (with ``n_expert`` > 0)."""
    expert_hidden: int = 0
    """One expert's width; 0: 4 * n_embd // top_k, so the active FLOPs match a dense MLP's."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention={self.attention!r}; valid: {', '.join(ATTENTION)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1)")
        if self.n_expert < 0 or (self.n_expert and not 1 <= self.top_k <= self.n_expert):
            raise ConfigError(f"n_expert={self.n_expert}, top_k={self.top_k}: need n_expert >= 0 "
                              "and, with experts, 1 <= top_k <= n_expert")

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or 4 * self.n_embd // self.top_k


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``F.dropout`` only when it drops something: with p = 0 (the default, and in eval)
    the captured graph has no dropout op, so dropout-free models are costed without one."""
    return F.dropout(x, p) if p > 0 else x


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.unfused = cfg.attention == "unfused"
        if self.unfused:
            # A buffer as in nanoGPT (built once, like Megatron's mask input); not
            # persistent, as it is no state to checkpoint.
            self.register_buffer("future", _future_mask(cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        if self.unfused:
            y = self._attend_unfused(q, k, v, drop)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return _dropout(self.out_proj(y), drop)

    def _attend_unfused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        drop: float) -> torch.Tensor:
        """softmax(QKᵀ/√d, later positions masked)·V with dropout on the probabilities
        (Vaswani et al. 2017, eq. 1; the dropout site of Megatron-LM)."""
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.future[:T, :T], float("-inf"))
        att = _dropout(F.softmax(att, dim=-1), drop)
        return att @ v


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc_in = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.fc_out = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc_out(F.gelu(self.fc_in(x)))
        return _dropout(y, self.dropout if self.training else 0.0)


class TopKRouter(nn.Module):
    """Softmax over experts, then the top k, renormalised (Mixtral's router)."""

    def __init__(self, n_embd: int, n_expert: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(n_expert, n_embd))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert indices [T, k])."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), index


class Experts(nn.Module):
    """E SwiGLU experts stored as 3-D weights, HF Mixtral's layout and forward signature
    (``runtime.moe_blocks``): gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, n_embd: int, n_expert: int, width: int) -> None:
        super().__init__()
        self.num_experts = n_expert
        self.gate_up_proj = nn.Parameter(torch.empty(n_expert, 2 * width, n_embd))
        self.down_proj = nn.Parameter(torch.empty(n_expert, n_embd, width))
        self.act_fn = F.silu

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; each token's k experts and weights [T, k] -> [T, H]. Dropless:
        every token reaches all its experts. The (token, choice) pairs are sorted by expert
        and run as one grouped op, so every shape is static and the model is captured and
        costed on meta tensors (``runtime.grouped_experts``)."""
        k = top_k_index.shape[-1]
        choice = top_k_index.reshape(-1)
        order = torch.argsort(choice, stable=True)
        token = order // k
        experts = torch.arange(self.num_experts, device=choice.device)
        counts = (choice.unsqueeze(1) == experts).sum(dim=0)
        y = grouped_swiglu(hidden[token], counts, self.gate_up_proj, self.down_proj)
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden).index_add(0, token, y)


class MoE(nn.Module):
    """Router + experts: forward(x [..., H]) -> [..., H]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = TopKRouter(cfg.n_embd, cfg.n_expert, cfg.top_k)
        self.experts = Experts(cfg.n_embd, cfg.n_expert, cfg.expert_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        weights, index = self.gate(flat)
        return self.experts(flat, index, weights).view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoE(cfg) if cfg.n_expert else MLP(cfg.n_embd, cfg.bias, cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: forward(idx [B, T] int64, pos [T] int64 = 0..T-1)
    -> logits [B, T, vocab]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if not _on_meta(self):
            self.apply(self._init_weights)

    def init_weights(self) -> None:
        """Initialise every parameter and buffer as the constructor does: what a model
        built on the meta device runs once its shards are allocated (torchtitan's
        convention, ``runtime.materialize``)."""
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            if isinstance(module, CausalSelfAttention) and module.unfused:
                module.future.copy_(_future_mask(module.future.shape[0]))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 initialisation, as in nanoGPT.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (TopKRouter, Experts)):
            for p in module.parameters(recurse=False):
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """``pos`` [T]: each token's position (default 0..T-1); context parallelism passes
        the global positions of a rank's sequence chunks."""
        _, T = idx.shape
        if pos is None:
            pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    n_layer: int = 4
    """Residual MLP blocks."""
    d_in: int = 256
    d_model: int = 1024
    n_classes: int = 16


class MLPBlock(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class MLPNet(nn.Module):
    """Residual MLP classifier: forward(x [B, d_in] float) -> logits [B, n_classes]."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.proj_in = nn.Linear(cfg.d_in, cfg.d_model)
        self.blocks = nn.ModuleList(MLPBlock(cfg.d_model) for _ in range(cfg.n_layer))
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _future_mask(block_size: int) -> torch.Tensor:
    """True above the diagonal: the later positions a query may not attend to."""
    return torch.ones(block_size, block_size, dtype=torch.bool).triu(1)


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


# -- the registry --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A named model: how to build it, make a batch for it, and score it."""

    name: str
    kind: str
    """'gpt' or 'mlp'."""
    config: GPTConfig | MLPConfig
    default_batch: int
    default_seq: int | None
    description: str

    def build(self, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
        """Random init (seeded); on 'meta' nothing is allocated."""
        with torch.device(device):
            if str(device) != "meta":
                torch.manual_seed(seed)
            return GPT(self.config) if self.kind == "gpt" else MLPNet(self.config)

    def example_inputs(
        self, batch: int, seq: int | None = None, device: str | torch.device = "meta"
    ) -> tuple[torch.Tensor, ...]:
        return self.make_batch(batch, seq, device=device)[0]

    def make_batch(
        self,
        batch: int,
        seq: int | None = None,
        *,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(inputs, targets) of global size ``batch``; the same on every rank for a seed."""
        gen = None
        if str(device) != "meta":
            gen = torch.Generator().manual_seed(seed)
        if self.kind == "gpt":
            seq = seq or self.default_seq
            cfg: GPTConfig = self.config  # type: ignore[assignment]
            if seq > cfg.block_size:
                raise ConfigError(
                    f"--seq {seq} exceeds {self.name}'s block_size {cfg.block_size}"
                )
            shape = (batch, seq + 1)
            if gen is None:
                tokens = torch.empty(shape, dtype=torch.long, device=device)
            else:
                tokens = torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device)
            return (tokens[:, :-1],), tokens[:, 1:]
        cfg_m: MLPConfig = self.config  # type: ignore[assignment]
        if gen is None:
            x = torch.empty(batch, cfg_m.d_in, device=device)
            y = torch.empty(batch, dtype=torch.long, device=device)
        else:
            x = torch.randn(batch, cfg_m.d_in, generator=gen).to(device)
            y = torch.randint(0, cfg_m.n_classes, (batch,), generator=gen).to(device)
        return (x,), y

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token (GPT) or sample (MLP)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def with_config(self, **overrides: object) -> ModelSpec:
        return replace(self, config=replace(self.config, **overrides))


def _gpt(name: str, layers: int, heads: int, embd: int, seq: int, batch: int, desc: str,
         **kw: object) -> ModelSpec:
    kw.setdefault("block_size", max(seq, 1024))
    cfg = GPTConfig(n_layer=layers, n_head=heads, n_embd=embd, **kw)
    return ModelSpec(name=name, kind="gpt", config=cfg, default_batch=batch, default_seq=seq,
                     description=desc)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _gpt("gpt-tiny", 2, 4, 64, 16, 8, "2-layer GPT for tests and quick runs",
             vocab_size=128, block_size=64),
        _gpt("gpt-tiny-tied", 2, 4, 64, 16, 8, "gpt-tiny with its head tied to the embedding",
             vocab_size=128, block_size=64, tie_embeddings=True),
        _gpt("gpt-small", 4, 4, 128, 64, 16, "4-layer GPT that trains on CPU ranks",
             vocab_size=512, block_size=256),
        _gpt("gpt2-small", 12, 12, 768, 1024, 8, "GPT-2 124M (Radford et al. 2019)"),
        _gpt("gpt2-xl", 48, 25, 1600, 1024, 8, "GPT-2 1.5B (Radford et al. 2019)"),
        _gpt("gpt3-1.3b", 24, 16, 2048, 2048, 512, "GPT-3 XL 1.3B (Brown et al. 2020)"),
        _gpt("gpt3-175b", 96, 96, 12288, 2048, 1536, "GPT-3 175B (Brown et al. 2020)"),
        _gpt("moe-tiny", 2, 4, 64, 16, 8, "2-layer GPT whose MLPs are 4 experts, top-2",
             vocab_size=128, block_size=64, n_expert=4, top_k=2),
        _gpt("moe-small", 4, 4, 128, 64, 16, "4-layer GPT whose MLPs are 8 experts, top-2",
             vocab_size=512, block_size=256, n_expert=8, top_k=2),
        ModelSpec(name="mlp", kind="mlp", config=MLPConfig(), default_batch=64,
                  default_seq=None, description="4-block residual MLP classifier"),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model {name!r}; built-in models: {', '.join(MODELS)}"
        ) from None


def gpt_param_count(cfg: GPTConfig) -> int:
    """Closed form, for tests: embeddings + blocks + final norm + head."""
    h, v, t, b = cfg.n_embd, cfg.vocab_size, cfg.block_size, int(cfg.bias)
    mlp = (4 * h * h + b * 4 * h) + (4 * h * h + b * h)
    if cfg.n_expert:  # router + E x (gate_up [2I, H] + down [H, I])
        mlp = cfg.n_expert * h + cfg.n_expert * 3 * cfg.expert_width * h
    block = 4 * (h * h + b * h) + mlp + 2 * (h + b * h)
    return v * h + t * h + cfg.n_layer * block + (h + b * h) + v * h


__all__ = ["GPT", "GPTConfig", "MoE", "Experts", "TopKRouter", "MLPConfig", "MLPNet", "ModelSpec", "MODELS", "get_model",
           "gpt_param_count"]
