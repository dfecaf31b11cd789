"""Pipeline schedules: the one table of them, and the simulator of their timelines."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Literal

from cost_models.overlap import pipeline_p2p_slowdown_s


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """One pipeline schedule, named as torch.distributed.pipelining's ``Schedule*`` class."""

    name: str
    virtual_stages: tuple[int, ...] | None
    """Stages per pipeline rank it runs: the values listed, or None for any v >= 2."""
    placement: Literal["looped", "v"] = "looped"
    """Which rank runs stage s of pp ranks: looped (s mod pp), or V-shaped (stages 0..pp-1
    go down the ranks, pp..2pp-1 come back up)."""
    split_backward: bool = False
    """Runs a stage's backward in two passes (input gradients, then weight gradients).
    torch's selective activation checkpointing allows one backward through a region, so
    selective recomputation cannot run under it (full recomputation can)."""
    searched: tuple[int, ...] | None = (1,)
    """The virtual stages per rank the planner tries; None: every v from 2 up to the
    layers per rank (each virtual stage holds at least one layer)."""
    sends_waited: Literal["at_step_end", "before_other_pass", "with_next_recv"] = \
        "at_step_end"
    """Where torch's schedule class waits on a rank's sends (torch 2.13,
    torch/distributed/pipelining/schedules.py); receives are always waited right before
    the action that needs them.
    at_step_end: _PipelineScheduleRuntime (the table schedules) issues each send right
    after its action and waits on them all after the last one: the sender never waits.
    before_other_pass: ScheduleGPipe waits on all its forward sends once its forwards are
    done, before the first backward; its backward sends at the step's end.
    with_next_recv: Schedule1F1B issues a send that precedes the other pass (F then B, B
    then F) together with that action's receive and waits on both before it; a send that
    precedes the same pass (warm-up forwards, cool-down backwards) is waited once that
    next action ends, before its own send is issued."""

    def accepts(self, v: int) -> bool:
        return v >= 2 if self.virtual_stages is None else v in self.virtual_stages

    def stage_rank(self, stage: int, num_ranks: int) -> int:
        if self.placement == "v" and stage >= num_ranks:
            return 2 * num_ranks - 1 - stage
        return stage % num_ranks


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec(name="GPipe", virtual_stages=(1,), sends_waited="before_other_pass"),
    ScheduleSpec(name="1F1B", virtual_stages=(1,), sends_waited="with_next_recv"),
    ScheduleSpec(name="Interleaved1F1B", virtual_stages=None, searched=None),
    ScheduleSpec(name="InterleavedZeroBubble", virtual_stages=None, split_backward=True,
                 searched=None),
    ScheduleSpec(name="ZBVZeroBubble", virtual_stages=(2,), placement="v",
                 split_backward=True, searched=(2,)),
)}
"""Every schedule the planner searches, the simulator models and the runtime runs."""

ACTIONS = ("F", "B", "W")
"""F: forward; B: backward (input gradients, and weight gradients unless split off);
W: weight gradients on their own (zero-bubble schedules)."""


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One action of one micro-batch on one pipeline rank."""

    rank: int
    """Pipeline rank (coordinate on the pp axis)."""
    stage: int
    action: str
    """One of ACTIONS."""
    microbatch: int
    start_s: float
    end_s: float

    @property
    def label(self) -> str:
        """torch.distributed.pipelining's notation: stage, action, micro-batch (e.g. 2F0)."""
        return f"{self.stage}{self.action}{self.microbatch}"


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """A simulated step of a pipeline schedule."""

    schedule: str
    num_ranks: int
    num_microbatches: int
    slots: tuple[Slot, ...]
    step_time_s: float
    """From the first action's start to the last action's end."""
    bubble_fraction: float
    """Idle share of rank-time: 1 - busy / (num_ranks · step_time)."""
    peak_inflight: tuple[int, ...]
    """Per rank, the most stage micro-batches whose activations were held at once."""
    peak_activation_bytes: tuple[float, ...] = ()
    """Per rank, the most activation bytes held at once (StageTimes.activation_bytes)."""


# -- the simulator ------------------------------------------------------------------------
#
# Each rank runs its actions in a fixed order (the schedule); an action starts when its rank
# is free and its inputs have arrived (previous stage's F plus a point-to-point transfer,
# next stage's B likewise); a rank also waits on its own sends where its schedule class
# does (ScheduleSpec.sends_waited). Zero-bubble schedules split the backward into B (input
# gradients, on the critical path) and W (weight gradients), and run a pending W whenever
# the rank would otherwise wait (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

SIM_SCHEDULES = tuple(SCHEDULES)


@dataclass(frozen=True, kw_only=True)
class StageTimes:
    """Per micro-batch times of one stage, seconds."""

    fwd_s: float
    bwd_s: float
    """Input-gradient part of the backward (the whole backward when W is not split off)."""
    wgrad_s: float = 0.0
    """Weight-gradient part; folded into B by schedules that do not split it."""
    activation_bytes: float = 0.0
    """Activations one micro-batch holds on this stage between its F and its last backward."""


def stage_ranks(schedule: str, num_ranks: int, num_stages: int) -> list[int]:
    """Pipeline rank of each stage (the schedule's ``placement``)."""
    spec = SCHEDULES[schedule]
    return [spec.stage_rank(s, num_ranks) for s in range(num_stages)]


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
            # The k-th forward runs chunk (k // p) mod v (backwards: the chunks reversed)
            # on micro-batch (k // pv)·p + k mod p.
            fwd = [("F", r + (k // p) % v * p, k // (p * v) * p + k % p) for k in range(m * v)]
            bwd = [("B", r + (v - 1 - (k // p) % v) * p, k // (p * v) * p + k % p)
                   for k in range(m * v)]
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


def waits_on_sends(schedule: str) -> bool | None:
    """How the schedule's ranks wait on a send followed by an action of the same pass (F
    then F, B or W then B or W): True once that next action ends, False not before the
    step's end; None when no send is waited before the step's end. A send followed by an
    action of the other pass is then waited before that action starts (ScheduleSpec.
    sends_waited)."""
    rule = SCHEDULES[schedule].sends_waited
    return None if rule == "at_step_end" else rule == "with_next_recv"


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

    A result crossing to another rank is sent when its action ends (or, where the
    schedule first waits on an earlier send, once it has) and arrives ``p2p_s`` later;
    the transfer is taken to start when it is issued (a receiver that posts its receive
    late does not hold it up). The sender goes on until the point where its schedule
    class waits on that send (ScheduleSpec.sends_waited), its actions meanwhile slowed by
    the part of the transfer they overlap, as cost_models.overlap.pipeline_p2p_slowdown_s
    (``p2p_slowdown``: σ); with ``p2p_blocking`` it waits for every transfer at once.

    ``orders``: per rank, the (action, stage, micro-batch) sequence the runtime's schedule
    runs (runtime.schedule_orders reads torch's); each rank then runs exactly that order,
    weight-gradient passes (W) where it puts them. Without, the fixed F/B orders of
    ``rank_orders`` with each deferred W run when its rank would otherwise wait (at most
    num_ranks of them pending), and ZBVZeroBubble built greedily.
    """
    actions = run_actions(schedule, num_ranks, num_microbatches, stages, p2p_s,
                          p2p_slowdown=p2p_slowdown, p2p_blocking=p2p_blocking, orders=orders)
    return _timeline(schedule, num_ranks, num_microbatches, actions, stages,
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
    ``in_order``: schedules whose every rank's order is fixed (no split W, or ``orders``
    placing every W) take the heap-free path (_run_in_order); False runs them through the
    event loop too, the reference that path is tested against. ``orders``: as
    ``simulate``'s."""
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

    # The hop from the stage that feeds this one: its F from stage - 1, its B from stage + 1.
    hop_f = [p2p_s if st > 0 and owner[st - 1] != owner[st] else 0.0 for st in range(num_stages)]
    hop_b = [p2p_s if st < last and owner[st + 1] != owner[st] else 0.0
             for st in range(num_stages)]
    fwd = [t.fwd_s for t in stages]
    bwd = [t.bwd_s if split_w else t.bwd_s + t.wgrad_s for t in stages]
    wgrad = [t.wgrad_s for t in stages]
    sends_f = [st < last and owner[st + 1] != owner[st] for st in range(num_stages)]
    sends_b = [st > 0 and owner[st - 1] != owner[st] for st in range(num_stages)]
    # Without a transfer time, or with every send waited at once, the waits are moot.
    waits = None if p2p_s == 0.0 or p2p_blocking or greedy else waits_on_sends(schedule)

    if in_order and (explicit or not split_w):  # each rank's order is fixed
        ran = _run_in_order(orders, owner, fwd, bwd, wgrad, hop_f, hop_b, sends_f, sends_b,
                            p2p_s, p2p_slowdown, p2p_blocking, m, waits)
        # The event loop runs actions in order of (start, rank): an action starts after
        # the start of the one that enabled it, strictly unless that one took no time.
        # Sorted so, the actions come in its order, and sums over them add up alike;
        # with a zero-time action the event loop itself decides the order.
        if all(end > start for _, (_, _, _, start, end) in ran):
            ran.sort(key=lambda item: (item[1][3], item[0]))
            return [(rank, stage, action, mb, start, end)
                    for rank, (action, stage, mb, start, end) in ran]
    return _run_events(orders, owner, fwd, bwd, wgrad, hop_f, hop_b, sends_f, sends_b, p2p_s,
                       p2p_slowdown, p2p_blocking, m, explicit=explicit, greedy=greedy,
                       split_w=split_w, schedule=schedule, waits=waits)


def _run_events(orders: list[list[tuple[str, int, int]]], owner: list[int],
                fwd: list[float], bwd: list[float], wgrad: list[float], hop_f: list[float],
                hop_b: list[float], sends_f: list[bool], sends_b: list[bool], p2p_s: float,
                p2p_slowdown: float, p2p_blocking: bool, m: int, *, explicit: bool,
                greedy: bool, split_w: bool, schedule: str,
                waits: bool | None = None) -> list[Action]:
    """The event loop (run_actions' arguments, unpacked): each rank's next action and its
    start are chosen from what has completed so far; the earliest start runs next (ties:
    the lower rank). A rank's choice changes only when it runs something or an action
    completes one of its candidates' inputs, so only those ranks are re-examined."""
    p, num_stages = len(orders), len(fwd)
    last = num_stages - 1
    done_f: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    done_b: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    slowed = p2p_slowdown != 1.0
    clock = [0.0] * p
    pos = [0] * p
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    out: list[Action] = []
    sent_until = [0.0] * p  # when this rank's last send completes
    after_next = [False] * p  # whether it waits on that send once its next action ends
    held = [0] * p
    next_f = [0] * num_stages
    next_b = [0] * num_stages
    total = 2 * m * num_stages
    finished = 0

    def arrival(action: str, stage: int, mb: int) -> float | None:
        """When the inputs of an F or B have arrived; None until they have all been made."""
        if action == "F":
            if stage == 0:
                return 0.0
            t = done_f[stage - 1][mb]
            return None if t is None else t + hop_f[stage]
        t = done_f[stage][mb]  # the F ran on this rank: no hop
        if t is None or stage == last:
            return t
        u = done_b[stage + 1][mb]
        if u is None:
            return None
        u += hop_b[stage]
        return t if t >= u else u

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
            ready = done_b[stage][mb] if action == "W" else arrival(action, stage, mb)
            return None if ready is None else (max(clock[r], ready), (action, stage, mb))
        waiting = pending_w[r]
        if len(waiting) >= p:
            # Deferred weight gradients hold activations: at most p may wait, so a rank
            # holds at most p stage micro-batches more than the schedule without W split.
            stage, mb = waiting[0]
            return clock[r], ("W", stage, mb)
        now = clock[r]
        if not greedy:  # one candidate, the order's next: the loop below, unrolled
            order = orders[r]
            if pos[r] < len(order):
                action = order[pos[r]]
                kind, stage, mb = action
                if kind == "F":  # arrival(), inlined
                    if stage == 0:
                        ready = 0.0
                    else:
                        ready = done_f[stage - 1][mb]
                        if ready is not None:
                            ready += hop_f[stage]
                else:
                    ready = arrival(kind, stage, mb)
                if ready is not None and not (waiting and ready > now):
                    return (now if now >= ready else ready), action
            if waiting:
                stage, mb = waiting[0]
                return now, ("W", stage, mb)
            return None
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

    def waits_on(r: int, action: str, stage: int, mb: int) -> bool:
        """Whether ``action`` of ``stage`` on micro-batch ``mb`` is one of rank r's next
        candidates (so completing its input may change r's choice)."""
        if greedy:
            return (next_f if action == "F" else next_b)[stage] == mb
        order = orders[r]
        return pos[r] < len(order) and order[pos[r]] == (action, stage, mb)

    # A rank has at most one live entry (the latest version); older ones are skipped.
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
        if after_next[r]:  # an earlier send, waited once this action ends
            after_next[r] = False
            if sent_until[r] > end:
                clock[r] = sent_until[r]
        made = clock[r]  # when this action's result goes out (its send is issued)
        if (sends_f[stage] if action == "F" else action == "B" and sends_b[stage]):
            sent_until[r] = made + p2p_s
            if p2p_blocking:
                clock[r] = sent_until[r]
            elif waits is not None and pos[r] + 1 < len(orders[r]):
                if (orders[r][pos[r] + 1][0] == "F") != (action == "F"):
                    clock[r] = sent_until[r]  # with the next action's receive
                else:
                    after_next[r] = waits
        woken = -1  # the other rank whose candidate this action may have fed
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
                done_f[stage][mb] = made
                next_f[stage] += 1
                held[r] += 1
                if stage < last and owner[stage + 1] != r \
                        and waits_on(owner[stage + 1], "F", stage + 1, mb):
                    woken = owner[stage + 1]
            else:
                done_b[stage][mb] = made
                next_b[stage] += 1
                if split_w:
                    pending_w[r].append((stage, mb))
                else:
                    held[r] -= 1
                if stage > 0 and owner[stage - 1] != r \
                        and waits_on(owner[stage - 1], "B", stage - 1, mb):
                    woken = owner[stage - 1]
        # In rank order, as the ranks were re-examined before: versions only order a
        # rank's own entries, so any order of refreshes gives the same run.
        refresh(r)
        if woken >= 0:
            refresh(woken)
    if finished < total:
        raise AssertionError(f"{schedule} deadlocked after {finished} of {total} actions")
    return out


def _run_in_order(orders: list[list[tuple[str, int, int]]], owner: list[int],
                  fwd: list[float], bwd: list[float], wgrad: list[float],
                  hop_f: list[float], hop_b: list[float],
                  sends_f: list[bool], sends_b: list[bool], p2p_s: float, p2p_slowdown: float,
                  p2p_blocking: bool, m: int, waits: bool | None = None
                  ) -> list[tuple[int, tuple[str, int, int, float, float]]]:
    """run_actions for fixed orders (no split W, or ``orders`` placing every W): an action
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
    after_next = [False] * p  # whether a rank waits on its last send once this action ends
    slowed = p2p_slowdown != 1.0
    out: list[tuple[int, tuple[str, int, int, float, float]]] = []
    ready_ranks = list(range(p))
    while ready_ranks:
        r = ready_ranks.pop()
        order = orders[r]
        while pos[r] < len(order):
            action, stage, mb = order[pos[r]]
            if action == "W":  # after its own B, on this rank: sends and wakes nothing
                ready = done_b[stage][mb]
                if ready is None:
                    break
                start = clock[r] if clock[r] >= ready else ready
                end = start + wgrad[stage]
                in_flight = sent_until[r] - start
                if in_flight > 0.0 or slowed:
                    end += pipeline_p2p_slowdown_s(end - start, max(0.0, in_flight),
                                                   slowdown=p2p_slowdown)
                out.append((r, (action, stage, mb, start, end)))
                clock[r] = end
                if after_next[r]:
                    after_next[r] = False
                    if sent_until[r] > end:
                        clock[r] = sent_until[r]
                pos[r] += 1
                continue
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
            if after_next[r]:  # an earlier send, waited once this action ends
                after_next[r] = False
                if sent_until[r] > end:
                    clock[r] = end = sent_until[r]  # ``end`` now: when the result goes out
            if sends_f[stage] if action == "F" else sends_b[stage]:
                sent_until[r] = end + p2p_s
                if p2p_blocking:
                    clock[r] = sent_until[r]
                elif waits is not None and pos[r] + 1 < len(order):
                    if (order[pos[r] + 1][0] == "F") != (action == "F"):
                        clock[r] = sent_until[r]  # with the next action's receive
                    else:
                        after_next[r] = waits
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


def _timeline(schedule: str, p: int, m: int, actions: list[Action],
              stages: list[StageTimes], split_w: bool) -> Timeline:
    makespan = max(a[5] for a in actions) - min(a[4] for a in actions)
    busy = sum(a[5] - a[4] for a in actions)
    releases = "W" if split_w else "B"
    peak_count, peak_bytes = [0] * p, [0.0] * p
    count, held = [0] * p, [0.0] * p
    for r, stage, action, _, _, _ in actions:  # in start order per rank: one at a time
        if action == "F":
            count[r] += 1
            held[r] += stages[stage].activation_bytes
            peak_count[r] = max(peak_count[r], count[r])
            peak_bytes[r] = max(peak_bytes[r], held[r])
        elif action == releases:
            count[r] -= 1
            held[r] -= stages[stage].activation_bytes
    ordered = sorted(actions, key=lambda a: (a[4], a[0]))
    return Timeline(schedule=schedule, num_ranks=p, num_microbatches=m,
                    slots=tuple(map(_slot, ordered)),
                    step_time_s=makespan, bubble_fraction=1 - busy / (p * makespan),
                    peak_inflight=tuple(peak_count), peak_activation_bytes=tuple(peak_bytes))


_new = object.__new__


def _slot(action: Action) -> Slot:
    """``Slot(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (a
    third of the cost; the planner builds 130,000 of them for one plan): the same fields,
    set at once, as ``copy.copy`` sets them."""
    slot = _new(Slot)
    rank, stage, kind, mb, start, end = action
    slot.__dict__.update(rank=rank, stage=stage, action=kind, microbatch=mb, start_s=start,
                         end_s=end)
    return slot
