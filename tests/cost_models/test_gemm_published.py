"""The presets' GEMM efficiency curves against the published GEMM timings they are fitted to
(autopar.planner.gemm_published): OpenXLA's sm_90 table for the H100s
(autopar/data/xla_gemm_sm90.csv), Microsoft Vidur's A100 linear-layer profiles for the A100s
(autopar/data/vidur_gemm_a100.csv).

Seen on these tables (fitted GEMMs; |relative error| of the modelled time):

    H100 bf16  d½ 37.2   65 GEMMs  median 2.8%, worst 21% (4 × 4096×4096×256)   no curve: 3.1%, 30%
                         smallest dimension ≥ 1024: worst 7.5%
    H100 tf32  d½ 265   139 GEMMs  median 8.6%, worst 38% (2 × 1024×1024×4096)  no curve: 26%, 58%
    A100 fp16  d½ 42.9  627 GEMMs  median 4.7%, worst 47% (256×7680×5120)       no curve: 5.8%, 52%
               (at the table's own asymptote, 233 TFLOP/s, or 222 refitted without a curve;
               mean error by smallest dimension d < 512: -1.8%, 512-1023: -2.1%, ≥ 1024:
               -0.5%; no curve: -11.4%, -5.0%, +1.8%)

Modelled too fast, worst: H100 bf16 GEMMs whose smallest dimension is the reduction (k = 256
or 512), tf32 ones of m = n = 1024 at any k; on the A100, single shapes either way by up to
half (a 256-token GEMM at 100 TFLOP/s, another at 266): how tiles fill 108 SMs. The curve
sees one dimension, not three.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from autopar.planner.gemm_published import (
    TABLES,
    asymptote_flops,
    fit_curves,
    fit_half_dims,
    relative_errors,
    table_for,
)
from cost_models.calibrate import CalibrationError, fit_gemm_shapes, fit_half_dim
from cost_models.hardware import Cluster

H100 = Cluster.preset("dgx-h100").device
A100 = Cluster.preset("dgx-a100-80g").device
XLA, VIDUR = TABLES


def test_the_sm90_table_holds_every_shape_of_its_grid_once():
    rows = XLA.gemms()
    dims = (256, 512, 1024, 2048, 4096)
    assert sorted((g.b, g.m, g.n, g.k) for g in rows) == [
        (b, m, n, k) for b in (1, 2, 4) for m in dims for n in dims for k in dims]


def test_the_a100_table_holds_four_gemms_per_model_degree_and_token_count():
    text = "\n".join(x for x in VIDUR.path.read_text().splitlines() if not x.startswith("#"))
    rows = list(csv.DictReader(io.StringIO(text)))
    per_key = Counter((r["model"], r["tp"], r["num_tokens"]) for r in rows)
    assert len(rows) == 1604 and set(per_key.values()) == {4}
    assert len({r["model"] for r in rows}) == 8
    assert {int(r["num_tokens"]) for r in rows} == {2**i for i in range(16)}
    # Llama-2-7b at tp 2: the QKV projection is 4096 -> 3 × 4096 / 2, the gated up 2 × 11008 / 2.
    shapes = {r["op"]: (int(r["m"]), int(r["n"]), int(r["k"])) for r in rows
              if (r["model"], r["tp"], r["num_tokens"]) == ("Llama-2-7b-hf", "2", "1024")}
    assert shapes == {"attn_pre_proj": (1024, 6144, 4096), "attn_post_proj": (1024, 4096, 2048),
                      "mlp_up_proj": (1024, 11008, 4096), "mlp_down_proj": (1024, 4096, 5504)}


@pytest.mark.parametrize("device, dtype", [(H100, "bfloat16"), (A100, "float16")])
def test_each_tables_fastest_gemm_agrees_with_the_presets_independent_ceiling(device, dtype):
    """Two sources, one device class: the table's best rate and the preset's ceiling
    (mamf-finder's best over a wider search, ml-engineering) are within 2%."""
    best = max(g.flops_per_s[dtype] for g in table_for(device).gemms())
    assert best == pytest.approx(asymptote_flops(device, dtype), rel=0.02)


@pytest.mark.parametrize("preset", Cluster.preset_names())
def test_every_presets_half_dims_are_the_fit_of_its_published_table(preset):
    device = Cluster.preset(preset).device
    fitted = fit_half_dims(device)
    assert set(device.matmul_half_dim) == set(fitted)
    for dtype, half in fitted.items():
        assert device.matmul_half_dim[dtype] == float(f"{half:.3g}"), dtype


def test_a100s_bf16_takes_the_fp16_curve_and_the_table_keeps_its_own_level():
    assert A100.matmul_half_dim["bfloat16"] == A100.matmul_half_dim["float16"]
    curve = fit_curves(A100)["float16"]
    assert curve.asymptote_flops / 1e12 == pytest.approx(232.9, abs=0.1)
    assert curve.asymptote_flops < 0.9 * asymptote_flops(A100, "float16")  # 268: the ceiling


def test_a_device_no_table_serves_is_named():
    with pytest.raises(ValueError, match="no published GEMM table for device 'cpu-x'"):
        table_for(replace(H100, name="cpu-x"))


def errors(device, dtype: str, *, curve: bool = True) -> list[tuple]:
    """(GEMM, relative error of its modelled time) of each fitted GEMM: the preset's d½, or
    no curve (every GEMM at the best single rate: the ceiling, or the A100 table's own)."""
    return relative_errors(device, dtype, size_effect=curve)


def median_abs(errs: list[tuple]) -> float:
    return statistics.median(abs(e) for _, e in errs)


def test_the_h100_bf16_curve_reproduces_the_tables_gemms():
    fitted, flat = errors(H100, "bfloat16"), errors(H100, "bfloat16", curve=False)
    assert len(fitted) == 65
    assert median_abs(fitted) < 0.03
    assert median_abs(fitted) < median_abs(flat)
    large = [e for g, e in fitted if g.min_dim >= 1024]
    assert max(map(abs, large)) < 0.08


def test_the_h100_tf32_curve_cuts_the_error_of_no_curve_threefold():
    fitted, flat = errors(H100, "tf32"), errors(H100, "tf32", curve=False)
    assert median_abs(fitted) < 0.09
    assert median_abs(flat) > 3 * median_abs(fitted)


def test_the_a100_curve_takes_the_trend_with_size_away():
    """At the best single rate (no curve), GEMMs of smallest dimension under 512 are
    modelled 11% fast on average, 512-1023 5% fast and the larger ones 2% slow; with the
    curve every size band is within 3% on average, and the bands within 2 points."""
    fitted, flat = errors(A100, "float16"), errors(A100, "float16", curve=False)
    assert len(fitted) == len(flat) == 627
    assert median_abs(fitted) < 0.05 < median_abs(flat)

    def band_means(errs: list[tuple]) -> list[float]:
        return [statistics.mean(e for g, e in errs if low <= g.min_dim < high)
                for low, high in ((0, 512), (512, 1024), (1024, 2**20))]

    with_curve, without = band_means(fitted), band_means(flat)
    assert max(map(abs, with_curve)) < 0.03 and max(with_curve) - min(with_curve) < 0.02
    assert without[0] < -0.09 and without[1] < -0.03 and without[2] > 0.01


def test_fit_half_dim_recovers_a_known_curve():
    rng = np.random.default_rng(0)
    m, n, k = (rng.integers(128, 8192, 40).astype(float) for _ in range(3))
    flops, d = 2 * m * n * k, np.minimum(np.minimum(m, n), k)
    rate, floor, half = 500e12, 5e-6, 150.0
    times = floor + flops * (d + half) / (d * rate)
    assert fit_half_dim(flops, d, times, asymptote_flops=rate, floor_s=floor) == pytest.approx(
        half, rel=1e-9)
    curve = fit_gemm_shapes(flops, d, times, floor_s=floor)  # both, from the same times
    assert curve.asymptote_flops == pytest.approx(rate, rel=1e-9)
    assert curve.half_dim == pytest.approx(half, rel=1e-9)
    faster = floor + flops / (1.2 * rate)  # faster than the ceiling: no size effect
    assert fit_half_dim(flops, d, faster, asymptote_flops=rate, floor_s=floor) == 0.0
    flat = fit_gemm_shapes(flops, d, faster, floor_s=floor, size_effect=False)
    assert flat.half_dim == 0.0 and flat.asymptote_flops == pytest.approx(1.2 * rate, rel=1e-9)


@pytest.mark.parametrize("args, message", [
    (([], [], []), "equal count"),
    (([1.0], [1.0, 2.0], [1.0]), "equal count"),
    (([1.0], [0.0], [1.0]), "must be positive"),
])
def test_fit_half_dim_refuses_what_it_cannot_fit(args, message):
    with pytest.raises(CalibrationError, match=message):
        fit_half_dim(*args, asymptote_flops=1e12)


@pytest.mark.parametrize("args, message", [
    (([1.0], [1.0], [1.0]), "at least two"),
    (([1.0, 2.0], [1.0, -1.0], [1.0, 2.0]), "must be positive"),
    (([8.0, 1.0], [2.0, 1.0], [1.0, 2.0]), "do not grow with size"),
    (([1.0, 2.0], [3.0, 3.0], [1.0, 2.0]), "every GEMM has smallest dimension 3"),
])
def test_fit_gemm_shapes_refuses_what_it_cannot_fit(args, message):
    with pytest.raises(CalibrationError, match=message):
        fit_gemm_shapes(*args)
