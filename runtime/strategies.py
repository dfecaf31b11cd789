"""What each per-layer parallel strategy means: one spec per strategy, in one place.

A layer's ``LayerPlan.strategy`` names one of the specs below. Everything autopar knows
about a strategy is a field of its spec, and every consumer reads the spec:

- the runtime (``runtime.data_parallel``): which sub-mesh FSDP2 or DDP runs the layer on,
  whether gathered parameters are freed after forward, which gradient syncs wait for the
  last micro-batch;
- the cost model (``autopar.planner.costs``, ``engine_costs``): which ranks shard the
  states, which collectives run per micro-batch and which once per step;
- the planner's option list and ``autopar explain``: when a strategy is available, and
  the sentence saying why not;
- reports and exports: the ZeRO stage, the shard degree, what torchtitan calls it.

Data-parallel group: the ranks holding the same (TP shard of a) parameter. A layer that
is not tensor-parallel computes redundantly inside its tp group (every tp rank sees the
same micro-batch), so its group is every rank of its stage, dp × cp × tp; a TP layer's
group is its dp × cp replicas (``Mesh.replicas``). Gradients are averaged over the group.

ZeRO's vocabulary: stage 1 shards optimizer states over the group, stage 2 gradients
too, stage 3 parameters too (Rajbhandari et al., 2020). ``gather`` and ``reduce`` say when
the engine communicates, which is what the cost model and the micro-batch syncs need.

ZeRO-3 comes at two granularities (``units``): ``fsdp`` shards the layer as one FSDP2 unit,
gathered whole (torchtitan's per-block FSDP); ``fsdp_modules`` makes each submodule owning
a weight matrix a unit of its own and the layer one more for the rest (norms), so a rank
holds one module's gathered parameters at a time rather than the layer's, as DeepSpeed's
ZeRO-3 gathers parameter by parameter. The price is more, smaller collectives.

A tensor-parallel layer takes the same stages over its dp × cp group: ``tp`` (0),
``tp_zero1``, ``tp_zero2``, ``tp_fsdp`` (3). FSDP2 shards the local shards of TP's DTensor
parameters over dp (torchtitan's 2-D pattern). ``tp_zero1`` is Megatron-LM's distributed
optimizer (``--use-distributed-optimizer``): the same collectives of the same bytes, a
reduce-scatter of the accumulated gradients at the last micro-batch and an all-gather of
the updated parameters. Megatron-LM all-gathers right after its optimizer step (overlapped
with the next forward under ``--overlap-param-gather``); FSDP2 keeps the updated shard and
all-gathers it in the next step's first forward, so between steps a rank holds P/N of the
parameters where Megatron-LM holds P.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Gather = Literal["never", "per_step", "per_use"]
Units = Literal["layer", "modules"]
Reduce = Literal["per_step", "per_microbatch"]
Availability = Literal["always", "shards", "hybrid", "tp", "tp_shards"]


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """One per-layer strategy: its whole meaning."""

    name: str
    summary: str
    """One sentence: what the strategy does (plan docs, reports)."""
    tensor_parallel: bool = False
    """Splits the layer over the mesh's tp axis with ``LayerPlan.tp_styles`` (Megatron
    column / row splits); its data-parallel group is then dp × cp, not the whole stage."""
    zero_stage: int = 0
    """States sharded over the shard group: 0 none, 1 optimizer states, 2 and gradients,
    3 and parameters (between uses)."""
    hybrid: bool = False
    """Shards inside runs of ``Plan.hsdp_shard_size`` consecutive ranks (a node) and
    replicates across them (HSDP); otherwise the shard group is the whole data-parallel
    group."""
    gather: Gather = "never"
    """When sharded parameters are all-gathered: ``never`` (they are not sharded),
    ``per_step`` (once, kept through every micro-batch: ZeRO-1/2 under FSDP2, no reshard
    after forward), ``per_use`` (before each forward and each backward, freed after:
    ZeRO-3)."""
    reduce: Reduce = "per_step"
    """When gradients are reduced: ``per_step`` (accumulated over the micro-batches, reduced
    after the last) or ``per_microbatch`` (reduce-scattered after every backward and
    accumulated sharded)."""
    offloadable: bool = False
    """May keep parameters, gradients and the optimizer step in host memory
    (``LayerPlan.offload``; FSDP2's CPUOffloadPolicy needs the parameters sharded)."""
    ddp: bool = False
    """A float32 plan of only such layers at pp = 1 runs on DDP itself rather than FSDP2
    (``runtime.data_parallel.uses_ddp``)."""
    available: Availability = "always"
    """Which mesh the strategy needs (``unavailable`` says it in words)."""
    torchtitan: str = "replicate"
    """torchtitan's closest data-parallel style: ``replicate`` (DDP) or ``shard`` (FSDP)."""
    expert_parallel: bool = True
    """The experts of the layer's mixture-of-experts blocks may be split over ep of its
    data-parallel ranks (``LayerPlan.expert_parallel``, runtime/expert_parallel.py)."""
    units: Units = "layer"
    """The FSDP2 units the layer is sharded as: ``layer``, one; ``modules``, one per
    submodule owning a weight matrix (``runtime.data_parallel.module_units``) and the layer's
    own for the rest."""

    @property
    def sharded(self) -> bool:
        """Anything is sharded over the data-parallel ranks."""
        return self.zero_stage > 0

    @property
    def all_reduces(self) -> bool:
        """Gradients are all-reduced (replicated layers; HSDP's across shard groups), which
        the engine overlaps with the step's last backward."""
        return not self.sharded or self.hybrid

    def group_ranks(self, replicas: int, tp: int) -> int:
        """Ranks of the data-parallel group: dp × cp (``replicas``) for a TP layer, every
        rank of the stage otherwise."""
        return replicas if self.tensor_parallel else replicas * tp

    def shard_ranks(self, replicas: int, tp: int, hsdp_shard_size: int | None) -> int:
        """Ranks one state is sharded over (1: not sharded)."""
        if not self.sharded:
            return 1
        if self.hybrid:
            if not hsdp_shard_size:
                raise ValueError(f"strategy {self.name!r} needs hsdp_shard_size")
            return hsdp_shard_size
        return self.group_ranks(replicas, tp)

    def unavailable(self, *, replicas: int, tp: int, microbatches: int = 1,
                    hsdp_shard_size: int | None = None, tp_split: bool = True,
                    tie: str | None = None, module_units: int | None = 0) -> str | None:
        """Why a layer cannot take this strategy on this mesh, or None when it can.

        ``tp_split``: an exact tensor-parallel split of the layer is known whose sizes tp
        divides; ``tie``: the tied weights the layer shares (tied layers take one
        data-parallel strategy together), None when it has none; ``module_units``: the
        layer's submodules owning a weight matrix (``LayerInfo.module_units``), None for a
        mixture-of-experts layer."""
        world = replicas * tp
        if self.units == "modules" and tie:
            return (f"tied weights: {tie}; tied layers are one FSDP2 unit together, not "
                    "split into their modules")
        if self.units == "modules" and module_units is None:
            return ("a mixture-of-experts layer: its experts are priced and split apart "
                    "(expert parallelism), as one FSDP2 unit with the layer")
        if self.units == "modules" and module_units < 2:
            return ("fewer than two submodules of the layer own a weight matrix: one FSDP2 "
                    "unit per module would gather no less than the layer's one")
        if self.tensor_parallel and tie:
            return (f"tied weights: {tie}; tensor parallelism would split the parameter in "
                    "one module and untie it from the other, so tied layers take one "
                    "data-parallel strategy together")
        if self.tensor_parallel and tp == 1:
            return "the mesh has tp = 1"
        if self.available in ("shards", "tp_shards") and self.group_ranks(replicas, tp) == 1:
            return "the mesh has one data-parallel rank (nothing to shard over)"
        if self.available == "hybrid" and not (
                hsdp_shard_size and 1 < hsdp_shard_size < world and world % hsdp_shard_size == 0):
            return "a stage's ranks fit in one node (hybrid sharding needs several)"
        if self.tensor_parallel and not tp_split:
            return (f"no exact tensor-parallel split of this layer is known whose sizes tp = "
                    f"{tp} divides")
        if self.zero_stage == 1 and microbatches == 1:
            return ("one micro-batch per step: ZeRO-1 is then the same program as ZeRO-2 "
                    "(gradients are reduce-scattered as soon as the backward ends)")
        return None


STRATEGY_SPECS: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec(
        name="replicate", ddp=True,
        summary="parameters replicated; gradients all-reduced (DDP semantics, ZeRO-0)"),
    StrategySpec(
        name="zero1", zero_stage=1, gather="per_step", reduce="per_step", available="shards",
        torchtitan="shard",
        summary="optimizer states sharded; parameters gathered once per step and gradients "
                "accumulated unsharded across micro-batches, reduce-scattered once per step "
                "(ZeRO-1)"),
    StrategySpec(
        name="zero2", zero_stage=2, gather="per_step", reduce="per_microbatch",
        available="shards", torchtitan="shard",
        summary="optimizer states and gradients sharded; parameters gathered once per step "
                "and kept through every micro-batch; gradients reduce-scattered after each "
                "micro-batch (ZeRO-2)"),
    StrategySpec(
        name="fsdp", zero_stage=3, gather="per_use", reduce="per_microbatch",
        offloadable=True, torchtitan="shard",
        summary="parameters, gradients and optimizer states sharded, parameters gathered "
                "before each use (ZeRO-3 / FSDP2)"),
    StrategySpec(
        name="fsdp_modules", zero_stage=3, gather="per_use", reduce="per_microbatch",
        offloadable=True, torchtitan="shard", expert_parallel=False, units="modules",
        summary="fsdp with one FSDP2 unit per submodule owning a weight matrix and one for the "
                "rest of the layer: a module's parameters gathered at a time, not the "
                "layer's, in more and smaller collectives (DeepSpeed ZeRO-3's granularity)"),
    StrategySpec(
        name="hsdp", zero_stage=3, hybrid=True, gather="per_use", reduce="per_microbatch",
        available="hybrid", torchtitan="shard", expert_parallel=False,
        summary="fsdp inside groups of Plan.hsdp_shard_size consecutive ranks (a node), "
                "replicated across the groups (hybrid sharding)"),
    StrategySpec(
        name="tp", tensor_parallel=True, available="tp",
        summary="Megatron tensor parallelism over the tp axis using tp_styles; gradients "
                "all-reduced over dp"),
    StrategySpec(
        name="tp_zero1", tensor_parallel=True, zero_stage=1, gather="per_step",
        reduce="per_step", available="tp_shards", torchtitan="shard",
        summary="tensor parallel over tp, optimizer states sharded over dp: gradients "
                "accumulated unsharded across micro-batches and reduce-scattered once per "
                "step, the updated shards all-gathered at the next step's first forward "
                "(Megatron-LM's distributed optimizer)"),
    StrategySpec(
        name="tp_zero2", tensor_parallel=True, zero_stage=2, gather="per_step",
        reduce="per_microbatch", available="tp_shards", torchtitan="shard",
        summary="tensor parallel over tp, optimizer states and gradients sharded over dp: "
                "gradients reduce-scattered after each micro-batch, parameters gathered once "
                "per step and kept through every micro-batch"),
    StrategySpec(
        name="tp_fsdp", tensor_parallel=True, zero_stage=3, gather="per_use",
        reduce="per_microbatch", offloadable=True, available="tp_shards", torchtitan="shard",
        summary="tensor parallel over tp and FSDP-sharded over dp"),
)}
"""Every strategy, in the order the planner offers them and assigns them within a class."""

STRATEGIES = tuple(STRATEGY_SPECS)


def spec(name: str) -> StrategySpec:
    """The spec of a strategy named in a plan (KeyError for an unknown name: plans are
    validated against STRATEGIES when read)."""
    return STRATEGY_SPECS[name]
