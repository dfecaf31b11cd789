"""Where the simulated pipeline ranks wait on their sends (cost_models.schedule,
ScheduleSpec.sends_waited): against timelines derived by hand, and against a replay of
torch 2.13's own ScheduleGPipe / Schedule1F1B step loops, transliterated below with their
communication as timed events."""

from __future__ import annotations

import random

import pytest
import schedule_reference as reference

from cost_models.schedule import SCHEDULES, StageTimes, run_actions, simulate


def _times(fwd_s: float, bwd_s: float, stages: int) -> list[StageTimes]:
    return [StageTimes(fwd_s=fwd_s, bwd_s=bwd_s)] * stages


def _rank_slots(timeline, rank: int) -> list[tuple[str, float, float]]:
    return [(s.label, s.start_s, s.end_s) for s in timeline.slots if s.rank == rank]


def test_1f1b_waits_on_each_send_with_the_next_receive():
    # 2 ranks, 3 micro-batches, F 1 s, B 2 s, each transfer 3 s. Rank 0 runs F0 F1 B0 F2
    # B1 B2, rank 1 F0 B0 F1 B1 F2 B2.
    # Rank 0: F0 0-1, sends it (arrives 4); F1 1-2, then waits on F0's send (4) before
    # sending F1 (4, arrives 7) with B0's receive, both waited: B0's gradient left rank 1
    # at 7, arrives 10: B0 10-12, F2 12-13, sent with B1's receive: send done 16, B1's
    # gradient (sent 13) arrives 16: B1 16-18. B2's gradient (sent 19) arrives 22: B2 22-24.
    # Rank 1: F0 4-5, B0 5-7, its send (7-10) waited with F1's receive (arrived 7): F1
    # 10-11, B1 11-13, send done 16 with F2's receive (sent 13, arrived 16): F2 16-17, B2
    # 17-19.
    t = simulate("1F1B", 2, 3, _times(1.0, 2.0, 2), p2p_s=3.0)
    assert _rank_slots(t, 0) == [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 10, 12),
                                 ("0F2", 12, 13), ("0B1", 16, 18), ("0B2", 22, 24)]
    assert _rank_slots(t, 1) == [("1F0", 4, 5), ("1B0", 5, 7), ("1F1", 10, 11),
                                 ("1B1", 11, 13), ("1F2", 16, 17), ("1B2", 17, 19)]
    # Never waiting (what the simulator did before) lets rank 1 run F1 at 7, B1 8-10.
    before = reference.simulate("1F1B", 2, 3, _times(1.0, 2.0, 2), p2p_s=3.0)
    assert _rank_slots(before, 1)[2:4] == [("1F1", 7, 8), ("1B1", 8, 10)]


def test_1f1b_step_is_longer_when_a_send_outlasts_the_next_receive():
    # 2 ranks, 4 micro-batches, F = B = 1 s, transfers 2 s. Rank 1's steady state: F_i
    # (1 s), B_i (1 s), then B_i's send (2 s) waited with F_{i+1}'s receive: 4 s per
    # micro-batch from F0 at 3 s: F3 at 15, B3 16-17, whose gradient reaches rank 0 at 19:
    # its B3 19-20. Never waiting on sends, rank 1 ran F1 at 5 s while B0's gradient was
    # still in flight, and the step took 18 s.
    t = simulate("1F1B", 2, 4, _times(1.0, 1.0, 2), p2p_s=2.0)
    assert _rank_slots(t, 1) == [("1F0", 3, 4), ("1B0", 4, 5), ("1F1", 7, 8),
                                 ("1B1", 8, 9), ("1F2", 11, 12), ("1B2", 12, 13),
                                 ("1F3", 15, 16), ("1B3", 16, 17)]
    assert t.step_time_s == 20.0
    before = reference.simulate("1F1B", 2, 4, _times(1.0, 1.0, 2), p2p_s=2.0)
    assert _rank_slots(before, 1)[2] == ("1F1", 5, 6)
    assert before.step_time_s == 18.0


def test_1f1b_warm_up_send_waited_after_the_next_forward():
    # 3 ranks: rank 0 warms up with F0, F1 and sends each; F0's send (1-4 s) is waited once
    # F1 ends (2 s), so F1's send goes at 4 and reaches rank 1 at 7, not 5.
    t = simulate("1F1B", 3, 3, _times(1.0, 1.0, 3), p2p_s=3.0)
    assert _rank_slots(t, 1)[:2] == [("1F0", 4, 5), ("1F1", 7, 8)]


def test_gpipe_waits_on_its_forward_sends_before_its_first_backward():
    # 2 ranks, 3 micro-batches, F 1 s, B 2 s, transfers 3 s. Rank 0's forwards go out at
    # 1, 2, 3 s without waiting (arriving 4, 5, 6); it then waits on them all (6 s) before
    # B0, whose gradient arrives at 12 anyway. Rank 1: F 4-7, B 7-13, its backward sends
    # waited only at the step's end, so they arrive 12, 14, 16: rank 0 B 12-18.
    t = simulate("GPipe", 2, 3, _times(1.0, 2.0, 2), p2p_s=3.0)
    assert _rank_slots(t, 1) == [("1F0", 4, 5), ("1F1", 5, 6), ("1F2", 6, 7),
                                 ("1B0", 7, 9), ("1B1", 9, 11), ("1B2", 11, 13)]
    assert _rank_slots(t, 0)[3:] == [("0B0", 12, 14), ("0B1", 14, 16), ("0B2", 16, 18)]
    # That wait never binds: rank r + 1 needs the last forward before its first backward,
    # whose gradient comes back a transfer later still. So GPipe's step is the one without
    # waits (the simulator's before), even with sends longer than compute.
    assert t == reference.simulate("GPipe", 2, 3, _times(1.0, 2.0, 2), p2p_s=3.0)


def test_blocking_sends_still_wait_for_every_transfer():
    # Megatron-LM 2021's exposed p2p: each send waited right after its action, whatever
    # the schedule class would do.
    t = simulate("GPipe", 2, 3, _times(1.0, 2.0, 2), p2p_s=3.0, p2p_blocking=True)
    assert _rank_slots(t, 0)[:3] == [("0F0", 0, 1), ("0F1", 4, 5), ("0F2", 8, 9)]


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble",
                                      "ZBVZeroBubble"])
def test_table_schedules_never_wait_on_sends(schedule):
    # _PipelineScheduleRuntime waits on its sends only after the step's last action.
    assert SCHEDULES[schedule].sends_waited == "at_step_end"
    stages = _times(1.0, 1.0, 4)
    new = simulate(schedule, 2, 4, stages, p2p_s=3.0)
    assert new == reference.simulate(schedule, 2, 4, stages, p2p_s=3.0)


# -- torch's step loops, replayed -------------------------------------------------------
#
# Each rank runs its schedule class's _step_microbatches as a generator of events:
# ("compute", action, mb), ("isend", sends) (issue, do not wait), ("wait", sends), and
# ("batch", sends, recvs) (issue the sends, then wait on sends and receives alike). A
# send issued at t completes, and its data arrives, at t + p2p_s.


def _ops(stage: int, p: int):
    first, last = stage == 0, stage == p - 1
    return (lambda i: [] if first else [("F", stage - 1, i)],   # forward receive
            lambda i: [] if last else [("F", stage, i)],        # forward send
            lambda i: [] if last else [("B", stage + 1, i)],    # backward receive
            lambda i: [] if first else [("B", stage, i)])       # backward send


def _torch_gpipe(stage: int, p: int, m: int):
    """ScheduleGPipe._step_microbatches (torch 2.13), its communication as events."""
    fwd_recv, fwd_send, bwd_recv, bwd_send = _ops(stage, p)
    fwd_sends_to_wait = []
    for i in range(m):
        yield ("batch", [], fwd_recv(i))
        yield ("compute", "F", i)
        yield ("isend", fwd_send(i))
        fwd_sends_to_wait += fwd_send(i)
    yield ("wait", fwd_sends_to_wait)
    for i in range(m):
        yield ("batch", [], bwd_recv(i))
        yield ("compute", "B", i)
        yield ("isend", bwd_send(i))


def _torch_1f1b(stage: int, p: int, m: int):
    """Schedule1F1B._step_microbatches (torch 2.13), its communication as events."""
    fwd_recv, fwd_send, bwd_recv, bwd_send = _ops(stage, p)
    warmup_chunks = min(m, p - stage)
    fwd_mb_index = bwd_mb_index = 0
    send_work, fwd_sends = [], []
    for _ in range(warmup_chunks):
        yield ("batch", [], fwd_recv(fwd_mb_index))
        yield ("compute", "F", fwd_mb_index)
        yield ("wait", send_work)
        fwd_sends = fwd_send(fwd_mb_index)
        if fwd_mb_index != warmup_chunks - 1:
            send_work = fwd_sends
            yield ("isend", send_work)
        fwd_mb_index += 1
    while True:
        yield ("batch", fwd_sends, bwd_recv(bwd_mb_index))
        yield ("compute", "B", bwd_mb_index)
        bwd_sends = bwd_send(bwd_mb_index)
        bwd_mb_index += 1
        if fwd_mb_index == m:
            break
        yield ("batch", bwd_sends, fwd_recv(fwd_mb_index))
        yield ("compute", "F", fwd_mb_index)
        fwd_sends = fwd_send(fwd_mb_index)
        fwd_mb_index += 1
    send_work = bwd_sends
    yield ("isend", send_work)
    while bwd_mb_index < m:
        yield ("batch", [], bwd_recv(bwd_mb_index))
        yield ("compute", "B", bwd_mb_index)
        yield ("wait", send_work)
        send_work = bwd_send(bwd_mb_index)
        yield ("isend", send_work)
        bwd_mb_index += 1


def _replay(loop, p: int, m: int, stages: list[StageTimes], p2p_s: float) -> list:
    """Every rank's (rank, stage, action, mb, start, end), running the ranks' loops until
    each has finished; a rank waits where a receive's send has not been issued yet."""
    issued: dict[tuple, float] = {}
    clock = [0.0] * p
    loops = [loop(r, p, m) for r in range(p)]
    pending: list = [next(g) for g in loops]
    out = []
    while any(e is not None for e in pending):
        progressed = False
        for r in range(p):
            while pending[r] is not None:
                event = pending[r]
                if event[0] == "compute":
                    _, action, mb = event
                    dur = stages[r].fwd_s if action == "F" else stages[r].bwd_s
                    out.append((r, r, action, mb, clock[r], clock[r] + dur))
                    clock[r] += dur
                elif event[0] == "isend":
                    for key in event[1]:
                        issued.setdefault(key, clock[r])
                elif event[0] == "wait":
                    clock[r] = max([clock[r]] + [issued[k] + p2p_s for k in event[1]])
                else:  # batch: issue the sends, then wait on everything
                    for key in event[1]:
                        issued.setdefault(key, clock[r])
                    if any(k not in issued for k in event[2]):
                        break  # the peer has not sent it yet
                    clock[r] = max([clock[r]] + [issued[k] + p2p_s
                                                 for k in event[1] + event[2]])
                pending[r] = next(loops[r], None)
                progressed = True
        assert progressed, "replay deadlocked"
    return out


@pytest.mark.parametrize("schedule, loop", [("GPipe", _torch_gpipe), ("1F1B", _torch_1f1b)])
def test_single_stage_schedules_wait_where_torchs_step_loops_do(schedule, loop):
    rnd = random.Random(schedule)
    for p in (2, 3, 4):
        for m in (p, p + 1, 2 * p, 3 * p):
            for _ in range(3):
                stages = [StageTimes(fwd_s=rnd.uniform(0.2, 1.5), bwd_s=rnd.uniform(0.2, 3.0))
                          for _ in range(p)]
                p2p_s = rnd.choice([0.1, 1.0, 2.5, 5.0])
                simulated = sorted(run_actions(schedule, p, m, stages, p2p_s))
                replayed = sorted(_replay(loop, p, m, stages, p2p_s))
                assert [a[:4] for a in simulated] == [a[:4] for a in replayed]
                for got, want in zip(simulated, replayed, strict=True):
                    assert got[4:] == pytest.approx(want[4:]), (p, m, got, want)
