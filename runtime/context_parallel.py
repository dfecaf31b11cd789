"""Context parallelism (``Mesh.cp``): ring attention, and the zigzag split of sequences.

Each of the ``cp`` ranks of a context-parallel group holds two of ``2 * cp`` equal chunks
of every sample's sequence: chunk ``r`` and chunk ``2cp - 1 - r``, concatenated in that
order ("zigzag"), so each rank holds one early and one late chunk and causal attention
costs every rank the same. Everything but attention acts per token and runs unchanged
on the local tokens; attention needs every earlier token of the whole sequence.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the K/V
blocks of the group travel around a ring of send/recv while each rank attends its local
queries to the block it holds, merging the partial results with an online softmax: each
partial carries its log-sum-exp, and two partials combine as weighted sums (Milakov &
Gimelshein 2018; the merge of flash attention). Backward sends K/V around again with
dK/dV accumulators beside them; after ``cp`` hops each accumulator is home. Masking is
by global position, per half of the local sequence: a (query half, key half) pair that
lies wholly in the future is skipped, one wholly in the past needs no mask.

Written by hand, not with ``torch.distributed.tensor.experimental.context_parallel``,
because that cannot train on CPU (no sharding rule for the CPU SDPA kernels, no CPU
backward for flex attention; see shared/TORCH_ON_CPU.md). ``RingAttentionMode`` swaps
every ``F.scaled_dot_product_attention`` call for ring attention while active, so a model
that uses SDPA needs no change beyond taking its tokens' positions.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import _disable_current_modes

from runtime.plan import PlanError

_SKIP = "skip"
"""A block plan entry: the keys all lie after the queries (causal), nothing to do."""


# -- the zigzag layout ---------------------------------------------------------------------


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds: chunks ``rank`` and
    ``2cp - 1 - rank`` of ``2cp`` equal chunks, in that order (int64, CPU)."""
    if seq_len % (2 * cp):
        raise PlanError(
            f"sequence length {seq_len} is not divisible by 2 × cp = {2 * cp}: context "
            f"parallelism gives each rank two of {2 * cp} equal chunks; use a multiple of "
            f"{2 * cp}")
    size = seq_len // (2 * cp)
    early = torch.arange(rank * size, (rank + 1) * size)
    late = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)
    return torch.cat([early, late])


def zigzag_layout(seq_len: int, cp: int) -> torch.Tensor:
    """[cp, seq_len / cp]: the positions every cp rank holds, by cp rank."""
    return torch.stack([zigzag_positions(seq_len, cp, rank) for rank in range(cp)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag chunks of ``x`` along ``dim`` (input ids, labels, position ids)."""
    index = zigzag_positions(x.shape[dim], cp, rank).to(x.device)
    return x.index_select(dim, index)


# -- one block: scores, masking, partial results -------------------------------------------


def _halves(n: int) -> list[slice]:
    """The local sequence in two halves: under the zigzag layout each half is one chunk of
    consecutive positions, so whole halves can be skipped or left unmasked."""
    if n % 2 or n < 2:
        return [slice(0, n)]
    return [slice(0, n // 2), slice(n // 2, n)]


def _block_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, causal: bool):
    """``_SKIP``, None (attend to every key) or a bool mask, True where a key is later."""
    if not causal:
        return None
    if int(pos_k.min()) > int(pos_q.max()):
        return _SKIP
    if int(pos_k.max()) <= int(pos_q.min()):
        return None
    return pos_k[None, :] > pos_q[:, None]


def _block_plan(positions: torch.Tensor, rank: int, causal: bool) -> list[list[tuple]]:
    """Per ring step, the (query slice, key slice, mask) pairs that hold any work.

    ``positions`` [cp, T]: every cp rank's token positions. At step s this rank holds the
    K/V of rank ``(rank - s) % cp``.
    """
    cp, n = positions.shape
    pos_q = positions[rank]
    plan = []
    for step in range(cp):
        pos_k = positions[(rank - step) % cp]
        pairs = []
        for qs in _halves(n):
            for ks in _halves(n):
                mask = _block_mask(pos_q[qs], pos_k[ks], causal)
                if mask is not _SKIP:
                    pairs.append((qs, ks, mask))
        plan.append(pairs)
    return plan


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the arithmetic dtype: float32, or float64 for float64 inputs."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, scale, mask):
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(mask.to(s.device), float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that saw no key) as 0, so exp(s - lse) is 0, not nan."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _merge_block(out, lse, q, k, v, scale, mask) -> None:
    """Attend ``q`` to one K/V block and merge into the running (out, lse), in place."""
    s = _scores(q, k, scale, mask)
    block_lse = torch.logsumexp(s, dim=-1)
    block_out = torch.exp(s - _finite(block_lse)[..., None]) @ v
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)[..., None]
    out.copy_(torch.exp(lse[..., None] - safe) * out + torch.exp(block_lse[..., None] - safe)
              * block_out)
    lse.copy_(new_lse)


def _block_grads(dq, dk, dv, q, k, v, do, lse, delta, scale, mask) -> None:
    """Flash-attention backward of one block, accumulated into dq, dk, dv in place."""
    p = torch.exp(_scores(q, k, scale, mask) - _finite(lse)[..., None])
    dv += p.transpose(-2, -1) @ do
    ds = p * (do @ v.transpose(-2, -1) - delta[..., None])
    dq += (ds @ k) * scale
    dk += (ds.transpose(-2, -1) @ q) * scale


# -- the ring --------------------------------------------------------------------------------


class _Shift:
    """Send tensors to the next rank of the ring and receive the previous rank's, as one
    flat message each way (one send/recv pair per hop, whatever the tensor count). Two
    shifts in flight at once (K/V and dK/dV in backward) need different ``tag``s: their
    messages have the same size and would otherwise be matched in posting order only."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup, tag: int = 0
                 ) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.shapes = [t.shape for t in tensors]
        send = torch.cat([t.reshape(-1) for t in tensors])
        self.recv = torch.empty_like(send)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group,
                       tag),
            dist.P2POp(dist.irecv, self.recv, dist.get_global_rank(group, (rank - 1) % size),
                       group, tag),
        ])
        self._send = send  # keep the buffer alive until the send completes

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        out, start = [], 0
        for shape in self.shapes:
            numel = math.prod(shape)
            out.append(self.recv[start:start + numel].view(shape))
            start += numel
        return out


class RingAttention(torch.autograd.Function):
    """Attention of the local queries over the whole sequence of a cp group.

    Inputs: local ``q, k, v`` [B, H, T, D] (this rank's tokens), ``positions`` [cp, T]
    (every cp rank's token positions, by cp rank), the softmax scale, causality and the
    cp process group. Arithmetic in float32 (float64 for float64 inputs); outputs and
    gradients in the inputs' dtypes.
    """

    @staticmethod
    def forward(ctx, q, k, v, positions, scale, causal, group):
        # Selective recomputation records the ops of a checkpointed forward in a dispatch
        # mode and replays saved outputs instead of running them again; replayed sends,
        # receives and in-place merges would leave the rerun's buffers empty. Hidden from
        # that mode, the ring is one unit: run for real in forward, and again when a
        # checkpointed layer reruns its forward (on every rank at the same point).
        with _disable_current_modes():
            return RingAttention._forward(ctx, q, k, v, positions, scale, causal, group)

    @staticmethod
    def _forward(ctx, q, k, v, positions, scale, causal, group):
        rank = dist.get_rank(group)
        plan = _block_plan(positions, rank, causal)
        qf, kv = _wide(q), [_wide(k), _wide(v)]
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=qf.dtype, device=q.device)
        for step, pairs in enumerate(plan):
            shift = _Shift(kv, group) if step < len(plan) - 1 else None
            for qs, ks, mask in pairs:
                _merge_block(out[..., qs, :], lse[..., qs], qf[..., qs, :], kv[0][..., ks, :],
                             kv[1][..., ks, :], scale, mask)
            if shift is not None:
                kv = shift.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.group = plan, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        qf, do = _wide(q), _wide(dout)
        delta = (do * out).sum(-1)  # rowsum(dO ∘ O), the softmax backward's correction
        dq = torch.zeros_like(qf)
        kv = [_wide(k), _wide(v)]
        dkv = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]
        for step, pairs in enumerate(ctx.plan):
            shift_kv = _Shift(kv, ctx.group) if step < len(ctx.plan) - 1 else None
            for qs, ks, mask in pairs:
                _block_grads(dq[..., qs, :], dkv[0][..., ks, :], dkv[1][..., ks, :],
                             qf[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                             do[..., qs, :], lse[..., qs], delta[..., qs], ctx.scale, mask)
            # The accumulators follow their K/V block; the last hop brings them home.
            dkv = _Shift(dkv, ctx.group, tag=1).wait()
            if shift_kv is not None:
                kv = shift_kv.wait()
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, group: dist.ProcessGroup, *,
                   is_causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)`` over
    the whole sequence of the cp ``group``, from this rank's local q, k, v [B, H, T, D].

    ``positions`` [cp, T]: the global positions of every cp rank's tokens, by cp rank
    (``zigzag_layout``); causality compares global positions.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    return RingAttention.apply(q, k, v, positions.cpu(), scale, is_causal, group)


# -- intercepting SDPA -----------------------------------------------------------------------


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> dict:
    """``F.scaled_dot_product_attention``'s arguments by name."""
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


class RingAttentionMode(TorchFunctionMode):
    """While active, every ``F.scaled_dot_product_attention`` call runs as ring attention
    over the cp ``group``; ``positions`` [cp, T] as for ``ring_attention``.

    Enter it around forward *and* backward: non-reentrant checkpointing reruns forward
    during backward, and the rerun must attend over the ring as the first run did.
    ``where`` names the module being run (for error messages); ``calls`` counts the
    attention calls intercepted.
    """

    def __init__(self, group: dist.ProcessGroup, positions: torch.Tensor,
                 where: Callable[[], str] = lambda: "the model") -> None:
        super().__init__()
        self.group, self.positions, self.where = group, positions.cpu(), where
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attend(_sdpa_args(*args, **kwargs))

    def _attend(self, a: dict) -> torch.Tensor:
        problem = self._problem(a)
        if self.calls == 0:
            problem = self._agree(problem, a["query"].device)
        if problem:
            raise PlanError(problem)
        q, k, v = a["query"], a["key"], a["value"]
        if a["enable_gqa"] and k.size(-3) != q.size(-3):
            # grouped-query attention: each K/V head serves a run of query heads
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
        self.calls += 1
        return ring_attention(q, k, v, self.positions, self.group,
                              is_causal=bool(a["is_causal"]), scale=a["scale"])

    def _agree(self, problem: str | None, device: torch.device) -> str | None:
        """On the first call: whether any cp rank refuses, so no rank waits on the ring
        for one that raised (a model may pass a mask on one rank only). One all-reduce
        per micro-batch, hidden from recomputation's dispatch mode like the ring."""
        flag = torch.tensor([float(problem is not None)], device=device)  # NCCL: on the GPU
        with _disable_current_modes():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and problem is None:
            return (f"F.scaled_dot_product_attention in {self.where()}: another "
                    "context-parallel rank refused this call (its error says why)")
        return problem

    def _problem(self, a: dict) -> str | None:
        """Why this SDPA call cannot run as ring attention, or None."""
        op = f"F.scaled_dot_product_attention in {self.where()}"
        if a["dropout_p"]:
            return (f"{op} has dropout_p={a['dropout_p']}: context parallelism (mesh.cp > 1) "
                    "runs ring attention, which has no attention dropout; set the attention "
                    "dropout to 0 or use mesh.cp = 1")
        if a["attn_mask"] is not None:
            return (f"{op} has an attn_mask: context parallelism (mesh.cp > 1) masks by "
                    "global position only (is_causal); drop the explicit mask or use "
                    "mesh.cp = 1")
        q, k = a["query"], a["key"]
        local = self.positions.shape[1]
        if q.size(-2) != local or k.size(-2) != local:
            return (f"{op}: query length {q.size(-2)} and key length {k.size(-2)} are not "
                    f"the {local} local tokens; context parallelism supports self-attention "
                    "over the sequence the runtime split")
        return None


# -- what the runtime needs: validation, batch split, the mode around a micro-batch ---------

POSITION_ARGS = ("pos", "position_ids")
"""Names of a forward argument that takes position ids: the zoo GPT's, Hugging Face's."""
_NEEDS = ("context parallelism (mesh.cp > 1) needs fused attention "
          "(F.scaled_dot_product_attention, which it runs as ring attention) and a forward "
          "that takes position ids (each rank holds chunks of every sequence)")


def position_argument(model: nn.Module) -> str:
    """The name of ``model.forward``'s position-ids argument; PlanError if it has none or
    computes attention unfused. Local: no collective."""
    config = getattr(model, "config", None)
    if getattr(config, "attention", None) == "unfused" or \
            getattr(config, "_attn_implementation", None) == "eager":
        raise PlanError(f"{type(model).__name__} computes attention unfused (explicit masked "
                        f"scores); {_NEEDS}: build it with fused attention (the zoo's "
                        "GPTConfig(attention='fused'), Hugging Face attn_implementation='sdpa')")
    params = inspect.signature(model.forward).parameters
    for name in POSITION_ARGS:
        if name in params:
            return name
    raise PlanError(f"{type(model).__name__}.forward takes no position ids (an argument "
                    f"named {' or '.join(POSITION_ARGS)}); {_NEEDS}")


class ContextParallel:
    """One model's context parallelism: the zigzag split of a batch's sequences, the
    position ids to pass, and ring attention around each micro-batch."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, position_arg: str) -> None:
        self.group, self.position_arg = group, position_arg
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._mode: RingAttentionMode | None = None
        self._path: list[str] = []
        for name, module in model.named_modules():
            module.register_forward_pre_hook(self._entering(name))
            module.register_forward_hook(self._leaving, always_call=True)

    def keep_through_recompute(self, module: nn.Module) -> None:
        """Make ``module``'s forward enter the ring-attention mode when run outside it.

        Torch-function modes are not active while autograd runs backward, where
        non-reentrant checkpointing reruns a layer's forward; the rerun must attend over
        the ring as the first run did. Call before ``runtime.recompute`` wraps the
        forward, so the checkpointed function is this one.
        """
        forward = module.forward

        @functools.wraps(forward)
        def run(*args, **kwargs):
            mode = self._mode
            if mode is None or mode in _get_current_function_mode_stack():
                return forward(*args, **kwargs)
            with mode:
                return forward(*args, **kwargs)

        module.forward = run

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag chunks of a batch tensor's sequence (dim 1)."""
        if x.dim() < 2:
            raise PlanError(f"a batch tensor of shape {tuple(x.shape)} has no sequence "
                            "dim 1 to split for context parallelism (mesh.cp > 1)")
        return shard_sequence(x, self.size, self.rank, dim=1)

    def _entering(self, name: str) -> Callable:
        def hook(module, args) -> None:
            self._path.append(name)
        return hook

    def _leaving(self, module, args, output) -> None:
        if self._path:
            self._path.pop()

    def _where(self) -> str:
        return f"module {self._path[-1]!r}" if self._path and self._path[-1] else "the model"

    @contextlib.contextmanager
    def attention(self, local_len: int, device: torch.device) -> Iterator[dict]:
        """Around one micro-batch's forward and backward: yields the keyword argument
        that passes the local tokens' positions; raises if no attention ran on the ring."""
        layout = zigzag_layout(local_len * self.size, self.size)
        pos = layout[self.rank].to(device)
        value = pos if self.position_arg == "pos" else pos.unsqueeze(0)  # HF: [batch, seq]
        self._path.clear()
        self._mode = mode = RingAttentionMode(self.group, layout, self._where)
        try:
            with mode:
                yield {self.position_arg: value}
        finally:
            self._mode = None
        if mode.calls == 0:
            raise PlanError(f"the model's forward made no F.scaled_dot_product_attention "
                            f"call; {_NEEDS}")
