"""The configurations the planner considers: a mesh and how a step runs on it.

pp = 1: every mesh dp × cp × tp with tp inside a node, dp dividing the global batch and cp
a power of two whose 2·cp chunks divide the sequence (models that can run
context-parallel only), each with a gradient accumulation m, any divisor of the
per-replica batch up to MAX_ACCUMULATION. pp > 1: every (tp, pp, dp), micro-batch count,
schedule with its virtual stages, and the strategy of tied layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.planner.costs import hsdp_shard_size
from autopar.planner.ties import tie_strategies
from cost_models.hardware import Cluster
from cost_models.schedule import SCHEDULES
from passes.records import LayerGraph
from runtime.plan import Mesh, schedule_microbatch_problem

MAX_MICROBATCHES_PER_STAGE = 8
"""m is searched among divisors of the per-replica batch in [pp, 8·pp]: beyond 8·pp the
bubble is under (p-1)/(9p-1) < 11% and smaller micro-batches only lose GEMM efficiency."""
MAX_ACCUMULATION = 64
"""Largest gradient accumulation searched for pp = 1 meshes."""



@dataclass(frozen=True, kw_only=True)
class Config:
    """One candidate: a mesh and how a step runs on it."""

    mesh: Mesh
    schedule: str | None = None
    """The pipeline schedule (cost_models.schedule.SCHEDULES); None at pp = 1."""
    virtual_stages: int = 1
    microbatches: int = 1
    """Micro-batches per step: the pipeline's, or gradient accumulation at pp = 1."""
    tie_strategy: str = ""
    """Pipelines: the data-parallel strategy every tied layer takes ('' for a model
    without ties, and at pp = 1, where tied layers are joined into one option)."""

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * self.virtual_stages


def candidate_meshes(cluster: Cluster, global_batch: int, *, seq_len: int | None = None,
                     context_parallel: bool = False) -> list[tuple[Mesh, str]]:
    """Every (dp, cp, tp) mesh of the cluster, with a reason when it cannot be used;
    cp > 1 only when ``context_parallel`` and the sequence splits into 2·cp chunks."""
    world = cluster.world_size
    out = []
    for tp in divisors(math.gcd(cluster.devices_per_node, world)):  # tp inside a node
        for cp in context_degrees(world // tp, seq_len if context_parallel else None):
            mesh = Mesh(dp=world // (tp * cp), cp=cp, tp=tp)
            reason = ""
            if global_batch % mesh.dp:
                reason = f"global batch {global_batch} is not divisible by dp={mesh.dp}"
            out.append((mesh, reason))
    return out



def context_degrees(ranks: int, seq_len: int | None) -> list[int]:
    """cp = 1, and the powers of two dividing ``ranks`` whose 2·cp chunks divide seq_len."""
    if seq_len is None:
        return [1]
    return [cp for cp in (2**i for i in range(ranks.bit_length()))
            if cp == 1 or (ranks % cp == 0 and seq_len % (2 * cp) == 0)]



def accumulation_steps(graph: LayerGraph, mesh: Mesh) -> list[int]:
    """Gradient accumulation candidates, in increasing order: every divisor of the
    per-replica batch up to MAX_ACCUMULATION (the runtime splits a replica's batch into any
    number of equal micro-batches; powers of two alone miss e.g. 21 of 63, where only a
    micro-batch of 3 fits); none for models whose BatchNorm uses batch statistics (a
    micro-batch's would differ)."""
    if batch_norm_layers(graph):
        return [1]
    local = graph.batch_size // mesh.dp
    return [m for m in divisors(local) if m <= MAX_ACCUMULATION]



def batch_norm_layers(graph: LayerGraph) -> list[str]:
    """Layers with BatchNorm in training mode (``LayerInfo.batch_norm_channels``)."""
    return [layer.name for layer in graph.layers if layer.batch_norm_channels]



def pipeline_configs(graph: LayerGraph, cluster: Cluster) -> list[Config]:
    """Every configuration to try (for a model with tied layers, one per strategy the tie
    can take); none when ``pipeline_problem`` says why."""
    world, batch = cluster.world_size, graph.batch_size
    layers = len(graph.layers) - len(graph.uncuttable)  # where a stage may start
    if pipeline_problem(graph) is not None:
        return []
    out = []
    # Stages cut from an exported graph run no tensor parallelism (passes/split_export.py).
    tps = [1] if graph.exported_stages else divisors(math.gcd(cluster.devices_per_node, world))
    for tp in tps:
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if pp < 2 or pp > layers or batch % dp:
                continue
            per_replica = batch // dp
            ms = [d for d in divisors(per_replica) if pp <= d <= MAX_MICROBATCHES_PER_STAGE * pp]
            for m in ms or [per_replica]:
                for schedule, v in searched_schedules(pp, layers):
                    if v > 1 and m % pp:
                        continue  # interleaving advances micro-batches in groups of pp
                    if schedule_microbatch_problem(schedule, pp, m):
                        continue  # torch's schedule would refuse it
                    mesh = Mesh(pp=pp, dp=dp, tp=tp)
                    ties = tie_strategies(graph, mesh, m, hsdp_shard_size(cluster, pp)) \
                        if graph.ties else ("",)
                    out += [Config(mesh=mesh, schedule=schedule, virtual_stages=v,
                                           microbatches=m, tie_strategy=t) for t in ties]
    return out


def searched_schedules(pp: int, layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages per rank) the planner tries on pp ranks: the schedule
    table's ``searched``, or every v from 2 while each virtual stage keeps a layer."""
    return [(name, v) for name, spec in SCHEDULES.items()
            for v in (spec.searched or range(2, layers // pp + 1)) if pp * v <= layers]


def pipeline_problem(graph: LayerGraph) -> str | None:
    """Why the planner offers no pipeline for this model, or None.

    A model that computes its own loss: a pipeline's loss is its last stage's loss_fn. A
    layer tied to a parameter the root's own forward reads: the root is on no stage of the
    plan, so no stage can be said to hold that copy. A root that only names the parameter
    (T5's and BART's ``shared`` embedding, run as ``embed_tokens``) holds no copy."""
    if graph.returns_loss:
        return ("the model computes its own loss (labels=), and a pipeline computes the loss "
                "on its last stage from the stage's output: plan with inputs without labels "
                "and train with a loss_fn")
    for tie in graph.ties:
        if tie.registered_at:
            return (f"{tie.describe()}: a pipeline places a module by its name; register it "
                    "once and call it again where it is reused (as ALBERT does), or give "
                    "each place its own module")
        if "" in tie.modules and graph.read_by_others & set(tie.params):
            return (f"tied weights ({tie.describe()}): the model's own forward reads the "
                    "shared parameter outside every planned module, and a pipeline places "
                    "planned modules only; read it inside a module (as an nn.Embedding or "
                    "nn.Linear holding it)")
    return None


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, from its prime factorisation (sympy's:
    trial division, then Pollard's rho), so a cluster of 10^9 nodes takes milliseconds
    where counting to n took hours."""
    from sympy import divisors as sympy_divisors  # loaded with torch.fx; lazy otherwise

    if n < 1:
        raise ValueError(f"divisors of {n}: a positive integer is needed")
    return [int(d) for d in sympy_divisors(n)]


