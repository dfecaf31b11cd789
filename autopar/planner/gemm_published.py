"""Published GEMM throughput by shape (autopar/data/xla_gemm_sm90.csv), and the GEMM
efficiency curve it gives a device's preset.

OpenXLA ships measured GEMM rates on a grid of shapes per GPU architecture (b ∈ {1, 2, 4}
batched (m×k)·(k×n), m, n, k ∈ {256, …, 4096}); its sm_90 entry is an SXM-class Hopper GPU
(the file's header). The cost model prices a GEMM as

    t = kernel floor + F·(d + d½)/(d·R∞)          (cost_models/compute.py)

with R∞ the device's large-GEMM ceiling (peak × matmul_efficiency, both published in the
preset) and d the GEMM's smallest dimension, as the planner passes it for every GEMM,
batched or not. ``fit_half_dims`` fits d½ per dtype to the table's GEMMs
(``cost_models.calibrate.fit_half_dim``), keeping the preset's ceiling and floor.

Only GEMMs that take at least ``FIT_FLOOR_MULTIPLE`` kernel floors are fitted: below that the
time is mostly the floor, and the table's small GEMMs take about 6 µs where the preset's
floor (for every kernel, not only GEMMs) is 4 µs; fitted too, that difference would pass for
a size effect and slow every large GEMM by it (bf16: d½ 233 over all shapes, against 37).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from importlib import resources

from cost_models.calibrate import fit_half_dim
from cost_models.compute import gemm_efficiency, roofline_s
from cost_models.hardware import Device

TABLE_PATH = resources.files("autopar") / "data" / "xla_gemm_sm90.csv"
COLUMNS = {"bfloat16": "bf16_flops_per_s", "tf32": "f32_flops_per_s"}
"""autopar's compute dtype -> the table's column (its "f32xf32->f32" runs on TF32)."""
FIT_FLOOR_MULTIPLE = 10


@dataclass(frozen=True, kw_only=True)
class PublishedGemm:
    b: int
    m: int
    n: int
    k: int
    flops_per_s: dict[str, float]
    """Measured rate per dtype (keys of ``COLUMNS``)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.b * self.m * self.n * self.k

    @property
    def min_dim(self) -> int:
        return min(self.m, self.n, self.k)

    def time_s(self, dtype: str) -> float:
        return self.flops / self.flops_per_s[dtype]


def published_gemms() -> list[PublishedGemm]:
    """Every row of the table, in its order."""
    lines = [x for x in TABLE_PATH.read_text().splitlines() if not x.startswith("#")]
    return [PublishedGemm(b=int(c["b"]), m=int(c["m"]), n=int(c["n"]), k=int(c["k"]),
                          flops_per_s={d: float(c[col]) for d, col in COLUMNS.items()})
            for c in csv.DictReader(io.StringIO("\n".join(lines)))]


def fitted_gemms(device: Device, dtype: str) -> list[PublishedGemm]:
    """The rows ``fit_half_dims`` fits for ``dtype``: at least FIT_FLOOR_MULTIPLE floors long."""
    floor = FIT_FLOOR_MULTIPLE * device.kernel_floor_s
    return [g for g in published_gemms() if g.time_s(dtype) >= floor]


def _alone(device: Device) -> Device:
    """``device`` with no training software's share: the table times GEMMs alone, as
    matmul_efficiency's source does."""
    return replace(device, software_efficiency=1.0)


def asymptote_flops(device: Device, dtype: str) -> float:
    """R∞: the device's published large-GEMM ceiling (peak × matmul_efficiency)."""
    return device.peak(dtype) * gemm_efficiency(_alone(device), dtype)


def fit_half_dims(device: Device) -> dict[str, float]:
    """d½ per dtype of ``COLUMNS`` on ``device``'s ceiling and floor (module docstring)."""
    out = {}
    for dtype in COLUMNS:
        rows = fitted_gemms(device, dtype)
        out[dtype] = fit_half_dim([g.flops for g in rows], [g.min_dim for g in rows],
                                  [g.time_s(dtype) for g in rows],
                                  asymptote_flops=asymptote_flops(device, dtype),
                                  floor_s=device.kernel_floor_s)
    return out


def model_time_s(g: PublishedGemm, device: Device, dtype: str) -> float:
    """The cost model's time of one table GEMM on ``device`` (its own d½), compute only, as
    the table measured it."""
    return roofline_s(g.flops, 0.0, 1, _alone(device), dtype, gemm_min_dim=g.min_dim)


def relative_errors(device: Device, dtype: str) -> dict[tuple[int, int, int, int], float]:
    """(modelled − published) / published time of each GEMM ``fit_half_dims`` fits, by
    (b, m, n, k), at ``device``'s own d½."""
    return {(g.b, g.m, g.n, g.k): model_time_s(g, device, dtype) / g.time_s(dtype) - 1
            for g in fitted_gemms(device, dtype)}
