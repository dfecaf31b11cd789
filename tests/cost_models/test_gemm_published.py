"""The H100 presets' GEMM efficiency curve against OpenXLA's published sm_90 GEMM table
(autopar/data/xla_gemm_sm90.csv; autopar.planner.gemm_published).

Seen on this table (fitted GEMMs: 10 kernel floors or longer; |relative error| of the
modelled time):

    bf16  d½ 37.2   65 GEMMs  median 2.8%, worst 21% (4 × 4096×4096×256)   no curve: 3.1%, 30%
                    smallest dimension ≥ 1024: worst 7.5%
    tf32  d½ 265   139 GEMMs  median 8.6%, worst 38% (2 × 1024×1024×4096)  no curve: 26%, 58%

Modelled too fast, worst: bf16 GEMMs whose smallest dimension is the reduction (k = 256 or
512), tf32 ones of m = n = 1024 at any k. The curve sees one dimension, not three.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np
import pytest

from autopar.planner.gemm_published import (
    COLUMNS,
    asymptote_flops,
    fit_half_dims,
    published_gemms,
    relative_errors,
)
from cost_models.calibrate import CalibrationError, fit_half_dim
from cost_models.hardware import Cluster

H100 = Cluster.preset("dgx-h100").device


def test_the_table_holds_every_shape_of_its_grid_once():
    rows = published_gemms()
    dims = (256, 512, 1024, 2048, 4096)
    assert sorted((g.b, g.m, g.n, g.k) for g in rows) == [
        (b, m, n, k) for b in (1, 2, 4) for m in dims for n in dims for k in dims]


def test_its_fastest_bf16_gemm_agrees_with_the_presets_independent_ceiling():
    """Two sources, one device class: the table's best bf16 rate and the preset's ceiling
    (mamf-finder's best over a wider search, ml-engineering) are within 2%."""
    best = max(g.flops_per_s["bfloat16"] for g in published_gemms())
    assert best == pytest.approx(asymptote_flops(H100, "bfloat16"), rel=0.02)


@pytest.mark.parametrize("preset", ["dgx-h100", "grand-teton-h100"])
def test_the_presets_half_dims_are_the_fit_of_the_published_table(preset):
    device = Cluster.preset(preset).device
    fitted = fit_half_dims(device)
    assert set(device.matmul_half_dim) == set(COLUMNS)
    for dtype, half in fitted.items():
        assert device.matmul_half_dim[dtype] == float(f"{half:.3g}"), dtype


def errors(dtype: str, half: float | None = None) -> dict[tuple, float]:
    """Relative error of the modelled time of each fitted GEMM (the preset's d½, or ``half``)."""
    device = H100 if half is None else replace(H100, matmul_half_dim={dtype: half})
    return relative_errors(device, dtype)


def test_the_bf16_curve_reproduces_the_tables_gemms():
    fitted, flat = errors("bfloat16"), errors("bfloat16", half=0.0)
    assert len(fitted) == 65
    assert statistics.median(map(abs, fitted.values())) < 0.03
    assert statistics.median(map(abs, fitted.values())) < statistics.median(
        map(abs, flat.values()))
    large = [e for (b, m, n, k), e in fitted.items() if min(m, n, k) >= 1024]
    assert max(map(abs, large)) < 0.08


def test_the_tf32_curve_cuts_the_error_of_no_curve_threefold():
    fitted, flat = errors("tf32"), errors("tf32", half=0.0)
    assert statistics.median(map(abs, fitted.values())) < 0.09
    assert (statistics.median(map(abs, flat.values()))
            > 3 * statistics.median(map(abs, fitted.values())))


def test_fit_half_dim_recovers_a_known_curve():
    rng = np.random.default_rng(0)
    m, n, k = (rng.integers(128, 8192, 40).astype(float) for _ in range(3))
    flops, d = 2 * m * n * k, np.minimum(np.minimum(m, n), k)
    rate, floor, half = 500e12, 5e-6, 150.0
    times = floor + flops * (d + half) / (d * rate)
    assert fit_half_dim(flops, d, times, asymptote_flops=rate, floor_s=floor) == pytest.approx(
        half, rel=1e-9)
    faster = floor + flops / (1.2 * rate)  # faster than the ceiling: no size effect
    assert fit_half_dim(flops, d, faster, asymptote_flops=rate, floor_s=floor) == 0.0


@pytest.mark.parametrize("args, message", [
    (([], [], []), "equal count"),
    (([1.0], [1.0, 2.0], [1.0]), "equal count"),
    (([1.0], [0.0], [1.0]), "must be positive"),
])
def test_fit_half_dim_refuses_what_it_cannot_fit(args, message):
    with pytest.raises(CalibrationError, match=message):
        fit_half_dim(*args, asymptote_flops=1e12)
