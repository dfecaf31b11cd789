"""Stage boundaries priced as the runtime crosses them (autopar/planner/stage_boundaries.py).

Megatron-LM's GPT at a small shape (tests/autopar/planner/test_scattered_sends.py's row):
8 blocks, tp = 8 inside a node, pp = 2 across two dgx-a100-80g nodes, one sample of 2048
tokens per micro-batch, fp16: the hidden states crossing the cut are
S = 2048 × 1024 × 2 B = 4 MiB. Links (the preset): network 25 GB/s, 10 µs; NVLink
300 GB/s, 5 µs; NCCL's launch 8.4 µs per collective.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from autopar.planner.engine import Engine, _Prepared
from autopar.planner.published import MegatronRow, megatron_cluster, megatron_graph, megatron_plan
from autopar.planner.stage_boundaries import gather_s
from cost_models.memory import precision
from runtime.plan import Plan

ROW = MegatronRow(params_b=1.0, heads=16, hidden=1024, layers=8, tp=8, pp=2, gpus=16,
                  global_batch=16, tflops_per_gpu=0.0, microbatch=1, interleave=1)
S = 2048 * 1024 * 2
NET_S = 10e-6 + S / 8 / 25e9  # one tp rank's eighth over the network
GATHER_S = 7 / 8 * S / 300e9 + 7 * 5e-6 + 8.4e-6  # NCCL's ring over 8 NVLink ranks


@functools.cache
def _graph():
    return megatron_graph(ROW)


def _engine() -> Engine:
    return Engine(_graph(), megatron_cluster(ROW), precision("float16"))


def _plan(*, scatter: bool, sp: set[int]) -> Plan:
    """The published plan with the blocks numbered in ``sp`` sequence-parallel (blocks
    0-3 on stage 0, 4-7 on stage 1)."""
    plan = megatron_plan(_graph(), ROW)
    blocks = [la.module for la in plan.layers if la.recompute == "full"]
    sp_styles = {layer.name: layer.tp.sp_styles for layer in _graph().layers
                 if layer.tp is not None and layer.tp.sp_styles}
    layers = tuple(
        dataclasses.replace(la, sequence_parallel=True, tp_styles=dict(sp_styles[la.module]))
        if la.module in blocks and blocks.index(la.module) in sp else la
        for la in plan.layers)
    return dataclasses.replace(plan, layers=layers, pipeline=dataclasses.replace(
        plan.pipeline, scatter_sends=scatter))


def _prepared(engine: Engine, plan: Plan) -> _Prepared:
    outcome = engine.evaluate(plan)
    return _Prepared(config=outcome.config, stage_of_layer=outcome.stage_of_layer,
                     costs=outcome.costs, lower_bound_s=outcome.lower_bound_s,
                     scatter_sends=plan.pipeline.scatter_sends)


def _boundary(prepared: _Prepared) -> int:
    stage_of = prepared.stage_of_layer
    return next(i for i in range(len(stage_of) - 1) if stage_of[i + 1] != stage_of[i])


def _skew(nbytes: float) -> float:
    return megatron_cluster(ROW).device.skew_s(nbytes)


@pytest.mark.parametrize("scatter", [False, True])
def test_a_boundary_between_sp_blocks_sends_the_shard_and_gathers_nothing(scatter):
    """Blocks 3 and 4 meet at the cut: 512 KiB per tp rank over the network, 30.97 µs,
    scattered or not, and no stage pays a gather."""
    engine = _engine()
    prepared = _prepared(engine, _plan(scatter=scatter, sp={3, 4}))
    assert NET_S == pytest.approx(30.97e-6, abs=1e-8)
    assert engine._p2p_s(prepared)[0] == pytest.approx(NET_S, rel=1e-12)
    i = _boundary(prepared)
    assert gather_s(prepared.costs[i], prepared.costs[i + 1], 8, engine.cluster) == (0, 0)


def test_an_sp_block_ending_a_stage_gathers_there_and_the_whole_is_sent():
    """Block 3 is SP, block 4 not: stage 0's forward all-gathers S over NVLink (55.63 µs
    with the launch), and the scattered send moves the eighth and gathers again on
    stage 1 (the runtime gathers, then slices)."""
    engine = _engine()
    plan = _plan(scatter=True, sp={3})
    prepared = _prepared(engine, plan)
    i = _boundary(prepared)
    assert GATHER_S == pytest.approx(55.63e-6, abs=1e-8)
    assert gather_s(prepared.costs[i], prepared.costs[i + 1], 8, engine.cluster) == \
        pytest.approx((GATHER_S + _skew(S), 0.0), rel=1e-12)
    assert engine._p2p_s(prepared)[0] == pytest.approx(NET_S + GATHER_S, rel=1e-12)
    times = engine._stage_times(prepared)
    members = [c for c, s in zip(prepared.costs, prepared.stage_of_layer, strict=True) if s == 0]
    assert times[0].fwd_s == pytest.approx(sum(c.fwd_s for c in members) + GATHER_S + _skew(S),
                                           rel=1e-12)
    assert times[1].bwd_s == pytest.approx(
        sum(c.bwd_s for c, s in zip(prepared.costs, prepared.stage_of_layer, strict=True)
            if s == 1), rel=1e-12)


def test_an_sp_block_opening_a_stage_gathers_its_gradient_there():
    """Block 4 is SP, block 3 not: it splits its whole input locally, and its backward
    all-gathers the gradient on stage 1 before it is sent back whole."""
    engine = _engine()
    prepared = _prepared(engine, _plan(scatter=False, sp={4}))
    i = _boundary(prepared)
    assert gather_s(prepared.costs[i], prepared.costs[i + 1], 8, engine.cluster) == \
        pytest.approx((0.0, GATHER_S + _skew(S)), rel=1e-12)
    assert engine._p2p_s(prepared)[0] == pytest.approx(10e-6 + S / 25e9, rel=1e-12)
    times = engine._stage_times(prepared)
    stage1 = [c for c, s in zip(prepared.costs, prepared.stage_of_layer, strict=True) if s == 1]
    assert times[1].bwd_s == pytest.approx(sum(c.bwd_s for c in stage1) + GATHER_S + _skew(S),
                                           rel=1e-12)


def test_the_shard_makes_the_step_faster_than_a_gathered_boundary():
    """The same blocks, the same stages: SP on both sides of the cut saves the stage-end
    gather and 7/8 of the send each micro-batch, which the step shows."""
    engine = _engine()
    both = engine.evaluate(_plan(scatter=True, sp={3, 4})).step_time_s
    one = engine.evaluate(_plan(scatter=True, sp={3})).step_time_s
    assert both < one


def test_the_report_says_which_boundaries_pass_shards():
    line = "after stage(s) 0 two sequence-parallel layers meet, and each tp rank passes on"
    assert line in _plan(scatter=False, sp={3, 4}).report()
    assert line in _plan(scatter=True, sp={3, 4}).report()
    assert "sequence-parallel layers meet" not in _plan(scatter=True, sp={3}).report()
