"""Run E experts on rows grouped by expert: the compute inside a mixture-of-experts layer.

Rows arrive sorted by expert, ``counts[e]`` of them for expert e (the layout both of a
dropless MoE's dispatch and of what expert parallelism's all-to-all delivers). Each expert
is an MLP whose weights are slices of 3-D tensors in HF Mixtral's layout
(``runtime.moe_blocks``): up [E, 2I or I, H], down [E, H, I].

``expert_mlp`` is the eager form (autograd through ordinary ops; any activation).
``grouped_swiglu`` is the same computation with SiLU as one custom op whose output shape
is its input's: a model that calls it can be captured and costed on meta tensors, where a
per-expert split by data-dependent counts cannot run. Its FLOPs are registered with
PyTorch's FLOP counter (3 GEMMs per row: 2·H·2I + 2·I·H).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula


def expert_mlp(rows: torch.Tensor, counts: list[int], up: torch.Tensor, down: torch.Tensor,
               act_fn: Callable[[torch.Tensor], torch.Tensor], gated: bool) -> torch.Tensor:
    """rows [S, H] sorted by expert, ``counts`` rows per expert (len E, sum S) -> [S, H].
    Gated: act(gate) * up with up's first I rows the gate (HF's concatenated layout)."""
    outs = []
    for e, chunk in enumerate(rows.split(counts)):
        if chunk.shape[0] == 0:
            continue
        h = F.linear(chunk, up[e])
        if gated:
            gate, lin = h.chunk(2, dim=-1)
            h = act_fn(gate) * lin
        else:
            h = act_fn(h)
        outs.append(F.linear(h, down[e]))
    if not outs:
        # No rows: an empty result still joins the graph, so every weight gets a gradient.
        return rows @ up.new_zeros(rows.shape[-1], down.shape[1]) + 0 * (up.sum() + down.sum())
    return torch.cat(outs)


@torch.library.custom_op("autopar::grouped_swiglu", mutates_args=())
def grouped_swiglu(rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """``expert_mlp`` with SiLU, gated, ``counts`` an int tensor [E]."""
    return expert_mlp(rows, counts.tolist(), gate_up, down, F.silu, gated=True)


@grouped_swiglu.register_fake
def _(rows, counts, gate_up, down):
    return rows.new_empty(rows.shape[0], down.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    rows, counts, gate_up, down = inputs
    ctx.save_for_backward(rows, counts, gate_up, down)


def _backward(ctx, grad: torch.Tensor):
    # Recomputes the forward under autograd: one extra expert forward per backward keeps
    # this op's saved state to its inputs, and reuses autograd's own GEMM gradients.
    rows, counts, gate_up, down = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (rows, gate_up, down)]
        out = expert_mlp(leaves[0], counts.tolist(), leaves[1], leaves[2], F.silu, gated=True)
        needs = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, needs, grad, allow_unused=True))
    d_rows, d_gate_up, d_down = (next(got) if t.requires_grad else None for t in leaves)
    return d_rows, None, d_gate_up, d_down


grouped_swiglu.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.autopar.grouped_swiglu)
def _grouped_swiglu_flops(rows_shape, counts_shape, gate_up_shape, down_shape, *args,
                          out_shape=None, **kwargs) -> int:
    rows, hidden = rows_shape
    width = down_shape[2]
    return 2 * rows * hidden * 2 * width + 2 * rows * width * hidden
