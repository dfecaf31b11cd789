"""The order in which torch.distributed.pipelining's schedules run each rank's actions,
read from torch's own schedule classes, so that the planner simulates what runs.

The multi-stage schedules (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble) build
their whole program as a table when constructed: per rank, a list of actions (stage,
forward / backward / weight-gradient pass, micro-batch), with empty slots where a rank
waits. ``torch_rank_orders`` asks each schedule's own ``_calculate_single_rank_operations``
for that table without building stages or process groups: the method reads only the
degrees set here (torch 2.13; tests/runtime/test_schedule_orders.py fails if that
changes). GPipe and 1F1B run imperatively, with no table; their orders are the textbook
ones (cost_models.schedule.rank_orders).
"""

from __future__ import annotations

import functools

from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _ComputationType

from cost_models.schedule import rank_orders

ACTION_OF = {
    _ComputationType.FORWARD: "F",
    _ComputationType.FULL_BACKWARD: "B",
    _ComputationType.BACKWARD_INPUT: "B",
    _ComputationType.BACKWARD_WEIGHT: "W",
}
"""torch's computation types as the simulator's actions (cost_models.schedule.ACTIONS)."""


def torch_rank_orders(schedule: str, pp: int, virtual_stages: int, microbatches: int
                      ) -> list[list[tuple[str, int, int]]] | None:
    """Per pipeline rank, the (action, stage, micro-batch) sequence torch's schedule runs;
    None for schedules without a table (GPipe, 1F1B)."""
    cls = getattr(schedules, f"Schedule{schedule}")
    if not issubclass(cls, PipelineScheduleMulti):
        return None
    table = object.__new__(cls)  # the table needs the degrees, not the stages
    rounds = max(1, microbatches // pp)
    table.__dict__.update(pp_group_size=pp, n_local_stages=virtual_stages,
                          _n_microbatches=microbatches, n_microbatches=microbatches,
                          num_stages=pp * virtual_stages, _num_stages=pp * virtual_stages,
                          number_of_rounds=rounds, microbatches_per_round=microbatches // rounds)
    return [[(ACTION_OF[a.computation_type], a.stage_index, a.microbatch_index)
             for a in table._calculate_single_rank_operations(rank) if a is not None]
            for rank in range(pp)]


BUILT_IN_EQUALS_TORCH = frozenset({"Interleaved1F1B"})
"""Schedules whose torch table is, action for action, the simulator's own order
(``cost_models.schedule.rank_orders``; tests/runtime/test_schedule_orders.py checks every
shape up to pp = 16, v = 6, m = 4·pp), which builds it ten times faster."""


@functools.lru_cache(maxsize=512)
def runtime_orders(schedule: str, pp: int, virtual_stages: int, microbatches: int
                   ) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per pipeline rank, the (action, stage, micro-batch) sequence the runtime runs:
    torch's own table where the schedule has one, the textbook order of GPipe and 1F1B
    (which torch runs imperatively) otherwise. What the planner simulates."""
    if schedule in BUILT_IN_EQUALS_TORCH:
        orders = rank_orders(schedule, pp, virtual_stages, microbatches)
    else:
        orders = torch_rank_orders(schedule, pp, virtual_stages, microbatches)
        if orders is None:
            orders = rank_orders(schedule, pp, virtual_stages, microbatches)
    return tuple(tuple(order) for order in orders)
