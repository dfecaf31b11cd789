"""The algorithms of cost_models/schedule.py as of commit c084213 (orders, event loop,
fixed-order path, Timeline assembly), kept verbatim as the reference their faster
successors are checked against (tests/cost_models/test_schedule_fast.py): the same actions,
times and order, and the same Timelines."""

# ruff: noqa

from __future__ import annotations

import heapq
from collections import deque

from cost_models.overlap import pipeline_p2p_slowdown_s


# The records and the schedule table are the current module's: only the algorithms are
# the old ones.
from cost_models.schedule import (  # noqa: E402
    SCHEDULES,
    SIM_SCHEDULES,
    Slot,
    StageTimes,
    Timeline,
    stage_ranks,
)


def rank_orders(schedule: str, num_ranks: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the (action, stage, micro-batch) sequence of F and B actions (fixed-order
    schedules; ZBVZeroBubble's order is chosen while simulating)."""
    p = num_ranks
    orders = []
    for r in range(p):
        if schedule == "GPipe":
            order = [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
        elif schedule == "1F1B" or (schedule == "InterleavedZeroBubble" and v == 1):
            order = _one_f_one_b([("F", r, i) for i in range(m)], [("B", r, i) for i in range(m)],
                                 warmup=min(p - r - 1, m))
        elif schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
            # Narayanan et al. (SC'21), section 2.2: micro-batches advance in groups of p
            # through the rank's chunks; warm-up is (p - r - 1)·2 + (v - 1)·p forwards.
            def virtual(k: int, backward: bool, r: int = r) -> tuple[int, int]:
                chunk = (k // p) % v
                chunk = v - 1 - chunk if backward else chunk
                return r + chunk * p, (k // (p * v)) * p + k % p
            fwd = [("F", *virtual(k, False)) for k in range(m * v)]
            bwd = [("B", *virtual(k, True)) for k in range(m * v)]
            order = _one_f_one_b(fwd, bwd, warmup=min((p - r - 1) * 2 + (v - 1) * p, m * v))
        else:  # ZBVZeroBubble is built greedily in simulate(); see _zbv_candidates.
            order = []
        orders.append(order)
    return orders


def _one_f_one_b(fwd: list, bwd: list, warmup: int) -> list:
    order = list(fwd[:warmup])
    for i in range(len(fwd) - warmup):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[len(fwd) - warmup:])
    return order


def simulate(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    stages: list[StageTimes],
    p2p_s: float = 0.0,
    *,
    p2p_slowdown: float = 1.0,
    p2p_blocking: bool = False,
    orders: list[list[tuple[str, int, int]]] | None = None,
) -> Timeline:
    """Simulate one step; ``stages`` lists every stage (num_ranks × virtual stages).

    A result crossing to another rank arrives ``p2p_s`` after its action ends. Meanwhile
    the sender goes on (torch.distributed.pipelining's isend), its next action slowed by
    the part of the transfer it overlaps, as cost_models.overlap.pipeline_p2p_slowdown_s
    (``p2p_slowdown``: σ); with ``p2p_blocking`` it waits for the transfer instead.

    ``orders``: per rank, the (action, stage, micro-batch) sequence the runtime's schedule
    runs (runtime.schedule_orders reads torch's); each rank then runs exactly that order,
    weight-gradient passes (W) where it puts them. Without, the fixed F/B orders of
    ``rank_orders`` with each deferred W run when its rank would otherwise wait (at most
    num_ranks of them pending), and ZBVZeroBubble built greedily.
    """
    actions = run_actions(schedule, num_ranks, num_microbatches, stages, p2p_s,
                          p2p_slowdown=p2p_slowdown, p2p_blocking=p2p_blocking, orders=orders)
    slots = [Slot(rank=r, stage=st, action=a, microbatch=mb, start_s=t0, end_s=t1)
             for r, st, a, mb, t0, t1 in actions]
    return _timeline(schedule, num_ranks, num_microbatches, slots, stages,
                     SCHEDULES[schedule].split_backward)


Action = tuple[int, int, str, int, float, float]
"""(rank, stage, action, micro-batch, start_s, end_s): a Slot's fields, as a tuple."""


def run_actions(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    stages: list[StageTimes],
    p2p_s: float = 0.0,
    *,
    p2p_slowdown: float = 1.0,
    p2p_blocking: bool = False,
    in_order: bool = True,
    orders: list[list[tuple[str, int, int]]] | None = None,
) -> list[Action]:
    """``simulate``'s actions in the order they ran, as tuples, without building the
    Timeline: what the planner needs of the many unit-time runs that give it in-flight
    counts. The loop keeps its state in flat lists (one entry per stage and micro-batch)
    rather than dicts of tuples: the planner runs it on 100,000-action schedules.
    ``in_order``: schedules without a split W take the heap-free path (_run_in_order);
    False runs them through the event loop too, the reference that path is tested
    against. ``orders``: as ``simulate``'s."""
    if schedule not in SIM_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SIM_SCHEDULES)}")
    p, m = num_ranks, num_microbatches
    v, rem = divmod(len(stages), p)
    if rem or v < 1:
        raise ValueError(f"{len(stages)} stages do not divide over {p} ranks")
    split_w = SCHEDULES[schedule].split_backward
    owner = stage_ranks(schedule, p, len(stages))
    explicit = orders is not None and any(a == "W" for order in orders for a, _, _ in order)
    greedy = orders is None and schedule == "ZBVZeroBubble"
    orders = orders if orders is not None else rank_orders(schedule, p, v, m)
    num_stages = len(stages)
    last = num_stages - 1

    # When each (stage, micro-batch) F and B ended; None until it has.
    done_f: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    done_b: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    # The hop from the stage that feeds this one: its F from stage - 1, its B from stage + 1.
    hop_f = [p2p_s if st > 0 and owner[st - 1] != owner[st] else 0.0 for st in range(num_stages)]
    hop_b = [p2p_s if st < last and owner[st + 1] != owner[st] else 0.0
             for st in range(num_stages)]
    fwd = [t.fwd_s for t in stages]
    bwd = [t.bwd_s if split_w else t.bwd_s + t.wgrad_s for t in stages]
    wgrad = [t.wgrad_s for t in stages]
    sends_f = [st < last and owner[st + 1] != owner[st] for st in range(num_stages)]
    sends_b = [st > 0 and owner[st - 1] != owner[st] for st in range(num_stages)]
    # The ranks to re-examine after an action of a stage: its own, its neighbours'.
    affected = [sorted({owner[st]} | {owner[n] for n in (st - 1, st + 1) if 0 <= n <= last})
                for st in range(num_stages)]
    slowed = p2p_slowdown != 1.0

    def arrival(action: str, stage: int, mb: int) -> float | None:
        if action == "W":  # after its own B, on the same rank
            return done_b[stage][mb]
        if action == "F":
            if stage == 0:
                return 0.0
            t = done_f[stage - 1][mb]
            return None if t is None else t + hop_f[stage]
        t = done_f[stage][mb]
        if t is None:
            return None
        t += 0.0  # the F ran on this rank: no hop
        if stage == last:
            return t
        u = done_b[stage + 1][mb]
        if u is None:
            return None
        u += hop_b[stage]
        return t if t >= u else u

    clock = [0.0] * p
    pos = [0] * p
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    out: list[Action] = []
    sent_until = [0.0] * p  # when this rank's last send completes

    if in_order and not split_w:  # no W to slot in: each rank's order is fixed
        ran = _run_in_order(orders, owner, fwd, bwd, hop_f, hop_b, sends_f, sends_b, p2p_s,
                            p2p_slowdown, p2p_blocking, m)
        # The event loop runs actions in order of (start, rank): an action starts after
        # the start of the one that enabled it, strictly unless that one took no time.
        # Sorted so, the actions come in its order, and sums over them add up alike;
        # with a zero-time action the event loop itself decides the order.
        if all(end > start for _, (_, _, _, start, end) in ran):
            ran.sort(key=lambda item: (item[1][3], item[0]))
            return [(rank, stage, action, mb, start, end)
                    for rank, (action, stage, mb, start, end) in ran]
    held = [0] * p
    next_f = [0] * num_stages
    next_b = [0] * num_stages
    total = 2 * m * num_stages
    finished = 0

    def candidates(r: int) -> list[tuple[str, int, int]]:
        if not greedy:
            order = orders[r]
            return [order[pos[r]]] if pos[r] < len(order) else []
        # ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): each
        # rank holds stage r going down and stage 2p-1-r coming back; backwards first, and
        # down-chunk forwards only while fewer than 2p half stages are held. With up to p
        # deferred W's this holds at most 1.5x 1F1B's activations (the paper's hand-built
        # ZB-V holds exactly 1F1B's).
        # The cap gates only the down chunk: an up-chunk forward follows this rank's own
        # down-chunk forward of the same micro-batch, and must never wait on the cap, or a
        # rank that filled it with down-chunk forwards would never free it (deadlock).
        down, up = r, 2 * p - 1 - r
        out = [("B", st, next_b[st]) for st in (up, down) if next_b[st] < m]
        if next_f[up] < m:
            out.append(("F", up, next_f[up]))
        if held[r] < 2 * p and next_f[down] < m:
            out.append(("F", down, next_f[down]))
        return out

    def choose(r: int) -> tuple[float, tuple[str, int, int]] | None:
        """The action rank r runs next and when, given what has completed so far."""
        if explicit:
            if pos[r] >= len(orders[r]):
                return None
            action, stage, mb = orders[r][pos[r]]
            ready = arrival(action, stage, mb)
            return None if ready is None else (max(clock[r], ready), (action, stage, mb))
        waiting = pending_w[r]
        if len(waiting) >= p:
            # Deferred weight gradients hold activations: at most p may wait, so a rank
            # holds at most p stage micro-batches more than the schedule without W split.
            stage, mb = waiting[0]
            return clock[r], ("W", stage, mb)
        now = clock[r]
        best_at, best = 0.0, None
        for action in candidates(r):
            ready = arrival(*action)
            if ready is None or (waiting and ready > now):
                continue
            at = now if now >= ready else ready
            if best is None or at < best_at:  # ties keep the earlier candidate
                best_at, best = at, action
        if best is not None:
            return best_at, best
        if waiting:
            stage, mb = waiting[0]
            return now, ("W", stage, mb)
        return None

    # Event-driven: a rank's next action changes only when it runs something or a
    # neighbouring stage completes, so only those ranks are re-examined.
    heap: list[tuple[float, int, int, tuple[str, int, int]]] = []
    version = [0] * p

    def refresh(r: int) -> None:
        version[r] += 1
        nxt = choose(r)
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], r, version[r], nxt[1]))

    for r in range(p):
        refresh(r)
    while heap:
        start, r, ver, (action, stage, mb) = heapq.heappop(heap)
        if ver != version[r]:
            continue
        if action == "F":
            end = start + fwd[stage]
        elif action == "W":
            end = start + wgrad[stage]
        else:
            end = start + bwd[stage]
        in_flight = sent_until[r] - start
        if in_flight > 0.0 or slowed:
            end += pipeline_p2p_slowdown_s(end - start, max(0.0, in_flight),
                                           slowdown=p2p_slowdown)
        out.append((r, stage, action, mb, start, end))
        clock[r] = end
        if (sends_f[stage] if action == "F" else action == "B" and sends_b[stage]):
            sent_until[r] = end + p2p_s
            if p2p_blocking:
                clock[r] = sent_until[r]
        if action == "W":
            if explicit:  # the table says which; each comes after its own B
                pending_w[r].remove((stage, mb))
                pos[r] += 1
            else:
                pending_w[r].popleft()
            held[r] -= 1
        else:
            finished += 1
            pos[r] += 1
            if action == "F":
                done_f[stage][mb] = end
                next_f[stage] += 1
                held[r] += 1
            else:
                done_b[stage][mb] = end
                next_b[stage] += 1
                if split_w:
                    pending_w[r].append((stage, mb))
                else:
                    held[r] -= 1
        for a in affected[stage]:
            refresh(a)
    if finished < total:
        raise AssertionError(f"{schedule} deadlocked after {finished} of {total} actions")
    return out


def _run_in_order(orders: list[list[tuple[str, int, int]]], owner: list[int],
                  fwd: list[float], bwd: list[float], hop_f: list[float], hop_b: list[float],
                  sends_f: list[bool], sends_b: list[bool], p2p_s: float, p2p_slowdown: float,
                  p2p_blocking: bool, m: int
                  ) -> list[tuple[int, tuple[str, int, int, float, float]]]:
    """run_actions for schedules without a split W (every rank's order fixed): an action
    starts when its rank is free and its inputs have arrived, so its times follow from
    its rank's previous action and its inputs alone, whatever order the ranks are
    advanced in. Each rank runs on until an input is missing; a rank whose action
    completes an input another rank waits for wakes that rank. The same arithmetic as
    the event loop, without its heap: the planner runs schedules of 65,000 actions."""
    p, num_stages = len(orders), len(fwd)
    last = num_stages - 1
    done_f: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    done_b: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    clock, sent_until, pos = [0.0] * p, [0.0] * p, [0] * p
    slowed = p2p_slowdown != 1.0
    out: list[tuple[int, tuple[str, int, int, float, float]]] = []
    ready_ranks = list(range(p))
    while ready_ranks:
        r = ready_ranks.pop()
        order = orders[r]
        while pos[r] < len(order):
            action, stage, mb = order[pos[r]]
            if action == "F":
                if stage == 0:
                    ready = 0.0
                else:
                    t = done_f[stage - 1][mb]
                    if t is None:
                        break
                    ready = t + hop_f[stage]
            else:
                t = done_f[stage][mb]
                if t is None:
                    break
                t += 0.0  # the F ran on this rank: no hop
                if stage == last:
                    ready = t
                else:
                    u = done_b[stage + 1][mb]
                    if u is None:
                        break
                    u += hop_b[stage]
                    ready = t if t >= u else u
            start = clock[r] if clock[r] >= ready else ready
            end = start + (fwd[stage] if action == "F" else bwd[stage])
            in_flight = sent_until[r] - start
            if in_flight > 0.0 or slowed:
                end += pipeline_p2p_slowdown_s(end - start, max(0.0, in_flight),
                                               slowdown=p2p_slowdown)
            out.append((r, (action, stage, mb, start, end)))
            clock[r] = end
            if sends_f[stage] if action == "F" else sends_b[stage]:
                sent_until[r] = end + p2p_s
                if p2p_blocking:
                    clock[r] = sent_until[r]
            pos[r] += 1
            if action == "F":
                done_f[stage][mb] = end
                woken = owner[stage + 1] if stage < last else r
            else:
                done_b[stage][mb] = end
                woken = owner[stage - 1] if stage > 0 else r
            if woken != r and woken not in ready_ranks:
                ready_ranks.append(woken)
    if any(pos[r] < len(orders[r]) for r in range(p)):
        raise AssertionError(f"deadlocked after {sum(pos)} of "
                             f"{sum(len(o) for o in orders)} actions")
    return out


def _timeline(schedule: str, p: int, m: int, slots: list[Slot], stages: list[StageTimes],
              split_w: bool) -> Timeline:
    makespan = max(s.end_s for s in slots) - min(s.start_s for s in slots)
    busy = sum(s.end_s - s.start_s for s in slots)
    releases = "W" if split_w else "B"
    peak_count, peak_bytes = [0] * p, [0.0] * p
    by_rank: list[list[Slot]] = [[] for _ in range(p)]
    for s in slots:  # already in start order per rank: a rank runs one action at a time
        by_rank[s.rank].append(s)
    for r in range(p):
        count, held = 0, 0.0
        for s in by_rank[r]:
            if s.action == "F":
                count += 1
                held += stages[s.stage].activation_bytes
                peak_count[r] = max(peak_count[r], count)
                peak_bytes[r] = max(peak_bytes[r], held)
            elif s.action == releases:
                count -= 1
                held -= stages[s.stage].activation_bytes
    return Timeline(schedule=schedule, num_ranks=p, num_microbatches=m,
                    slots=tuple(sorted(slots, key=lambda s: (s.start_s, s.rank))),
                    step_time_s=makespan, bubble_fraction=1 - busy / (p * makespan),
                    peak_inflight=tuple(peak_count), peak_activation_bytes=tuple(peak_bytes))
