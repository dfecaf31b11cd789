"""Software generations (cost_models/software.py, software.toml): the share of a device's
GEMM ceiling a training stack keeps, selected by a cluster, fitted on named rows."""

from __future__ import annotations

import math

import pytest

from autopar.planner.fsdp_published import fit_software, fit_software_and_host, fsdp_rows
from cost_models.calibrate import (
    CalibrationError,
    fit_software_efficiency,
    fit_software_efficiency_with,
    split_software_efficiency,
)
from cost_models.compute import gemm_efficiency
from cost_models.errors import ConfigError
from cost_models.hardware import Cluster
from cost_models.software import DEFAULT_SOFTWARE, software, software_names, with_software

CALIBRATION_ROWS = {
    # (generation, device): fsdp_scaling.csv row ids, as software.toml names them
    ("llm-foundry-2023", "A100-SXM4-80GB"): (51, 53),
    ("llm-foundry-2023", "H100-SXM5-80GB"): (40, 41),
    ("torchtitan-2024", "A100-SXM4-80GB"): (1,),
    ("torchtitan-2024", "H100-SXM5-96GB-500W"): (9,),
}


def test_the_generations_named_by_the_issue_exist_and_state_their_source():
    assert {"torch-eager", "megatron-lm-2021", "llm-foundry-2023",
            "torchtitan-2024"} <= set(software_names())
    for name in software_names():
        sw = software(name)
        assert sw.source and sw.calibrated_on and 0 < sw.efficiency <= 1


def test_the_default_keeps_the_a100s_seventy_percent_of_peak():
    """The large-GEMM rate on A100 presets stays what the cost model was built with: the
    MAMF ceiling (85.9%) times torch-eager's factor is 0.7 of peak (smaller GEMMs run below
    it by the A100 GEMM curve)."""
    cluster = Cluster.preset("dgx-a100-80g")
    assert cluster.software == DEFAULT_SOFTWARE
    assert gemm_efficiency(cluster.device, "bfloat16") == pytest.approx(0.7, rel=1e-12)
    h100 = Cluster.preset("dgx-h100").device
    assert gemm_efficiency(h100, "bfloat16") == pytest.approx(0.801 * 0.7 / 0.859)


def test_megatron_2021_exposes_its_communication_and_runs_fused_adam():
    cluster = with_software(Cluster.local(2), "megatron-lm-2021")
    assert cluster.overlap.exposed == ("fsdp", "dp", "pp")  # the CPU's own fsdp kept first
    assert cluster.optimizer == "fused-adam" and cluster.software == "megatron-lm-2021"


def test_a_generation_fitted_per_device_applies_that_devices_value():
    lf = software("llm-foundry-2023")
    h100 = with_software(Cluster.preset("dgx-h100"), lf)
    a100 = with_software(Cluster.preset("dgx-a100-80g"), lf)
    assert h100.device.software_efficiency == lf.efficiency_by_device["H100-SXM5-80GB"]
    assert a100.device.software_efficiency == lf.efficiency_by_device["A100-SXM4-80GB"]
    other = with_software(Cluster.preset("pcie-8x-a100"), lf)
    assert other.device.software_efficiency == lf.efficiency


def test_a_cluster_file_selects_software_by_name_and_a_wrong_name_is_refused():
    base = """name = "x"
[device]
name = "d"
memory_gib = 80
memory_bandwidth_GBps = 2000
matmul_efficiency = 0.8
[device.peak_tflops]
bfloat16 = 300
[intra_node]
kind = "nvlink"
bandwidth_GBps = 300
latency_us = 5
[inter_node]
kind = "network"
bandwidth_GBps = 25
latency_us = 10
"""
    plain = Cluster.from_toml_text(base)
    assert plain.software == "" and plain.device.software_efficiency == 1.0
    chosen = Cluster.from_toml_text('software = "torchtitan-2024"\n' + base)
    assert chosen.device.software_efficiency == software("torchtitan-2024").efficiency
    with pytest.raises(ConfigError, match="unknown software generation 'titan'.*torch-eager"):
        Cluster.from_toml_text('software = "titan"\n' + base)
    with pytest.raises(ConfigError, match="software must be a generation's name"):
        Cluster.from_toml_text("software = 3\n" + base)
    measured = base.replace("matmul_efficiency = 0.8", "software_efficiency = 0.9")
    assert Cluster.from_toml_text(measured).device.software_efficiency == 0.9
    with pytest.raises(ConfigError, match="either it or \\[device\\] software_efficiency"):
        Cluster.from_toml_text('software = "torch-eager"\n' + measured)
    with pytest.raises(ConfigError, match=r"software_efficiency must be in \(0, 1\]"):
        Cluster.from_toml_text(base.replace("matmul_efficiency = 0.8",
                                            "software_efficiency = 1.5"))


def test_fit_software_efficiency_finds_the_factor_a_linear_model_implies():
    """Compute ∝ 1/s plus a fixed communication time: the root is known in closed form."""
    def ratios(s: float) -> list[float]:
        published = [1 / (1 / 0.6 + 0.2), 1 / (1 / 0.6 + 0.5)]  # made at s = 0.6
        return [1 / (1 / s + c) / p for c, p in zip((0.2, 0.5), published, strict=True)]

    assert fit_software_efficiency(ratios) == pytest.approx(0.6, rel=1e-6)
    with pytest.raises(CalibrationError, match="no software efficiency"):
        fit_software_efficiency(lambda s: [s * 0.5])  # published faster than s = 1 predicts


@pytest.mark.parametrize("key", list(CALIBRATION_ROWS))
def test_each_fitted_value_is_the_fit_on_its_named_calibration_rows(key):
    """software.toml's numbers come from the rows it names, and from no other row."""
    generation, device = key
    rows = {r.row_id: r for r in fsdp_rows()}
    sw, chosen = software(generation), [rows[i] for i in CALIBRATION_ROWS[key]]
    if device in sw.fsdp_host_s_by_device:  # fitted with its host time
        fitted, host = fit_software_and_host(chosen)
        assert math.isclose(sw.fsdp_host_s_by_device[device], host, rel_tol=2e-3)
    else:
        fitted = fit_software(chosen)
    assert math.isclose(sw.efficiency_by_device[device], fitted, rel_tol=2e-3)


def test_a_generations_host_time_becomes_the_devices_fsdp_overhead():
    lf = software("llm-foundry-2023")
    h100 = with_software(Cluster.preset("dgx-h100"), lf)
    assert h100.device.fsdp_overhead_s == lf.fsdp_host_s_by_device["H100-SXM5-80GB"] > 0
    other = with_software(Cluster.preset("pcie-8x-a100"), lf)
    assert other.device.fsdp_overhead_s == lf.fsdp_host_s > 0
    titan = with_software(Cluster.preset("dgx-h100"), "torchtitan-2024")
    assert titan.device.fsdp_overhead_s == 0  # states none: the preset's own


def test_fit_software_efficiency_with_recovers_both_from_two_rows():
    """Compute ∝ 1/s plus h per micro-batch: rows with different micro-batch counts per
    unit of compute separate the two."""
    def ratios(s: float, h: float) -> list[float]:
        # (compute at s = 1, micro-batches): made at s = 0.7, h = 0.004
        rows = ((1.0, 10), (1.0, 40))
        published = [1 / (c / 0.7 + n * 0.004) for c, n in rows]
        return [1 / (c / s + n * h) / p for (c, n), p in zip(rows, published, strict=True)]

    s, h = fit_software_efficiency_with(ratios, 0.0, 0.02)
    assert s == pytest.approx(0.7, rel=1e-4) and h == pytest.approx(0.004, rel=1e-3)


def test_a_gpus_measured_gemm_rate_splits_into_published_hardware_and_software():
    """``autopar calibrate --topology dgx-h100`` on an H100: bf16 GEMMs through eager
    autograd at 600 TFLOP/s are 600 / (989 · 0.801) = 75.7% of the published ceiling; the
    bf16 peak stays the datasheet's, float32's measured rate folds into its peak."""
    h100 = Cluster.preset("dgx-h100").device
    peaks, share, ref = split_software_efficiency(
        {"float32": 40e12, "bfloat16": 600e12}, h100.peak_flops, h100.matmul_efficiency)
    assert ref == "bfloat16" and share == pytest.approx(600 / (989 * 0.801))
    assert peaks["bfloat16"] == 989e12
    assert peaks["float32"] * 0.801 * share == pytest.approx(40e12)
    _, capped, _ = split_software_efficiency({"bfloat16": 950e12}, h100.peak_flops, 0.801)
    assert capped == 1.0  # above the published ceiling: the ceiling's error, not a gain
    with pytest.raises(CalibrationError, match="no measured dtype"):
        split_software_efficiency({"float64": 1e12}, h100.peak_flops, 0.801)


@pytest.mark.parametrize(("entry", "message"), [
    ({"efficiency": 0.8, "fsdp_host_us": -1}, r"fsdp_host_us must be microseconds in \[0, 1e6\)"),
    ({"efficiency": 0.8, "fsdp_host_us_by_device": {"H100": "3 ms"}},
     r"H100 must be microseconds"),
    ({"efficiency": 0.8, "fsdp_host_us_by_device": 3}, "fsdp_host_us_by_device must be a table of device name"),
    ({"efficiency": 0.8, "host_us": 3}, r"unknown field\(s\) host_us"),
    ({"efficiency": 0.8, "fsdp_bandwidth_share": 0}, r"fsdp_bandwidth_share must be a number in \(0, 1\]"),
])
def test_a_malformed_generation_is_refused_by_field(entry, message):
    from cost_models.software import software_from_dict

    with pytest.raises(ConfigError, match=r"my.toml: \[g\]: " + message):
        software_from_dict("g", entry, "my.toml")


def test_a_bandwidth_share_slows_the_sharded_collectives_bandwidth_term_only():
    """deepspeed-zero3-2021's share divides the bandwidth of sharded data parallelism's
    gathers and reduce-scatters; their latency terms stay, and a replicated layer's
    all-reduce is not its (Cluster.fsdp_links)."""
    from cost_models.comm import Group, all_gather_s

    cluster = with_software(Cluster.preset("dgx-a100-80g", nodes=48), "deepspeed-zero3-2021")
    share, links = cluster.fsdp_bandwidth_share, cluster.fsdp_links()
    assert 0 < share < 1 and links.fsdp_bandwidth_share == 1.0
    group = Group(384)
    big, tiny = 4e9, 4e3
    slow, fast = all_gather_s(big, group, links), all_gather_s(big, group, cluster)
    latency = all_gather_s(1.0, group, cluster)  # latency terms alone, in effect
    assert slow - latency == pytest.approx((fast - latency) / share, rel=1e-3)
    assert all_gather_s(tiny, group, links) == pytest.approx(
        all_gather_s(tiny, group, cluster), rel=0.2)
    plain = Cluster.preset("dgx-a100-80g", nodes=48)
    assert plain.fsdp_links() is plain
