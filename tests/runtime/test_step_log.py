"""The step log (runtime/step_log.py): one plain line every N steps with loss, throughput,
MFU against the plan's prediction and peak memory, through the ``autopar.steps`` logger."""

from __future__ import annotations

import logging
import resource
from types import SimpleNamespace

import pytest
import torch

from runtime.plan import MemoryBreakdown, Mesh, Plan, Prediction, Rationale
from runtime.step_log import StepLog


def _plan(**changes) -> Plan:
    """dp=4, a global batch of 32 sequences of 128 tokens, 4e12 model FLOPs a step on
    devices of 1e12 FLOP/s, predicted at 2 s a step."""
    prediction = Prediction(step_time_s=2.0, compute_s=1.5, comm_s=0.5,
                            memory=MemoryBreakdown(), capacity_bytes=2**34)
    rationale = Rationale(model_flops_per_step=4e12, peak_flops_per_device=1e12, nodes=1,
                          devices_per_node=4, memory_margin_fraction=0.1)
    fields = dict(global_batch=32, seq_len=128, mesh=Mesh(dp=4), prediction=prediction,
                  rationale=rationale)
    return Plan(**{**fields, **changes})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _log(plan: Plan, every: int, clock: Clock, **kwargs) -> StepLog:
    return StepLog(SimpleNamespace(plan=plan, device=torch.device("cpu")), every, clock=clock,
                   **kwargs)


def test_every_nth_step_logs_one_plain_line_with_hand_derived_numbers(caplog):
    """4 steps in 10 s: 2.5 s a step; 32 × 128 tokens / 2.5 s = 1638 tokens/s;
    MFU 4e12 / (2.5 s × 4 × 1e12) = 40%, the plan's 2 s would be 50%."""
    clock = Clock()
    log = _log(_plan(), 4, clock)
    caplog.set_level(logging.INFO, logger="autopar.steps")
    lines = []
    for step in range(1, 9):
        clock.now += 2.5
        lines.append(log(step, 3.25))
    assert lines[:3] == [None] * 3 and lines[4:7] == [None] * 3
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    assert lines[3].startswith(
        "step 4 | loss 3.250000 | 1638 tokens/s | 2.500 s/step (plan 2.000 s) | "
        "mfu 40.0% (plan 50.0%) | peak memory ")
    assert lines[3].endswith(" GiB (rss)")
    logged_gib = float(lines[3].split("peak memory ")[1].split(" GiB")[0])
    assert logged_gib == pytest.approx(rss_gib, abs=0.02)
    assert lines[7].startswith("step 8 | ")
    assert [r.getMessage() for r in caplog.records] == [lines[3], lines[7]]
    assert all(r.name == "autopar.steps" and r.levelno == logging.INFO for r in caplog.records)
    assert not any("\r" in line or "\n" in line for line in (lines[3], lines[7]))


def test_without_sequences_or_flop_counts_it_says_samples_and_no_mfu():
    clock = Clock()
    log = _log(_plan(seq_len=None, rationale=None, prediction=None), 1, clock)
    clock.now += 0.5
    line = log(1, 0.5)
    assert line.startswith("step 1 | loss 0.500000 | 64.0 samples/s | 0.500 s/step | "
                           "mfu n/a (the plan has no FLOP count) | peak memory ")


def test_tokens_per_sample_overrides_the_plan_and_every_must_be_positive():
    clock = Clock()
    log = _log(_plan(seq_len=None), 1, clock, tokens_per_sample=10)
    clock.now += 1.0
    assert "| 320 tokens/s |" in log(1, 1.0)
    with pytest.raises(ValueError, match="every must be a positive number of steps"):
        _log(_plan(), 0, clock)


def run_job(plan_json: str) -> tuple[list[float], list[str]]:
    """``autopar run``'s loop on one rank, with what it logged to ``autopar.steps``."""
    from autopar.training import train_worker

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    steps = logging.getLogger("autopar.steps")
    steps.addHandler(handler)
    steps.setLevel(logging.INFO)
    try:
        losses = train_worker("gpt-tiny", plan_json, 4, 8, 16, 0, log_every=2)
    finally:
        steps.removeHandler(handler)
    return losses, lines


def test_autopar_runs_loop_logs_every_n_steps_on_rank_0_only(pool2):
    from test_runtime_numerics import gpt_all

    (losses, lines), (_, other) = pool2.run(run_job, gpt_all("replicate", dp=2))
    assert [line.split(" | ")[:2] for line in lines] == [
        ["step 2", f"loss {losses[1]:.6f}"], ["step 4", f"loss {losses[3]:.6f}"]]
    assert all(" tokens/s | " in line for line in lines)  # gpt-tiny: 8 × 16 tokens a step
    assert other == []
