"""The plan report: totals equal the plan's numbers, MFU follows PaLM, every number has a
source, the rationale round-trips through JSON, and progress is quiet off a terminal."""

from __future__ import annotations

import io

import pytest
from report_cases import BATCH, SEQ, gpt2_small_plan

from autopar.progress import SearchProgress
from autopar.report import format_plan, totals
from autopar.zoo import get_model
from runtime.plan import MemoryBreakdown, Mesh, Plan, Prediction
from runtime.plan_report import human_bytes, ms


def test_totals_equal_the_plans_prediction_and_appear_in_the_report():
    plan = gpt2_small_plan()
    p, t = plan.prediction, totals(plan)
    assert (t.step_time_s, t.compute_s, t.comm_s, t.bubble_s) == (
        p.step_time_s, p.compute_s, p.comm_s, p.bubble_s)
    assert t.compute_s + t.comm_s + t.bubble_s == pytest.approx(t.step_time_s)
    assert t.samples_per_s == pytest.approx(BATCH / p.step_time_s)
    assert t.tokens_per_s == pytest.approx(BATCH * SEQ / p.step_time_s)
    assert t.peak_memory_bytes == p.memory.total_bytes
    text = format_plan(plan)
    assert plan.report() == text
    for seconds in (p.step_time_s, p.compute_s, p.comm_s, p.bubble_s):
        assert ms(seconds) in text
    assert f"{t.mfu:.1%}" in text
    assert human_bytes(p.memory.total_bytes) in text
    assert human_bytes(p.memory.optimizer_bytes) in text


def test_mfu_is_palm_model_flops_over_peak_and_matches_the_closed_form():
    plan = gpt2_small_plan()
    r = plan.rationale
    expected = r.model_flops_per_step / (
        plan.prediction.step_time_s * plan.world_size * r.peak_flops_per_device)
    assert totals(plan).mfu == pytest.approx(expected)
    # PaLM appendix B: 6N + 12·L·H·Q·T FLOPs per token (N without embedding lookups).
    model = get_model("gpt2-small").build("meta")
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    n -= model.wte.weight.numel() + model.wpe.weight.numel()
    palm = (6 * n + 12 * cfg.n_layer * cfg.n_embd * SEQ) * BATCH * SEQ
    assert r.model_flops_per_step == pytest.approx(palm, rel=0.01)


def test_every_headline_number_is_labelled_with_its_source():
    text = format_plan(gpt2_small_plan())
    for label in ("predicted step time", "throughput", "MFU", "peak memory per rank"):
        line = next(x for x in text.splitlines() if x.strip().startswith(label))
        assert "[modelled]" in line, line
    assert "Layers  [modelled" in text and "Memory per rank  [modelled" in text


def test_per_rank_memory_table_sums_to_the_prediction():
    plan = gpt2_small_plan(memory_gib=4)
    m = plan.prediction.memory
    row = next(x for x in format_plan(plan).splitlines() if "(every rank)" in x)
    cells = [human_bytes(v) for v in (m.params_bytes, m.grads_bytes, m.optimizer_bytes,
                                      m.activations_bytes, m.buffers_bytes, m.margin_bytes,
                                      m.total_bytes)]
    assert row.split()[3:] == [c for cell in cells for c in cell.split()] + [
        f"{m.total_bytes / plan.prediction.capacity_bytes:.0%}"]


def test_alternatives_say_why_they_lost():
    plan = gpt2_small_plan()
    text = format_plan(plan, top_k=3)
    alts = plan.rationale.alternatives
    assert alts[0].mesh == plan.mesh and "chosen" in text
    slower = alts[1]
    if slower.step_time_s is not None:  # solved: its own plan's time
        delta = slower.step_time_s - plan.prediction.step_time_s
        assert f"slower by {ms(delta)}" in text
    else:  # not solved because its memory-blind bound already loses: the bound
        delta = slower.lower_bound_s - plan.prediction.step_time_s
        assert delta > 0 and f"slower by at least {ms(delta)}" in text
    assert text.count("\n  ") >= 3
    tight = gpt2_small_plan(memory_gib=0.5)
    infeasible = [a for a in tight.rationale.alternatives if a.status == "infeasible"]
    assert infeasible, "at 0.5 GiB some mesh should not fit"
    assert "does not fit: needs " + human_bytes(infeasible[0].min_memory_bytes) in format_plan(
        tight, top_k=10)


def test_rationale_round_trips_through_json():
    plan = gpt2_small_plan()
    assert Plan.from_json(plan.to_json()) == plan
    # Per class, not per layer: 16 layers share 4 classes. Alternatives are one per mesh.
    assert len(plan.rationale.classes) == len({la.layer_class for la in plan.layers}) < \
        len(plan.layers)
    assert len(plan.rationale.alternatives) == 10  # tp ∈ {1, 2, 4, 8} × cp ∈ {1, ..., 8 / tp}
    # each option's hidden communication: ~1 kB more; the blocks' fsdp_modules options ~1.4
    assert len(plan.to_json()) < 29_000


def test_hand_written_plan_reports_without_prediction_or_rationale():
    plan = Plan(global_batch=8, mesh=Mesh(dp=2))
    assert "no prediction" in plan.report()
    pred = Prediction(step_time_s=1.0, compute_s=0.75, comm_s=0.25,
                      memory=MemoryBreakdown(params_bytes=1024**3), capacity_bytes=2 * 1024**3,
                      source="calibrated")
    text = Plan(global_batch=8, mesh=Mesh(dp=2), prediction=pred).report()
    assert "1000.000 ms  [calibrated]" in text and "MFU                   -" in text
    assert "1 GiB of 2 GiB (50%)" in text


class FakeTTY(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_draws_on_a_terminal_and_is_quiet_otherwise(tty):
    from autopar.planner.search import Candidate

    stream = FakeTTY(tty)
    progress = SearchProgress(stream, min_interval_s=0)
    for i in (1, 2):
        progress(evaluated=i, total=2, best_s=0.0125,
                 candidate=Candidate(mesh=Mesh(dp=8 // i, tp=i), status="optimal"))
    progress.close()
    out = stream.getvalue()
    if tty:
        assert "2/2 candidates" in out and "best 12.500 ms/step" in out
    else:
        assert out == "" and progress.calls == 2


def test_search_reports_progress_until_every_candidate_is_counted():
    from autopar.api import search_plans

    spec = get_model("gpt-tiny")
    seen = []
    result = search_plans(spec.build("meta"), "dgx-a100-80g",
                          spec.example_inputs(16, device="meta"), model_name=spec.name,
                          progress=lambda **kw: seen.append(kw))
    counts = [s["evaluated"] for s in seen]
    assert counts == sorted(set(counts)) and counts[0] >= 1
    assert counts[-1] == len(result.candidates) <= seen[-1]["total"]
    assert seen[-1]["best_s"] == pytest.approx(result.plan.solver.objective_s)
