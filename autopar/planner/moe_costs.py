"""Layers holding mixture-of-experts blocks: their options and costs under expert parallelism.

A layer with MoE blocks (``LayerInfo.moe``, passes/moe.py) is priced in two parts:

- its *dense part* (attention, norms, router, shared experts): the layer as captured less
  what the capture counted inside the experts modules, under the option's strategy on the
  whole mesh, by ``costs.layer_cost`` as any layer;
- its *experts*: every block's E/ep experts on each rank, as a layer of their own made
  from ``cost_models.moe`` (grouped GEMMs at their real shapes, the dispatched rows'
  activations, the memory-bound permutation and activation kernels), under the strategy
  the experts take on the mesh whose data-parallel axis is dp/ep (the ranks left beside
  the ep group hold the same experts and reduce, or FSDP-shard, them among themselves, as
  torchtitan shards experts over ``dp_shard_mod_ep``), plus the all-to-alls: dispatch
  and combine each micro-batch forward and backward, and again when full recomputation
  reruns the forward.

The experts replace, not add to, the captured experts module: the capture ran every expert
on one rank (and counts no FLOPs at all where its GEMMs are grouped_mm calls). Every
option of such a layer, ep = 1 included, is priced this way, so EP and non-EP options
compare on the same footing.

Which options: a degree ep > 1 for every divisor of dp that divides each block's expert
count, with each strategy the runtime combines EP with, in the plans it runs
(``runtime_problem``: today a pure data-parallel mesh, float32, no gradient accumulation,
no offload or recomputation of the layer, runtime/expert_parallel.py). The costs below
price more than that (TP meshes, offload, recomputation), so that an estimate of a plan
the runtime does not run yet can still be made.

Expert strategy: the option's strategy, but the experts are not tensor-parallel (their
3-D weights have no TP style): under ``tp`` they are replicated as under ``replicate``,
under ``tp_zero1``, ``tp_zero2`` and ``tp_fsdp`` sharded as under ``zero1``, ``zero2`` and
``fsdp``; a sharded strategy on an expert mesh of one rank is ``replicate`` (nothing to
shard).

Approximations, stated: the ranks holding one expert shard are ep·cp·tp apart but their
gradient collectives are priced as consecutive ranks (exact inside one node, optimistic
across nodes); the experts' FSDP communication hides behind the experts' own compute, and
the dense part's behind its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from cost_models import moe
from cost_models.comm import Group
from cost_models.hardware import Cluster
from cost_models.memory import Precision
from passes.records import CAPTURE_ACTIVATION_BYTES, GemmShape, LayerInfo, MoEInfo
from runtime.plan import Mesh, option_label, parse_option
from runtime.strategies import STRATEGIES, spec

if TYPE_CHECKING:
    from autopar.planner.costs import LayerCost

EXPERT_STRATEGY = {"replicate": "replicate", "zero1": "zero1", "zero2": "zero2",
                   "fsdp": "fsdp", "fsdp_modules": "fsdp", "tp": "replicate",
                   "tp_zero1": "zero1", "tp_zero2": "zero2", "tp_fsdp": "fsdp", "hsdp": "hsdp"}
"""The strategy a MoE layer's experts take under the layer's strategy (module docstring)."""
EP_STRATEGIES = tuple(s for s in STRATEGIES if spec(s).expert_parallel
                      and not spec(s).tensor_parallel)
"""Strategies offered with an expert-parallel degree above 1: those whose spec combines
with it (runtime.strategies); tensor-parallel ones need a tp axis, which the runtime_problem
below rules out."""

LOAD_IMBALANCE = moe.DEFAULT_LOAD_IMBALANCE
"""The busiest rank's routed rows over the mean, assumed by the planner."""

PERMUTE_ELEMENTS_PER_ROW = 6
"""Memory-bound traffic per routed row, in units of H elements: gathering the rows into
expert order and scattering them back (read and write each: 4H), and scaling the experts'
outputs by the routing weights (read H, write H: 2H)."""

COST_TERMS_NOT_SUMMED = ("microbatches", "expert_parallel", "output_bytes")
"""LayerCost's numeric fields that are not a sum of the two parts: the output is the
dense part's (the experts' rows return into it)."""

AllToAllFn = Callable[[LayerInfo, int, Mesh, Cluster, Precision, int], tuple[float, float]]
"""``all_to_all_s``'s signature (imbalance aside): ``Estimators.expert_all_to_all``."""

CostFn = Callable[..., "LayerCost"]
"""``costs.layer_cost``: (layer, option, mesh, cluster, prec, microbatches, *,
hsdp_shard_size) -> LayerCost."""


# -- which degrees ----------------------------------------------------------------------------

def ep_degrees(layer: LayerInfo, mesh: Mesh) -> tuple[int, ...]:
    """Expert-parallel degrees above 1 the layer can take: divisors of mesh.dp that divide
    every block's expert count."""
    if not layer.moe:
        return ()
    experts = math.gcd(*(b.shape.num_experts for b in layer.moe))
    return tuple(d for d in range(2, mesh.dp + 1) if mesh.dp % d == 0 and experts % d == 0)


def ep_problem(layer: LayerInfo, mesh: Mesh, *, precision: str = "float32",
               microbatches: int = 1) -> str | None:
    """Why the layer cannot take expert parallelism on this mesh, or None when it can."""
    if not layer.moe:
        return "no mixture-of-experts block in this layer"
    if mesh.dp == 1:
        return "mesh.dp is 1: no data-parallel ranks to split the experts over"
    if not ep_degrees(layer, mesh):
        counts = ", ".join(str(b.shape.num_experts) for b in layer.moe)
        return (f"no divisor of mesh.dp={mesh.dp} above 1 divides the experts' count "
                f"({counts})")
    return runtime_problem(mesh, precision=precision, microbatches=microbatches)


def runtime_problem(mesh: Mesh, *, precision: str = "float32", microbatches: int = 1,
                    strategy: str = "replicate", recompute: str = "none",
                    offload: bool = False) -> str | None:
    """What of this combination the expert-parallel runtime does not run yet
    (runtime/expert_parallel.py refuses it in ``runtime.validate``), or None. The search
    offers only what the runtime runs."""
    if (mesh.pp, mesh.cp, mesh.tp) != (1, 1, 1):
        return (f"the runtime runs expert parallelism on a data-parallel mesh only, and "
                f"this one is {mesh.describe()}")
    if precision != "float32":
        return f"the runtime runs expert parallelism in float32 only, not {precision}"
    if microbatches > 1:
        return "the runtime runs expert parallelism without gradient accumulation only"
    if strategy not in EP_STRATEGIES:
        return (f"the runtime combines expert parallelism with {', '.join(EP_STRATEGIES)} "
                f"only, not {strategy}")
    if offload or recompute != "none":
        return "the runtime runs expert parallelism without offload or recomputation only"
    return None


def with_expert_parallel(layer: LayerInfo, mesh: Mesh, labels: tuple[str, ...], *,
                         microbatches: int = 1) -> tuple[str, ...]:
    """``labels`` and, for a MoE layer, each label the runtime can run with expert
    parallelism (``runtime_problem``) at every degree the layer can take."""
    out = list(labels)
    for ep in ep_degrees(layer, mesh):
        for label in labels:
            choice = parse_option(label)
            if runtime_problem(mesh, microbatches=microbatches, strategy=choice["strategy"],
                               recompute=choice["recompute"], offload=choice["offload"]):
                continue
            out.append(option_label(**{**choice, "expert_parallel": ep}))
    return tuple(out)


def runnable(labels: tuple[str, ...], precision: str) -> tuple[str, ...]:
    """``labels`` less the expert-parallel ones where the runtime cannot run them in
    ``precision`` (``runtime_problem``)."""
    if runtime_problem(Mesh(), precision=precision) is None:
        return labels
    return tuple(o for o in labels if parse_option(o)["expert_parallel"] == 1)


# -- the two parts ----------------------------------------------------------------------------

def dense_part(layer: LayerInfo) -> LayerInfo:
    """The layer less what the capture counted inside its experts modules."""
    blocks = layer.moe
    per_param = layer.param_bytes / layer.param_count if layer.param_count else 4.0
    bwd_ratio = layer.bwd_flops / layer.fwd_flops if layer.fwd_flops else 2.0
    experts = tuple(b.experts for b in blocks)

    def less(name: str, of_block: Callable[[MoEInfo], float] | None = None):
        total = sum((of_block or (lambda b: getattr(b, name)))(b) for b in blocks)
        value = getattr(layer, name) - total
        return max(type(value)(0), value)

    return replace(
        layer, moe=(), module_units=(),  # its units are not apart from the experts'
        param_count=less("param_count"),
        param_bytes=max(0, layer.param_bytes - round(sum(b.param_count for b in blocks)
                                                     * per_param)),
        param_tensors=less("param_tensors"),
        fwd_flops=less("fwd_flops"),
        bwd_flops=max(0.0, layer.bwd_flops - bwd_ratio * sum(b.fwd_flops for b in blocks)),
        selective_fwd_flops=less("selective_fwd_flops"),
        saved_bytes=less("saved_bytes"), saved_fixed_bytes=less("saved_fixed_bytes"),
        saved_low=None,  # the blocks' 16-bit bytes are not apart: scale the rest
        selective_saved_bytes=layer.selective_saved_bytes
        - sum(b.selective_saved_bytes for b in blocks),
        selective_fixed_bytes=less("selective_fixed_bytes"),
        mem_bytes=less("mem_bytes"), memory_bound_bytes=less("memory_bound_bytes"),
        num_ops=less("num_ops"),
        gemms=tuple(g for g in layer.gemms
                    if not any(g.module == e or g.module.startswith(e + ".") for e in experts)),
    )


def expert_layer(layer: LayerInfo, ep: int, mesh: Mesh, microbatches: int,
                 imbalance: float = LOAD_IMBALANCE) -> LayerInfo:
    """The rank's experts of every block as one layer, in the units ``layer_cost`` reads on
    the expert mesh (dp/ep): quantities of one micro-batch on one rank times the batch
    shards it divides by there, (dp/ep)·cp·m."""
    shards = (mesh.replicas // ep) * microbatches
    scale = float(shards * CAPTURE_ACTIVATION_BYTES)  # bytes at the capture's dtype
    flops = saved = traffic = alone = 0.0
    gemms: list[GemmShape] = []
    params = tensors = ops = 0
    for b in layer.moe:
        shape, tokens = b.shape, b.tokens / (mesh.replicas * microbatches)
        rows = moe.routed_rows(tokens, shape, ep, imbalance)
        local = moe.local_experts(shape, ep)
        for m, n, k in moe.expert_gemms(tokens, shape, ep, imbalance):
            gemms.append(GemmShape(module=_join(layer.name, b.experts),
                                   flops=local * 2.0 * m * n * k * shards, m=m * shards,
                                   n=n, k=k))
            traffic += local * (m * k + k * n + m * n) * scale
        flops += moe.expert_fwd_flops(tokens, shape, ep, imbalance) * shards
        saved += moe.dispatched_activation_bytes(tokens, shape, ep, CAPTURE_ACTIVATION_BYTES,
                                                 imbalance) * shards
        alone += rows * _memory_bound_elements(shape) * scale
        params += moe.expert_params(shape, ep)
        tensors += 2
        ops += 2 + (2 if shape.gated else 1) + 3  # GEMMs, activation, permutes and scale
    return LayerInfo(
        name=layer.name, layer_class=f"{layer.layer_class}/experts", index=layer.index,
        param_count=params, param_bytes=params * CAPTURE_ACTIVATION_BYTES,
        param_tensors=tensors, fwd_flops=flops, bwd_flops=moe.BWD_PER_FWD_GEMM * flops,
        saved_bytes=round(saved), output_bytes=0, mem_bytes=round(traffic + alone),
        memory_bound_bytes=round(alone), num_ops=ops, gemms=tuple(gemms))


def _memory_bound_elements(shape: moe.ExpertShape) -> int:
    """Elements the memory-bound kernels move per routed row: the activation (gated:
    act(gate) reads and writes I, the product reads 2I and writes I; plain: 2I) and the
    permutations and weighting (PERMUTE_ELEMENTS_PER_ROW · H)."""
    i = shape.intermediate_size
    return (5 * i if shape.gated else 2 * i) + PERMUTE_ELEMENTS_PER_ROW * shape.hidden_size


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if name else prefix


def all_to_all_s(layer: LayerInfo, ep: int, mesh: Mesh, cluster: Cluster, prec: Precision,
                 microbatches: int, imbalance: float = LOAD_IMBALANCE) -> tuple[float, float]:
    """(one dispatch or combine of every block, with its skew; the largest send and receive
    buffers) per micro-batch. The ep group: ep consecutive data-parallel ranks, cp·tp
    apart in the mesh (pp, dp, cp, tp)."""
    if ep == 1:
        return 0.0, 0.0
    group = Group(ep, mesh.cp * mesh.tp)
    total = buffer = 0.0
    for b in layer.moe:
        tokens = b.tokens / (mesh.replicas * microbatches)
        nbytes = moe.dispatch_bytes(tokens, b.shape, ep, prec.activation_bytes, imbalance)
        total += moe.all_to_all_step_s(tokens, b.shape, ep, group, cluster,
                                       prec.activation_bytes, imbalance)
        total += cluster.device.skew_s(nbytes)  # each blocks the experts after it
        buffer = max(buffer, moe.all_to_all_buffer_bytes(tokens, b.shape, ep,
                                                         prec.activation_bytes, imbalance))
    return total, buffer


# -- the option's cost ------------------------------------------------------------------------

def expert_option(strategy: str, recompute: str, offload: bool, expert_mesh: Mesh) -> str:
    """The experts' option under the layer's (module docstring)."""
    mapped = EXPERT_STRATEGY[strategy]
    if mapped != "replicate" and expert_mesh.replicas * expert_mesh.tp == 1:
        mapped = "replicate"
    return option_label(mapped, recompute, offload and spec(mapped).offloadable, False)


def moe_layer_cost(layer: LayerInfo, option: str, mesh: Mesh, cluster: Cluster,
                   prec: Precision, microbatches: int, *, hsdp_shard_size: int | None,
                   layer_cost: CostFn, all_to_all: AllToAllFn | None = None,
                   imbalance: float = LOAD_IMBALANCE) -> LayerCost:
    """The cost of a MoE layer under ``option`` (its ``ep<n>`` part included), its parts
    priced by ``layer_cost`` and its all-to-alls by ``all_to_all`` (``all_to_all_s`` at
    ``imbalance`` unless given: ``Estimators.expert_all_to_all``)."""
    choice = parse_option(option)
    ep = choice.pop("expert_parallel")
    if ep > 1 and (ep not in ep_degrees(layer, mesh) or choice["strategy"] not in EP_STRATEGIES):
        why = ep_problem(layer, mesh) or (
            f"ep{ep} needs a divisor of mesh.dp={mesh.dp} that divides the experts' count, "
            f"and one of the strategies {', '.join(EP_STRATEGIES)}")
        raise ValueError(f"layer {layer.name!r}: option {option!r} is not available: {why}")
    m = microbatches
    dense = layer_cost(dense_part(layer), option_label(**choice), mesh, cluster, prec, m,
                       hsdp_shard_size=hsdp_shard_size)
    expert_mesh = replace(mesh, dp=mesh.dp // ep)
    experts = layer_cost(
        expert_layer(layer, ep, mesh, m, imbalance),
        expert_option(choice["strategy"], choice["recompute"], choice["offload"], expert_mesh),
        expert_mesh, cluster, prec, m, hsdp_shard_size=hsdp_shard_size)
    if ep == 1:  # every expert on the rank: no tokens travel
        a2a, buffer = 0.0, 0.0
    elif all_to_all is None:
        a2a, buffer = all_to_all_s(layer, ep, mesh, cluster, prec, m, imbalance)
    else:
        a2a, buffer = all_to_all(layer, ep, mesh, cluster, prec, m)
    fwd_a2a = 2 * a2a  # dispatch and combine
    bwd_a2a = 2 * a2a + (2 * a2a if choice["recompute"] == "full" else 0.0)
    total = _sum(dense, experts)
    total["fwd_s"] += fwd_a2a
    total["bwd_s"] += bwd_a2a
    total["comm_s"] += m * (fwd_a2a + bwd_a2a)
    total["buffers_bytes"] += buffer
    return replace(dense, **total, option=option, expert_parallel=ep)


def _sum(dense: LayerCost, experts: LayerCost) -> dict[str, float]:
    """Every time and memory term of the two parts added (COST_TERMS_NOT_SUMMED aside)."""
    out = {}
    for f in fields(dense):
        value = getattr(dense, f.name)
        if f.name in COST_TERMS_NOT_SUMMED or isinstance(value, bool) or \
                not isinstance(value, (int, float)):
            continue
        out[f.name] = value + getattr(experts, f.name)
    return out
