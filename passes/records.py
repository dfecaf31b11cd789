"""Typed records the passes produce and the planner consumes.

All sizes are for the batch the model was captured with (the global batch); the planner
divides batch-proportional quantities by the data-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.moe import ExpertShape
from runtime.tied import Tie

CAPTURE_ACTIVATION_BYTES = 4
"""Capture runs in float32: recorded floating activation sizes are scaled by a plan's
activation bytes / this."""


@dataclass(frozen=True)
class SavedSplit:
    """Saved-for-backward bytes by kind, at the captured batch and dtypes (fp32 capture)."""

    floating: int = 0
    """Floating bytes: they scale with the activation dtype of the plan."""
    fixed: int = 0
    """Non-floating bytes (dropout masks, indices): they do not."""
    freed: int = 0
    """Floating bytes selective recomputation frees (negative: bytes it holds that nothing
    else would, a matmul output autograd does not save)."""
    freed_fixed: int = 0
    """Non-floating bytes selective recomputation frees."""

    def __add__(self, other: SavedSplit) -> SavedSplit:
        return SavedSplit(self.floating + other.floating, self.fixed + other.fixed,
                          self.freed + other.freed, self.freed_fixed + other.freed_fixed)

    def __sub__(self, other: SavedSplit) -> SavedSplit:
        return SavedSplit(self.floating - other.floating, self.fixed - other.fixed,
                          self.freed - other.freed, self.freed_fixed - other.freed_fixed)

    def at_dtype(self, scale: float) -> SavedSplit:
        """Floating bytes times ``scale`` (another activation dtype); masks unchanged."""
        return SavedSplit(self.floating * scale, self.fixed, self.freed * scale,
                          self.freed_fixed)


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective a strategy issues per step, at the captured (global) batch."""

    kind: str
    """'all_reduce' | 'all_gather' | 'reduce_scatter'."""
    nbytes: int
    """Size of the full (unsharded) tensor, in bytes, at the captured batch."""
    phase: str
    """'fwd' or 'bwd'."""


@dataclass(frozen=True, kw_only=True)
class GemmShape:
    """One matrix multiply a layer's forward runs (aten mm/addmm, or bmm/baddbmm for
    ``batched``): ``batch`` products of an (m×k) by a (k×n) matrix, at the captured batch.

    For a Linear, m is the token dimension (every leading dim of its input folded), so it
    splits with the batch, n its out features and k its in features. For a batched product
    (a hand-written attention's QKᵀ and ·V) the batch count is samples × heads: it splits
    with the batch and with tensor-parallel heads, and m, n, k do not.
    """

    module: str
    """Path of the module that ran it, relative to the layer ('' for the layer itself)."""
    flops: float
    """2·batch·m·n·k (what FlopCounterMode counts for it)."""
    m: int
    n: int
    k: int
    batch: int = 1
    batched: bool = False


@dataclass(frozen=True, kw_only=True)
class TPOption:
    """How a layer can be split Megatron-style over a tensor-parallel group."""

    styles: dict[str, str]
    """Submodule path relative to the layer ('' for the layer itself) -> runtime.plan.TP_STYLES."""
    divisors: tuple[int, ...]
    """The TP degree must divide each of these (attention heads, hidden features, vocabulary)."""
    sharded_param_bytes: int
    """Parameter bytes split across the group (the rest stay replicated)."""
    sharded_fwd_flops: float
    """Forward FLOPs that divide by the degree (matmuls and attention of sharded heads)."""
    sharded_saved_bytes: int
    """Saved-for-backward activation bytes that divide by the degree."""
    collectives: tuple[Collective, ...]
    """Collectives over the TP group per step (Megatron f/g operators, gathers)."""
    sharded_saved: SavedSplit | None = None
    """``sharded_saved_bytes`` by kind (None: all floating, none freed by selective)."""
    sharded_memory_bound_bytes: int = 0
    """Part of the layer's ``memory_bound_bytes`` moved by ops on TP-sharded tensors (an
    activation between a colwise and a rowwise Linear): it divides by the degree."""
    sp_saved_bytes: int = 0
    """With sequence parallelism: further saved bytes (norms, dropout, residual ops outside
    the TP-sharded set) that divide by the degree. 0 when SP is not possible."""
    sp_saved: SavedSplit | None = None
    """``sp_saved_bytes`` by kind (None: all floating, none freed by selective)."""
    sp_collectives: tuple[Collective, ...] | None = None
    """With sequence parallelism: the collectives replacing ``collectives`` (reduce-scatter
    and all-gather along the sequence). None when the layer cannot be sequence-parallel."""
    sp_styles: dict[str, str] | None = None
    """With sequence parallelism: the ``tp_styles`` a plan gives the layer when it sets
    ``sequence_parallel`` (``styles`` plus 'sequence_parallel' for the norm/element-wise
    submodules run on sequence shards). None exactly when ``sp_collectives`` is None."""
    sp_seq_len: int | None = None
    """With sequence parallelism: the length of the sequence the layer splits (dim 1 of its
    residual stream at the captured batch; an encoder's and a decoder's may differ), which
    the TP degree must divide."""


@dataclass(frozen=True, kw_only=True)
class MoEInfo:
    """A mixture-of-experts block inside a layer (passes/moe.py), with what the capture
    counted for its experts module: the planner replaces those numbers by the experts'
    own costs under each expert-parallel degree (autopar/planner/moe_costs.py)."""

    block: str
    """The block's path relative to the layer ('' when the layer is the block)."""
    experts: str
    """The experts module's path relative to the layer."""
    shape: ExpertShape
    tokens: int
    """Tokens through the block at the captured batch (the router's rows)."""
    param_count: int
    """Parameters of the experts module (every expert)."""
    param_tensors: int
    fwd_flops: float = 0.0
    """Forward FLOPs the capture counted inside the experts module (0 where its GEMMs run
    as an op the FLOP counter does not know, such as grouped_mm)."""
    selective_fwd_flops: float = 0.0
    saved_bytes: int = 0
    saved_fixed_bytes: int = 0
    selective_saved_bytes: int = 0
    selective_fixed_bytes: int = 0
    mem_bytes: int = 0
    memory_bound_bytes: int = 0
    num_ops: int = 0


@dataclass(frozen=True, kw_only=True)
class LayerInfo:
    """One layer: a module of the user's model, with the costs of its ops."""

    name: str
    """Fully-qualified module name (``''`` never; root-level ops attach to a neighbour)."""
    layer_class: str
    """Identical layers (same code, parameter shapes, op sequence) share this key."""
    index: int
    """Position in execution order."""
    param_count: int
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    saved_bytes: int
    """Activation bytes autograd saves for backward (parameters excluded)."""
    output_bytes: int
    """Bytes of the layer's output activation."""
    mem_bytes: int
    """Bytes read and written by the forward ops (for the memory-bound roofline term)."""
    num_ops: int
    """Forward kernels (for the per-kernel launch floor)."""
    memory_bound_bytes: int = 0
    """Part of mem_bytes moved by kernels that do no FLOPs (norms, activations, dropout,
    residual adds): they run at memory bandwidth between the matmuls, never hidden under
    them, so the roofline adds their time instead of taking a max over the layer."""
    saved_fixed_bytes: int = 0
    """Part of saved_bytes held in non-floating dtypes (dropout masks, indices): it does not
    scale with the compute precision."""
    selective_saved_bytes: int = 0
    """Floating bytes selective recomputation frees: it keeps the layer's inputs and the
    outputs of runtime.plan.SELECTIVE_SAVE_OPS (weight matmuls, TP collectives) and
    recomputes the rest. Negative when it would hold more than no recomputation."""
    selective_fixed_bytes: int = 0
    """Non-floating bytes selective recomputation frees (dropout masks)."""
    saved_low: SavedSplit | None = None
    """What the layer saves at 16 bits, in that run's bytes (passes/low_precision.py): 2 a
    floating element, 4 where the model casts up to float32 (RMSNorm's ``.float()``, a
    float32 softmax), which scaling the float32 capture's ``saved`` misses. None where the
    graph casts nothing up (scaling is exact) or the 16-bit capture failed."""
    selective_fwd_flops: float = 0.0
    """Forward FLOPs of the ops outside SELECTIVE_SAVE_OPS: what selective recomputation
    runs again (the attention products; norms and element-wise ops count no FLOPs)."""
    input_bytes: int = 0
    """Bytes of the layer's floating inputs: what full recomputation keeps (its checkpoint)."""
    inplace_input_bytes: int = 0
    """Bytes of the floating inputs the layer's forward modifies in place (a
    ``ReLU(inplace=True)`` layer): recomputing it keeps a copy of them to rerun from, which
    no other layer shares, and copies them twice (runtime/recompute.py)."""
    attention_kv_bytes: int = 0
    """Bytes of the keys and values the layer's F.scaled_dot_product_attention reads: what
    context parallelism's ring passes between ranks (passes/context_parallel.py)."""
    attention_fwd_flops: float = 0.0
    """Forward FLOPs of that attention (what a ring step's transfer overlaps with)."""
    gemms: tuple[GemmShape, ...] = ()
    """The forward's matrix multiplies, in execution order: their sizes set their
    efficiency (cost_models.compute.gemm_efficiency). Part of fwd_flops; the rest (fused
    attention, convolutions) is priced at the large-GEMM rate."""
    tp: TPOption | None = None
    """How this layer can be tensor-parallel, or None if no safe split is known."""
    param_tensors: int = 0
    """Parameter tensors the layer owns: the optimizer launches kernels per tensor
    (cost_models.optimizer)."""
    module_units: tuple[int, ...] = ()
    """Parameter counts of the submodules ``fsdp_modules`` shards as FSDP2 units of their
    own (``runtime.data_parallel.module_units``: those owning a weight matrix); the
    layer's other parameters (norms) are one more unit."""
    batch_norm_channels: tuple[int, ...] = ()
    """Channels of each BatchNorm module in the layer that normalises with batch statistics
    (training mode): the runtime all-reduces their statistics over the data-parallel
    replicas every forward and backward (runtime/batch_norm.py), and they forbid
    micro-batching (gradient accumulation, pipelines), which would change the statistics."""
    reuses_weights: bool = False
    """The layer uses one of its parameters twice (a module run at several depths, as
    ALBERT's layer): torch's split backward cannot defer its weight gradients, so a
    stage holding it runs them in its backward (runtime/pipeline.py) and the planner
    prices them there (planner/costs.py)."""
    loss_bytes: int = 0
    """Float32 bytes of the model's output this layer produces (the logits), at the
    captured batch; 0 on every other layer. The runtime computes the user's loss on the
    output in float32 (runtime/precision.py casts it up at the root), so cross-entropy
    keeps one float32 copy of it from forward to backward and two more in its backward
    (planner/costs.py charges them). Not part of ``layer_class``: the output layer gets a
    class of its own (passes/layer_graph.py)."""
    moe: tuple[MoEInfo, ...] = ()
    """The mixture-of-experts blocks inside this layer (passes/moe.py): the layer can take
    an expert-parallel degree (``runtime.plan.LayerPlan.expert_parallel``)."""
    output_last_dims: tuple[int, ...] = ()
    """The last dim of each floating tensor the layer hands to later layers: what a
    pipeline send scattered over tp splits (``runtime.pipeline_sends``), so the planner
    scatters only where every one divides by tp."""

    @property
    def saved(self) -> SavedSplit:
        """``saved_bytes`` by kind."""
        return SavedSplit(self.saved_bytes - self.saved_fixed_bytes, self.saved_fixed_bytes,
                          self.selective_saved_bytes, self.selective_fixed_bytes)


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """The model as the planner sees it: layers in execution order."""

    layers: tuple[LayerInfo, ...]
    batch_size: int
    """Global batch the costs were captured at."""
    seq_len: int | None = None
    param_dtype: str = "float32"
    model_name: str = ""
    context_parallel_problem: str | None = "the graph was not analysed for context parallelism"
    """Why the model cannot run context-parallel, or None when it can
    (passes/context_parallel.py)."""
    uncuttable: frozenset[int] = frozenset()
    """Layer indices no pipeline stage may start at: a cut there would send a value other
    than a floating-point tensor between stages (an int64 position tensor made before
    the first layer, a Python number), which the runtime refuses (passes/split_stages.py),
    or would put a layer run between two calls of one module on another stage than it."""
    boundary_bytes: tuple[int, ...] = ()
    """Per layer, the bytes of the floating tensors crossing a cut after it, at the
    global batch (as ``output_bytes``): its output, and what an earlier layer or input
    hands to a later layer (T5's encoder output, a padding mask), constants excepted
    (each stage recomputes them; ``passes.layer_graph.boundary_bytes``). Empty for a graph
    made by hand: each layer's ``output_bytes`` stands for its cut."""
    ties: tuple[Tie, ...] = ()
    """Layers sharing parameters (tied weights; passes/group_layers.py ``find_ties``): each
    tie's layers must take one strategy (the runtime shards them as one FSDP2 unit). The
    shared parameter's bytes are in one layer's ``param_bytes``, its owner's; '' among a
    tie's modules stands for the root."""
    read_by_others: frozenset[str] = frozenset()
    """Parameters an op reads in a layer that does not hold them (an op of the root's own
    forward counts in the layer that ran before it), by the name the capture reads them
    under. A tie's '' whose parameters none reads is a name only (T5's and BART's
    ``shared`` embedding, run as the encoder's and the decoder's ``embed_tokens``)."""
    returns_loss: bool = False
    """The model returns a loss it computes itself (Hugging Face's ``labels=``): a pipeline
    cannot run it, since its last stage computes the loss from its output with a loss_fn."""
    exported_stages: bool = False
    """Pipeline stages of this model are cut from a ``torch.export`` capture (symbolic
    tracing cannot capture it, it takes keyword inputs, or a tie crosses stages;
    passes/split_stages.py), and such stages take no tensor parallelism."""
    extra: dict[str, object] = field(default_factory=dict)

    def tie_of(self, name: str) -> Tie | None:
        """The tie layer ``name`` is part of, if any."""
        return next((t for t in self.ties if name in t.modules), None)

    @property
    def classes(self) -> dict[str, list[LayerInfo]]:
        out: dict[str, list[LayerInfo]] = {}
        for layer in self.layers:
            out.setdefault(layer.layer_class, []).append(layer)
        return out

    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)
