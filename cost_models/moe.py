"""Mixture-of-experts blocks under expert parallelism: pure estimators, seconds or bytes.

A block (``ExpertShape``) routes each of its T tokens to ``top_k`` of its E experts; an
expert is an MLP of hidden size H and intermediate size I, gated (SwiGLU: one fused
gate_up projection H -> 2I, then down I -> H, as Mixtral and DeepSeek) or not (H -> I -> H).
Expert parallelism of degree ep splits the experts over ep data-parallel ranks (E/ep each;
Lepikhin et al., "GShard", 2020; torchtitan's ``ExpertParallel``): each rank sends every
routed copy of its tokens to the rank holding that expert (dispatch) and gets the expert's
output back (combine), both all-to-alls, and the backward runs both again on the gradients.

Token counts are per rank and micro-batch. A rank with T tokens routes R = T·top_k rows;
over ep ranks every rank receives, on average, R rows for its E/ep experts (R·ep/E rows
per expert). Routing is never perfectly even and the busiest rank sets the time of the
all-to-all and of the expert GEMMs (every rank waits for it at the combine): its rows are
R·imbalance. ``DEFAULT_LOAD_IMBALANCE`` is the planner's assumption when nothing better is
known; with ep = 1 one rank holds every expert and the imbalance does not matter (the
rows add up to R whatever the routing).

Volumes: dispatch sends R·H elements per rank, of which (ep-1)/ep leave it
(``cost_models.comm.all_to_all_s`` prices that on the link classes the group crosses);
combine returns as many. Forward: dispatch + combine; backward: the combine's gradient
goes out as a dispatch and the dispatch's gradient comes back as a combine: 4 all-to-alls
of R·H elements per block per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.comm import Group, all_to_all_s
from cost_models.compute import roofline_s
from cost_models.hardware import Cluster, Device

DEFAULT_LOAD_IMBALANCE = 1.0
"""Rows on the busiest rank over the mean, under expert parallelism. 1.0: balanced. Models
trained with an auxiliary load-balancing loss route close to evenly over ranks that hold
several experts each (Fedus, Zoph & Shazeer, "Switch Transformers", JMLR 2022, section 2.2,
train with capacity factors 1.0-1.25 and drop under 1% of tokens; Jiang et al., "Mixtral of
Experts", 2024, section 5, find no expert specialising by domain), and a randomly
initialised router routes near uniformly. Pass a measured figure (the busiest rank's rows
over the mean, from routing statistics) where routing is known to be skewed; a capacity
factor c with token dropping caps it at c."""

ALL_TO_ALLS_PER_STEP = 4
"""All-to-alls per block and micro-batch: dispatch and combine, forward and backward."""

BWD_PER_FWD_GEMM = 2
"""A GEMM's backward is two GEMMs of its size: the input gradient and the weight gradient."""


@dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """The experts of one MoE block, as its detector reads them."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    gated: bool = True
    """SwiGLU-style: the first projection makes a gate and an up half (H -> 2I)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ExpertShape.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"ExpertShape.top_k={self.top_k} exceeds num_experts="
                             f"{self.num_experts}: a token cannot go to more experts than exist")

    @property
    def up_width(self) -> int:
        """Output width of the first projection: 2I gated, I otherwise."""
        return (2 if self.gated else 1) * self.intermediate_size

    @property
    def params_per_expert(self) -> int:
        """H·up_width + I·H weights (experts carry no biases in Mixtral or DeepSeek)."""
        return self.hidden_size * self.up_width + self.intermediate_size * self.hidden_size


def check_degree(shape: ExpertShape, ep: int) -> None:
    if ep < 1 or shape.num_experts % ep:
        raise ValueError(f"expert-parallel degree {ep} must be a positive divisor of "
                         f"num_experts={shape.num_experts}")


# -- routing ----------------------------------------------------------------------------------

def routed_rows(tokens: float, shape: ExpertShape, ep: int,
                imbalance: float = DEFAULT_LOAD_IMBALANCE) -> float:
    """Rows the busiest rank's experts process: T·top_k, times the imbalance when ep > 1."""
    check_degree(shape, ep)
    if imbalance < 1:
        raise ValueError(f"load imbalance is the busiest rank's rows over the mean, >= 1; "
                         f"got {imbalance}")
    return tokens * shape.top_k * (imbalance if ep > 1 else 1.0)


def rows_per_expert(tokens: float, shape: ExpertShape, ep: int,
                    imbalance: float = DEFAULT_LOAD_IMBALANCE) -> float:
    """The m dimension of each local expert's GEMMs: the busiest rank's rows over its E/ep
    experts."""
    return routed_rows(tokens, shape, ep, imbalance) / local_experts(shape, ep)


def local_experts(shape: ExpertShape, ep: int) -> int:
    check_degree(shape, ep)
    return shape.num_experts // ep


# -- communication ----------------------------------------------------------------------------

def dispatch_bytes(tokens: float, shape: ExpertShape, ep: int, dtype_bytes: int,
                   imbalance: float = DEFAULT_LOAD_IMBALANCE) -> float:
    """One all-to-all's input on the busiest rank: its routed rows × H × dtype bytes."""
    return routed_rows(tokens, shape, ep, imbalance) * shape.hidden_size * dtype_bytes


def all_to_all_step_s(tokens: float, shape: ExpertShape, ep: int, group: Group,
                      cluster: Cluster, dtype_bytes: int,
                      imbalance: float = DEFAULT_LOAD_IMBALANCE) -> float:
    """One dispatch or combine of one block and micro-batch over the ep group (ranks
    ``group.stride`` apart): α-β on the link classes the group crosses. A rank keeps 1/ep of
    its rows, sends (ep-1)/ep of them; 0 at ep = 1."""
    if group.size != ep:
        raise ValueError(f"the all-to-all group has {group.size} ranks, ep is {ep}")
    if ep == 1:
        return 0.0
    return all_to_all_s(dispatch_bytes(tokens, shape, ep, dtype_bytes, imbalance), group,
                        cluster)


# -- compute ----------------------------------------------------------------------------------

def expert_gemms(tokens: float, shape: ExpertShape, ep: int,
                 imbalance: float = DEFAULT_LOAD_IMBALANCE) -> tuple[tuple[float, int, int], ...]:
    """(m, n, k) of one local expert's forward GEMMs: gate_up (m×H)·(H×up_width), then
    down (m×I)·(I×H), m the rows per expert. Each runs E/ep times on the rank."""
    m = rows_per_expert(tokens, shape, ep, imbalance)
    h, i = shape.hidden_size, shape.intermediate_size
    return ((m, shape.up_width, h), (m, h, i))


def expert_fwd_flops(tokens: float, shape: ExpertShape, ep: int,
                     imbalance: float = DEFAULT_LOAD_IMBALANCE) -> float:
    """Forward FLOPs of the rank's experts: 2·m·n·k per GEMM, E/ep experts."""
    gemms = expert_gemms(tokens, shape, ep, imbalance)
    return local_experts(shape, ep) * sum(2.0 * m * n * k for m, n, k in gemms)


def expert_gemms_s(tokens: float, shape: ExpertShape, ep: int, device: Device, dtype: str,
                   dtype_bytes: int, imbalance: float = DEFAULT_LOAD_IMBALANCE
                   ) -> tuple[float, float]:
    """(forward, backward) seconds of the rank's expert GEMMs. Each projection runs as one
    grouped GEMM over the E/ep local experts (``torch._grouped_mm``, as Hugging Face's
    default experts implementation and torchtitan run them): E/ep GEMMs of one shape, each
    at that shape's efficiency (``cost_models.compute.roofline_s`` with its smallest
    dimension), in one kernel. Backward is twice the forward (``BWD_PER_FWD_GEMM``)."""
    if tokens <= 0:
        return 0.0, 0.0
    n_local = local_experts(shape, ep)
    fwd = sum(roofline_s(n_local * 2.0 * m * n * k, n_local * (m * k + k * n + m * n) * dtype_bytes,
                         1, device, dtype, gemm_min_dim=min(m, n, k))
              for m, n, k in expert_gemms(tokens, shape, ep, imbalance))
    return fwd, BWD_PER_FWD_GEMM * fwd


# -- memory -----------------------------------------------------------------------------------

def expert_params(shape: ExpertShape, ep: int = 1) -> int:
    """Expert weights one rank holds before any further sharding: E/ep experts."""
    return local_experts(shape, ep) * shape.params_per_expert


def expert_shard_params(shape: ExpertShape, ep: int, shards: int) -> float:
    """Expert weights per rank when the E/ep experts are also sharded (FSDP / ZeRO) over
    ``shards`` ranks: the data-parallel ranks left beside the ep group (dp / ep of them,
    times tp where the layer's sharding spans tp), as torchtitan shards experts over
    ``dp_shard_mod_ep``."""
    if shards < 1:
        raise ValueError(f"shards must be a positive integer, got {shards}")
    return expert_params(shape, ep) / shards


def saved_elements_per_row(shape: ExpertShape) -> int:
    """Elements an expert keeps for backward per routed row: its input (H, for the
    gate_up weight gradient), the gate_up output (up_width, for the activation's backward),
    the activation's output (I) and, gated, the product fed to down (I, down's weight
    gradient; ungated the activation output is that input), and the down output (H, for
    the routing weight's gradient)."""
    i = shape.intermediate_size
    return shape.hidden_size + shape.up_width + i + (i if shape.gated else 0) + shape.hidden_size


def dispatched_activation_bytes(tokens: float, shape: ExpertShape, ep: int, dtype_bytes: int,
                                imbalance: float = DEFAULT_LOAD_IMBALANCE) -> float:
    """Activations the busiest rank's experts keep for backward, one micro-batch."""
    return (routed_rows(tokens, shape, ep, imbalance) * saved_elements_per_row(shape)
            * dtype_bytes)


def all_to_all_buffer_bytes(tokens: float, shape: ExpertShape, ep: int, dtype_bytes: int,
                            imbalance: float = DEFAULT_LOAD_IMBALANCE) -> float:
    """Transient send and receive buffers of one all-to-all (0 at ep = 1: no all-to-all)."""
    if ep == 1:
        return 0.0
    return 2 * dispatch_bytes(tokens, shape, ep, dtype_bytes, imbalance)
