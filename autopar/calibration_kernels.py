"""The kernels ``autopar calibrate`` times besides collectives.

GEMMs (``linear_op``): a Linear's forward and backward, its three GEMMs as training runs
them.

Memory-bound kernels (``memory_kernels``): what a transformer's training step runs between
its matmuls — residual adds, GELU, layer norm, softmax — and AdamW's element-wise updates,
plus a plain copy. On a GPU they all stream at about the copy bandwidth; on a CPU the
transcendental ones (GELU's erf, softmax's exp, layer norm's reductions) run at a third to
a half of it, so a copy alone would make every memory-bound kernel look 2-3x faster than
it is. The profile's ``memory_bandwidth_GBps`` is the mix's harmonic mean (equal bytes
through each kernel: ``cost_models.calibrate.kernel_mix_bandwidth_GBps``).

Fused attention (``attention_op``): ``F.scaled_dot_product_attention``, causal, forward and
backward, with FLOPs counted as the planner counts them (FlopCounterMode: 4·b·h·s²·d
forward whether causal or not, backward twice that), so the measured rate over the GEMM
rate is ``Device.attention_efficiency`` as the cost model applies it.

The loss (``loss_op``): cross-entropy over float32 logits, forward and backward, with bytes
counted as the planner counts its passes (``autopar.planner.loss_costs``), so the measured
rate over the memory-bound mix's is ``Device.loss_efficiency`` as the cost model applies it.
On a CPU log-softmax's exp and row reductions run below the mix; the rate also depends on
the vocabulary (a row's length).

Host overheads (``host_overhead_ops``): on CPU ranks the parallel engines' own work —
FSDP2's hooks, copies and allocations around each module, DTensor's dispatch of every op
on a sharded tensor — runs on the same core as the kernels, so it adds to the step. (On a
GPU the host runs ahead of the kernels and hides it; ``autopar calibrate`` measures it on
CPU ranks only.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autopar.planner.loss_costs import LOSS_BWD_PASSES, LOSS_FWD_PASSES

ROW = 1024
"""Elements per row of the memory-bound kernels' tensors (a hidden size)."""


def linear_op(n: int, dtype: torch.dtype, device: torch.device | str
              ) -> tuple[int, Callable[[], object]]:
    """(GEMMs per call, the call): an n → n Linear's forward and backward on n tokens,
    y = x·Wᵀ, dX = dY·W and dW = dYᵀ·x, each an n × n × n GEMM. Timed as training runs
    them (transposed operands, fresh outputs and gradients, autograd between them): on a
    CPU rank 2-4% below a bare square ``torch.mm`` at n = 1024 and more at small n
    (bench/cost_fidelity.py's cross-check; BENCHMARKS.md)."""
    x = torch.randn(n, n, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(n, n, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(n, n, device=device, dtype=dtype)

    def forward_backward() -> None:
        torch.autograd.grad(F.linear(x, weight), (x, weight), grad)

    return 3, forward_backward


def memory_kernels(nbytes: int, device: torch.device | str
                   ) -> dict[str, tuple[int, Callable[[], object]]]:
    """Name -> (bytes read + written per call, the call) on float32 tensors of ``nbytes``."""
    x = torch.randn(max(1, nbytes // 4 // ROW), ROW, device=device)
    y, out = torch.randn_like(x), torch.empty_like(x)
    positive = torch.rand_like(x) + 1
    size = x.nbytes
    return {
        "copy": (2 * size, lambda: out.copy_(x)),
        "add": (3 * size, lambda: torch.add(x, y, out=out)),
        "gelu": (2 * size, lambda: F.gelu(x)),
        "layer_norm": (2 * size, lambda: F.layer_norm(x, (ROW,))),
        "softmax": (2 * size, lambda: torch.softmax(x, dim=-1)),
        "lerp_": (3 * size, lambda: y.lerp_(x, 0.1)),
        "addcdiv_": (4 * size, lambda: y.addcdiv_(x, positive, value=-1e-6)),
    }


def attention_op(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str
                 ) -> tuple[float, Callable[[], object]]:
    """(Counted FLOPs of forward + backward, the call) of causal attention on ``shape`` =
    (batch × heads, sequence, head dim)."""
    heads, seq, dim = shape
    q, k, v = (torch.randn(1, heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, heads, seq, dim, device=device, dtype=dtype)

    def forward_backward() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.backward(out, grad, inputs=[q, k, v])

    forward = 4.0 * heads * seq * seq * dim
    return 3 * forward, forward_backward


def loss_op(shape: tuple[int, int], device: torch.device | str
            ) -> tuple[float, Callable[[], object]]:
    """(Counted bytes of forward + backward, the call) of ``F.cross_entropy`` on float32
    logits of ``shape`` = (tokens, vocabulary), as the zoo's models call it."""
    tokens, vocab = shape
    logits = torch.randn(tokens, vocab, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)

    def forward_backward() -> None:
        torch.autograd.backward(F.cross_entropy(logits, targets), inputs=[logits])

    return (LOSS_FWD_PASSES + LOSS_BWD_PASSES) * float(logits.nbytes), forward_backward


# -- host overheads of the parallel engines (CPU ranks) --------------------------------------

HOST_STACK = 8
"""Modules in the stacks ``host_overhead_ops`` times: small Linears, so the engines' own
host time, not their kernels, is what differs between the plain and the wrapped stack."""
HOST_WIDTH = 64


def host_overhead_ops(one: DeviceMesh, device: torch.device | str
                      ) -> dict[str, Callable[[], object]]:
    """Forward + backward of a stack of HOST_STACK Linears: plain, under FSDP2 (every module
    and the root ``fully_shard``-ed) and tensor-parallel (alternating colwise / rowwise);
    and one in-place op on a plain and on a DTensor parameter. ``one`` is a mesh of this
    rank alone, so no collective waits on another rank: what is left is host time."""
    torch.manual_seed(0)
    x = torch.randn(16, HOST_WIDTH, device=device)

    def stack() -> nn.Sequential:
        return nn.Sequential(*(nn.Linear(HOST_WIDTH, HOST_WIDTH) for _ in range(HOST_STACK))
                             ).to(device)

    plain, fsdp, tp = stack(), stack(), stack()
    for module in fsdp:
        fully_shard(module, mesh=one)
    fully_shard(fsdp, mesh=one)
    parallelize_module(tp, one, {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                 for i in range(HOST_STACK)})
    local = torch.zeros(HOST_WIDTH, device=device)
    sharded = distribute_tensor(torch.zeros(HOST_WIDTH, device=device), one, [Shard(0)])
    return {
        "plain": lambda: plain(x).sum().backward(),
        "fsdp": lambda: fsdp(x).sum().backward(),
        "tp": lambda: tp(x).sum().backward(),
        "op": lambda: local.add_(1.0),
        "dtensor op": lambda: sharded.add_(1.0),
    }
