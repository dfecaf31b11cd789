"""The cost of a tensor-parallel layer under the distributed optimizer (``tp_zero1``) and
``tp_zero2``: which states divide by dp, which collectives replace plain tp's all-reduce,
what of them overlaps (only where the runtime overlaps them), and when the planner offers
them. A gpt-small block on one DGX A100 node, dp 4 × tp 2, bfloat16."""

from __future__ import annotations

from dataclasses import replace

import pytest
from export_cases import SEQ, gpt_small

from autopar.planner.costs import allowed_options, layer_cost
from autopar.planner.estimators import CostContext, dp_comm_s
from cost_models.comm import Group, all_gather_s, all_reduce_s, reduce_scatter_s
from cost_models.hardware import Cluster
from cost_models.memory import precision
from runtime.plan import Mesh
from runtime.strategies import spec

MESH = Mesh(dp=4, tp=2)
PREC = precision("bfloat16")
M = 4  # micro-batches per step


@pytest.fixture(scope="module")
def block():
    return next(x for x in gpt_small().layers if x.name == "h.0")


@pytest.fixture(scope="module")
def cluster():
    return Cluster.preset("dgx-a100-80g", nodes=1)


def tp_params(layer) -> float:
    """Parameters on one tp rank: the TP-split ones divided by tp, the rest whole."""
    split = layer.tp.sharded_param_bytes / layer.param_bytes
    return layer.param_count * (1 - split + split / MESH.tp)


def test_optimizer_states_divide_by_dp_and_gradients_accumulate_unsharded(block, cluster):
    n = tp_params(block)
    tp = layer_cost(block, "tp", MESH, cluster, PREC, M)
    zero1 = layer_cost(block, "tp_zero1", MESH, cluster, PREC, M)
    zero2 = layer_cost(block, "tp_zero2", MESH, cluster, PREC, M)
    # Adam in mixed precision: fp32 master weight and two moments, 12 bytes a parameter.
    assert tp.optimizer_bytes == pytest.approx(12 * n)
    assert zero1.optimizer_bytes == zero2.optimizer_bytes == pytest.approx(12 * n / MESH.dp)
    # tp holds the reduced fp32 gradient; tp_zero1 accumulates the bf16 one unsharded over
    # the micro-batches; tp_zero2 holds its fp32 dp shard.
    assert tp.grads_bytes == pytest.approx(4 * n)
    assert zero1.grads_bytes == pytest.approx(2 * n)
    assert zero2.grads_bytes == pytest.approx(4 * n / MESH.dp)
    # bf16 parameters gathered through the step beside FSDP2's dp shard of them
    assert zero1.params_bytes == zero2.params_bytes == pytest.approx(2 * n * (1 + 1 / MESH.dp))


def test_a_reduce_scatter_and_an_all_gather_over_dp_replace_the_all_reduce(block, cluster):
    """Each over the layer's dp replicas (ranks tp apart), with the device's skew at each
    (the ranks wait for each other between two layers' compute)."""
    n, group = tp_params(block), Group(MESH.dp, MESH.tp)

    def comm(strategy: str, mesh: Mesh):
        ctx = CostContext(mesh=mesh, cluster=cluster, prec=PREC, microbatches=M,
                          strategy=spec(strategy))
        return dp_comm_s(ctx, n, spec(strategy).shard_ranks(mesh.replicas, mesh.tp, None))

    skew = cluster.device.skew_s
    gather = all_gather_s(2 * n, group, cluster) + skew(2 * n)
    scatter = reduce_scatter_s(2 * n, group, cluster) + skew(2 * n)
    zero1 = comm("tp_zero1", MESH)
    assert (zero1.gather_per_step, zero1.reduce_per_step) == pytest.approx((gather, scatter))
    assert zero1.per_step == pytest.approx(gather + scatter)
    assert (zero1.gather_per_micro, zero1.reduce_per_micro) == (0.0, 0.0)
    zero2 = comm("tp_zero2", MESH)
    assert (zero2.gather_per_step, zero2.reduce_per_micro) == pytest.approx((gather, scatter))
    assert comm("tp", MESH).per_step == pytest.approx(all_reduce_s(2 * n, group, cluster))
    # In a pipeline both reduce once after the last micro-batch: one program.
    piped = [comm(s, replace(MESH, pp=2)) for s in ("tp_zero1", "tp_zero2")]
    assert piped[0] == piped[1] and piped[0].reduce_per_micro == 0.0


def test_the_step_collectives_hide_only_where_the_runtime_overlaps_them(block, cluster):
    """At pp = 1 FSDP2 gathers in the step's first forward and reduce-scatters in the last
    backward, so part hides; with the 'fsdp' pattern exposed, or under pipelining (the
    schedule reduces after its last micro-batch), nothing does."""
    overlapped = layer_cost(block, "tp_zero1", MESH, cluster, PREC, M)
    exposed_cluster = replace(cluster, overlap=replace(cluster.overlap, exposed=("fsdp",)))
    exposed = layer_cost(block, "tp_zero1", MESH, exposed_cluster, PREC, M)
    assert overlapped.hidden_comm_s > 0 and exposed.hidden_comm_s == 0
    assert exposed.comm_s - overlapped.comm_s == pytest.approx(overlapped.hidden_comm_s)
    assert overlapped.hidden_comm_s < overlapped.step_s
    piped = layer_cost(block, "tp_zero1", replace(MESH, pp=2), cluster, PREC, M)
    assert piped.hidden_comm_s == 0


def test_offered_on_a_tp_mesh_with_dp_ranks_and_micro_batches(block):
    def strategies(mesh: Mesh, m: int) -> set[str]:
        return {o.split("+")[0] for o in allowed_options(block, mesh, seq_len=SEQ,
                                                         microbatches=m)}

    assert {"tp_zero1", "tp_zero2"} <= strategies(MESH, M)
    assert "tp_zero1" not in strategies(MESH, 1)  # ZeRO-2's program then
    assert not {"tp_zero1", "tp_zero2"} & strategies(Mesh(dp=1, tp=8), M)  # nothing to shard
    assert not {"tp_zero1", "tp_zero2"} & strategies(Mesh(dp=8), M)  # no tp axis
