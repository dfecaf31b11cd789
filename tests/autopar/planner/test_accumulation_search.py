"""pp = 1 gradient accumulation: the search tries every accumulation the runtime can run
(any divisor of the per-replica batch), so it is exact against brute force over them.

Powers of two alone missed plans whose per-replica batch has an odd factor: MPT-30b on 8
H100 (fsdp_scaling.csv row 40) runs 63 samples a replica as 21 micro-batches of 3, and
the search, offered only m = 1 there, fell back to context parallelism, 15% slower by its
own model (tests/cost_models/test_fsdp_scaling.py)."""

from __future__ import annotations

import itertools

import pytest
from planner_cases import GiB, graph_of, make_cluster, make_layer

from autopar.planner import search
from autopar.planner.configs import MAX_ACCUMULATION, accumulation_steps, candidate_meshes
from autopar.planner.costs import HOST_MEMORY_BYTES, layer_options
from cost_models.memory import precision
from runtime.plan import Mesh

BF16 = precision("bfloat16")


def blocks(batch: int):
    """Two transformer-sized blocks whose activations dominate a small device."""
    tokens, h = 2048 * batch, 1024
    layers = [make_layer(f"h.{i}", "Block", i, params=12 * h * h, fwd_flops=24 * h * h * tokens,
                         saved_bytes=34 * tokens * h * 4, act_bytes=tokens * h * 4)
              for i in range(2)]
    return graph_of(layers, batch)


def divisors_by_counting(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def brute_force(graph, cluster) -> tuple[float, int]:
    """(best step time, its accumulation) over every mesh, every accumulation dividing the
    per-replica batch (counted here, not taken from the planner) and every option per layer."""
    best = (float("inf"), 0)
    for mesh, reason in candidate_meshes(cluster, graph.batch_size):
        if reason:
            continue
        for m in divisors_by_counting(graph.batch_size // mesh.dp):
            options = [list(layer_options(layer, None, mesh, cluster, BF16, m).values())
                       for layer in graph.layers]
            for combo in itertools.product(*options):
                resident = sum(c.resident_bytes for c in combo)
                need = (1 + cluster.memory_margin_fraction) * (
                    resident + max(c.buffers_bytes for c in combo))
                if (need <= cluster.device.memory_bytes
                        and sum(c.host_bytes for c in combo) <= HOST_MEMORY_BYTES):
                    best = min(best, (sum(c.time_s for c in combo), m))
    return best


@pytest.mark.parametrize("memory_gib", [0.5, 1.0])
def test_search_equals_brute_force_when_only_an_odd_accumulation_fits(memory_gib):
    """Batch 6 on 2 devices: 3 samples a replica at dp = 2. At 1 GiB a whole micro-batch
    of 3 fits only with recomputation and 3 micro-batches of 1 are 10% faster; at 0.5 GiB
    only 3 micro-batches fit. Powers of two offered m = 1 alone there."""
    graph, cluster = blocks(6), make_cluster(per_node=2, memory_bytes=int(memory_gib * GiB))
    expected, m = brute_force(graph, cluster)
    assert m == 3  # the case needs the odd accumulation
    plan = search(graph, cluster, precision_name="bfloat16", pipeline=False).plan
    assert plan.solver.objective_s == pytest.approx(expected, rel=1e-9)
    assert plan.gradient_accumulation == 3


def test_accumulations_are_every_divisor_up_to_the_limit():
    assert accumulation_steps(blocks(63), Mesh(dp=1)) == [1, 3, 7, 9, 21, 63]
    assert accumulation_steps(blocks(96), Mesh(dp=1)) == [
        m for m in divisors_by_counting(96) if m <= MAX_ACCUMULATION]
    assert accumulation_steps(blocks(96), Mesh(dp=2)) == divisors_by_counting(48)
