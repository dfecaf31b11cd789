"""Find the mixture-of-experts (MoE) blocks of a model, by structure.

One detector serves the planner (which layers hold experts, and their shapes) and the
expert-parallel runtime (which module to shard). It looks at parameters' shapes and a
few attributes, never at class names, so any model written in the layout below is found,
on real or meta weights alike.

What is recognised (the layout of Hugging Face transformers 5.x ``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts`` and about seventy other
``*Experts`` classes, and of ``autopar.zoo``'s MoE):

    experts module  direct parameters, E experts, hidden size H, expert width I:
                      gated (SwiGLU):  gate_up_proj [E, 2I, H] (gate rows then up rows)
                                       down_proj    [E, H, I]
                      plain:           up_proj      [E, I, H], down_proj [E, H, I]
                    no other direct parameters (no biases), an ``act_fn`` callable,
                    ``is_transposed`` / ``is_concatenated`` (where present) False / True,
                    and forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])
                    -> [T, H]
    block           the experts module's parent, with a router child (``gate`` or
                    ``router`` first, else any child) holding a 2-D ``weight`` [E, H]
                    (an ``nn.Linear(H, E)`` or HF's ``*TopKRouter``); top-k from the
                    block's or the router's ``top_k`` (or ``num_experts_per_tok`` of a
                    ``config``); shared experts from a ``shared_experts`` or
                    ``shared_expert`` child (DeepSeek, Qwen-MoE), planned with the block's
                    dense parts.

Not recognised: transposed layouts (GPT-OSS), experts with biases, experts held as a
``ModuleList`` of MLPs (Switch Transformers, NLLB-MoE), DBRX's flattened 2-D weights.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

ROUTER_NAMES = ("gate", "router")
"""Child names tried first for the router; any child with a weight [E, H] is tried next."""
SHARED_NAMES = ("shared_experts", "shared_expert")
"""Child names of shared (always-on) experts."""


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block: a router choosing ``top_k`` of ``num_experts`` experts per token."""

    path: str
    """Fully-qualified name of the block (the experts module's parent)."""
    router: str
    """FQN of the router module (its weight is [num_experts, hidden_size])."""
    experts: str
    """FQN of the experts module, whose 3-D parameters hold every expert."""
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    """One expert's width I."""
    gated: bool
    """SwiGLU-style: ``gate_up_proj`` [E, 2I, H]; else ``up_proj`` [E, I, H]."""
    shared_experts: str | None = None
    """FQN of the shared experts, or None."""

    @property
    def expert_param_names(self) -> tuple[str, str]:
        """The experts module's two 3-D parameters, up-projection first."""
        return ("gate_up_proj" if self.gated else "up_proj", "down_proj")

    @property
    def expert_params(self) -> int:
        """Parameters of all experts together."""
        up = (2 if self.gated else 1) * self.intermediate_size * self.hidden_size
        return self.num_experts * (up + self.hidden_size * self.intermediate_size)


def find_moe_blocks(module: nn.Module, prefix: str = "") -> list[MoEBlock]:
    """Every MoE block under ``module`` in ``named_modules`` order, FQNs under ``prefix``."""
    blocks = []
    for name, child in module.named_modules(prefix=prefix):
        shape = experts_shape(child)
        if shape is None:
            continue
        parent_name, _, _ = name.rpartition(".")
        parent = module.get_submodule(_relative(parent_name, prefix)) if name != prefix else None
        block = _block(parent, parent_name, name, shape) if parent is not None else None
        if block is not None:
            blocks.append(block)
    return blocks


def experts_shape(module: nn.Module) -> tuple[int, int, int, bool] | None:
    """(num_experts, hidden, intermediate, gated) when ``module`` is an experts module in
    the layout of the module docstring, else None."""
    params = dict(module.named_parameters(recurse=False))
    gated = "gate_up_proj" in params
    up_name = "gate_up_proj" if gated else "up_proj"
    if set(params) != {up_name, "down_proj"} or not callable(getattr(module, "act_fn", None)):
        return None
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return None
    up, down = params[up_name], params["down_proj"]
    if up.dim() != 3 or down.dim() != 3:
        return None
    num_experts, hidden, width = down.shape
    if tuple(up.shape) != (num_experts, (2 if gated else 1) * width, hidden):
        return None
    if not _takes_routing(module):
        return None
    return num_experts, hidden, width, gated


def _takes_routing(module: nn.Module) -> bool:
    """forward(hidden, top_k_index, top_k_weights): three positional parameters."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3


def _block(parent: nn.Module, path: str, experts: str,
           shape: tuple[int, int, int, bool]) -> MoEBlock | None:
    num_experts, hidden, width, gated = shape
    router_name = _router_name(parent, num_experts, hidden, exclude=experts.rpartition(".")[2])
    if router_name is None:
        return None
    router = parent.get_submodule(router_name)
    top_k = _top_k(parent, router)
    if top_k is None or not 1 <= top_k <= num_experts:
        return None
    shared = next((n for n in SHARED_NAMES if isinstance(getattr(parent, n, None), nn.Module)),
                  None)
    return MoEBlock(path=path, router=_join(path, router_name), experts=experts,
                    num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                    intermediate_size=width, gated=gated,
                    shared_experts=_join(path, shared) if shared else None)


def _router_name(parent: nn.Module, num_experts: int, hidden: int, exclude: str) -> str | None:
    children = dict(parent.named_children())
    order = [n for n in ROUTER_NAMES if n in children]
    order += [n for n in children if n not in ROUTER_NAMES and n != exclude]
    for name in order:
        weight = getattr(children[name], "weight", None)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == (num_experts, hidden):
            return name
    return None


def _top_k(parent: nn.Module, router: nn.Module) -> int | None:
    for owner in (parent, router):
        k = getattr(owner, "top_k", None)
        if isinstance(k, int):
            return k
        k = getattr(getattr(owner, "config", None), "num_experts_per_tok", None)
        if isinstance(k, int):
            return k
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _relative(name: str, prefix: str) -> str:
    """``name`` (under ``prefix``) as a path from the module ``prefix`` names."""
    if not prefix:
        return name
    return name[len(prefix) + 1:] if name != prefix else ""
