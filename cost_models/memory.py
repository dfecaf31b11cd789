"""Memory of model states per rank, by precision and ZeRO stage.

Bytes per parameter (Rajbhandari et al., "ZeRO", SC'20, section 3.1): mixed-precision Adam
keeps a 2-byte parameter, a 2-byte gradient and K = 12 bytes of optimizer state (fp32
master copy, momentum, variance): 16 bytes per parameter. Pure fp32 keeps 4 + 4 + 8 = 16.

ZeRO stage s over a data-parallel group of N ranks shards, per parameter:
    stage 0: nothing           p + g + K
    stage 1: optimizer states  p + g + K/N
    stage 2: + gradients       p + (g + K)/N
    stage 3: + parameters      (p + g + K)/N          (FSDP's full sharding)
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Precision:
    name: str
    param_bytes: int
    grad_bytes: int
    """Bytes per gradient element as computed and reduced (the compute dtype's)."""
    held_grad_bytes: int = 4
    """Bytes per element of the gradient kept until the optimizer step: float32 in every
    precision. FSDP2 casts each reduced gradient to its float32 sharded parameter's dtype
    (torch.distributed.fsdp's ``foreach_reduce``); Megatron-LM accumulates fp16 gradients
    into float32 ``main_grad`` buffers. So mixed precision holds 2 + 4 + 12 = 18 bytes a
    parameter, not ZeRO's 16 (``zero_model_states`` keeps the paper's accounting)."""
    optimizer_bytes: int
    """Adam state per parameter, fp32 master copy included when params are low precision."""
    activation_bytes: int
    """Bytes per activation element."""
    compute_dtype: str

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


PRECISIONS = {
    "float32": Precision(name="float32", param_bytes=4, grad_bytes=4, optimizer_bytes=8,
                         activation_bytes=4, compute_dtype="float32"),
    "bfloat16": Precision(name="bfloat16", param_bytes=2, grad_bytes=2, optimizer_bytes=12,
                          activation_bytes=2, compute_dtype="bfloat16"),
    "float16": Precision(name="float16", param_bytes=2, grad_bytes=2, optimizer_bytes=12,
                         activation_bytes=2, compute_dtype="float16"),
}


def precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ConfigError(
            f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class MemoryTerms:
    """The five kinds of memory a rank holds, in bytes: the one record of them that layer
    costs, liveness events, option costs and a plan's predicted peak all build on."""

    params_bytes: int | float = 0
    """Integers in a plan's records; modelled averages may be fractional."""
    grads_bytes: int | float = 0
    optimizer_bytes: int | float = 0
    activations_bytes: int | float = 0
    """Saved for backward."""
    buffers_bytes: int | float = 0
    """Transient: communication buffers, gathered parameters, recomputed activations."""

    @property
    def states_bytes(self) -> float:
        """Model states: parameters, gradients and optimizer states."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.states_bytes + self.activations_bytes + self.buffers_bytes


def zero_model_states(num_params: float, stage: int, dp: int, prec: Precision) -> MemoryTerms:
    """Per-rank model-state bytes under ZeRO stage 0-3 over ``dp`` data-parallel ranks."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    p = num_params * prec.param_bytes
    g = num_params * prec.grad_bytes
    k = num_params * prec.optimizer_bytes
    return MemoryTerms(
        params_bytes=p / dp if stage >= 3 else p,
        grads_bytes=g / dp if stage >= 2 else g,
        optimizer_bytes=k / dp if stage >= 1 else k,
    )
