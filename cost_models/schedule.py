"""Pipeline schedules: the one table of them, and the simulator of their timelines."""

from __future__ import annotations

import heapq
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
    searched: tuple[int, ...] = (1,)
    """The virtual stages per rank the planner tries."""

    def accepts(self, v: int) -> bool:
        return v >= 2 if self.virtual_stages is None else v in self.virtual_stages

    def stage_rank(self, stage: int, num_ranks: int) -> int:
        if self.placement == "v" and stage >= num_ranks:
            return 2 * num_ranks - 1 - stage
        return stage % num_ranks


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec(name="GPipe", virtual_stages=(1,)),
    ScheduleSpec(name="1F1B", virtual_stages=(1,)),
    ScheduleSpec(name="Interleaved1F1B", virtual_stages=None, searched=(2,)),
    ScheduleSpec(name="InterleavedZeroBubble", virtual_stages=None, split_backward=True,
                 searched=(2,)),
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
# next stage's B likewise). Zero-bubble schedules split the backward into B (input
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

    ``orders``: per rank, the (action, stage, micro-batch) sequence the runtime's schedule
    runs (runtime.schedule_orders reads torch's); each rank then runs exactly that order,
    weight-gradient passes (W) where it puts them. Without, the fixed F/B orders of
    ``rank_orders`` with each deferred W run when its rank would otherwise wait (at most
    num_ranks of them pending), and ZBVZeroBubble built greedily.

    A result crossing to another rank arrives ``p2p_s`` after its action ends. Meanwhile
    the sender goes on (torch.distributed.pipelining's isend), its next action slowed by
    the part of the transfer it overlaps, as cost_models.overlap.pipeline_p2p_slowdown_s
    (``p2p_slowdown``: σ); with ``p2p_blocking`` it waits for the transfer instead.
    """
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
    last = len(stages) - 1

    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    pos = [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    slots: list[Slot] = []

    def arrival(action: str, stage: int, mb: int) -> float | None:
        if action == "W":  # after its own B, on the same rank
            return done.get(("B", stage, mb))
        if action == "F":
            deps = [] if stage == 0 else [("F", stage - 1, mb)]
        else:
            deps = [("F", stage, mb)] + ([] if stage == last else [("B", stage + 1, mb)])
        times = []
        for dep in deps:
            if dep not in done:
                return None
            hop = p2p_s if owner[dep[1]] != owner[stage] else 0.0
            times.append(done[dep] + hop)
        return max(times, default=0.0)

    def duration(action: str, stage: int) -> float:
        t = stages[stage]
        if action == "F":
            return t.fwd_s
        if action == "W":
            return t.wgrad_s
        return t.bwd_s if split_w else t.bwd_s + t.wgrad_s

    def sends(action: str, stage: int) -> bool:
        to = stage + 1 if action == "F" else stage - 1
        return action != "W" and 0 <= to <= last and owner[to] != owner[stage]

    sent_until = [0.0] * p  # when this rank's last send completes

    held = [0] * p
    next_mb = {(a, st): 0 for a in "FB" for st in range(len(stages))}
    total = 2 * m * len(stages)

    def candidates(r: int) -> list[tuple[str, int, int]]:
        if not greedy:
            return [orders[r][pos[r]]] if pos[r] < len(orders[r]) else []
        # ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): each
        # rank holds stage r going down and stage 2p-1-r coming back; backwards first, and
        # down-chunk forwards only while fewer than 2p half stages are held. With up to p
        # deferred W's this holds at most 1.5x 1F1B's activations (the paper's hand-built
        # ZB-V holds exactly 1F1B's).
        # The cap gates only the down chunk: an up-chunk forward follows this rank's own
        # down-chunk forward of the same micro-batch, and must never wait on the cap, or a
        # rank that filled it with down-chunk forwards would never free it (deadlock).
        down, up = r, 2 * p - 1 - r
        out = [("B", st, next_mb["B", st]) for st in (up, down) if next_mb["B", st] < m]
        if next_mb["F", up] < m:
            out.append(("F", up, next_mb["F", up]))
        if held[r] < 2 * p and next_mb["F", down] < m:
            out.append(("F", down, next_mb["F", down]))
        return out

    def choose(r: int) -> tuple[float, tuple[str, int, int]] | None:
        """The action rank r runs next and when, given what has completed so far."""
        if explicit:
            if pos[r] >= len(orders[r]):
                return None
            action, stage, mb = orders[r][pos[r]]
            ready = arrival(action, stage, mb)
            return None if ready is None else (max(clock[r], ready), (action, stage, mb))
        if len(pending_w[r]) >= p:
            # Deferred weight gradients hold activations: at most p may wait, so a rank
            # holds at most p stage micro-batches more than the schedule without W split.
            stage, mb = pending_w[r][0]
            return clock[r], ("W", stage, mb)
        choice = None
        for priority, (action, stage, mb) in enumerate(candidates(r)):
            ready = arrival(action, stage, mb)
            if ready is None or (pending_w[r] and ready > clock[r]):
                continue
            option = (max(clock[r], ready), priority, (action, stage, mb))
            if choice is None or option[:2] < choice[:2]:
                choice = option
        if choice is not None:
            return choice[0], choice[2]
        if pending_w[r]:
            stage, mb = pending_w[r][0]
            return clock[r], ("W", stage, mb)
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
        end = start + duration(action, stage)
        in_flight = max(0.0, sent_until[r] - start)
        end += pipeline_p2p_slowdown_s(end - start, in_flight, slowdown=p2p_slowdown)
        slots.append(Slot(rank=r, stage=stage, action=action, microbatch=mb,
                          start_s=start, end_s=end))
        clock[r] = end
        if sends(action, stage):
            sent_until[r] = end + p2p_s
            if p2p_blocking:
                clock[r] = sent_until[r]
        if action == "W":
            pending_w[r].remove((stage, mb))
            held[r] -= 1
            pos[r] += explicit
        else:
            done[(action, stage, mb)] = end
            pos[r] += 1
            next_mb[action, stage] += 1
            held[r] += 1 if action == "F" else 0
            if action == "B" and split_w:
                pending_w[r].append((stage, mb))
            elif action == "B":
                held[r] -= 1
        for affected in {r} | {owner[n] for n in (stage - 1, stage + 1) if 0 <= n <= last}:
            refresh(affected)
    if len(done) < total:
        raise AssertionError(f"{schedule} deadlocked after {len(done)} of {total} actions")
    return _timeline(schedule, p, m, slots, stages, split_w)


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
