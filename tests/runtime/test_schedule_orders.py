"""torch's own pipeline schedule tables (runtime/schedule_orders.py), read without stages or
process groups, and the simulator (cost_models/schedule.py) running them exactly."""

from __future__ import annotations

import pytest

from cost_models.schedule import SCHEDULES, StageTimes, rank_orders, simulate
from runtime.schedule_orders import BUILT_IN_EQUALS_TORCH, torch_rank_orders

SHAPES = [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16)]
"""(pp, virtual stages, micro-batches) as the planner searches them: m a multiple of pp."""


def test_interleaved_1f1b_runs_the_order_of_narayanan_et_al():
    """torch's Interleaved1F1B table is the textbook order of the simulator, which
    runtime_orders therefore builds instead (BUILT_IN_EQUALS_TORCH)."""
    assert BUILT_IN_EQUALS_TORCH == {"Interleaved1F1B"}
    for pp in (2, 3, 4, 5, 8, 16):
        for v in range(2, 7):
            for m in range(pp, 4 * pp + 1, pp):
                assert torch_rank_orders("Interleaved1F1B", pp, v, m) == rank_orders(
                    "Interleaved1F1B", pp, v, m), (pp, v, m)


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), [
    (schedule, *shape) for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble")
    for shape in SHAPES if SCHEDULES[schedule].accepts(shape[1])])
def test_every_table_is_a_whole_step_with_each_weight_pass_after_its_backward(schedule, pp, v,
                                                                              m):
    orders = torch_rank_orders(schedule, pp, v, m)
    seen = [a for order in orders for a in order]
    stages = pp * v
    assert sorted(seen) == sorted((a, s, mb) for a in "FBW" for s in range(stages)
                                  for mb in range(m))
    for order in orders:
        for i, (action, stage, mb) in enumerate(order):
            if action == "W":
                assert ("B", stage, mb) in order[:i]


def test_single_stage_schedules_have_no_table():
    assert torch_rank_orders("GPipe", 4, 1, 8) is None
    assert torch_rank_orders("1F1B", 4, 1, 8) is None


def _uniform(stages: int) -> list[StageTimes]:
    return [StageTimes(fwd_s=1.0, bwd_s=1.0, wgrad_s=1.0, activation_bytes=1.0)
            for _ in range(stages)]


def test_interleaved_zero_bubble_holds_what_torch_schedules_not_the_1f1b_warmup():
    """pp = 4, v = 2, m = 8, unit times. torch's InterleavedZeroBubble warms up with
    (v - 1)·pp + (pp - 1 - r) forwards (``_get_warmup_ops`` with factor 1), not
    Interleaved1F1B's (v - 1)·pp + 2·(pp - 1 - r); each B's W follows at once after the
    first r steady-state steps, so rank 0 never holds more than 8 stage micro-batches.
    The F/B order with weight passes deferred greedily held 12 on rank 0."""
    stages = _uniform(8)
    torch_order = simulate("InterleavedZeroBubble", 4, 8, stages,
                           orders=torch_rank_orders("InterleavedZeroBubble", 4, 2, 8))
    assert torch_order.peak_inflight == (8, 8, 8, 8)
    assert simulate("InterleavedZeroBubble", 4, 8, stages).peak_inflight[0] == 12
    first_b = [a for a, _, _ in torch_rank_orders("InterleavedZeroBubble", 4, 2, 8)[0]].index("B")
    assert first_b == (2 - 1) * 4 + (4 - 1 - 0) + 1  # warm-up, then one steady-state F


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble",
                                      "ZBVZeroBubble"])
@pytest.mark.parametrize(("pp", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_the_simulator_runs_every_table_without_deadlock(schedule, pp, m):
    timeline = simulate(schedule, pp, m, _uniform(2 * pp),
                        orders=torch_rank_orders(schedule, pp, 2, m))
    slots = {(s.action, s.stage, s.microbatch): s for s in timeline.slots}
    assert len(slots) == len(timeline.slots)  # each action once
    # A rank runs its table's actions in the table's order.
    for rank, order in enumerate(torch_rank_orders(schedule, pp, 2, m)):
        starts = [slots[a].start_s for a in order]
        assert starts == sorted(starts) and all(slots[a].rank == rank for a in order)
