"""Calibration: the fits recover known numbers; a quick run writes a profile the planner uses."""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import replace

import pytest
from dist_pool import RANKS
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.api import search_plans
from autopar.calibrate import (
    OVERLAP_PATTERNS,
    Measurements,
    OverlapSample,
    Settings,
    fit,
    fitted_gemm_curve,
    write_profile,
)
from autopar.calibration_kernels import loss_op, memory_kernels
from autopar.calibration_measure import HostTiming
from autopar.cli import main
from autopar.planner.loss_costs import LOSS_BWD_PASSES, LOSS_FWD_PASSES
from autopar.zoo import get_model
from cost_models.calibrate import (
    AlphaBeta,
    CalibrationError,
    fit_alpha_beta,
    fit_matmul,
    fit_overlap_slowdown,
    kernel_mix_bandwidth_GBps,
    nondecreasing_fit,
    predict_s,
    spread,
)
from cost_models.comm import Group, all_gather_s, all_reduce_s, group_link, p2p_s
from cost_models.compute import roofline_s
from cost_models.errors import ConfigError
from cost_models.hardware import Cluster, Link
from cost_models.overlap import overlap_slowdown_s

pytestmark = RANKS  # spawns its own ranks (tests/dist_pool.py)

SIZES = [4096 * 4**i for i in range(7)]  # 4 KiB … 16 MiB


# -- fits on synthetic data --------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(alpha=st.floats(1e-6, 1e-3), gbps=st.floats(0.1, 500), n=st.integers(2, 64),
       kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "p2p"]))
def test_fit_alpha_beta_recovers_known_latency_and_bandwidth(alpha, gbps, n, kind):
    times = [predict_s(kind, s, n, AlphaBeta(alpha, gbps)) for s in SIZES]
    fit = fit_alpha_beta(SIZES, times, kind=kind, group_size=n)
    assert fit.latency_s == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert fit.bandwidth_GBps == pytest.approx(gbps, rel=1e-6)


@given(alpha=st.floats(1e-6, 1e-3), gbps=st.floats(0.1, 500), n=st.integers(2, 16))
def test_fitted_link_plugged_into_comm_reproduces_the_ring_times(alpha, gbps, n):
    link = Link(kind="loopback", bandwidth_GBps=gbps, latency_s=alpha)
    cluster = replace(Cluster.local(n), intra_node=link)
    group = Group(n)
    for kind, model in (("all_reduce", all_reduce_s), ("all_gather", all_gather_s)):
        fit = fit_alpha_beta(SIZES, [model(s, group, cluster) for s in SIZES], kind=kind,
                             group_size=n)
        refit = Link(kind="loopback", bandwidth_GBps=fit.bandwidth_GBps, latency_s=fit.latency_s)
        again = replace(cluster, intra_node=refit)
        for s in SIZES:
            assert model(s, group, again) == pytest.approx(model(s, group, cluster), rel=1e-6)
    fit = fit_alpha_beta(SIZES, [p2p_s(s, link) for s in SIZES], kind="p2p")
    assert (fit.latency_s, fit.bandwidth_GBps) == pytest.approx((alpha, gbps), rel=1e-6)


def test_noisy_fit_keeps_latency_non_negative_and_rejects_flat_times():
    fit = fit_alpha_beta([1e3, 1e6, 1e7], [1e-4, 1e-3, 1.01e-2], kind="p2p")
    assert fit.latency_s >= 0 and fit.bandwidth_GBps > 0
    with pytest.raises(CalibrationError, match="do not grow with message size"):
        fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3], kind="p2p")
    with pytest.raises(CalibrationError, match="at least 2 ranks"):
        fit_alpha_beta(SIZES, SIZES, kind="all_reduce", group_size=1)


@given(peak=st.floats(1e9, 1e15), eff=st.floats(0.05, 1.0))
def test_fit_matmul_recovers_efficiency_against_a_known_peak(peak, eff):
    sizes = [256, 512, 1024, 2048]
    # small GEMMs further from peak: rate = eff·peak·n/(n + 64) at 2048 is the "large" rate
    large_rate = eff * peak
    rates = [large_rate * (n / (n + 64)) / (2048 / (2048 + 64)) for n in sizes]
    times = [2 * n**3 / r for n, r in zip(sizes, rates, strict=True)]
    fit = fit_matmul(sizes, times, peak_flops=peak)
    assert fit.efficiency == pytest.approx(eff, rel=1e-9)
    own = fit_matmul(sizes, times)  # peak := best measured: here the largest GEMM
    assert own.peak_flops == pytest.approx(large_rate) and own.efficiency == pytest.approx(1.0)


def test_memory_bandwidth_of_a_kernel_mix_is_the_harmonic_mean_of_their_rates():
    # 1 GB through a 10 GB/s copy and a 2.5 GB/s softmax: 0.1 + 0.4 s for 2 GB, 4 GB/s.
    assert kernel_mix_bandwidth_GBps([2e9, 1e9], [0.2, 0.4]) == pytest.approx(4.0)
    assert kernel_mix_bandwidth_GBps([1e9], [0.1]) == pytest.approx(10.0)
    with pytest.raises(CalibrationError, match="positive kernel sizes"):
        kernel_mix_bandwidth_GBps([1e9], [0.0])


# -- overlap slowdown and repeatability, on synthetic timings ---------------------------------

@given(sigma=st.floats(1.0, 9.0), compute_s=st.floats(1e-3, 1.0),
       comm_over_compute=st.floats(0.05, 20.0))
def test_overlap_fit_recovers_the_slowdown_cost_models_overlap_charges(
        sigma, compute_s, comm_over_compute):
    # Timings as cost_models.overlap models them: compute P beside communication C takes
    # P + w(1 - 1/σ); the communication outlasts it or not, and the fit reads σ either way.
    comm_s = comm_over_compute * compute_s
    beside_s = compute_s + overlap_slowdown_s(compute_s, comm_s, slowdown=sigma)
    assert fit_overlap_slowdown(compute_s, beside_s, comm_s) == pytest.approx(sigma, rel=1e-6)


def test_overlap_fit_reads_compute_beside_over_alone_when_the_communication_outlasts_it():
    assert fit_overlap_slowdown(0.1, 0.25, 0.4) == pytest.approx(2.5)
    assert fit_overlap_slowdown(0.1, 0.25, 0.25) == pytest.approx(2.5)  # the cases meet


def test_overlap_fit_clamps_a_speed_up_to_one_and_rejects_what_the_model_cannot_explain():
    assert fit_overlap_slowdown(0.1, 0.08, 0.5) == 1.0  # faster beside comm: noise
    assert fit_overlap_slowdown(0.1, 0.09, 0.05) == 1.0
    with pytest.raises(CalibrationError, match="more than the communication ran"):
        fit_overlap_slowdown(0.1, 0.2, 0.05)  # lost 0.1 s beside 0.05 s of communication
    with pytest.raises(CalibrationError, match="must be positive"):
        fit_overlap_slowdown(0.0, 0.1, 0.1)


def test_spread_of_repeated_windows():
    s = spread([30.0, 40.0, 36.0])
    assert (s.low, s.median, s.high) == (30.0, 36.0, 40.0)
    assert s.relative == pytest.approx(10 / 36)
    assert spread([5.0]).relative == 0
    with pytest.raises(CalibrationError, match="positive repeated measurements"):
        spread([])


def synthetic_measurements(sigmas: dict[str, float]) -> Measurements:
    """Two ranks' worth of clean timings: 40 GFLOP/s GEMMs (windows 36..44), a 1 GB/s link,
    and per pattern three (alone, beside) pairs slowed by the given σ."""
    m = Measurements(backend="gloo", nproc=2, threads=1, floor_s=1e-5,
                     memory_kernels={"copy": (2**27, 0.01), "softmax": (2**27, 0.04)})
    rates = (36e9, 40e9, 44e9)
    m.gemm_windows_s = {"float32": {n: [2 * n**3 / r for r in rates] for n in (256, 512, 1024)}}
    m.gemm_s = {"float32": {n: w[1] for n, w in m.gemm_windows_s["float32"].items()}}
    link = AlphaBeta(1e-4, 1.0)
    m.comm_s = {"all_reduce": {s: predict_s("all_reduce", s, 2, link) for s in SIZES}}
    m.overlap = {p: [OverlapSample(0.2, 0.2 * sigma * k, 10.0) for k in (0.95, 1.0, 1.1)]
                 for p, sigma in sigmas.items()}
    return m


def test_profile_writes_the_measured_slowdowns_and_the_gemm_spread_and_reads_them_back(
        tmp_path):
    sigmas = {"dp": 1.8, "fsdp": 2.5, "pp": 0.9}  # pp ran faster beside its send/recv: 1
    cal = fit(synthetic_measurements(sigmas), Settings())
    assert cal.overlap["dp"].median == pytest.approx(1.8)
    assert (cal.overlap["fsdp"].low, cal.overlap["fsdp"].high) == pytest.approx((2.375, 2.75))
    assert cal.overlap["pp"].median == 1.0
    assert cal.gemm_spread["float32"][512].relative == pytest.approx(8 / 40)
    cluster = write_profile(cal, tmp_path / "p.toml")
    assert (cluster.overlap.dp_slowdown, cluster.overlap.fsdp_slowdown,
            cluster.overlap.pp_slowdown) == pytest.approx((1.8, 2.5, 1.0))
    assert "overlap slowdown measured" in cluster.source
    assert cluster.overlap.exposed == ("fsdp",)  # FSDP2 on CPU ranks waits for its collectives
    text = (tmp_path / "p.toml").read_text()
    assert "# [overlap]: measured." in text
    gemm = cluster.extra["gemm"]["float32"]
    assert gemm["tflops_min"] == pytest.approx([0.036] * 3)
    assert gemm["tflops_max"] == pytest.approx([0.044] * 3)
    assert cluster.extra["overlap"]["fsdp"]["compute_beside_s"] == pytest.approx([0.475, 0.5, 0.55])


def test_profile_writes_the_host_overheads_and_reads_them_back(tmp_path):
    m = synthetic_measurements({})
    m.host = HostTiming(fsdp_s=9e-4, tp_s=1.1e-3, dtensor_op_s=4e-5, skew_s=3e-3,
                        skew_at=((2**20, 4.5e-3), (2**22, 6e-3)), skew_window_s=0.01)
    cluster = write_profile(fit(m, Settings()), tmp_path / "p.toml")
    d = cluster.device
    assert (d.fsdp_overhead_s, d.tp_overhead_s, d.dtensor_op_overhead_s,
            d.collective_skew_s) == pytest.approx((9e-4, 1.1e-3, 4e-5, 3e-3))
    assert [n for n, _ in d.collective_skew_at] == [2**20, 2**22]
    assert [t for _, t in d.collective_skew_at] == pytest.approx([4.5e-3, 6e-3])
    # A skew measured lower at a larger message than at one element (noise) is pooled:
    # the file keeps the nearest non-decreasing curve, and what was measured beside it.
    m.host = replace(m.host, skew_at=((2**20, 2e-3), (2**22, 6e-3)))
    d = write_profile(fit(m, Settings()), tmp_path / "q.toml").device
    assert d.collective_skew_s == pytest.approx(2.5e-3)
    assert [t for _, t in d.collective_skew_at] == pytest.approx([2.5e-3, 6e-3])
    assert "measured_us = [3000, 2000, 6000]" in (tmp_path / "q.toml").read_text()
    assert "after 10 ms" in (tmp_path / "p.toml").read_text()



def test_an_engine_measured_as_free_on_cpu_ranks_is_refused_not_written():
    # fsdp - plain <= 0 on every try: the plain stack ran as slow as the wrapped one
    # (other work swamped it); a profile saying FSDP2 costs no host time would be wrong.
    m = synthetic_measurements({})
    m.host = HostTiming(fsdp_s=0.0, tp_s=1.1e-3, dtensor_op_s=0.0, skew_s=None, skew_at=(),
                        skew_window_s=0.01)
    with pytest.raises(CalibrationError, match=r"FSDP2, DTensor measured 3 times .* idle"):
        fit(m, Settings())

@pytest.mark.parametrize("values, fitted", [
    ([1, 2, 3], [1, 2, 3]),
    ([3, 1, 2], [2, 2, 2]),
    ([2.5, 0, 1.3, 7.45, 7.7], [1.25, 1.25, 1.3, 7.45, 7.7]),
    ([2.7, 0.9, 3.9, 8.1, 5.6], [1.8, 1.8, 3.9, 6.85, 6.85]),
])
def test_nondecreasing_fit_pools_adjacent_violators(values, fitted):
    assert nondecreasing_fit(values) == pytest.approx(fitted)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e-2, allow_nan=False), min_size=1, max_size=8))
def test_nondecreasing_fit_never_falls_and_keeps_the_total(values):
    fitted = nondecreasing_fit(values)
    assert all(a <= b + 1e-15 for a, b in zip(fitted, fitted[1:], strict=False))
    assert sum(fitted) == pytest.approx(sum(values), abs=1e-12)
    if values == sorted(values):
        assert fitted == pytest.approx(values)


def test_a_slowdown_no_profile_accepts_is_left_at_the_default_with_a_note(tmp_path):
    cal = fit(synthetic_measurements({"dp": 12.0, "pp": 1.5}), Settings())
    assert "dp" not in cal.overlap and any("past what a profile accepts" in n for n in cal.notes)
    cluster = write_profile(cal, tmp_path / "p.toml")
    assert cluster.overlap.dp_slowdown == Cluster.local(2).overlap.dp_slowdown
    assert cluster.overlap.pp_slowdown == pytest.approx(1.5)


@pytest.mark.parametrize("value", ["0.5", '"fast"', "true", "10"])
def test_malformed_overlap_slowdown_is_refused_naming_the_field(value):
    text = PROFILE_WITHOUT_OVERLAP + f"\n[overlap]\ndp_slowdown = {value}\n"
    with pytest.raises(ConfigError, match=r"\[overlap\]: dp_slowdown must be a number"):
        Cluster.from_toml_text(text, source="p.toml")


PROFILE_WITHOUT_OVERLAP = """
name = "tiny"
[device]
name = "cpu-process"
memory_gib = 1
memory_bandwidth_GBps = 10
[device.peak_tflops]
float32 = 0.05
[intra_node]
kind = "loopback"
bandwidth_GBps = 1
latency_us = 100
[inter_node]
kind = "loopback"
bandwidth_GBps = 1
latency_us = 100
"""


# -- a quick calibration on 2 local gloo ranks ------------------------------------------------

@pytest.fixture(scope="module")
def calibration_run(tmp_path_factory):
    """The one spawn of this file: (profile path, what `autopar calibrate` printed)."""
    path = tmp_path_factory.mktemp("calibrate") / "profile.toml"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["calibrate", "--quick", "--nproc", "2", "--out", str(path),
                     "--attention-shape", "4,64,16", "--loss-shape", "64,512"]) == 0
    return path, out.getvalue()


@pytest.fixture(scope="module")
def profile(calibration_run):
    return calibration_run[0]


def test_quick_calibration_measures_every_overlap_slowdown_and_the_gemm_spread(calibration_run):
    path, printed = calibration_run
    cluster = Cluster.from_toml(path)
    for pattern in OVERLAP_PATTERNS:
        assert getattr(cluster.overlap, f"{pattern}_slowdown") >= 1.0, pattern
        assert f"{pattern}_slowdown" in path.read_text()  # measured, not the default
        pairs = cluster.extra["overlap"][pattern]["compute_alone_s"]
        assert len(pairs) == Settings.quick().overlap_repeats
    gemm = cluster.extra["gemm"]["float32"]
    assert all(lo <= mid <= hi for lo, mid, hi in
               zip(gemm["tflops_min"], gemm["tflops"], gemm["tflops_max"], strict=True))
    assert "overlap slowdown measured" in cluster.source
    table = printed.splitlines()
    assert any(line.startswith("overlap") and "sigma" in line for line in table)
    assert all(any(line.startswith(p + " ") for line in table) for p in OVERLAP_PATTERNS)
    assert any("windows min..max" in line and "spread" in line for line in table)


def test_quick_calibration_measures_the_work_beside_gemms_and_the_host_overheads(
        calibration_run):
    path, printed = calibration_run
    cluster = Cluster.from_toml(path)
    d = cluster.device
    # Memory-bound kernels: the profile's bandwidth is the harmonic mean of the mix's rates.
    rates = cluster.extra["memory"]["GBps"]
    assert cluster.extra["memory"]["kernels"] == list(memory_kernels(4096, "cpu"))
    assert d.memory_bandwidth_GBps == pytest.approx(len(rates) / sum(1 / r for r in rates),
                                                    rel=1e-3)
    # Attention at the shape asked for, over float32's fitted large-GEMM rate.
    attention = cluster.extra["attention"]
    assert attention["shape"] == [4, 64, 16] and attention["dtype"] == "float32"
    assert d.attention_efficiency == pytest.approx(
        attention["tflops"] * 1e12 / (d.peak("float32") * d.matmul_efficiency), rel=1e-2)
    # Cross-entropy at the shape asked for, over the memory-bound mix's bandwidth.
    loss = cluster.extra["loss"]
    assert loss["shape"] == [64, 512]
    assert d.loss_efficiency == pytest.approx(min(10, loss["GBps"] / d.memory_bandwidth_GBps),
                                              rel=1e-2)
    # gloo ranks: torch's AdamW steps one tensor at a time; FSDP2, TP and DTensor cost
    # host time on the ranks' cores.
    assert cluster.optimizer == "adamw-for-loop" and cluster.host.offload is False
    assert d.fsdp_overhead_s > 0 and d.tp_overhead_s > 0 and d.dtensor_op_overhead_s > 0
    assert "collective_skew_us = " in path.read_text()  # measured (0 when no rank waits)
    assert [n for n, _ in d.collective_skew_at] == list(Settings.quick().skew_bytes)
    assert "host overheads: FSDP2" in printed and "harmonic mean" in printed
    assert "causal attention float32 (batch x heads, seq, head dim) = (4, 64, 16)" in printed
    assert "cross-entropy float32 (tokens, vocabulary) = (64, 512)" in printed


def test_quick_calibration_writes_a_calibrated_profile(profile, capsys):
    cluster = Cluster.from_toml(profile)
    assert cluster.provenance == "calibrated" and cluster.devices_per_node == 2
    assert "2 local ranks" in cluster.source and "all ranks at once" in cluster.source
    d = cluster.device
    assert d.peak("float32") > 0 and 0 < d.matmul_efficiency <= 1
    assert d.memory_bandwidth_GBps > 0 and d.memory_bytes > 0 and d.kernel_floor_s > 0
    for dtype, gemm in cluster.extra["gemm"].items():
        # The profile's roofline reproduces the GEMM curve refitted on the recorded rates
        # (rounded to 4 digits in the file, hence rel 1e-2): peak, efficiency, d_half and the
        # kernel floor were written consistently. Not "equals the measured times": on a loaded
        # 2-core VM the rates can fall with size (cache) or not grow at all (oversubscribed
        # threads wait out a scheduler tick), which no saturating curve follows.
        sizes = gemm["sizes"]
        times = [2 * n**3 / (r * 1e12) for n, r in zip(sizes, gemm["tflops"], strict=True)]
        curve = fitted_gemm_curve(dict(zip(sizes, times, strict=True)), d.kernel_floor_s)
        for n in sizes:
            modelled = roofline_s(2 * n**3, 0, 1, d, dtype, gemm_min_dim=n)
            assert modelled == pytest.approx(d.kernel_floor_s + 2 * n**3 / curve.rate(n),
                                             rel=1e-2)
    link = cluster.intra_node
    assert link.kind == "loopback" and link.bandwidth_GBps > 0 and link.latency_s >= 0


@pytest.mark.parametrize("kind, model", [
    ("all_reduce", lambda s, c: all_reduce_s(s, Group(2), c)),
    ("all_gather", lambda s, c: all_gather_s(s, Group(2), c)),  # its own [collective_links]
    ("p2p", lambda s, c: p2p_s(s, group_link(c, Group(2)))),
])
def test_fitted_links_reproduce_the_measured_times(calibration_run, kind, model):
    """The planner's formula with the profile's link reproduces the recorded times as well
    as the best α-β fit of them does (the file's link is that fit, and the fit's ring terms
    are the model's). Not a bound on the errors themselves: on a loaded 2-core machine a
    quick run's times scatter by 2x, and no link reproduces them better than the fit.
    all_gather's and send/recv's links are informative: where their recorded times do not
    grow with the size (a loaded machine's send/recv can take less time at 1 MiB than at
    4 KiB), the profile has no such link and the run printed why."""
    profile, printed = calibration_run
    cluster = Cluster.from_toml(profile)
    measured = cluster.extra["measured"][kind]
    rows = list(zip(measured["sizes_bytes"], measured["times_s"], strict=True))
    if kind != "all_reduce" and kind not in cluster.collective_links:
        with pytest.raises(CalibrationError, match="do not grow with message size"):
            fit_alpha_beta(*zip(*rows, strict=True), kind=kind, group_size=2)
        assert f"{kind} not fitted: {kind} times do not grow" in printed
        return
    best = fit_alpha_beta(*zip(*rows, strict=True), kind=kind, group_size=2)
    errors = sorted(abs(model(s, cluster) / t - 1) for s, t in rows)
    fit_errors = sorted(abs(predict_s(kind, s, 2, best) / t - 1) for s, t in rows)
    median = len(rows) // 2
    assert errors[median] <= fit_errors[median] + 1e-3, (errors, fit_errors)  # 4-digit file
    assert all(math.isfinite(e) for e in errors)


def test_plan_with_the_profile_says_calibrated(profile, capsys):
    capsys.readouterr()
    assert main(["plan", "--model", "gpt-tiny", "--cluster", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and "[calibrated]" in out


# -- one device, the links from another cluster --------------------------------------------

def test_one_device_calibration_takes_the_links_from_its_topology_and_plans(tmp_path):
    """``--nproc 1 --topology dgx-h100``: the device is this machine's, measured; nodes,
    devices per node, links and overlap are the preset's, and the profile plans."""
    path = tmp_path / "one.toml"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["calibrate", "--quick", "--nproc", "1", "--topology", "dgx-h100",
                     "--out", str(path)]) == 0
    cluster, preset = Cluster.from_toml(path), Cluster.preset("dgx-h100")
    assert cluster.provenance == "calibrated" and "from dgx-h100" in cluster.source
    assert (cluster.nodes, cluster.devices_per_node) == (preset.nodes, preset.devices_per_node)
    assert (cluster.intra_node, cluster.inter_node, cluster.collective_links, cluster.overlap) \
        == (preset.intra_node, preset.inter_node, preset.collective_links, preset.overlap)
    d = cluster.device
    assert d.name == "cpu-process" and d.peak("float32") < preset.device.peak("float32")
    assert cluster.host.offload is False  # a CPU process: the host is the device
    assert d.memory_bandwidth_GBps == pytest.approx(
        len(cluster.extra["memory"]["GBps"]) / sum(1 / r for r in cluster.extra["memory"]["GBps"]),
        rel=1e-3)
    assert d.attention_efficiency != 1.0 and d.loss_efficiency != 1.0  # both measured
    text = path.read_text()
    assert "collective_skew_us" not in text and "extra.measured" not in text  # one rank
    assert "collective " not in out.getvalue()  # no collective rows in the table
    # The GEMM table puts each measured rate beside the topology's datasheet peak.
    rows = [line.split() for line in out.getvalue().splitlines()
            if line.startswith("float32 ")]
    assert "of H100-SXM5-80GB's peak" in out.getvalue()
    gemm = cluster.extra["gemm"]["float32"]
    assert [int(r[1]) for r in rows] == gemm["sizes"]
    for row, tflops in zip(rows, gemm["tflops"], strict=True):
        assert float(row[-1].rstrip("%")) == pytest.approx(tflops / 67 * 100, abs=0.06)
    spec = get_model("gpt-tiny")
    plan = search_plans(spec.build("meta"), cluster, spec.example_inputs(8, 32, device="meta"),
                        time_limit_s=5).plan
    assert plan.mesh.world_size == cluster.world_size


# -- a calibration that cannot run -------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--nproc", "1"], "collectives need a second rank"),
    (["--backend", "nccl"], "nccl needs CUDA GPUs"),
    (["--out", "no/such/dir/p.toml"], "output directory no/such/dir does not exist"),
    (["--nproc", "2", "--topology", "dgx-h100"], "--topology is for a one-device calibration"),
    (["--nproc", "1", "--topology", "nosuch"], "unknown cluster preset 'nosuch'"),
    (["--nproc", "1", "--topology", "dgx-h100", "--backend", "nccl"], "nccl needs CUDA GPUs"),
])
def test_calibration_that_cannot_run_exits_2_saying_why(args, message, tmp_path, capsys,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["calibrate", "--quick", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("shape, message", [
    ("8,512", "three integers like 8,512,64; got '8,512'"),
    ("8,0,64", "expected a positive integer, got 0"),
])
def test_a_bad_attention_shape_exits_2_naming_it(shape, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", "--attention-shape", shape])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--attention-shape" in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("shape, message", [
    ("2048", "two integers like 2048,8192; got '2048'"),
    ("2048,-1", "expected a positive integer, got -1"),
    ("a,8", "expected a positive integer, got 'a'"),
])
def test_a_bad_loss_shape_exits_2_naming_it(shape, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", f"--loss-shape={shape}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--loss-shape" in err and message in err and "Traceback" not in err


def test_the_loss_kernel_counts_the_passes_the_planner_charges():
    """``loss_op`` counts (forward + backward passes) x the float32 logits: the bytes
    ``loss_costs.loss_s`` divides by ``loss_efficiency`` x the bandwidth."""
    moved, _ = loss_op((16, 100), "cpu")
    assert moved == (LOSS_FWD_PASSES + LOSS_BWD_PASSES) * 16 * 100 * 4


def test_existing_profile_is_kept_unless_forced(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text("keep me")
    assert main(["calibrate", "--quick", "--out", str(path)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err and path.read_text() == "keep me"
