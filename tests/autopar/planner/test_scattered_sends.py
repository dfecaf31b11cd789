"""Scattered pipeline sends in the cost model and the planner (``PipelineSpec.scatter_sends``;
runtime/pipeline_sends.py runs them).

A scattered send of S bytes is S/tp over the pipeline link plus an all-gather of S over the
tp group (cost_models.comm.scattered_p2p_s); the planner scatters where that is faster and
every floating tensor that can cross a cut splits by tp, and prices a given plan as it says.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from autopar.planner.engine import Engine, _Prepared
from autopar.planner.published import MegatronRow, megatron_cluster, megatron_graph, megatron_plan
from cost_models.comm import p2p_s, scattered_p2p_s
from cost_models.hardware import Cluster
from cost_models.memory import precision
from runtime.plan import Plan

FP16 = precision("float16")


def test_scattered_send_is_a_tp_th_over_the_network_plus_an_nvlink_all_gather():
    """dgx-a100-80g: network 25 GB/s, 10 µs; NVLink 300 GB/s, 5 µs; NCCL launch 8.4 µs.
    8 MB over tp = 8: 1 MB / 25 GB/s + 10 µs = 50 µs on the network, and the ring
    all-gather 7/8 · 8 MB / 300 GB/s + 7 · 5 µs + 8.4 µs = 66.73 µs; whole, 330 µs."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    nbytes = 8e6
    assert scattered_p2p_s(nbytes, cluster.inter_node, 8, cluster) == pytest.approx(
        50e-6 + 7 / 8 * nbytes / 300e9 + 35e-6 + 8.4e-6, rel=1e-12)
    assert p2p_s(nbytes, cluster.inter_node) == pytest.approx(330e-6, rel=1e-12)
    # Inside a node the pipeline link is NVLink too: scattering only adds the all-gather.
    assert scattered_p2p_s(nbytes, cluster.intra_node, 8, cluster) > p2p_s(
        nbytes, cluster.intra_node)


# Megatron-LM's GPT at a small shape: 8 blocks, tp = 8 inside a node, pp = 2 across two.
ROW = MegatronRow(params_b=1.0, heads=16, hidden=1024, layers=8, tp=8, pp=2, gpus=16,
                  global_batch=16, tflops_per_gpu=0.0, microbatch=1, interleave=1)


@functools.cache
def _graph():
    return megatron_graph(ROW)


def _plan(scatter: bool) -> Plan:
    plan = megatron_plan(_graph(), ROW)
    return dataclasses.replace(
        plan, pipeline=dataclasses.replace(plan.pipeline, scatter_sends=scatter))


def _engine(graph=None) -> Engine:
    return Engine(graph or _graph(), megatron_cluster(ROW), FP16)


def test_the_published_plan_scatters_like_megatron():
    assert megatron_plan(_graph(), ROW).pipeline.scatter_sends
    one_stage = dataclasses.replace(ROW, pp=1, gpus=8)
    assert megatron_plan(_graph(), one_stage).pipeline is None


def test_a_given_plan_is_priced_as_it_says():
    """The hidden states of one micro-batch (1 × 2048 × 1024 fp16 = 4 MiB) cross the
    network: scattered, 0.5 MiB crosses it, each way, on every micro-batch."""
    engine = _engine()
    on, off = engine.evaluate(_plan(True)), engine.evaluate(_plan(False))
    assert on.scatter_sends and not off.scatter_sends
    whole = p2p_s(2 * 2048 * 1024, megatron_cluster(ROW).inter_node)
    scattered = scattered_p2p_s(2 * 2048 * 1024, megatron_cluster(ROW).inter_node, 8,
                                megatron_cluster(ROW))
    assert scattered < whole / 2  # 87 µs against 178 µs
    # Megatron's sends block (its profile exposes 'pp'): each of the m = 16 forward and
    # backward transfers of the boundary waits, so the step saves at least one of each.
    assert off.step_time_s - on.step_time_s >= 2 * (whole - scattered)


def _choose(engine: Engine, plan: Plan):
    """What the search does with a configuration: the planner picks the sends."""
    outcome = engine.evaluate(plan)
    prepared = _Prepared(config=outcome.config, stage_of_layer=outcome.stage_of_layer,
                         costs=outcome.costs, lower_bound_s=outcome.lower_bound_s)
    return engine.finish(prepared)


def test_the_planner_scatters_across_nodes_and_writes_it_in_the_plan():
    engine = _engine()
    chosen = _choose(engine, _plan(False))
    assert chosen.scatter_sends
    assert chosen.step_time_s == pytest.approx(engine.evaluate(_plan(True)).step_time_s)


def test_the_planner_sends_whole_when_a_last_dim_does_not_split():
    """A layer before the last stage hands on a tensor whose last dim (12) tp = 8 does not
    divide: the runtime could not slice it, so the planner does not scatter."""
    graph = _graph()
    layers = list(graph.layers)
    layers[1] = dataclasses.replace(layers[1], output_last_dims=(1024, 12))
    engine = _engine(dataclasses.replace(graph, layers=tuple(layers)))
    assert not _choose(engine, _plan(False)).scatter_sends


def test_capture_records_the_last_dims_layers_hand_on():
    graph = _graph()
    blocks = [la for la in graph.layers if la.name.startswith("h.")]
    assert blocks and all(la.output_last_dims == (1024,) for la in blocks)


def test_the_report_says_sends_are_scattered_and_what_it_saves():
    assert ("sends    scattered over tp=8: each tp rank sends 1/8 of a boundary activation"
            in _plan(True).report())
    assert "7/8 of the pipeline link's bytes saved" in _plan(True).report()
    assert "sends    whole from each of the tp=8 ranks" in _plan(False).report()
