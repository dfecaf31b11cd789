"""The simulator (cost_models/schedule.py) against its earlier implementation
(schedule_reference.py, commit c084213) on random stage times, transfers, slowdowns and
blocking sends, and on random per-rank orders: identical actions, times, order and
Timelines, whichever path runs them (fixed orders, explicit orders with W, deferred W,
greedy ZB-V). The reference never waits on a non-blocking send; where the schedule class
does (ScheduleSpec.sends_waited: GPipe, 1F1B) and a transfer takes time, the two paths
are checked against each other only (tests/cost_models/test_schedule_sends.py checks
those waits against torch's step loops)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import schedule_reference as reference

from cost_models.schedule import SCHEDULES, StageTimes, run_actions, simulate
from runtime.schedule_orders import torch_rank_orders

CASES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 3),
         ("InterleavedZeroBubble", 2), ("InterleavedZeroBubble", 3),
         ("InterleavedZeroBubble", 1), ("ZBVZeroBubble", 2)]
LINKS = [dict(p2p_s=0.0), dict(p2p_s=0.3), dict(p2p_s=0.3, p2p_slowdown=1.7),
         dict(p2p_s=0.2, p2p_blocking=True)]


def _stages(rnd: random.Random, n: int, *, zeros: bool) -> list[StageTimes]:
    times = [0.0, 0.5, 1.0, 1.7] if zeros else [0.5, 1.0, 1.7]
    return [StageTimes(fwd_s=rnd.choice(times) + rnd.random() * 0.1,
                       bwd_s=rnd.choice(times) + rnd.random() * 0.1,
                       wgrad_s=rnd.choice([0.0, 0.4, 0.9] if zeros else [0.4, 0.9]),
                       activation_bytes=rnd.choice([1.0, 2.5, 4.0])) for _ in range(n)]


def _same(schedule: str, p: int, m: int, stages: list[StageTimes], **kwargs) -> None:
    new = run_actions(schedule, p, m, stages, **kwargs)
    assert new == run_actions(schedule, p, m, stages, in_order=False, **kwargs)
    waits = SCHEDULES[schedule].sends_waited != "at_step_end" and \
        kwargs.get("p2p_s", 0.0) > 0.0 and not kwargs.get("p2p_blocking", False)
    if waits:
        return
    assert new == reference.run_actions(schedule, p, m, stages, **kwargs)
    assert _fields(simulate(schedule, p, m, stages, **kwargs)) == \
        _fields(reference.simulate(schedule, p, m, stages, **kwargs))


def _fields(timeline) -> dict:
    """A Timeline's fields, its slots as tuples (the two modules' classes differ)."""
    return dataclasses.asdict(timeline)


@pytest.mark.parametrize("schedule, v", CASES)
@pytest.mark.parametrize("link", range(len(LINKS)))
def test_every_schedule_runs_as_before(schedule, v, link):
    rnd = random.Random(f"{schedule}{v}{link}")
    for p in (1, 2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            for zeros in (False, True):  # zero-time actions: ties in start time
                _same(schedule, p, m, _stages(rnd, p * v, zeros=zeros), **LINKS[link])


def _shuffled_ws(rnd: random.Random, orders: list[list[tuple[str, int, int]]]) -> list:
    """Each rank's order with every W moved to a random place after its own B (a W feeds
    nothing, so the order stays runnable)."""
    out = []
    for order in orders:
        order = list(order)
        for w in [a for a in order if a[0] == "W"]:
            order.remove(w)
            after = order.index(("B", w[1], w[2])) + 1
            order.insert(rnd.randint(after, len(order)), w)
        out.append(order)
    return out


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble",
                                      "ZBVZeroBubble"])
@pytest.mark.parametrize("link", range(len(LINKS)))
def test_explicit_orders_run_as_before(schedule, link):
    rnd = random.Random(f"{schedule}{link}")
    for p, m in ((2, 2), (2, 4), (4, 4), (4, 8), (3, 6)):
        torch_orders = torch_rank_orders(schedule, p, 2, m)
        for orders in (torch_orders, _shuffled_ws(rnd, torch_orders),
                       _shuffled_ws(rnd, torch_orders)):
            for zeros in (False, True):
                _same(schedule, p, m, _stages(rnd, 2 * p, zeros=zeros), orders=orders,
                      **LINKS[link])


def test_runs_taken_from_the_event_loop_as_random_orders():
    """Orders no schedule makes: what one run of the deferred-W loop did on random times,
    with its W's moved, replayed on other random times."""
    rnd = random.Random(0)
    for p, m in ((2, 6), (3, 6), (4, 8)):
        made = run_actions("InterleavedZeroBubble", p, m, _stages(rnd, 2 * p, zeros=False))
        orders = [[(a, st, mb) for r, st, a, mb, _, _ in made if r == rank]
                  for rank in range(p)]
        for _ in range(3):
            _same("InterleavedZeroBubble", p, m, _stages(rnd, 2 * p, zeros=True),
                  orders=_shuffled_ws(rnd, orders), p2p_s=rnd.choice([0.0, 0.2]))
