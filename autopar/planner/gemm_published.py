"""Published GEMM throughput by shape, and the GEMM efficiency curve it gives a device's
preset. One table per GPU architecture (``TABLES``, naming the presets' devices it serves):

- sm_90 (H100): OpenXLA's measured GEMM rates (autopar/data/xla_gemm_sm90.csv) on a grid of
  shapes, b ∈ {1, 2, 4} batched (m×k)·(k×n), m, n, k ∈ {256, …, 4096}, bf16 and tf32; its
  entry is an SXM-class Hopper GPU (the file's header).
- sm_80 (A100): Microsoft Vidur's measured kernel times of the four linear layers of eight
  LLMs' tensor-parallel shards on an A100-SXM4-80GB (autopar/data/vidur_gemm_a100.csv),
  fp16, m = 1…32,768 tokens.

The cost model prices a GEMM as

    t = kernel floor + F·(d + d½)/(d·R∞)          (cost_models/compute.py)

with R∞ the device's large-GEMM ceiling (peak × matmul_efficiency, both published in the
preset) and d the GEMM's smallest dimension, as the planner passes it for every GEMM,
batched or not. ``fit_curves`` fits d½ per dtype to a table's GEMMs with the preset's floor:

- sm_90: with the preset's ceiling kept (``cost_models.calibrate.fit_half_dim``). The table's
  fastest bf16 GEMM is within 2% of it: one device class, two sources that agree.
- A100: with the table's own asymptote, fitted with d½ (``fit_gemm_shapes``), and only d½ goes
  into the preset (``python bench/published.py`` prints these figures). Vidur's fitted
  GEMMs of smallest dimension ≥ 1024 run at a median 225 TFLOP/s, 16% under the ceiling
  (268, mamf-finder's best shape), from 160 to 272 by shape: a level set by how each
  shape's tiles fill the 108 SMs, not by its size. Fitted against the
  ceiling, that gap passes for a size effect (d½ 116, median error 9.8%, and the large
  GEMMs still about 10% faster than measured); with the table's own asymptote (233) the
  size effect is d½ 43, median error 4.7%. The preset keeps the ceiling, which the software
  generations' efficiencies (cost_models/software.toml) are shares of.

Only GEMMs that take at least ``FIT_FLOOR_MULTIPLE`` kernel floors are fitted: below that the
time is mostly the floor, and the sm_90 table's small GEMMs take about 6 µs where the preset's
floor (for every kernel, not only GEMMs) is 4 µs; fitted too, that difference would pass for
a size effect and slow every large GEMM by it (bf16: d½ 233 over all shapes, against 37).
The A100 table's GEMMs go down to one token: matrix-vector products that read a whole weight
matrix, bound by memory, which the cost model prices by their bytes and not by this curve.
Of that table only the GEMMs the roofline prices as compute-bound at the ceiling are fitted
(``TABLES[...].compute_bound_only``); the sm_90 grid starts at 256-cubes and keeps its rule.
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from importlib.resources.abc import Traversable

from cost_models.calibrate import GemmCurve, fit_gemm_shapes, fit_half_dim
from cost_models.compute import gemm_bytes, gemm_efficiency, roofline_s
from cost_models.hardware import Device

FIT_FLOOR_MULTIPLE = 10
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "tf32": 4}
"""Bytes of an element of each table dtype (tf32 GEMMs read and write float32)."""


@dataclass(frozen=True, kw_only=True)
class PublishedGemm:
    b: int
    m: int
    n: int
    k: int
    flops_per_s: dict[str, float]
    """Measured rate per dtype (its table's ``dtypes``)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.b * self.m * self.n * self.k

    @property
    def min_dim(self) -> int:
        return min(self.m, self.n, self.k)

    def bytes(self, dtype: str) -> float:
        return self.b * gemm_bytes(self.m, self.n, self.k, DTYPE_BYTES[dtype])

    def time_s(self, dtype: str) -> float:
        return self.flops / self.flops_per_s[dtype]


def _data_rows(path: Traversable) -> list[dict[str, str]]:
    lines = [x for x in path.read_text().splitlines() if not x.startswith("#")]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


@functools.cache
def _xla_rows(path: Traversable) -> tuple[PublishedGemm, ...]:
    return tuple(PublishedGemm(b=int(c["b"]), m=int(c["m"]), n=int(c["n"]), k=int(c["k"]),
                          flops_per_s={"bfloat16": float(c["bf16_flops_per_s"]),
                                       "tf32": float(c["f32_flops_per_s"])})
                 for c in _data_rows(path))


@functools.cache
def _vidur_rows(path: Traversable) -> tuple[PublishedGemm, ...]:
    """Times (ms) as rates, the form every table's rows share."""
    out = []
    for c in _data_rows(path):
        m, n, k = int(c["m"]), int(c["n"]), int(c["k"])
        out.append(PublishedGemm(b=1, m=m, n=n, k=k, flops_per_s={
            "float16": 2.0 * m * n * k / (float(c["median_ms"]) * 1e-3)}))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class GemmTable:
    name: str
    path: Traversable
    read: Callable[[Traversable], tuple[PublishedGemm, ...]]
    """Its rows, from its file (each source has its own columns; read once)."""
    devices: tuple[str, ...]
    """The presets' ``Device.name``s of the table's architecture."""
    dtypes: tuple[str, ...]
    """The dtypes the table measured."""
    same_curve: dict[str, str] = field(default_factory=dict)
    """Dtypes the presets give the curve of a measured one: unmeasured -> measured."""
    compute_bound_only: bool = False
    """Fit only GEMMs the roofline prices as compute-bound at the device's ceiling."""
    own_asymptote: bool = False
    """Fit R∞ with d½ (the table's own level) rather than keep the device's ceiling."""

    def gemms(self) -> tuple[PublishedGemm, ...]:
        """Every row of the table, in its order."""
        return self.read(self.path)


_DATA = resources.files("autopar") / "data"
TABLES = (
    GemmTable(name="OpenXLA sm_90", path=_DATA / "xla_gemm_sm90.csv", read=_xla_rows,
              devices=("H100-SXM5-80GB", "H100-SXM5-96GB-500W"), dtypes=("bfloat16", "tf32")),
    # A100's fp16 and bf16 tensor cores have one peak (the datasheet) and cuBLAS runs them
    # with the same tile shapes: the fp16 curve is the bf16 one. The H100 presets list the
    # dtypes OpenXLA measured (bf16, tf32); fp16 there has no curve.
    GemmTable(name="Vidur A100", path=_DATA / "vidur_gemm_a100.csv", read=_vidur_rows,
              devices=("A100-SXM4-80GB", "A100-PCIe-80GB"), dtypes=("float16",),
              same_curve={"bfloat16": "float16"}, compute_bound_only=True, own_asymptote=True),
)
"""The published tables; each preset device is served by at most one."""


def table_for(device: Device) -> GemmTable:
    """The table of ``device``'s architecture; a ValueError names the devices there are."""
    for table in TABLES:
        if device.name in table.devices:
            return table
    known = ", ".join(name for table in TABLES for name in table.devices)
    raise ValueError(f"no published GEMM table for device {device.name!r}; tables exist for "
                     f"{known} (`autopar calibrate` fits a device's own curve)")


def _alone(device: Device) -> Device:
    """``device`` with no training software's share: the tables time GEMMs alone, as
    matmul_efficiency's source does."""
    return replace(device, software_efficiency=1.0)


def asymptote_flops(device: Device, dtype: str) -> float:
    """R∞: the device's published large-GEMM ceiling (peak × matmul_efficiency)."""
    return device.peak(dtype) * gemm_efficiency(_alone(device), dtype)


def fitted_gemms(device: Device, dtype: str) -> list[PublishedGemm]:
    """The rows ``fit_half_dims`` fits for ``dtype`` (a dtype the table measured): at least
    FIT_FLOOR_MULTIPLE floors long, and compute-bound where the table says so."""
    table = table_for(device)
    floor = FIT_FLOOR_MULTIPLE * device.kernel_floor_s
    ridge = asymptote_flops(device, dtype) / (device.memory_bandwidth_GBps * 1e9)
    return [g for g in table.gemms() if g.time_s(dtype) >= floor
            and (not table.compute_bound_only or g.flops >= ridge * g.bytes(dtype))]


def fit_curves(device: Device, *, size_effect: bool = True) -> dict[str, GemmCurve]:
    """R∞ and d½ per dtype the table measured, on ``device``'s floor (and ceiling, unless
    the table fits its own asymptote: module docstring). ``size_effect=False``: the best
    curve with d½ = 0 (every GEMM at the ceiling, or at the table's own level refitted)."""
    table = table_for(device)
    out = {}
    for dtype in table.dtypes:
        rows = fitted_gemms(device, dtype)
        flops, dims = [g.flops for g in rows], [g.min_dim for g in rows]
        times = [g.time_s(dtype) for g in rows]
        if table.own_asymptote:
            out[dtype] = fit_gemm_shapes(flops, dims, times, floor_s=device.kernel_floor_s,
                                         size_effect=size_effect)
        else:
            ceiling = asymptote_flops(device, dtype)
            half = fit_half_dim(flops, dims, times, asymptote_flops=ceiling,
                                floor_s=device.kernel_floor_s) if size_effect else 0.0
            out[dtype] = GemmCurve(asymptote_flops=ceiling, half_dim=half)
    return out


def fit_half_dims(device: Device) -> dict[str, float]:
    """d½ per dtype, as ``device``'s preset lists it: every dtype its table measured, and
    those ``same_curve`` gives a measured one's curve."""
    half = {dtype: c.half_dim for dtype, c in fit_curves(device).items()}
    shared = table_for(device).same_curve
    return half | {dtype: half[measured] for dtype, measured in shared.items()}


def model_time_s(g: PublishedGemm, device: Device, dtype: str,
                 asymptote: float | None = None) -> float:
    """The cost model's time of one table GEMM on ``device`` (its own d½), compute only, as
    the table measured it (the fitted GEMMs the roofline prices by their FLOPs).
    ``asymptote``: R∞ in place of the device's ceiling (a table's own level)."""
    alone = _alone(device)
    if asymptote is not None:
        alone = replace(alone, matmul_efficiency=asymptote / device.peak(dtype))
    return roofline_s(g.flops, 0.0, 1, alone, dtype, gemm_min_dim=g.min_dim)


def relative_errors(device: Device, dtype: str, *, size_effect: bool = True
                    ) -> list[tuple[PublishedGemm, float]]:
    """(modelled − published) / published time of each GEMM ``fit_half_dims`` fits, at
    ``device``'s own d½ and the R∞ it was fitted with, in the table's order (a shape can
    appear more than once: the A100 table has it for each model that runs it).
    ``size_effect=False``: no curve, every GEMM at the R∞ fitted without one."""
    asymptote = fit_curves(device, size_effect=size_effect)[dtype].asymptote_flops
    if not size_effect:
        device = replace(device, matmul_half_dim={})
    return [(g, model_time_s(g, device, dtype, asymptote) / g.time_s(dtype) - 1)
            for g in fitted_gemms(device, dtype)]
