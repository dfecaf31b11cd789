"""The search cannot hang: divisors come from factorisation, and every loop stops at the
time limit (issue 16, part 6)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.errors import ConfigError, TimeLimitError
from autopar.planner import search
from autopar.planner.configs import divisors, pipeline_configs
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from passes.layer_graph import build_layer_graph

ROOT = Path(__file__).resolve().parents[3]


def brute_divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_equal_counting_on_every_small_number():
    assert all(divisors(n) == brute_divisors(n) for n in range(1, 2049))


@pytest.mark.parametrize("n, count", [
    (8 * 10**9, 130),                 # 10^9 DGX nodes: 2^12 · 5^9 → 13 · 10 divisors
    (2**40, 41),
    (8 * (10**12 + 39), 8),           # 10^12 + 39 is prime: 4 · 2 divisors
    (2**3 * 3**4 * 5**2 * 7 * 11 * 13, 4 * 5 * 3 * 2 * 2 * 2),
])
def test_divisors_of_huge_numbers_are_immediate_and_divide(n, count):
    start = time.perf_counter()
    out = divisors(n)
    assert time.perf_counter() - start < 1.0
    assert len(out) == count and out == sorted(out)
    assert all(n % d == 0 for d in out) and out[0] == 1 and out[-1] == n


def test_divisors_refuse_non_positive_numbers():
    with pytest.raises(ValueError, match="positive integer"):
        divisors(0)


@pytest.fixture(scope="module")
def tiny_graph():
    spec = get_model("gpt-tiny")
    return build_layer_graph(spec.build("meta"), spec.example_inputs(16, device="meta"),
                             model_name="gpt-tiny")


def test_a_billion_nodes_get_an_answer_at_once(tiny_graph):
    """The cluster file's limit refuses it first; below the limit, the divisors of a
    hundred thousand nodes come from factorisation, and a mesh search that no dp fits
    ends at once."""
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="beyond the limit of 100000"):
        Cluster.preset("dgx-a100-80g", nodes=10**9)
    cluster = Cluster.preset("dgx-a100-80g", nodes=99_991)  # a prime number of nodes
    assert pipeline_configs(tiny_graph, cluster) == []  # no dp of the batch fits a stage
    with pytest.raises(ConfigError, match="not divisible by any data-parallel degree"):
        search(tiny_graph, cluster)
    assert time.perf_counter() - start < 5.0


def test_cli_plans_a_billion_nodes_promptly_with_a_clear_error():
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "plan", "--model", "gpt2-small",
         "--nodes", "1000000000"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert "--nodes: expected a positive node count of at most 100000" in run.stderr
    assert time.perf_counter() - start < 120


class FakeClock:
    """time.perf_counter advancing one second per call: the deadline passes after a fixed
    number of checks, whatever the machine's speed."""

    def __init__(self) -> None:
        self.calls = itertools.count()

    def __call__(self) -> float:
        return float(next(self.calls))


def test_a_search_past_its_deadline_returns_the_best_plan_found_so_far(tiny_graph, monkeypatch):
    cluster = Cluster.local(4)
    full = search(tiny_graph, cluster, time_limit_s=600)
    assert full.plan.solver.status == "optimal"
    monkeypatch.setattr(time, "perf_counter", FakeClock())
    # The clock reads 0 at the start and 1 when the first mesh is searched; the clock
    # readings of its solves pass the deadline (second 2.5) before the second mesh.
    cut = search(tiny_graph, cluster, time_limit_s=2.5)
    report = cut.plan.solver
    assert report.status == "time limit"
    assert report.lower_bound_s == 0.0 and report.gap == 1.0  # nothing is certified
    assert cut.plan.mesh == cut.candidates[0].mesh  # the one mesh searched in time
    assert cut.plan.prediction.step_time_s >= full.plan.prediction.step_time_s
    skipped = [c for c in cut.candidates if "time limit" in c.reason]
    assert len(skipped) == len(cut.candidates) - 1


def test_a_search_with_no_plan_by_its_deadline_says_how_to_allow_more(tiny_graph, monkeypatch):
    monkeypatch.setattr(time, "perf_counter", FakeClock())
    with pytest.raises(TimeLimitError, match="within the time limit of 0.5 s: allow more time"):
        search(tiny_graph, Cluster.local(4), time_limit_s=0.5)


@pytest.mark.parametrize("limit", [0.0, -5.0, math.nan, math.inf])
def test_time_limit_must_be_a_positive_number_of_seconds(tiny_graph, limit):
    with pytest.raises(ConfigError, match="positive number of seconds"):
        search(tiny_graph, Cluster.local(2), time_limit_s=limit)
