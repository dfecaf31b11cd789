"""``autopar calibrate``: measure this machine and write a cluster profile.

One launch of ``nproc`` local ranks (gloo on CPU; NCCL with CUDA events on GPUs) measures,
in order: GEMM throughput by size and dtype with *every rank running at once* (on a shared
CPU that is what one rank gets during training), a large tensor copy (memory bandwidth),
the smallest op (kernel floor), then all_reduce / all_gather by message size and a
send/recv ping-pong between ranks 0 and 1, then the overlap slowdown σ of each pattern of
``cost_models.overlap`` (a GEMM window alone, and again beside that pattern's
communication). Each number is the median of repeats after a warm-up; a rank's result is
the slowest rank's median. GEMM windows are repeated and their spread recorded: on a shared
machine the rate moves by tens of percent between runs. ``cost_models.calibrate`` fits
them; ``write_profile`` writes a TOML file that ``Cluster.from_toml`` loads.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import threading
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
    Spread,
    fit_alpha_beta,
    fit_gemm_curve,
    fit_matmul,
    fit_memory_bandwidth_GBps,
    fit_overlap_slowdown,
    predict_s,
    relative_error,
    spread,
)
from cost_models.hardware import Cluster, GiB

KiB, MiB = 1024, 1024**2
BACKENDS = ("auto", "gloo", "nccl")
COLLECTIVES = ("all_reduce", "all_gather", "p2p")
OVERLAP_PATTERNS = ("dp", "fsdp", "pp")
"""``cost_models.overlap``'s patterns, each timed beside its own communication: dp beside
all_reduce (DDP's gradient buckets), fsdp beside all_gather_single + reduce_scatter_single
(what FSDP2's ``fully_shard`` issues), pp beside isend/irecv with both ring neighbours."""
MAX_SLOWDOWN = 10.0
"""``Cluster.from_toml`` refuses an ``[overlap]`` slowdown this large (a typo, or a broken
measurement: compute at a tenth of its speed)."""
OVERLAP_COMM_FACTOR = 1.5
"""The communication issued beside a GEMM window is sized to last this many times the
window, each timed alone. Beside each other both slow down, and the communication mostly
outlasts the compute (then σ = compute beside / alone); when it ends first,
``fit_overlap_slowdown`` reads σ from when it ended. Larger only makes the run longer."""


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
    gemm_windows: int = 3
    """Windows per GEMM size: the median is fitted, the spread (min..max) recorded."""
    overlap_gemm_size: int = 1024
    """n of the n × n float32 GEMMs whose slowdown beside communication is measured."""
    overlap_repeats: int = 3
    """(alone, beside) window pairs per overlap pattern; σ is the median over the pairs."""
    timeout_s: float = 120

    @classmethod
    def quick(cls) -> Settings:
        return cls(gemm_sizes=(128, 256, 512), dtypes=("float32",), copy_bytes=16 * MiB,
                   message_bytes=tuple(4 * KiB * 4**i for i in range(6)),  # 4 KiB … 4 MiB
                   warmup=1, repeats=5, gemm_window_s=0.05, overlap_gemm_size=512,
                   timeout_s=60)


@dataclass
class Measurements:
    """Slowest-rank medians, seconds."""

    backend: str
    nproc: int
    threads: int
    gemm_s: dict[str, dict[int, float]] = field(default_factory=dict)
    gemm_windows_s: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    """Per-GEMM time of each window; ``gemm_s`` is their median."""
    copy_s: float = 0.0
    copy_bytes: int = 0
    floor_s: float = 0.0
    comm_s: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per collective: comm.py's size S (bytes) → time."""
    overlap: dict[str, list[OverlapSample]] = field(default_factory=dict)
    """Per pattern of OVERLAP_PATTERNS: the (alone, beside) window pairs."""


@dataclass(frozen=True)
class OverlapSample:
    """One GEMM window timed alone, then beside communication started with it (seconds)."""

    compute_alone_s: float
    compute_beside_s: float
    comm_s: float
    """From the common start until the communication was seen complete."""


@dataclass
class Calibration:
    measurements: Measurements
    cluster_text: str
    fits: dict[str, AlphaBeta]
    rows: list[tuple[str, int, float, float]]
    """(collective, S bytes, measured s, predicted s) for the summary table."""
    notes: list[str] = field(default_factory=list)
    overlap: dict[str, Spread] = field(default_factory=dict)
    """Per pattern: σ of the window pairs; the median is the profile's slowdown."""
    gemm_spread: dict[str, dict[int, Spread]] = field(default_factory=dict)
    """Per dtype and size: FLOP/s per rank over the GEMM windows; the median is fitted."""


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
    overlap = {}
    for pattern, samples in m.overlap.items():
        sigmas = overlap_slowdowns(samples)
        if not sigmas:
            notes.append(f"overlap {pattern}: no window pair fits the overlap model; the "
                         "profile keeps the default slowdown")
        elif (fitted := spread(sigmas)).median >= MAX_SLOWDOWN:
            notes.append(f"overlap {pattern}: slowdown {fitted.median:.3g} is past what a "
                         "profile accepts (< 10); the profile keeps the default")
        else:
            overlap[pattern] = fitted
    gemm_spread = {d: {n: spread([2 * n**3 / t for t in w]) for n, w in v.items()}
                   for d, v in m.gemm_windows_s.items()}
    text = profile_text(m, settings, fits, name=name, overlap=overlap, gemm_spread=gemm_spread)
    return Calibration(measurements=m, cluster_text=text, fits=fits, rows=rows, notes=notes,
                       overlap=overlap, gemm_spread=gemm_spread)


def overlap_slowdowns(samples: list[OverlapSample]) -> list[float]:
    """σ of each window pair that the overlap model can explain (others are noise)."""
    sigmas = []
    for s in samples:
        try:
            sigmas.append(fit_overlap_slowdown(s.compute_alone_s, s.compute_beside_s, s.comm_s))
        except CalibrationError:
            continue
    return sigmas


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
            windows = _sustained(timer, lambda a=a, b=b: torch.mm(a, b), settings, device)
            m.gemm_windows_s.setdefault(dtype, {})[n] = windows
            m.gemm_s[dtype][n] = statistics.median(windows)
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
    m.overlap = _measure_overlap(settings, device, timer)
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


def _measure_overlap(settings: Settings, device: torch.device | str,
                     timer: Callable) -> dict[str, list[OverlapSample]]:
    """(alone, beside) pairs of one GEMM window per pattern of OVERLAP_PATTERNS.

    Every rank runs the same window (the same GEMM count) at once, first alone, then with
    the pattern's communication issued (``async_op=True``) just before it and waited after
    it; the communication is repeated to last OVERLAP_COMM_FACTOR windows (timed alone).
    Message: the largest of ``settings.message_bytes``. The pairs alternate, so that a
    machine whose speed drifts moves both halves of a pair alike.
    """
    n = settings.overlap_gemm_size
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def op() -> None:
        torch.mm(a, b)

    window, count, op_s = _window(timer, op, settings, device)
    x = torch.zeros(settings.message_bytes[-1] // 4, device=device)  # zeros stay finite
    out: dict[str, list[OverlapSample]] = {}
    for pattern in OVERLAP_PATTERNS:
        issue = _overlap_comm(pattern, x)
        for _ in range(settings.warmup):
            _wait(issue())
        dist.barrier()
        chunk_s = timer(lambda issue=issue: _wait(issue()))
        chunks = _agree(math.ceil(OVERLAP_COMM_FACTOR * count * op_s / max(chunk_s, 1e-9)),
                        device)

        def issue_all(issue=issue, chunks=chunks) -> list:
            return [w for _ in range(chunks) for w in issue()]

        samples = []
        for _ in range(settings.overlap_repeats):
            dist.barrier()
            alone_s = timer(window)
            dist.barrier()
            beside_s, comm_s = _time_beside(op, count, issue_all, cuda=x.is_cuda)
            samples.append(OverlapSample(alone_s, beside_s, comm_s))
        out[pattern] = samples
    return out


def _overlap_comm(pattern: str, x: torch.Tensor) -> Callable[[], list]:
    """A function issuing one round of the pattern's communication; returns its works."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pattern == "dp":
        return lambda: [dist.all_reduce(x, async_op=True)]
    if pattern == "fsdp":
        full = torch.zeros(world * x.numel(), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: [gather(full, x, async_op=True), scatter(x, full, async_op=True)]
    received = torch.empty_like(x)
    return lambda: [dist.isend(x, (rank + 1) % world), dist.irecv(received, (rank - 1) % world)]


def _time_beside(op: Callable[[], object], count: int, issue: Callable[[], list], *,
                 cuda: bool) -> tuple[float, float]:
    """(compute s, communication s) of ``count`` ops run beside the works ``issue`` starts.

    On CPU a thread waits on the works (``wait`` releases the GIL) and notes when they end;
    polling ``is_completed`` cannot, since gloo's send/recv works report completion only
    once waited on. On CUDA the works are waited after the ops: the end is read as
    max(compute, comm), which reads σ as compute beside / alone (a lower bound when the
    communication ended first).
    """
    if cuda:
        start, done, comm_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        works = issue()
        for _ in range(count):
            op()
        done.record()
        _wait(works)
        comm_done.record()
        comm_done.synchronize()
        return start.elapsed_time(done) / 1e3, start.elapsed_time(comm_done) / 1e3
    works = issue()
    start = time.perf_counter()
    ended: list[float | BaseException] = []

    def wait_and_note() -> None:
        try:
            _wait(works)
            ended.append(time.perf_counter())
        except BaseException as e:  # re-raised on the rank's main thread below
            ended.append(e)

    waiter = threading.Thread(target=wait_and_note, name="autopar-calibrate-wait")
    waiter.start()
    for _ in range(count):
        op()
    end = time.perf_counter()
    waiter.join()
    if isinstance(ended[0], BaseException):
        raise ended[0]
    return end - start, ended[0] - start


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _agree(count: int, device: torch.device | str) -> int:
    """The largest of every rank's ``count``: ranks must issue the same collectives."""
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _median(timer: Callable, op: Callable[[], object], settings: Settings, *,
            small: bool = False) -> float:
    """Median after warm-up; small messages are cheap and noisy, so they get 4x the repeats."""
    for _ in range(settings.warmup):
        op()
    times = [timer(op) for _ in range(settings.repeats * (4 if small else 1))]
    return statistics.median(times) / getattr(op, "round_trips", 1)


def _sustained(timer: Callable, op: Callable[[], object], settings: Settings,
               device: torch.device | str) -> list[float]:
    """Per-op times of ``op`` run back to back for ``settings.gemm_window_s``, one per
    window (``settings.gemm_windows`` of them).

    Every rank starts each window together and runs the same count of ops, so that a
    window measures a rank's share of the machine with all ranks busy; windows of
    different lengths let the last rank run alone and read up to 10x faster.
    """
    window, count, _ = _window(timer, op, settings, device)
    times = []
    for _ in range(settings.gemm_windows):
        dist.barrier()
        times.append(timer(window))
    return [t / count for t in times]


def _window(timer: Callable, op: Callable[[], object], settings: Settings,
            device: torch.device | str) -> tuple[Callable[[], None], int, float]:
    """(A window of back-to-back ops lasting about ``settings.gemm_window_s``, its count of
    ops, one op's time).

    The count is what a rank completed in one such window with every rank multiplying at
    once, the largest of any rank's so that all run the same work. One op timed alone
    would not do: on oversubscribed CPU cores a small GEMM takes 0.03 ms or, when its
    threads wait out a scheduler tick, 10 ms, and a count read from the fast case makes a
    window of seconds.
    """
    for _ in range(settings.warmup):
        op()
    dist.barrier()
    elapsed, ops = 0.0, 0
    while elapsed < settings.gemm_window_s:
        elapsed += timer(op)
        ops += 1
    count = _agree(ops, device)

    def window() -> None:
        for _ in range(count):
            op()

    return window, count, elapsed / ops


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
    for d, v in first.gemm_s.items():
        slowest = {n: max(per_rank, key=lambda r, d=d, n=n: r.gemm_s[d][n]) for n in v}
        out.gemm_s[d] = {n: r.gemm_s[d][n] for n, r in slowest.items()}
        out.gemm_windows_s[d] = {n: r.gemm_windows_s[d][n] for n, r in slowest.items()}
    for pattern in first.overlap:  # the rank whose compute slowed most
        out.overlap[pattern] = max(
            (r.overlap[pattern] for r in per_rank),
            key=lambda samples: statistics.median(overlap_slowdowns(samples) or [0.0]))
    for kind, v in first.comm_s.items():
        ranks = per_rank[:2] if kind == "p2p" else per_rank
        out.comm_s[kind] = {s: max(r.comm_s[kind][s] for r in ranks) for s in v}
    return out


# -- the profile -----------------------------------------------------------------------------

def profile_text(m: Measurements, settings: Settings, fits: dict[str, AlphaBeta], *,
                 name: str | None = None, overlap: dict[str, Spread] | None = None,
                 gemm_spread: dict[str, dict[int, Spread]] | None = None) -> str:
    """The cluster profile as TOML (the format of cost_models/presets/)."""
    overlap, gemm_spread = overlap or {}, gemm_spread or {}
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
              f"{_size(sizes[0])}..{_size(sizes[-1])}; link fitted on all_reduce"
              + (f"; overlap slowdown measured ({', '.join(overlap)}) on float32 GEMM "
                 f"{settings.overlap_gemm_size}" if overlap else ""))
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
        f"# GEMM rates are the median of {settings.gemm_windows} windows of "
        f"{settings.gemm_window_s:g} s; [extra.gemm.<dtype>]",
        "# tflops_min/tflops_max give the windows' spread (the rate of a shared machine moves).",
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
    lines += _overlap_lines(m, settings, overlap)
    for k, v in m.comm_s.items():  # what the fits were made from, S as in comm.py
        lines += ["", f"[extra.measured.{k}]", f"sizes_bytes = {list(v)}",
                  f"times_s = [{', '.join(f'{t:.4g}' for t in v.values())}]"]
    for dtype, times in m.gemm_s.items():
        lines += ["", f"[extra.gemm.{dtype}]", f"sizes = {list(times)}",
                  f"tflops = [{', '.join(f'{2 * n**3 / t / 1e12:.4g}' for n, t in times.items())}]"]
        if dtype in gemm_spread:
            for end in ("low", "high"):
                rates = (getattr(gemm_spread[dtype][n], end) for n in times)
                lines.append(f"tflops_{'min' if end == 'low' else 'max'} = "
                             f"[{', '.join(f'{r / 1e12:.4g}' for r in rates)}]")
    return "\n".join(lines) + "\n"


def _overlap_lines(m: Measurements, settings: Settings, overlap: dict[str, Spread]) -> list[str]:
    """``[overlap]`` (measured slowdowns) and ``[extra.overlap.<pattern>]`` (the timings)."""
    if not overlap:
        return []
    lines = [
        "",
        "# [overlap]: measured. Every rank ran the same window of float32 GEMMs "
        f"(n = {settings.overlap_gemm_size})",
        "# alone, then with the pattern's communication issued (async_op=True) before it and",
        "# waited after it: dp all_reduce; fsdp all_gather + reduce_scatter; pp isend/irecv to",
        "# both ring neighbours. slowdown = compute beside / alone while the communication",
        "# outlasts it (cost_models.calibrate.fit_overlap_slowdown), clamped to >= 1; the median",
        f"# of {settings.overlap_repeats} pairs on the slowest rank. Patterns not listed keep "
        "the default.",
        "[overlap]",
        *(f"{p}_slowdown = {s.median:.4g}" for p, s in overlap.items()),
        *_exposed_lines(m.backend),
    ]
    for pattern, spread_ in overlap.items():
        samples = m.overlap[pattern]
        lines += ["", f"[extra.overlap.{pattern}]",
                  f"slowdown_min = {spread_.low:.4g}", f"slowdown_max = {spread_.high:.4g}"]
        for key in ("compute_alone_s", "compute_beside_s", "comm_s"):
            lines.append(f"{key} = [{', '.join(f'{getattr(s, key):.4g}' for s in samples)}]")
    return lines


def _exposed_lines(backend: str) -> list[str]:
    """On CPU ranks FSDP2 issues its gathers and reduce-scatters synchronously (it overlaps
    them only through CUDA streams), however well gloo could overlap them."""
    if backend != "gloo":
        return []
    return ["# FSDP2 waits for each collective on CPU: its communication is never overlapped.",
            'exposed = ["fsdp"]']


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
    lines.append(f"{'GEMM':<11} {'n':>8} {'GFLOP/s per rank, ' + str(m.nproc) + ' ranks at once':>40}"
                 f"   {'windows min..max':>16} {'spread':>6}")
    for dtype, times in m.gemm_s.items():
        for n, t in times.items():
            row = f"{dtype:<11} {n:>8} {2 * n**3 / t / 1e9:>40.1f}"
            s = cal.gemm_spread.get(dtype, {}).get(n)
            if s is not None:
                row += f"   {f'{s.low / 1e9:.1f}..{s.high / 1e9:.1f}':>16} {s.relative:>6.0%}"
            lines.append(row)
    lines.append(f"memory bandwidth (copy {m.copy_bytes // 2 // MiB} MiB): "
                 f"{m.copy_bytes / m.copy_s / 1e9:.2f} GB/s;  kernel floor {m.floor_s * 1e6:.1f} us")
    if cal.overlap:
        lines += ["", f"{'overlap':<11} {'sigma':>6} {'pairs min..max':>15} "
                      f"{'compute alone ms':>17} {'beside ms':>10} {'comm ms':>8}"]
    for pattern, s in cal.overlap.items():
        samples = m.overlap[pattern]
        alone, beside, comm = (statistics.median(getattr(x, k) for x in samples) * 1e3
                               for k in ("compute_alone_s", "compute_beside_s", "comm_s"))
        lines.append(f"{pattern:<11} {s.median:>6.2f} {f'{s.low:.2f}..{s.high:.2f}':>15} "
                     f"{alone:>17.1f} {beside:>10.1f} {comm:>8.1f}")
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
