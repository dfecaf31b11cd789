"""Analysis passes that annotate a captured graph, node by node, on meta tensors.

Each pass writes one record under one key of ``passes.meta_keys``. The cost passes
(``count_flops``, ``count_saved_bytes``, ``count_bytes``) take the nodes to annotate, so
callers can run them on one representative layer per class of identical layers.

Conventions:

- FLOPs are what ``torch.utils.flop_counter.FlopCounterMode`` counts: matmul-like ops only
  (mm/addmm/bmm/convolution: 2·m·n·k), elementwise ops and norms count 0. Scaled dot-product
  attention counts ``4·b·heads·s_q·s_kv·head_dim`` (QKᵀ and PV) whether or not it is causal:
  the causal mask is not subtracted.
- GEMM sizes: of the FLOPs, those of aten mm/addmm/bmm/baddbmm (what nn.Linear and
  torch.matmul run on inputs of any rank) are also recorded per product with their
  (m, n, k) and batch count, so the cost model can price each at its size. Fused attention
  and convolutions are not recorded: they are priced at the large-GEMM rate.
- Saved bytes: activations autograd keeps for backward, captured with
  ``torch.autograd.graph.saved_tensors_hooks`` while the nodes run on meta tensors that
  require grad where the model's do (``needs_grad``); parameters and buffers are excluded and storages are deduplicated (three
  projections of one input save it once). Attention is run as the fused (flash) kernel, as
  on GPUs: it saves q, k, v, the output and the log-sum-exp, not the s×s probabilities that
  the math fallback (what meta tensors would otherwise dispatch to) keeps. A mask that
  needs a gradient (a learned bias) is run as the kernel GPUs use for it, memory-efficient
  attention, which saves the bias too (``attention_kernel``). Dropout in
  training runs as the fused kernel too (``aten.native_dropout``, what CUDA dispatches to):
  it saves a bool mask, where the CPU/meta decomposition saves a floating noise tensor.
  RMSNorm (``nn.RMSNorm``, ``F.rms_norm``) runs as CUDA's fused kernel
  (``aten._fused_rms_norm``): it saves its input and a reciprocal RMS per row, where the
  composite CPUs run saves float32 copies of the input and of its normalised value.
- Saved bytes are split by dtype (floating, or fixed: bool masks, integer indices) and by
  what selective recomputation does with them. Its runtime policy (``runtime.recompute``)
  keeps the layer's inputs and the output of every op in ``runtime.plan.SELECTIVE_SAVE_OPS``
  (weight matmuls, collectives) and recomputes the rest. So a saved storage is freed unless
  one of those ops produced it or it is a layer input; and an output of those ops that
  autograd does not save (a projection whose consumer saves nothing) is held all the same,
  so it counts against what is freed. The selective fields are therefore "bytes none holds
  minus bytes selective holds", exact for this policy, and negative for a layer selective
  would make bigger. Producers are aten ops, not graph nodes, because one node
  (``torch.matmul``, ``F.linear``) runs several aten ops and only some are kept (linear's
  addmm is; matmul's copies of q and k and its bmm are not).
- Selective FLOPs are the forward FLOPs of every op outside ``SELECTIVE_SAVE_OPS``: what
  backward runs again (for attention: QKᵀ and ·V, or the fused kernel).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Callable, Iterable

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from cost_models.errors import AutoparError
from passes import meta_keys as K
from passes.records import GemmShape, SavedSplit
from passes.shape_memo import ShapeMemo
from runtime.plan import SELECTIVE_SAVE_OPS

aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(torch.__file__)

SDPA_TARGETS = (aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)
DROPOUT_TARGETS = (aten.dropout.default, F.dropout, torch.dropout)
RMS_NORM_TARGETS = (aten.rms_norm.default, F.rms_norm, torch.rms_norm)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                "enable_gqa")


def sdpa_arguments(node: Node) -> dict[str, object]:
    """An F.scaled_dot_product_attention node's arguments by parameter name (the ones
    given; the rest are at their defaults)."""
    return dict(zip(_SDPA_PARAMS, node.args, strict=False)) | dict(node.kwargs)
_SAVED_BY_SELECTIVE = frozenset(SELECTIVE_SAVE_OPS)
_NO_KERNEL_FUNCTIONS = {
    "getitem", "getattr", "sym_size", "sym_numel", "sym_stride", "size", "dim", "alias",
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze",
    "expand", "expand_as", "split", "split_with_sizes", "chunk", "unbind", "slice", "select",
    "as_strided", "flatten", "unflatten", "view_as", "detach", "_assert_tensor_metadata",
    "contiguous", "type_as", "to", "_to_copy", "lift_fresh_copy",
}
# Of these, the ones that produce a view of their input (no bytes moved).
_VIEW_FUNCTIONS = _NO_KERNEL_FUNCTIONS - {"getitem", "getattr", "sym_size", "sym_numel",
                                          "sym_stride", "size", "dim", "_assert_tensor_metadata"}


class PassError(AutoparError):
    """An analysis pass failed on a node; the message names the pass and the node."""


def op_name(node: Node) -> str:
    """Short op name shared by symbolic_trace and export graphs: 'linear', 'view', 'gelu'."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if node.op == "call_module":
        return "module"
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return getattr(target, "__name__", str(target))


def fail(pass_name: str, node: Node, err: BaseException) -> PassError:
    """The error of a pass that failed on ``node``: the module that ran it, the op, the
    source line, and what to do. Passes run every op on meta tensors (shapes, no data)."""
    stack = node.meta.get("nn_module_stack") or {}
    path = node.meta.get(K.MODULE_PATH, str(list(stack.values())[-1][0]) if stack else "")
    where = source_line(node)
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return PassError(
        f"pass {pass_name} failed on node {node.name!r} (op {op_name(node)!r}) in module "
        f"{path or '<root>'!r}" + (f" at {where}" if where else "")
        + f": {type(err).__name__}: {first}\n  autopar runs each op on meta tensors "
        "(shapes and dtypes, no data) to cost it; make that line work without reading "
        "tensor values (no .item(), .tolist(), .numpy()), or report the op if it is a "
        f"PyTorch op that cannot run on the meta device. Node: {node.format_node()}")


def source_line(node: Node) -> str:
    """``file:line `code``` of the user's line that made ``node``: from the stack trace
    export records, else the first line of the running module's forward that names the
    op (symbolic tracing records no stack), else that forward's ``def`` line; '' if none."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)[^\n]*\n\s*([^\n]*)', trace)
    frames = [f for f in frames if not os.path.abspath(f[0]).startswith(_TORCH_DIR)]
    if frames:
        file, line, code = frames[-1]
        return f"{file}:{line} `{code.strip()}`"
    stack = node.meta.get("nn_module_stack") or {}
    cls = list(stack.values())[-1][1] if stack else None
    forward = getattr(cls, "forward", None) if isinstance(cls, type) else None
    try:
        lines, start = inspect.getsourcelines(forward)
        file = inspect.getsourcefile(forward)
    except (OSError, TypeError):
        return ""
    name = op_name(node)
    for offset, text in enumerate(lines):
        if re.search(rf"\b{re.escape(name)}\b", text) and offset:
            return f"{file}:{start + offset} `{text.strip()}`"
    return f"{file}:{start} (forward of {cls.__name__})"


# -- module paths, shapes, op kinds --------------------------------------------------------


def annotate_module_paths(gm: GraphModule) -> None:
    """MODULE_PATH: innermost module of each node's ``nn_module_stack`` ('' = the root)."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = ""
        if stack:
            path = str(list(stack.values())[-1][0])
        # export names a module's second call "name@1"; the module is the same.
        node.meta[K.MODULE_PATH] = path.split("@")[0]


def propagate_shapes(gm: GraphModule, example_inputs: tuple, *, reuse: bool = True
                     ) -> dict[Node, object]:
    """TENSOR on every node; returns the meta value of each node for later passes.

    ``reuse``: a node whose op and input layouts were seen before takes fresh tensors laid
    out as that earlier node's outputs instead of running (``passes.shape_memo``): the
    records are the same, and repeated blocks cost what one block costs."""
    env: dict[Node, object] = {}
    inputs = iter(example_inputs)
    memo = ShapeMemo(gm) if reuse else None
    with torch.no_grad():
        for node in gm.graph.nodes:
            try:
                if node.op == "placeholder":
                    env[node] = next(inputs, node.args[0] if node.args else None)
                elif node.op == "output":
                    continue
                else:
                    args, kwargs = _lookup(node, env)
                    env[node] = _run_or_reuse(gm, node, args, kwargs, memo)
            except Exception as e:
                raise fail("propagate_shapes", node, e) from e
            node.meta[K.TENSOR] = tensor_meta(env[node])
    return env


def _run_or_reuse(gm: GraphModule, node: Node, args: tuple, kwargs: dict,
                  memo: ShapeMemo | None) -> object:
    if memo is None:
        return execute(gm, node, args, kwargs)
    key = memo.key(node, args, kwargs)
    found, out = memo.lookup(key)
    if not found:
        out = execute(gm, node, args, kwargs)
        memo.record(key, args, kwargs, out)
    return out


def tensor_meta(value: object) -> K.TensorMeta:
    leaves = [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
    specs = tuple(
        K.TensorSpec(shape=tuple(t.shape), stride=tuple(t.stride()), dtype=str(t.dtype)[6:],
                     nbytes=t.numel() * t.element_size())
        for t in leaves
    )
    return K.TensorMeta(tensors=specs, is_tensor=isinstance(value, torch.Tensor))


def count_ops(gm: GraphModule) -> None:
    """OP_KIND: whether each node launches a kernel, and whether it is a view."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            node.meta[K.OP_KIND] = K.OpKind(is_kernel=False, is_view=False)
            continue
        name = op_name(node)
        # torch.export's unlifted module checks input shapes in a `_guards_fn` submodule.
        guard = node.op == "call_module" and str(node.target).startswith("_guards")
        node.meta[K.OP_KIND] = K.OpKind(
            is_kernel=name not in _NO_KERNEL_FUNCTIONS and not guard,
            is_view=name in _VIEW_FUNCTIONS,
        )


def mark_needs_grad(gm: GraphModule) -> None:
    """NEEDS_GRAD: whether each node's value depends on a trainable parameter. Inputs do
    not (a model's inputs are data); non-floating and detached values never do."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, str(node.target))
            flag = isinstance(value, torch.Tensor) and value.requires_grad
        elif node.op in ("placeholder", "output") or op_name(node) in ("detach", "detach_"):
            flag = False
        else:
            flag = any(a.meta.get(K.NEEDS_GRAD, False) for a in node.all_input_nodes)
            if node.op == "call_module":
                mod = gm.get_submodule(str(node.target))
                flag = flag or any(p.requires_grad for p in mod.parameters())
        record = node.meta.get(K.TENSOR)
        if record is not None and not any(getattr(torch, t.dtype).is_floating_point
                                          for t in record.tensors):
            flag = False
        node.meta[K.NEEDS_GRAD] = flag


def needs_grad(gm: GraphModule, node: Node) -> bool:
    """NEEDS_GRAD of ``node``, marking the whole graph first if it is not marked yet."""
    if K.NEEDS_GRAD not in node.meta:
        mark_needs_grad(gm)
    return node.meta[K.NEEDS_GRAD]


def count_bytes(gm: GraphModule, nodes: Iterable[Node]) -> None:
    """MEM_BYTES: bytes of tensor inputs + outputs of each kernel (views move nothing)."""
    for node in nodes:
        kind: K.OpKind = node.meta[K.OP_KIND]
        if not kind.is_kernel:
            node.meta[K.MEM_BYTES] = 0
            continue
        written = node.meta[K.TENSOR].nbytes
        inputs = {a for a in node.all_input_nodes}
        weights = [a for a in inputs if a.op == "get_attr"]
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            weights, inputs = list(mod.parameters()) + list(mod.buffers()), inputs
        read = sum(a.meta[K.TENSOR].nbytes for a in inputs - set(weights) if K.TENSOR in a.meta)
        if op_name(node) == "embedding" or isinstance(
            gm.get_submodule(str(node.target)) if node.op == "call_module" else None,
            torch.nn.Embedding,
        ):
            read += written  # an embedding reads the rows it returns, not the table
        else:
            read += sum(_value_bytes(gm, w) for w in weights)
        node.meta[K.MEM_BYTES] = read + written


def _value_bytes(gm: GraphModule, w: object) -> int:
    if isinstance(w, Node):
        w = fetch_attr(gm, str(w.target))
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0


# -- FLOPs and saved-for-backward bytes ----------------------------------------------------


def _flash_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


_FLOP_MAPPING = {aten._scaled_dot_product_flash_attention_for_cpu: _flash_flops}


def count_flops(gm: GraphModule, nodes: list[Node], env: dict[Node, object]) -> None:
    """FLOPS and SELECTIVE_FLOPS: forward FLOPs of each node, and the part of them selective
    recomputation runs again: every op outside ``SELECTIVE_SAVE_OPS`` (FlopCounterMode; see
    the module docstring). GEMMS: the matrix multiplies each node runs, with their sizes."""
    counter = FlopCounterMode(display=False, custom_mapping=_FLOP_MAPPING)
    gemms = _GemmRecorder()
    start = [(0, 0)]

    def before(node: Node) -> None:
        start[0] = (counter.get_total_flops(), _recomputed_flops(counter))
        gemms.seen.clear()

    def after(node: Node, out: object) -> None:
        total, selective = start[0]
        node.meta[K.FLOPS] = float(counter.get_total_flops() - total)
        node.meta[K.SELECTIVE_FLOPS] = float(_recomputed_flops(counter) - selective)
        node.meta[K.GEMMS] = tuple(gemms.seen)

    # gemms is entered last, so it sees each op first and hands it on to the counter.
    with counter, gemms, torch.no_grad():
        run_nodes(gm, nodes, env, "count_flops", before=before, after=after,
                  fused_kernels=True)


def _recomputed_flops(counter: FlopCounterMode) -> int:
    """FLOPs counted so far for ops outside SELECTIVE_SAVE_OPS (counts are keyed by packet)."""
    per_op = counter.get_flop_counts().get("Global", {})
    return sum(n for op, n in per_op.items() if str(op) not in _SAVED_BY_SELECTIVE)


_GEMM_OPS = {aten.mm.default: False, aten.addmm.default: False, aten.bmm.default: True,
             aten.baddbmm.default: True}
"""aten GEMMs -> whether batched. nn.Linear and torch.matmul reach these on inputs of any rank
(leading dims folded into m, or into the batch count); fused attention and convolutions do
not: they stay at the large-GEMM rate."""


class _GemmRecorder(TorchDispatchMode):
    """Records the (m, n, k) of each aten GEMM run under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[GemmShape] = []

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple,
                           args: tuple = (), kwargs: dict | None = None) -> object:
        batched = _GEMM_OPS.get(func)
        if batched is not None:
            # mm(a, b), bmm(a, b); addmm(bias, a, b), baddbmm(bias, a, b).
            a, b = (args[0], args[1]) if func in (aten.mm.default, aten.bmm.default) \
                else (args[1], args[2])
            batch = int(a.shape[0]) if batched else 1
            m, k, n = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
            self.seen.append(GemmShape(module="", flops=2.0 * batch * m * n * k, m=m, n=n,
                                       k=k, batch=batch, batched=batched))
        return func(*args, **(kwargs or {}))


def count_saved_bytes(gm: GraphModule, nodes: list[Node], env: dict[Node, object]) -> None:
    """SAVED: bytes autograd saves for backward per node (parameters/buffers excluded,
    storages deduplicated over ``nodes``, attributed to the first node saving them), split
    by dtype and by what selective recomputation frees (see the module docstring)."""
    excluded = {StorageWeakRef(t.untyped_storage()) for t in _attr_tensors(gm, nodes)}
    # storage -> node that produced it ('' for the layer's inputs); a storage first seen
    # while a node runs (its outputs, or internals such as attention's log-sum-exp) is its.
    owner: dict[StorageWeakRef, str] = {}
    producers = _ProducerMode()
    seen: set[StorageWeakRef] = set()
    current: list[tuple[str, int]] = []
    parts: list[tuple[str, SavedSplit]] = []
    split = _SavedSplit()
    running = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in excluded and ref not in seen:
            seen.add(ref)
            nbytes = t.untyped_storage().nbytes()
            current.append((owner.get(ref, running[0]), nbytes))
            freed = not producers.kept_by_selective(ref)
            split.add(t, nbytes, selective=freed)
            parts.append((owner.get(ref, running[0]), _kind(t, nbytes, freed=freed)))
        return t

    def on_input(node: Node, value: object) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                owner.setdefault(StorageWeakRef(t.untyped_storage()), "")
                producers.add_input(t)

    def before(node: Node) -> None:
        current.clear()
        parts.clear()
        split.reset()
        running[0] = node.name
        producers.start(node.name)

    def after(node: Node, out: object) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                owner.setdefault(StorageWeakRef(t.untyped_storage()), node.name)
        node.meta[K.SAVED] = dataclasses.replace(split.record(current), parts=tuple(parts))

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            producers:
        run_nodes(gm, nodes, env, "count_saved_bytes", before=before, after=after,
                  on_input=on_input, fresh_inputs=True, fused_kernels=True)
    _charge_kept_but_unsaved(nodes, producers, seen | excluded)


def _charge_kept_but_unsaved(nodes: list[Node], producers: _ProducerMode,
                             saved: set[StorageWeakRef]) -> None:
    """Selective recomputation holds every layer input and every output of
    SELECTIVE_SAVE_OPS, saved by autograd or not; the ones autograd does not save cost
    memory only under selective, so they are subtracted from what it frees, at the node
    that made (or first read) them."""
    extra: dict[str, tuple[int, int]] = {}  # node -> (floating, fixed) bytes
    for ref, (name, t) in producers.made.items():
        if ref in saved or not producers.kept_by_selective(ref):
            continue
        nbytes = t.untyped_storage().nbytes()
        floating, fixed = extra.get(name, (0, 0))
        extra[name] = ((floating + nbytes, fixed) if t.is_floating_point()
                       else (floating, fixed + nbytes))
    for node in nodes:
        if node.name in extra:
            floating, fixed = extra[node.name]
            record: K.SavedBytes = node.meta[K.SAVED]
            held = SavedSplit(freed=-floating, freed_fixed=-fixed)
            node.meta[K.SAVED] = dataclasses.replace(
                record, selective_nbytes=record.selective_nbytes - floating,
                selective_fixed_nbytes=record.selective_fixed_nbytes - fixed,
                parts=(*record.parts, (node.name, held)))


def _kind(t: torch.Tensor, nbytes: int, *, freed: bool) -> SavedSplit:
    """One saved storage as a SavedSplit."""
    if t.is_floating_point():
        return SavedSplit(floating=nbytes, freed=nbytes if freed else 0)
    return SavedSplit(fixed=nbytes, freed_fixed=nbytes if freed else 0)


class _ProducerMode(TorchDispatchMode):
    """Names the aten op (overload packet, e.g. 'aten.addmm') that first produced each
    storage ('' for a layer input), and the node running when it appeared.

    Views and in-place ops keep the first producer: what selective recomputation holds is
    decided by the op that created the storage. Outputs are kept alive so a freed
    storage's address is never reused by a later one under the same key.
    """

    def __init__(self) -> None:
        super().__init__()
        self.of: dict[StorageWeakRef, str] = {}
        self.made: dict[StorageWeakRef, tuple[str, torch.Tensor]] = {}
        self.node = ""
        self._inputs: list[torch.Tensor] = []

    def add_input(self, t: torch.Tensor) -> None:
        """A layer input, charged to the node that reads it first: the one started next.
        (Its fresh meta storage was made by a factory op under this mode: not a producer.)"""
        ref = StorageWeakRef(t.untyped_storage())
        self.of[ref] = ""
        self.made.pop(ref, None)
        self._inputs.append(t)

    def start(self, node_name: str) -> None:
        self.node = node_name
        for t in self._inputs:
            self._note(t, "")
        self._inputs.clear()

    def kept_by_selective(self, ref: StorageWeakRef) -> bool:
        """Held by the selective policy: a layer input ('', also the default for a storage
        no op made) or an output of SELECTIVE_SAVE_OPS."""
        op = self.of.get(ref, "")
        return op == "" or op in _SAVED_BY_SELECTIVE

    def _note(self, t: torch.Tensor, op: str) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        self.of.setdefault(ref, op)
        self.made.setdefault(ref, (self.node, t))

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple,
                           args: tuple = (), kwargs: dict | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t, str(func.overloadpacket))
        return out


class _SavedSplit:
    """One node's saved bytes by kind: fixed (non-floating), selective floating/fixed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.fixed = self.selective = self.selective_fixed = 0

    def add(self, t: torch.Tensor, nbytes: int, *, selective: bool) -> None:
        # Floating only: autocast and bf16 training change these dtypes, never bool/int.
        fixed = not t.is_floating_point()
        self.fixed += nbytes if fixed else 0
        if selective:
            if fixed:
                self.selective_fixed += nbytes
            else:
                self.selective += nbytes

    def record(self, saved: list[tuple[str, int]]) -> K.SavedBytes:
        return K.SavedBytes(
            nbytes=sum(b for _, b in saved), producers=tuple(saved),
            fixed_nbytes=self.fixed, selective_nbytes=self.selective,
            selective_fixed_nbytes=self.selective_fixed,
        )


# -- running nodes on meta ------------------------------------------------------------------


def run_nodes(
    gm: GraphModule,
    nodes: list[Node],
    env: dict[Node, object],
    pass_name: str,
    *,
    before: Callable[[Node], None] = lambda n: None,
    after: Callable[[Node, object], None] = lambda n, out: None,
    on_input: Callable[[Node, object], None] = lambda n, value: None,
    fresh_inputs: bool = False,
    fused_kernels: bool = False,
) -> dict[Node, object]:
    """Run ``nodes`` (in graph order) on meta tensors; inputs from outside come from ``env``.

    With ``fresh_inputs``, outside tensors are replaced by new tensors, requiring grad
    where the model's value does (``needs_grad``: not a mask, not a rotary table computed
    under no_grad, whose products would otherwise save their other operand too), so
    autograd sees the nodes as a graph of their own. With
    ``fused_kernels``, attention, dropout and RMSNorm run as the kernels GPUs dispatch to.
    """
    local: dict[Node, object] = {}
    inside = set(nodes)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in local or arg in inside:
                continue
            value = env[arg]
            if arg.op == "get_attr":
                value = fetch_attr(gm, str(arg.target))
            elif fresh_inputs and isinstance(value, torch.Tensor):
                value = _fresh(value, needs_grad(gm, arg))
            on_input(arg, value)
            local[arg] = value
        try:
            args, kwargs = _lookup(node, local)
            before(node)
            out = execute(gm, node, args, kwargs, fused_kernels=fused_kernels)
            after(node, out)
        except PassError:
            raise
        except Exception as e:
            raise fail(pass_name, node, e) from e
        local[node] = out
    return local


def execute(gm: GraphModule, node: Node, args: tuple, kwargs: dict, *,
            fused_kernels: bool = False) -> object:
    if node.op == "get_attr":
        return fetch_attr(gm, str(node.target))
    if node.op == "call_function":
        if fused_kernels and node.target in SDPA_TARGETS:
            kernel = attention_kernel(gm, node)
            node.meta[K.ATTENTION_KERNEL] = kernel
            return _fused_sdpa(node.target, args, kwargs, kernel)
        if fused_kernels and node.target in DROPOUT_TARGETS:
            return _fused_dropout(node.target, args, kwargs)
        if fused_kernels and node.target in RMS_NORM_TARGETS:
            return _fused_rms_norm(node.target, args, kwargs)
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        obj, *rest = args
        return getattr(obj, str(node.target))(*rest, **kwargs)
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if fused_kernels and type(mod) is torch.nn.Dropout and not mod.inplace:
            return _fused_dropout(F.dropout, args, {"p": mod.p, "training": mod.training})
        if fused_kernels and type(mod) is torch.nn.RMSNorm and len(args) == 1 and not kwargs:
            return _fused_rms_norm(F.rms_norm, (args[0], mod.normalized_shape, mod.weight,
                                                mod.eps), {})
        return mod(*args, **kwargs)
    raise AssertionError(f"cannot execute {node.op} node {node.name}")


def fetch_attr(gm: GraphModule, target: str) -> object:
    obj: object = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _lookup(node: Node, env: dict[Node, object]) -> tuple[tuple, dict]:
    args = torch.fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
    return tuple(args), dict(kwargs)


def _fresh(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new meta tensor like ``t``; one that requires grad is not a leaf, since a layer
    may modify its input in place (a ``ReLU(inplace=True)`` layer, ``x += y``), which
    autograd refuses on a leaf that requires grad."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if not (requires_grad and (t.is_floating_point() or t.is_complex())):
        return out
    return out.requires_grad_().clone()


def _attr_tensors(gm: GraphModule, nodes: list[Node]) -> list[torch.Tensor]:
    """Parameters and buffers the nodes read (get_attr inputs and called modules)."""
    out: list[torch.Tensor] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = fetch_attr(gm, str(arg.target))
                if isinstance(value, torch.Tensor):
                    out.append(value)
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            out += list(mod.parameters()) + list(mod.buffers())
    return out


def attention_kernel(gm: GraphModule, node: Node) -> str:
    """The kernel a GPU runs for an attention node in training, which the cost passes run:

    - 'flash': the default; it takes no gradient for ``attn_mask``.
    - 'efficient' (memory-efficient attention): the mask is a learned bias that needs a
      gradient (T5's relative position bias), which only this kernel differentiates; it
      saves the bias for backward as well.
    - 'math' (the unfused composite, which saves the s×s probabilities): grouped-query
      ``enable_gqa`` or arguments the fused kernels do not take.
    """
    bound = sdpa_arguments(node)
    if bound.get("enable_gqa") or set(bound) - set(_SDPA_PARAMS):
        return "math"
    mask = bound.get("attn_mask")
    if isinstance(mask, Node) and needs_grad(gm, mask):
        return "efficient"
    return "flash"


def _fused_sdpa(target: object, args: tuple, kwargs: dict, kernel: str) -> torch.Tensor:
    """Attention as ``kernel`` (see ``attention_kernel``)."""
    if kernel == "math":
        return target(*args, **kwargs)
    bound = dict(zip(_SDPA_PARAMS, args, strict=False)) | kwargs
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    dropout_p, is_causal = bound.get("dropout_p", 0.0), bound.get("is_causal", False)
    if kernel == "efficient":
        # As sdpa hands it over: the bias broadcast to (batch, heads, s_q, s_kv).
        bias = mask.expand(*q.shape[:-1], k.shape[-2])
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=bound.get("scale"))[0]
    if isinstance(mask, torch.Tensor):
        # Needs no gradient in the model, even where a layer's fresh inputs require one.
        mask = mask.detach()
    out, _ = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=mask, scale=bound.get("scale"))
    return out


def _fused_dropout(target: object, args: tuple, kwargs: dict) -> torch.Tensor:
    """Dropout as CUDA runs it: ``aten.native_dropout``, which saves a bool mask (ATen's
    ``dropout`` takes this path when ``is_fused_kernel_acceptable``: CUDA, 0 < p < 1). The
    original op otherwise, including in-place dropout, which CUDA also runs unfused."""
    if target is F.dropout:
        names, defaults = ("input", "p", "training", "inplace"), {"p": 0.5, "training": True}
    else:  # aten.dropout / torch.dropout: (input, p, train)
        names, defaults = ("input", "p", "training"), {}
    bound = defaults | dict(zip(names, args, strict=False)) | kwargs
    bound.setdefault("training", bound.pop("train", None))
    x, p = bound["input"], bound["p"]
    fusable = bound["training"] and not bound.get("inplace") and 0 < p < 1
    if fusable and x.is_floating_point() and x.numel() > 0:
        return aten.native_dropout(x, p, True)[0]
    return target(*args, **kwargs)


def _fused_rms_norm(target: object, args: tuple, kwargs: dict) -> torch.Tensor:
    """RMSNorm as CUDA runs it: ATen's ``rms_norm`` hands it to ``_fused_rms_norm`` unless
    the weight's dtype differs from the input's, or the input is complex or channels-last
    (then the composite, the original op here)."""
    names = ("input", "normalized_shape", "weight", "eps")
    bound = {"weight": None, "eps": None} | dict(zip(names, args, strict=False)) | kwargs
    x, weight = bound["input"], bound["weight"]
    fusable = (x.is_floating_point() and x.numel() > 0
               and (weight is None or weight.dtype == x.dtype)
               and not _channels_last(x))
    if not fusable:
        return target(*args, **kwargs)
    return _FusedRMSNorm.apply(x, weight, list(bound["normalized_shape"]), bound["eps"])


def _channels_last(x: torch.Tensor) -> bool:
    """ATen's ``suggest_memory_format`` is channels-last (2-D or 3-D)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return (x.dim() in formats and not x.is_contiguous()
            and x.is_contiguous(memory_format=formats[x.dim()]))


class _FusedRMSNorm(torch.autograd.Function):
    """``aten._fused_rms_norm`` with CUDA's derivative: it saves the input, the weight and
    the reciprocal RMS per row (ATen's derivatives.yaml). Off CUDA that op runs its
    composite, which saves what the composite does; this saves what CUDA saves."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        out, rstd = aten._fused_rms_norm(x, normalized_shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        return out

    @staticmethod
    def backward(ctx, grad):
        # Off CUDA there is no kernel for its backward: differentiate the composite.
        x, weight, _ = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_()]
            if weight is not None:
                inputs.append(weight.detach().requires_grad_())
            out = F.rms_norm(inputs[0], ctx.normalized_shape, inputs[-1] if weight is not None
                             else None, ctx.eps)
            grads = torch.autograd.grad(out, inputs, grad)
        return grads[0], (grads[1] if weight is not None else None), None, None
