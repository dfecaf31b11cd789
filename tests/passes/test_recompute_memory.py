"""What one block holds for backward under each recompute mode: measured at run time on
one process, against what the capture predicts, and the gradients each mode gives.

Block: the zoo GPT's Megatron-shaped block (``attention="unfused"``, dropout 0.1 at the
three Megatron sites), recomputed by ``runtime.recompute.apply_recompute`` as a plan runs it.

Measured: the bytes of storages made during the block's forward that are still alive after
it: autograd's saved tensors, and under checkpointing the inputs the checkpoint keeps and
the selective policy's cache of matmul outputs. Parameters, buffers and the block's output
are left out, and the block's input is made inside the measurement (so it counts only when
the block keeps it). ``saved_tensors_hooks`` alone cannot see a checkpointed block: the
checkpoint installs its own hooks in the region (the innermost pair wins) and the selective
cache is held outside autograd; for ``none`` the hooks are checked to give the same bytes.

Predicted, from the block's LayerInfo: ``none`` saved_bytes; ``selective`` saved_bytes -
selective_saved_bytes - selective_fixed_bytes; ``full`` input_bytes. The capture models
dropout as CUDA runs it (``native_dropout``, a 1-byte bool mask); CPU's ``aten.dropout``
keeps a float32 noise tensor instead, so on CPU each fixed byte (here every one is a
dropout mask element, tests/passes/test_activation_capture.py) is 4 bytes. Selective and full
recompute every dropout, so this changes only ``none``.

Tolerance: none. The capture runs the same aten ops on meta tensors that the block runs
here on CPU, so the predicted storages are these storages; a torch whose decompositions
differ between the two (a matmul that stops folding into addmm, a norm that saves another
statistic) is what a remainder would mean, and this test is where it should show.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.zoo import GPT, GPTConfig
from passes.layer_graph import build_layer_graph
from passes.records import LayerInfo
from runtime.plan import LayerPlan
from runtime.recompute import apply_recompute

SEQ, BATCH, HIDDEN, HEADS = 32, 2, 64, 4
CPU_DROPOUT_NOISE_BYTES = 4
"""Bytes per element CPU dropout keeps for backward (a float32 noise tensor)."""


def _config(**overrides: object) -> GPTConfig:
    cfg = dict(n_layer=1, n_head=HEADS, n_embd=HIDDEN, vocab_size=128, block_size=SEQ,
               dropout=0.1, attention="unfused")
    return GPTConfig(**(cfg | overrides))


def _model(cfg: GPTConfig, mode: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    apply_recompute(model, [LayerPlan(module=f"h.{i}", recompute=mode)
                            for i in range(cfg.n_layer)])
    return model


class _Made(TorchDispatchMode):
    """Weak references to the storage of every tensor an op makes while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.refs.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out

    def alive_bytes(self, excluded: set[int]) -> int:
        alive = {ref.cdata: n for ref, n in self.refs if not ref.expired()}
        return sum(n for cdata, n in alive.items() if cdata not in excluded)


def _storage_ids(tensors) -> set[int]:
    return {StorageWeakRef(t.untyped_storage()).cdata for t in tensors}


def held_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes the block's forward leaves held for backward (module docstring)."""
    made = _Made()
    with made:
        h = x * 1.0  # the block's input, made here: counted only if the block keeps it
        y = block(h)
    del h
    excluded = _storage_ids([*block.parameters(), *block.buffers(), y])
    return made.alive_bytes(excluded)


def hooked_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves in the block's forward (no checkpoint)."""
    excluded = _storage_ids([*block.parameters(), *block.buffers()])
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage()).cdata
        if key not in excluded:
            sizes[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x * 1.0)
    return sum(sizes.values())


def predicted_on_cpu(block: LayerInfo, mode: str) -> int:
    if mode == "full":
        return block.input_bytes
    floating = block.saved_bytes - block.saved_fixed_bytes
    fixed = block.saved_fixed_bytes
    if mode == "selective":
        floating -= block.selective_saved_bytes
        fixed -= block.selective_fixed_bytes
    return floating + CPU_DROPOUT_NOISE_BYTES * fixed


@pytest.fixture(scope="module")
def megatron_info() -> LayerInfo:
    lg = build_layer_graph(GPT(_config()), (torch.zeros(BATCH, SEQ, dtype=torch.long),))
    return lg.layers[[la.name for la in lg.layers].index("h.0")]


def _measured(mode: str) -> int:
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    return held_bytes(_model(_config(), mode).h[0], x)


def test_selective_holds_less_than_none_and_more_than_full():
    none, selective, full = (_measured(m) for m in ("none", "selective", "full"))
    assert full < selective < none, (none, selective, full)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_measured_bytes_are_what_the_capture_predicts(megatron_info, mode):
    assert _measured(mode) == predicted_on_cpu(megatron_info, mode)


def test_hooks_and_live_storages_agree_without_recomputation():
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    block = _model(_config(), "none").h[0]
    assert held_bytes(block, x) == hooked_bytes(block, x)


# -- numerics -------------------------------------------------------------------------------


def _gradients(mode: str, seed: int) -> dict[str, torch.Tensor]:
    cfg = _config(n_layer=2)
    model = _model(cfg, mode)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)  # the dropout masks
    model(tokens).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_gradients_of_no_recompute_dropout_included(mode):
    """Recomputed dropout draws the same masks: checkpoint restores the RNG state of the
    forward (``preserve_rng_state``) before rerunning it. Another seed's gradients differ,
    so the masks matter to the comparison."""
    reference = _gradients("none", seed=0)
    recomputed = _gradients(mode, seed=0)
    for name, grad in reference.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-6, atol=0, msg=name)
    other = _gradients("none", seed=1)
    assert not torch.equal(other["h.0.attn.q_proj.weight"], reference["h.0.attn.q_proj.weight"])
