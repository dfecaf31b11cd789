"""``autopar calibrate``: measure this machine and write a cluster profile.

One launch of ``nproc`` local ranks (gloo on CPU; NCCL with CUDA events on GPUs) measures,
in order: GEMM throughput by size and dtype with *every rank running at once* (on a shared
CPU that is what one rank gets during training), a large tensor copy (memory bandwidth),
the smallest op (kernel floor), then all_reduce / all_gather by message size and a
send/recv ping-pong between ranks 0 and 1. Each number is the median of repeats after a
warm-up; a rank's result is the slowest rank's median. ``cost_models.calibrate`` fits
them; ``write_profile`` writes a TOML file that ``Cluster.from_toml`` loads.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from cost_models.calibrate import (
    AlphaBeta,
    CalibrationError,
    GemmCurve,
    fit_alpha_beta,
    fit_gemm_curve,
    fit_matmul,
    fit_memory_bandwidth_GBps,
    predict_s,
    relative_error,
)
from cost_models.hardware import Cluster, GiB

KiB, MiB = 1024, 1024**2
BACKENDS = ("auto", "gloo", "nccl")
COLLECTIVES = ("all_reduce", "all_gather", "p2p")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What to measure; ``quick()`` keeps a run to a few seconds for tests and CI."""

    gemm_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    copy_bytes: int = 64 * MiB
    message_bytes: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(7))  # 4 KiB … 16 MiB
    warmup: int = 2
    repeats: int = 7
    gemm_window_s: float = 0.2
    """Each GEMM timing runs back to back for at least this long, so that every rank is
    multiplying for the whole window (short repeats drift apart and catch other ranks idle:
    bench/cost_fidelity.py measured 53 GFLOP/s calibrated against 39 sustained)."""
    timeout_s: float = 120

    @classmethod
    def quick(cls) -> Settings:
        return cls(gemm_sizes=(128, 256, 512), dtypes=("float32",), copy_bytes=16 * MiB,
                   message_bytes=tuple(4 * KiB * 4**i for i in range(6)),  # 4 KiB … 4 MiB
                   warmup=1, repeats=5, gemm_window_s=0.05, timeout_s=60)


@dataclass
class Measurements:
    """Slowest-rank medians, seconds."""

    backend: str
    nproc: int
    threads: int
    gemm_s: dict[str, dict[int, float]] = field(default_factory=dict)
    copy_s: float = 0.0
    copy_bytes: int = 0
    floor_s: float = 0.0
    comm_s: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per collective: comm.py's size S (bytes) → time."""


@dataclass
class Calibration:
    measurements: Measurements
    cluster_text: str
    fits: dict[str, AlphaBeta]
    rows: list[tuple[str, int, float, float]]
    """(collective, S bytes, measured s, predicted s) for the summary table."""
    notes: list[str] = field(default_factory=list)


# -- the calibration that can run ----------------------------------------------------------

def resolve_backend(backend: str, nproc: int) -> str:
    """The backend to use, or a CalibrationError saying why this calibration cannot run."""
    if nproc < 2:
        raise CalibrationError(
            f"--nproc {nproc}: collectives need a second rank; use --nproc 2 or more")
    if backend not in BACKENDS:
        raise CalibrationError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not dist.is_nccl_available() or gpus == 0:
            raise CalibrationError(
                "backend nccl needs CUDA GPUs and a torch build with NCCL; this machine has "
                "none: use --backend gloo")
        if gpus < nproc:
            raise CalibrationError(f"--nproc {nproc} with nccl needs {nproc} GPUs; found {gpus}")
    elif not dist.is_gloo_available():
        raise CalibrationError("this torch build has no gloo backend")
    return backend


def calibrate(nproc: int = 2, *, backend: str = "auto", settings: Settings | None = None,
              name: str | None = None) -> Calibration:
    from runtime.launch import spawn

    settings = settings or Settings()
    backend = resolve_backend(backend, nproc)
    per_rank = spawn(_measure_rank, nproc, settings, backend, backend=backend,
                     timeout_s=settings.timeout_s)
    m = _slowest(per_rank, backend, nproc)
    return fit(m, settings, name=name)


def fit(m: Measurements, settings: Settings, *, name: str | None = None) -> Calibration:
    fits, notes = {}, []
    for kind, v in m.comm_s.items():
        try:
            fits[kind] = fit_alpha_beta(list(v), list(v.values()), kind=kind, group_size=m.nproc)
        except CalibrationError as e:
            if kind == "all_reduce":  # the profile's link: nothing to write without it
                raise
            notes.append(f"{kind} not fitted: {e}")  # the others are informative only
    rows = [(k, s, t, predict_s(k, s, m.nproc, fits[k]))
            for k, v in m.comm_s.items() if k in fits for s, t in v.items()]
    text = profile_text(m, settings, fits, name=name)
    return Calibration(measurements=m, cluster_text=text, fits=fits, rows=rows, notes=notes)


# -- measuring, on every rank ----------------------------------------------------------------

def _measure_rank(settings: Settings, backend: str) -> Measurements:
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    timer = _cuda_timer if backend == "nccl" else _cpu_timer
    m = Measurements(backend=backend, nproc=dist.get_world_size(),
                     threads=torch.get_num_threads())
    for dtype in settings.dtypes:
        if not _supports(dtype, device):
            continue
        m.gemm_s[dtype] = {}
        for n in settings.gemm_sizes:
            a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
            b = torch.randn(n, n, device=device).to(getattr(torch, dtype))
            dist.barrier()  # every rank multiplies at once: a rank's share of the machine
            m.gemm_s[dtype][n] = _sustained(timer, lambda a=a, b=b: torch.mm(a, b), settings)
    src = torch.empty(settings.copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dist.barrier()
    m.copy_s, m.copy_bytes = _median(timer, lambda: dst.copy_(src), settings), 2 * src.nbytes
    one = torch.ones(1, device=device)
    m.floor_s = _median(timer, lambda: one.add_(1), settings)
    world = dist.get_world_size()
    for kind in COLLECTIVES:
        m.comm_s[kind] = {}
        for nbytes in settings.message_bytes:
            x = torch.zeros(nbytes // 4, device=device)
            size, op = _collective(kind, x, world)
            dist.barrier()
            m.comm_s[kind][size] = _median(timer, op, settings, small=nbytes < 256 * KiB)
    return m


def _collective(kind: str, x: torch.Tensor, world: int) -> tuple[int, Callable[[], object]]:
    """(S in comm.py's convention, the op). p2p is a ping-pong between ranks 0 and 1."""
    if kind == "all_reduce":
        return x.nbytes, lambda: dist.all_reduce(x)
    if kind == "all_gather":
        out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return out.nbytes, lambda: gather(out, x)
    rank = dist.get_rank()

    def ping_pong() -> None:  # one-way time = half a round trip (halved in _median)
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    ping_pong.round_trips = 2  # type: ignore[attr-defined]
    return x.nbytes, ping_pong


def _median(timer: Callable, op: Callable[[], object], settings: Settings, *,
            small: bool = False) -> float:
    """Median after warm-up; small messages are cheap and noisy, so they get 4x the repeats."""
    for _ in range(settings.warmup):
        op()
    times = [timer(op) for _ in range(settings.repeats * (4 if small else 1))]
    return statistics.median(times) / getattr(op, "round_trips", 1)


def _sustained(timer: Callable, op: Callable[[], object], settings: Settings) -> float:
    """Per-op time of ``op`` run back to back for ``settings.gemm_window_s`` (median of
    three windows)."""
    for _ in range(settings.warmup):
        op()
    count = max(1, math.ceil(settings.gemm_window_s / max(timer(op), 1e-9)))

    def window() -> None:
        for _ in range(count):
            op()

    return statistics.median(timer(window) for _ in range(3)) / count


def _cpu_timer(op: Callable[[], object]) -> float:
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _cuda_timer(op: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    op()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _supports(dtype: str, device: torch.device | str) -> bool:
    try:
        x = torch.ones(8, 8, device=device, dtype=getattr(torch, dtype))
        torch.mm(x, x)
        return True
    except (RuntimeError, TypeError):
        return False


def _slowest(per_rank: list[Measurements], backend: str, nproc: int) -> Measurements:
    """Every number as its slowest rank's; p2p from ranks 0 and 1 only."""
    first = per_rank[0]
    out = Measurements(backend=backend, nproc=nproc, threads=first.threads,
                       copy_bytes=first.copy_bytes,
                       copy_s=max(r.copy_s for r in per_rank),
                       floor_s=max(r.floor_s for r in per_rank))
    out.gemm_s = {d: {n: max(r.gemm_s[d][n] for r in per_rank) for n in v}
                  for d, v in first.gemm_s.items()}
    for kind, v in first.comm_s.items():
        ranks = per_rank[:2] if kind == "p2p" else per_rank
        out.comm_s[kind] = {s: max(r.comm_s[kind][s] for r in ranks) for s in v}
    return out


# -- the profile -----------------------------------------------------------------------------

def profile_text(m: Measurements, settings: Settings, fits: dict[str, AlphaBeta], *,
                 name: str | None = None) -> str:
    """The cluster profile as TOML (the format of cost_models/presets/)."""
    host = platform.node() or "this-machine"
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    curves = {d: fitted_gemm_curve(t, m.floor_s) for d, t in m.gemm_s.items()}
    # Device has one efficiency: float32's. Other dtypes fold theirs into their peak, so that
    # peak x efficiency is each dtype's fitted large-GEMM rate.
    eff = _efficiency(curves.get("float32"), m.gemm_s.get("float32", {}))
    peaks = {d: c.asymptote_flops / eff for d, c in curves.items()}
    bandwidth = fit_memory_bandwidth_GBps([m.copy_bytes], [m.copy_s])
    link = fits["all_reduce"]
    gpu = m.backend == "nccl"
    memory = (torch.cuda.get_device_properties(0).total_memory if gpu
              else _ram_bytes() // m.nproc)
    sizes = sorted(next(iter(m.comm_s.values())))
    source = (f"autopar calibrate on {host}, {when}: {m.backend}, {m.nproc} local ranks, "
              f"{m.threads} threads each; GEMM {'/'.join(peaks)} "
              f"{settings.gemm_sizes[0]}..{settings.gemm_sizes[-1]} on all ranks at once; "
              f"copy {m.copy_bytes // 2 // MiB} MiB; all_reduce/all_gather/send-recv "
              f"{_size(sizes[0])}..{_size(sizes[-1])}; link fitted on all_reduce")
    lines = [
        f"# Calibrated by `autopar calibrate` on {host}, {when}.",
        f"# Backend {m.backend}, {m.nproc} ranks. GEMM throughput was measured with all {m.nproc}",
        "# ranks multiplying at once (ranks share the machine, so that is what a rank gets).",
        "# GEMM times fitted per dtype to t = floor + 2n^3 (n + d_half) / (n R_inf)",
        "# (cost_models/compute.py's efficiency curve): matmul_half_dim := d_half; float32:",
        "# peak_tflops := the larger of R_inf and the best rate measured, matmul_efficiency :=",
        "# R_inf / that peak; other dtypes: peak := their R_inf / that efficiency. So peak x",
        "# efficiency is each dtype's fitted large-GEMM rate.",
        "# memory_bandwidth_GBps: bytes read + written by a large copy, over its time.",
        "# intra_node: alpha-beta fitted on all_reduce to cost_models/comm.py's ring formula;",
        "# inter_node repeats it (one machine: no network was measured). [collective_links]:",
        "# all_gather and send/recv on their own fits inside the node (gloo's all_gather is not",
        "# a ring: it costs more); reduce_scatter, not measured, uses intra_node.",
        f'name = "calibrated-{_bare(host)}"',
        f'source = "{source}"',
        'provenance = "calibrated"',
        "nodes = 1",
        f"devices_per_node = {m.nproc}",
        "",
        "[device]",
        f'name = "{torch.cuda.get_device_name(0) if gpu else "cpu-process"}"',
        f"memory_gib = {memory / GiB:.3f}",
        f"memory_bandwidth_GBps = {bandwidth:.4g}",
        f"matmul_efficiency = {eff:.4f}",
        f"kernel_floor_us = {m.floor_s * 1e6:.3f}",
        "",
        "[device.peak_tflops]",
        *(f"{d} = {p / 1e12:.6g}" for d, p in peaks.items()),
        "",
        "[device.matmul_half_dim]",
        *(f"{d} = {c.half_dim:.4g}" for d, c in curves.items()),
    ]
    kind = "pcie" if gpu else "loopback"
    for table in ("intra_node", "inter_node"):
        lines += ["", f"[{table}]", f'kind = "{kind}"', f"bandwidth_GBps = {link.bandwidth_GBps:.4g}",
                  f"latency_us = {link.latency_s * 1e6:.4g}"]
    for k, f in fits.items():  # each collective on its own fit inside the node
        if k != "all_reduce":
            lines += ["", f"[collective_links.{k}]", f'kind = "{kind}"',
                      f"bandwidth_GBps = {f.bandwidth_GBps:.4g}",
                      f"latency_us = {f.latency_s * 1e6:.4g}"]
    for k, v in m.comm_s.items():  # what the fits were made from, S as in comm.py
        lines += ["", f"[extra.measured.{k}]", f"sizes_bytes = {list(v)}",
                  f"times_s = [{', '.join(f'{t:.4g}' for t in v.values())}]"]
    for dtype, times in m.gemm_s.items():
        lines += ["", f"[extra.gemm.{dtype}]", f"sizes = {list(times)}",
                  f"tflops = [{', '.join(f'{2 * n**3 / t / 1e12:.4g}' for n, t in times.items())}]"]
    return "\n".join(lines) + "\n"


def fitted_gemm_curve(times: dict[int, float], floor_s: float) -> GemmCurve:
    """The fitted curve; with times too noisy to fit one, the largest GEMMs' rate and no
    size effect (the summary ``fit_matmul`` makes)."""
    try:
        return fit_gemm_curve(list(times), list(times.values()), floor_s=floor_s)
    except CalibrationError:
        mm = fit_matmul(list(times), list(times.values()))
        return GemmCurve(asymptote_flops=mm.peak_flops * mm.efficiency, half_dim=0.0)


def _efficiency(curve: GemmCurve | None, times: dict[int, float]) -> float:
    """R∞ over the peak, where peak := the larger of R∞ and the best rate measured."""
    if curve is None:
        return 1.0
    best = max((2 * n**3 / t for n, t in times.items()), default=curve.asymptote_flops)
    return curve.asymptote_flops / max(best, curve.asymptote_flops)


def write_profile(cal: Calibration, path: str | os.PathLike, *, force: bool = False) -> Cluster:
    """Write the profile (refusing to overwrite unless ``force``) and load it back."""
    check_output(path, force=force)
    Path(path).write_text(cal.cluster_text)
    return Cluster.from_toml(path)


def check_output(path: str | os.PathLike, *, force: bool = False) -> None:
    path = Path(path)
    if not path.parent.is_dir():
        raise CalibrationError(f"output directory {path.parent} does not exist")
    if path.exists() and not force:
        raise CalibrationError(f"{path} exists; pass --force to overwrite it")


def format_table(cal: Calibration) -> str:
    m = cal.measurements
    lines = [f"{'collective':<11} {'S':>8} {'measured ms':>12} {'fitted ms':>10} {'error':>7}"]
    lines.append("-" * len(lines[0]))
    for kind, s, t, p in cal.rows:
        lines.append(f"{kind:<11} {_size(s):>8} {t * 1e3:>12.3f} {p * 1e3:>10.3f} "
                     f"{relative_error(p, t):>+7.0%}")
    lines.append("")
    for k, f in cal.fits.items():
        lines.append(f"{k:<11} alpha {f.latency_s * 1e6:8.1f} us  B {f.bandwidth_GBps:7.3f} GB/s"
                     + ("   <- the profile's link" if k == "all_reduce" else ""))
    lines += [*cal.notes, ""]
    lines.append(f"{'GEMM':<11} {'n':>8} {'GFLOP/s per rank, ' + str(m.nproc) + ' ranks at once':>40}")
    for dtype, times in m.gemm_s.items():
        for n, t in times.items():
            lines.append(f"{dtype:<11} {n:>8} {2 * n**3 / t / 1e9:>40.1f}")
    lines.append(f"memory bandwidth (copy {m.copy_bytes // 2 // MiB} MiB): "
                 f"{m.copy_bytes / m.copy_s / 1e9:.2f} GB/s;  kernel floor {m.floor_s * 1e6:.1f} us")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _bare(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in host)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GiB
