"""The ``node.meta`` / ``graph_module.meta`` keys autopar's passes write, and their records.

Each analysis pass writes one typed record under one key; consumers only read that key.
Keys are prefixed so they never collide with torch's own (``val``, ``nn_module_stack``).
"""

from __future__ import annotations

from dataclasses import dataclass

from passes.records import SavedSplit

# -- graph-level (GraphModule.meta) -------------------------------------------------------

CAPTURE = "autopar.capture"
"""CaptureInfo: how the graph was captured."""

# -- node-level (Node.meta) -----------------------------------------------------------------

TENSOR = "autopar.tensor"
"""TensorMeta, written by ``annotate.propagate_shapes``."""
MODULE_PATH = "autopar.module_path"
"""str: fully-qualified name of the innermost module that ran the node ('' for the root)."""
OP_KIND = "autopar.op_kind"
"""OpKind, written by ``annotate.count_ops``."""
FLOPS = "autopar.flops"
"""float: forward FLOPs, written by ``annotate.count_flops``."""
SELECTIVE_FLOPS = "autopar.selective_flops"
"""float: the part of FLOPS done by ops outside ``runtime.plan.SELECTIVE_SAVE_OPS`` (what
selective recomputation runs again), written by ``annotate.count_flops`` from the same
count as FLOPS (a second run of the layer would only repeat it)."""
GEMMS = "autopar.gemms"
"""tuple[records.GemmShape, ...]: the matrix multiplies (aten mm/addmm/bmm/baddbmm) the
node runs, ``module`` left '' (the layer graph fills it), written by ``annotate.count_flops``."""
SAVED = "autopar.saved"
"""SavedBytes, written by ``annotate.count_saved_bytes``."""
MEM_BYTES = "autopar.mem_bytes"
"""int: bytes read + written by the node, written by ``annotate.count_bytes``."""
LAYER = "autopar.layer"
"""LayerRef, written by ``group_layers.group_layers``."""
NEEDS_GRAD = "autopar.needs_grad"
"""bool: whether the node's value depends on a trainable parameter (so autograd tracks
it in training), written by ``annotate.mark_needs_grad``."""
ATTENTION_KERNEL = "autopar.attention_kernel"
"""str, on scaled dot-product attention nodes: the kernel costed for training ('flash',
'efficient' or 'math', see ``annotate.attention_kernel``), written by the cost passes."""
INPLACE_INPUTS = "autopar.inplace_inputs"
"""int: floating bytes of the layer's inputs the node is the first to modify in place,
written by ``inplace.count_inplace_inputs``."""
TP_STYLE = "autopar.tp_style"
"""str (a runtime.plan.TP_STYLES entry), on linear/embedding nodes of a layer's
representative, written by ``tensor_parallel.find_tensor_parallel``."""


@dataclass(frozen=True, kw_only=True)
class CaptureInfo:
    method: str
    """'export' or 'symbolic_trace'."""
    seconds: float
    """Wall time of the capture."""
    fallback_reason: str = ""
    """Why the preferred method was not used ('' when it was)."""


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    nbytes: int
    """Bytes of this tensor's elements (not of the storage it may view)."""


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """The node's output: the tensors it produces (flattened), or a Python value."""

    tensors: tuple[TensorSpec, ...]
    is_tensor: bool
    """True when the output is a single tensor (not a tuple of them or a Python value)."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True, kw_only=True)
class OpKind:
    is_kernel: bool
    """False for views, shape queries, getitem and other ops that launch no kernel."""
    is_view: bool


@dataclass(frozen=True, kw_only=True)
class SavedBytes:
    """Activation bytes autograd saves for backward when this node runs (parameters and
    buffers excluded; storages already saved by an earlier node of the layer not counted)."""

    nbytes: int
    producers: tuple[tuple[str, int], ...]
    """(name of the node whose output owns the saved storage, or '' for a layer input; bytes)."""
    parts: tuple[tuple[str, SavedSplit], ...] = ()
    """The same storages by owner and kind, with the selective corrections charged to the
    node that made them (for splits by owner: tensor and sequence parallelism)."""
    fixed_nbytes: int = 0
    """Part of nbytes in non-floating dtypes (dropout masks, indices): mixed precision
    changes floating dtypes only, so these bytes do not scale with the compute dtype."""
    selective_nbytes: int = 0
    """Floating part of nbytes that selective recomputation frees: storages neither a layer
    input nor made by an op in ``runtime.plan.SELECTIVE_SAVE_OPS`` (views keep their
    storage's maker), less outputs of those ops autograd does not save (selective holds
    them anyway), so it can be negative."""
    selective_fixed_nbytes: int = 0
    """Non-floating part of selective bytes (dropout masks)."""


@dataclass(frozen=True, kw_only=True)
class LayerRef:
    name: str
    """Fully-qualified name of the layer's module."""
    index: int
    """Position of the layer in execution order."""
    layer_class: str = ""
