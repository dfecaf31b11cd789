"""Pipeline schedule timelines: the data a schedule simulator produces and reports draw."""

from __future__ import annotations

from dataclasses import dataclass

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
    """Per rank, the most micro-batches whose activations were held at once."""
