"""Turn micro-benchmark measurements into Device and Link numbers (fitting only).

Measuring is done above (``autopar.calibrate``); this module is pure arithmetic so that the
fits can be tested on synthetic data with known answers.

Collectives are fitted to the same α-β ring formulas ``cost_models.comm`` evaluates, so a
fitted link plugged back into ``collective_s`` / ``p2p_s`` reproduces the measured times:

    t = L·α + F·S/B        L = latency steps, F = bytes factor (see ``ring_terms``)

The fit is least squares on the *relative* residual (each equation weighted by 1/t), so a
4 KiB message, whose time is mostly latency, counts as much as a 16 MiB one.

GEMMs: ``fit_gemm_curve`` fits ``cost_models.compute``'s efficiency curve to square GEMM
times (n×n·n×n), so that the roofline reproduces them:

    t(n) = floor + 2n³ / (R∞ · n/(n + d½))  =  floor + (2n³ + 2n²·d½) / R∞

linear in (1/R∞, d½/R∞): weighted least squares on the relative residual as above
(``fit_gemm_shapes``: the same for GEMMs of any shape, d their smallest dimension). R∞ is
the large-GEMM rate (peak × matmul_efficiency), d½ the half-efficiency dimension. A CPU
process (shared cores, frequency scaling, threads) has no datasheet peak, so the profile
takes peak := the larger of R∞ and the best rate measured. ``fit_matmul`` is the older
summary: peak := best rate, efficiency := largest GEMMs' rate / peak.

Overlap: ``fit_overlap_slowdown`` reads ``cost_models.overlap``'s slowdown σ from a compute
window timed alone and again beside communication (derived in its docstring). ``spread``
summarises repeated timings (min / median / max) so a profile says how repeatable it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cost_models.errors import ConfigError

FIT_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


class CalibrationError(ConfigError):
    """Measurements that cannot be fitted, or a calibration that cannot run; says why."""


@dataclass(frozen=True)
class AlphaBeta:
    latency_s: float
    bandwidth_GBps: float


@dataclass(frozen=True)
class MatmulFit:
    peak_flops: float
    """The best FLOP/s measured (over sizes)."""
    efficiency: float
    """Rate of the largest GEMMs measured / peak_flops, in (0, 1]."""


@dataclass(frozen=True)
class GemmCurve:
    asymptote_flops: float
    """R∞: FLOP/s of large GEMMs (peak × matmul_efficiency)."""
    half_dim: float
    """d½: the GEMM dimension at which the rate is R∞ / 2 (0: no size effect measured)."""

    def rate(self, n: float) -> float:
        return self.asymptote_flops * n / (n + self.half_dim)


def ring_terms(kind: str, group_size: int) -> tuple[float, float]:
    """(latency steps L, bytes factor F) of ``cost_models.comm`` for one collective.

    S is comm.py's size: the full tensor for all_reduce, the gathered output for
    all_gather, the unreduced input for reduce_scatter, one rank's input for all_to_all,
    the message for p2p. Groups inside one node: the ring formulas.
    """
    if kind == "p2p":
        return 1.0, 1.0
    if kind not in FIT_KINDS:
        raise CalibrationError(f"unknown collective {kind!r}; valid: {', '.join(FIT_KINDS)}")
    if group_size < 2:
        raise CalibrationError(f"a collective needs at least 2 ranks, got {group_size}")
    steps = (2 if kind == "all_reduce" else 1) * (group_size - 1)
    return float(steps), steps / group_size


def predict_s(kind: str, nbytes: float, group_size: int, fit: AlphaBeta) -> float:
    latency_steps, bytes_factor = ring_terms(kind, group_size)
    return latency_steps * fit.latency_s + bytes_factor * nbytes / (fit.bandwidth_GBps * 1e9)


def fit_alpha_beta(
    sizes_bytes: Sequence[float],
    times_s: Sequence[float],
    *,
    kind: str = "all_reduce",
    group_size: int = 2,
) -> AlphaBeta:
    """Per-step latency α and per-device bandwidth B reproducing the measured times.

    Weighted least squares on t = L·α + F·S/B with α >= 0; raises CalibrationError when the
    times do not grow with the size (no bandwidth can be read from them).
    """
    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if s.shape != t.shape or s.size < 2:
        raise CalibrationError("need at least two (size, time) measurements of equal count")
    if np.any(t <= 0) or np.any(s <= 0):
        raise CalibrationError("sizes and times must be positive")
    latency_steps, bytes_factor = ring_terms(kind, group_size)
    w = 1.0 / t
    a = np.column_stack([np.full_like(s, latency_steps), bytes_factor * s]) * w[:, None]
    (alpha, inv_b), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if alpha < 0:  # noise on tiny latencies: refit through the origin
        x = bytes_factor * s * w
        alpha, inv_b = 0.0, float(x @ (t * w) / (x @ x))
    if inv_b <= 0:
        raise CalibrationError(
            f"{kind} times do not grow with message size ({s.min():.0f}..{s.max():.0f} bytes); "
            "measure larger messages or more repeats"
        )
    return AlphaBeta(latency_s=float(alpha), bandwidth_GBps=float(1.0 / inv_b / 1e9))


def gemm_flops(m: int, n: int, k: int) -> float:
    """FLOPs of an (m×k)·(k×n) matrix multiply: one multiply and one add per term."""
    return 2.0 * m * n * k


def fit_matmul(
    sizes: Sequence[int],
    times_s: Sequence[float],
    *,
    peak_flops: float | None = None,
    large_fraction: float = 1.0,
) -> MatmulFit:
    """Peak and efficiency from square GEMM times (size n: n×n·n×n).

    ``peak_flops`` None: peak := the best measured rate. Efficiency := median rate of the
    GEMMs at least ``large_fraction`` of the largest size, over the peak (capped at 1).
    """
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if n.size == 0 or n.shape != t.shape or np.any(t <= 0) or np.any(n <= 0):
        raise CalibrationError("need positive GEMM sizes and times of equal count")
    rates = 2.0 * n**3 / t
    peak = float(rates.max()) if peak_flops is None else float(peak_flops)
    if peak <= 0:
        raise CalibrationError(f"peak FLOP/s must be positive, got {peak}")
    large = float(np.median(rates[n >= large_fraction * n.max()]))
    return MatmulFit(peak_flops=peak, efficiency=min(1.0, large / peak))


def fit_gemm_curve(sizes: Sequence[int], times_s: Sequence[float], *,
                   floor_s: float = 0.0) -> GemmCurve:
    """R∞ and d½ reproducing square GEMM times (size n: n×n·n×n) through the roofline
    (``fit_gemm_shapes`` with F = 2n³, d = n)."""
    n = np.asarray(sizes, dtype=float)
    if n.size < 2 or n.shape != np.shape(times_s) or np.any(n <= 0):
        raise CalibrationError("need at least two positive GEMM sizes and times of equal count")
    return fit_gemm_shapes(2 * n**3, n, times_s, floor_s=floor_s)


def fit_gemm_shapes(flops: Sequence[float], min_dims: Sequence[float],
                    times_s: Sequence[float], *, floor_s: float = 0.0,
                    size_effect: bool = True) -> GemmCurve:
    """R∞ and d½ reproducing the times of GEMMs of any shape through the roofline:

        t = floor + F·(d + d½)/(d·R∞)       F: a GEMM's FLOPs, d: its smallest dimension

    linear in (1/R∞, d½/R∞). ``floor_s``: the kernel floor the roofline adds to every op,
    taken off the times first. A negative d½ (noise, or no size effect) is refitted as 0;
    ``size_effect=False`` fits R∞ alone with d½ = 0 (every GEMM at one rate).
    """
    f = np.asarray(flops, dtype=float)
    d = np.asarray(min_dims, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if f.size < 2 or not (f.shape == d.shape == t.shape):
        raise CalibrationError("need at least two GEMMs' FLOPs, smallest dimensions and times "
                               "of equal count")
    if np.any(f <= 0) or np.any(d <= 0) or np.any(t <= 0):
        raise CalibrationError("GEMM FLOPs, sizes and times must be positive")
    if size_effect and np.unique(d).size < 2:
        raise CalibrationError(
            f"every GEMM has smallest dimension {d[0]:.0f}: a size effect needs GEMMs of at "
            "least two sizes")
    w = 1.0 / t
    target = (t - floor_s) * w
    a = np.column_stack([f, f / d]) * w[:, None]
    (inv_rate, half_over_rate), *_ = np.linalg.lstsq(a, target, rcond=None)
    if half_over_rate < 0 or not size_effect:
        x = a[:, 0]
        inv_rate, half_over_rate = float(x @ target / (x @ x)), 0.0
    if inv_rate <= 0:
        raise CalibrationError(
            f"GEMM times do not grow with size (FLOPs {f.min():.3g}..{f.max():.3g}); measure "
            "larger GEMMs or more repeats")
    return GemmCurve(asymptote_flops=float(1 / inv_rate),
                     half_dim=float(half_over_rate / inv_rate))


def fit_half_dim(flops: Sequence[float], min_dims: Sequence[float], times_s: Sequence[float],
                 *, asymptote_flops: float, floor_s: float = 0.0) -> float:
    """d½ reproducing GEMM times of any shape through the roofline, R∞ and the kernel floor
    given (a device's published ceiling and floor):

        t = floor + F·(d + d½)/(d·R∞)        F: the GEMM's FLOPs, d: its smallest dimension

    linear in d½: least squares on the relative residual, as above. A negative d½ (GEMMs
    faster than R∞ allows) is returned as 0.
    """
    f = np.asarray(flops, dtype=float)
    d = np.asarray(min_dims, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if f.size == 0 or not (f.shape == d.shape == t.shape):
        raise CalibrationError("need GEMM FLOPs, smallest dimensions and times of equal count")
    if np.any(f <= 0) or np.any(d <= 0) or np.any(t <= 0) or asymptote_flops <= 0:
        raise CalibrationError("GEMM FLOPs, dimensions, times and the asymptote must be positive")
    x = f / (d * asymptote_flops) / t
    y = (t - floor_s - f / asymptote_flops) / t
    return max(0.0, float(x @ y / (x @ x)))


def kernel_mix_bandwidth_GBps(bytes_moved: Sequence[float], times_s: Sequence[float]) -> float:
    """Memory bandwidth of a mix of memory-bound kernels, one (bytes read + written, time)
    each: the harmonic mean of their rates, i.e. total bytes over total time were the same
    bytes put through every kernel, so a slow kernel weighs as it does in a step that runs
    them all."""
    b = np.asarray(bytes_moved, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if b.size == 0 or b.shape != t.shape or np.any(t <= 0) or np.any(b <= 0):
        raise CalibrationError("need positive kernel sizes and times of equal count")
    return float(b.size / np.sum(t / b) / 1e9)


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one figure: the median is the one fitted."""

    low: float
    median: float
    high: float

    @property
    def relative(self) -> float:
        """(high - low) / median: 0.3 means the repeats span 30% of the fitted figure."""
        return (self.high - self.low) / self.median


def nondecreasing_fit(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares: pool adjacent
    violators, each run that falls replaced by its mean. For a quantity that cannot fall
    along the sequence but whose measurements scatter (a collective's skew by message
    size). Ten lines here rather than a SciPy dependency."""
    runs: list[tuple[float, int]] = []  # (sum, count) of each pooled run
    for v in values:
        runs.append((float(v), 1))
        while len(runs) > 1 and runs[-2][0] / runs[-2][1] > runs[-1][0] / runs[-1][1]:
            total, count = runs.pop()
            runs[-1] = (runs[-1][0] + total, runs[-1][1] + count)
    return [total / count for total, count in runs for _ in range(count)]


def spread(values: Sequence[float]) -> Spread:
    v = np.asarray(values, dtype=float)
    if v.size == 0 or np.any(v <= 0) or not np.all(np.isfinite(v)):
        raise CalibrationError(f"need positive repeated measurements, got {list(values)}")
    return Spread(low=float(v.min()), median=float(np.median(v)), high=float(v.max()))


def fit_overlap_slowdown(compute_alone_s: float, compute_beside_s: float,
                         comm_s: float) -> float:
    """The slowdown σ >= 1 of compute while communication runs beside it.

    ``cost_models.overlap``'s model: compute of P seconds alone and communication of C
    seconds start together; while both run, compute advances at 1/σ of its speed, and at
    full speed once the communication has ended. Measured: P (the compute alone), T (the
    same compute, started together with the communication: ``compute_beside_s``) and C
    (from that start until the communication completed: ``comm_s``, as observed beside the
    compute, so its own slowdown is in it). Then

    - C >= T (the communication outlasted the compute; the calibration sizes it so): all
      of the compute ran slowed, T = σ·P, so  σ = T / P.
    - C < T: by C the compute had done C/σ of its P; the rest ran at full speed,
      T = C + (P - C/σ), so  T - P = C·(1 - 1/σ)  and  σ = C / (C - (T - P)).
      That needs T - P < C (the compute cannot lose more time than the communication
      ran); timings that break it contradict the model: CalibrationError.

    The two agree at C = T, and for C < T the second exceeds T/P (their difference has
    the sign of (T - C)(T - P)): a compute that outlasts the communication has its lost
    time spread over less of the window. Clamped to >= 1: compute that ran faster beside
    communication than alone (T < P) is timing noise on a shared machine, not a speed-up.
    """
    p, t, c = float(compute_alone_s), float(compute_beside_s), float(comm_s)
    if p <= 0 or t <= 0 or c < 0 or not all(map(np.isfinite, (p, t, c))):
        raise CalibrationError(
            f"overlap timings must be positive: compute alone {p}, beside {t}, comm {c}")
    if c >= t:
        sigma = t / p
    elif t - p < c:
        sigma = c / (c - (t - p))
    else:
        raise CalibrationError(
            f"compute beside communication lost {t - p:.4g} s, more than the communication "
            f"ran ({c:.4g} s): not the overlap model's slowdown (noise on a busy machine?)")
    return max(1.0, sigma)


def fit_software_efficiency(ratios: Callable[[float], Sequence[float]], *,
                            low: float = 0.05, high: float = 1.0, rel_tol: float = 1e-7
                            ) -> float:
    """A software generation's efficiency factor s (``cost_models.software``), fitted on
    its calibration rows: the s at which predicted / published throughput of those rows has
    a geometric mean of 1. ``ratios(s)`` gives that ratio per row with the factor s applied.

    Predicted throughput grows with s (compute time is proportional to 1/s, communication
    and memory-bound kernels do not depend on it), so the mean log-ratio is increasing in s
    and bisection finds its root. A CalibrationError when no s in (low, high] reaches the
    published rows (the rows are slower than ``low`` or faster than ``high`` allows)."""
    def mean_log(s: float) -> float:
        values = np.asarray(ratios(s), dtype=float)
        if values.size == 0 or np.any(values <= 0) or not np.all(np.isfinite(values)):
            raise CalibrationError(f"calibration ratios must be positive, got {values}")
        return float(np.mean(np.log(values)))

    lo, hi = low, high
    if mean_log(hi) < 0 or mean_log(lo) > 0:
        raise CalibrationError(
            f"no software efficiency in ({low}, {high}] reproduces the calibration rows: "
            f"predicted/published is {np.exp(mean_log(lo)):.3g} at {low} and "
            f"{np.exp(mean_log(hi)):.3g} at {high}")
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_log(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit_software_efficiency_with(
        ratios: Callable[[float, float], Sequence[float]], low: float, high: float, *,
        rel_tol: float = 1e-7) -> tuple[float, float]:
    """A generation's efficiency factor s fitted together with a second value x of its
    (``cost_models.software``: the FSDP host time, the sharded collectives' bandwidth
    share) on its calibration rows: for each x, s is ``fit_software_efficiency``'s
    (geometric mean of predicted / published at 1), and x in [low, high] minimises the
    squared log-ratios left (on two rows: both exact). ``ratios(s, x)`` gives predicted /
    published per row; an x at which no s reproduces the rows is no fit.

    x is separable from s where it weighs on the rows unequally: a fixed time per layer and
    micro-batch on rows with little compute per micro-batch, a collective bandwidth on rows
    whose step is bound by it; s weighs on every row's compute alike. Golden-section search
    (the residual is unimodal in x: each row's log-ratio moves monotonically with it)."""
    def fitted(x: float) -> tuple[float, float]:
        """(squared log-ratios left, s) at x; inf where no s reproduces the rows."""
        try:
            s = fit_software_efficiency(lambda e: ratios(e, x), rel_tol=rel_tol)
        except CalibrationError:
            return math.inf, math.nan
        return float(np.sum(np.log(np.asarray(ratios(s, x), dtype=float)) ** 2)), s

    lo, hi = low, high
    golden = (math.sqrt(5) - 1) / 2
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    fa, fb = fitted(a)[0], fitted(b)[0]
    while hi - lo > 1e-4 * (high - low):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - golden * (hi - lo)
            fa = fitted(a)[0]
        else:
            lo, a, fa = a, b, fb
            b = lo + golden * (hi - lo)
            fb = fitted(b)[0]
    x = (lo + hi) / 2
    residual, s = fitted(x)
    if not math.isfinite(residual):
        raise CalibrationError(f"no value in [{low}, {high}] with an efficiency in (0.05, 1] "
                               "reproduces the calibration rows")
    return s, x


def split_software_efficiency(rates_flops: dict[str, float], datasheet_peaks: dict[str, float],
                              ceiling: float) -> tuple[dict[str, float], float, str]:
    """A GPU's measured large-GEMM rates split into the hardware its preset publishes and
    the share the software that measured them keeps (``cost_models.software``).

    ``rates_flops``: R∞ per dtype, measured through the training stack (torch's eager
    autograd); ``datasheet_peaks`` and ``ceiling``: the preset's peak FLOP/s and published
    GEMM ceiling (``Device.matmul_efficiency``). On the reference dtype (bfloat16 where both
    have it, else the first they share) software_efficiency = R∞ / (peak · ceiling), at most
    1 (a rate above the published ceiling is the ceiling's error, not the software's gain).
    Returns (peaks, software_efficiency, reference dtype): the reference dtype keeps its
    datasheet peak; any other measured dtype folds its rate into its peak, so that
    peak · ceiling · software_efficiency is each dtype's measured rate."""
    shared = [d for d in rates_flops if d in datasheet_peaks]
    if not shared:
        raise CalibrationError(
            f"no measured dtype ({', '.join(rates_flops) or 'none'}) has a datasheet peak "
            f"({', '.join(datasheet_peaks) or 'none'}) to split against")
    if not 0 < ceiling <= 1:
        raise CalibrationError(f"a GEMM ceiling must be in (0, 1], got {ceiling}")
    ref = "bfloat16" if "bfloat16" in shared else shared[0]
    software = min(1.0, rates_flops[ref] / (datasheet_peaks[ref] * ceiling))
    peaks = {d: r / (ceiling * software) for d, r in rates_flops.items()}
    peaks[ref] = datasheet_peaks[ref]
    return peaks, software, ref
