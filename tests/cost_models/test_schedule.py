"""The pipeline schedule simulator against published bubble fractions and memory."""

from __future__ import annotations

import pytest

from cost_models.schedule import StageTimes, simulate, stage_ranks

CASES = [(2, 4), (4, 4), (4, 8), (8, 16)]


def uniform(stages: int, per_stage_s: float = 1.0) -> list[StageTimes]:
    return [StageTimes(fwd_s=per_stage_s, bwd_s=per_stage_s, wgrad_s=per_stage_s,
                       activation_bytes=1.0)] * stages


@pytest.mark.parametrize("p, m", CASES)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    t = simulate(schedule, p, m, uniform(p))
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert t.step_time_s == pytest.approx((m + p - 1) * 3)


@pytest.mark.parametrize("p, m", CASES)
def test_interleaving_divides_the_bubble_by_v(p, m):
    # Narayanan et al. (SC'21): bubble time (p - 1)·(tf + tb) / v.
    t = simulate("Interleaved1F1B", p, m, uniform(2 * p, 0.5))
    assert t.bubble_fraction == pytest.approx((p - 1) / (2 * m + p - 1))


@pytest.mark.parametrize("p, m", CASES)
def test_zero_bubble_h1_leaves_a_third_of_the_1f1b_bubble(p, m):
    # Qi et al. (ICLR'24), ZB-H1: bubble (p - 1)(T_F + T_B - T_W) = (p - 1)·T with T_F =
    # T_B = T_W = T, against 1F1B's (p - 1)·3T.
    zb = simulate("InterleavedZeroBubble", p, m, uniform(p))
    base = simulate("1F1B", p, m, uniform(p))
    idle = lambda t: t.bubble_fraction * t.step_time_s  # noqa: E731
    assert idle(zb) == pytest.approx(idle(base) / 3)


@pytest.mark.parametrize("p, m", CASES)
def test_zbv_beats_1f1b_and_holds_no_more_activations(p, m):
    zbv = simulate("ZBVZeroBubble", p, m, uniform(2 * p, 0.5))
    one = simulate("1F1B", p, m, uniform(p))
    assert zbv.bubble_fraction < one.bubble_fraction
    # A V stage is half a 1F1B stage. This greedy ZB-V holds at most 2p half stages in
    # flight plus p deferred weight gradients: 1.5x 1F1B's p full stages (the paper's
    # hand-built ZB-V matches 1F1B; ours trades that memory for a simpler rule).
    assert max(zbv.peak_activation_bytes) <= 3 * p * 1.0


@pytest.mark.parametrize("p, m", CASES)
def test_in_flight_micro_batches_per_schedule(p, m):
    gpipe = simulate("GPipe", p, m, uniform(p))
    one = simulate("1F1B", p, m, uniform(p))
    assert gpipe.peak_inflight == (m,) * p  # GPipe holds every micro-batch
    assert one.peak_inflight == tuple(min(p - r, m) for r in range(p))  # 1F1B: p - r


def test_point_to_point_time_lengthens_the_step():
    p, m = 4, 8
    fast = simulate("1F1B", p, m, uniform(p))
    slow = simulate("1F1B", p, m, uniform(p), p2p_s=0.5)
    # Fill and drain cross p - 1 boundaries each way; in the steady state every F/B pair
    # also waits for a round trip, so transfers cost at least that much.
    assert slow.step_time_s >= fast.step_time_s + 2 * (p - 1) * 0.5
    assert slow.bubble_fraction > fast.bubble_fraction


def test_slowest_stage_sets_the_steady_state():
    times = uniform(4)
    times[2] = StageTimes(fwd_s=2, bwd_s=2, wgrad_s=2)
    t = simulate("1F1B", 4, 16, times)
    assert t.step_time_s >= 16 * 6  # m micro-batches through the 6 s stage


def test_timeline_labels_follow_torch_notation_and_cover_every_action():
    t = simulate("1F1B", 2, 3, uniform(2))
    assert {s.label for s in t.slots if s.rank == 1} >= {"1F0", "1B2"}
    assert len(t.slots) == 2 * 3 * 2
    assert stage_ranks("ZBVZeroBubble", 4, 8) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_ranks("Interleaved1F1B", 4, 8) == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2),
                                         ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_in_flight_peaks_stop_growing_by_4p_micro_batches(schedule, v, p):
    # The planner simulates in-flight profiles at min(m, 4p) micro-batches.
    from autopar.planner.stages import stage_peaks

    peaks = [stage_peaks(simulate(schedule, p, m, uniform(p * v)), p * v) for m in (4 * p, 8 * p)]
    assert peaks[0] == peaks[1]
