"""The planner counts a pipeline stage's in-flight micro-batches at min(m, 2p) when m is a
multiple of p (stages.SATURATION_MICROBATCHES_PER_RANK): the peaks counted along torch's
own tables at every larger multiple are the same (issue 17, part 7)."""

from __future__ import annotations

import pytest

from autopar.planner.configs import Config
from autopar.planner.engine import Engine
from autopar.planner.stages import SATURATION_MICROBATCHES_PER_RANK, unit_peaks
from cost_models.hardware import Cluster
from cost_models.memory import precision
from passes.records import LayerGraph
from runtime.plan import Mesh

MULTI_STAGE = ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]


def shapes(schedules: list[str], ps: range | list[int], vs: range | list[int]):
    for schedule in schedules:
        for p in ps:
            for v in [2] if schedule == "ZBVZeroBubble" else vs:
                yield schedule, p, v


@pytest.mark.parametrize("schedule, p, v", list(shapes(MULTI_STAGE, range(2, 9), range(2, 6)))
                         + [("1F1B", p, 1) for p in range(2, 9)])
def test_peaks_at_every_larger_multiple_of_p_equal_those_at_2p(schedule, p, v):
    saturated = unit_peaks(schedule, p, v, SATURATION_MICROBATCHES_PER_RANK * p)
    for k in range(SATURATION_MICROBATCHES_PER_RANK + 1, 7):
        assert unit_peaks(schedule, p, v, k * p) == saturated, (schedule, p, v, k)


@pytest.mark.parametrize("schedule, p, v", [("ZBVZeroBubble", 32, 2), ("ZBVZeroBubble", 64, 2),
                                            ("InterleavedZeroBubble", 32, 2),
                                            ("Interleaved1F1B", 32, 4)])
def test_peaks_saturate_at_the_pipeline_depths_of_the_largest_plans(schedule, p, v):
    # The Megatron 1T row searches these depths (its plan: ZBVZeroBubble, p = 32, m = 8p).
    assert unit_peaks(schedule, p, v, 3 * p) == unit_peaks(schedule, p, v, 2 * p)


def test_peaks_are_not_taken_from_2p_at_counts_that_are_no_multiple_of_p():
    # A given plan may run InterleavedZeroBubble at m = 10 on p = 4 (two rounds of five);
    # its peaks exceed those of m = 8, so the engine counts that m itself.
    assert unit_peaks("InterleavedZeroBubble", 4, 2, 10) != unit_peaks(
        "InterleavedZeroBubble", 4, 2, 8)
    engine = Engine(LayerGraph(layers=(), batch_size=16), Cluster.local(8),
                    precision("float32"))
    for m in (8, 10, 16, 24):
        config = Config(mesh=Mesh(pp=4, dp=2, tp=1), schedule="InterleavedZeroBubble",
                        virtual_stages=2, microbatches=m)
        assert engine.inflight(config) == unit_peaks("InterleavedZeroBubble", 4, 2, m)
