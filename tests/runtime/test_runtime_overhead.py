"""bench/runtime_overhead.py compares equal work: its hand-written torch programs (DDP, TP
with parallelize_module, a PipelineStage with Schedule1F1B) and autopar's trainer under
the same plan start from the same loss, one process's, and stay together."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from dist_pool import RANKS

pytestmark = RANKS  # spawns its own ranks (tests/dist_pool.py)

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_hand_written_programs_match_autopar_and_one_process(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the spawned ranks import the script by name
    bench = importlib.import_module("runtime_overhead")
    spec = bench.spec()
    inputs, targets = spec.make_batch(bench.BATCH, bench.SEQ, seed=0)
    one_process = spec.loss_fn(spec.build(seed=0)(*inputs), targets).item()

    rows = bench.run(("ddp", "tp", "pipeline"), nproc=2, steps=1, warmup=0,
                     schedule="1F1B", microbatches=4)

    assert [r.plan for r in rows] == ["ddp", "tp", "pipeline"]
    for row in rows:
        autopar, hand = row.first_losses
        assert autopar == pytest.approx(one_process, rel=1e-5), row.plan
        assert hand == pytest.approx(one_process, rel=1e-5), row.plan
        assert row.worst_loss_rel < 1e-5, row.plan
        assert row.wall_s["autopar"] > 0 and row.cpu_s["hand"] > 0
