"""Measuring, on every rank of an ``autopar calibrate`` launch: what ``Settings`` asks
for, timed as ``autopar.calibrate``'s docstring describes, into ``Measurements`` (each
number the slowest rank's, ``slowest``). The fits and the profile are ``autopar.calibrate``'s.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.calibration_kernels import (
    HOST_STACK,
    attention_op,
    host_overhead_ops,
    linear_op,
    loss_op,
    memory_kernels,
)
from cost_models.calibrate import CalibrationError, fit_overlap_slowdown

KiB, MiB = 1024, 1024**2
COLLECTIVES = ("all_reduce", "all_gather", "p2p")
OVERLAP_PATTERNS = ("dp", "fsdp", "pp")
"""``cost_models.overlap``'s patterns, each timed beside its own communication: dp beside
all_reduce (DDP's gradient buckets), fsdp beside all_gather_single + reduce_scatter_single
(what FSDP2's ``fully_shard`` issues), pp beside isend/irecv with both ring neighbours."""
OVERLAP_COMM_FACTOR = 1.5
"""The communication issued beside a GEMM window is sized to last this many times the
window, each timed alone. Beside each other both slow down, and the communication mostly
outlasts the compute (then σ = compute beside / alone); when it ends first,
``fit_overlap_slowdown`` reads σ from when it ended. Larger only makes the run longer."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What to measure; ``quick()`` keeps a run to a few seconds for tests and CI."""

    gemm_sizes: tuple[int, ...] | None = None
    """n of the n → n Linears timed; None: 256 … 2048 on CPU, 256 … 8192 on GPUs (an H100's
    bfloat16 GEMMs are still far from their asymptote at 2048, so a curve fitted below it
    would guess R∞)."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    memory_kernel_bytes: int | None = None
    """Size of each memory-bound kernel's tensors; None: 4 MiB on CPU (an activation of the
    models CPU ranks train; glibc serves allocations below its mmap threshold from the heap,
    while larger ones fault in fresh pages on every call and run several times slower),
    256 MiB on GPUs (past an H100's 50 MB L2 cache, so the kernels stream from HBM)."""
    attention_shape: tuple[int, int, int] = (8, 512, 64)
    """Fused attention's (batch × heads, sequence, head dim): its rate depends on the shape
    (on CPU it doubles from head dim 32 to 128); pass the model's own for its planning."""
    loss_shape: tuple[int, int] = (2048, 8192)
    """Cross-entropy's (tokens, vocabulary) of float32 logits: on CPU its rate depends on
    the vocabulary; pass the model's own (tokens per rank and micro-batch) for its planning."""
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
    skew_window_s: float = 0.01
    """Compute between two blocking collectives when measuring the collective skew: about a
    layer's forward on a CPU rank (ranks drift further apart over longer windows)."""
    skew_rounds: int = 30
    """(window, collective) rounds timed together, against as many windows alone."""
    skew_repeats: int = 5
    """(with collectives, alone) pairs per message size; the skew is their median."""
    skew_bytes: tuple[int, ...] = (256 * KiB, MiB, 4 * MiB, 16 * MiB)
    """Messages the skew is measured at besides one element (``Device.collective_skew_at``):
    those up to the largest of ``message_bytes``."""
    timeout_s: float = 120

    @classmethod
    def quick(cls) -> Settings:
        return cls(gemm_sizes=(128, 256, 512), dtypes=("float32",), attention_shape=(4, 128, 32),
                   loss_shape=(256, 1024), skew_bytes=(MiB,), skew_repeats=3,
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
    memory_kernels: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Per memory-bound kernel (``calibration_kernels.memory_kernels``): (bytes read + written,
    seconds) per call."""
    attention: AttentionTiming | None = None
    loss: LossTiming | None = None
    host: HostTiming | None = None
    """Host overheads, measured on CPU ranks only (GPUs hide them behind kernels)."""
    floor_s: float = 0.0
    comm_s: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per collective: comm.py's size S (bytes) → time."""
    overlap: dict[str, list[OverlapSample]] = field(default_factory=dict)
    """Per pattern of OVERLAP_PATTERNS: the (alone, beside) window pairs."""


@dataclass(frozen=True)
class AttentionTiming:
    """Causal fused attention, forward + backward, on the slowest rank."""

    dtype: str
    shape: tuple[int, int, int]
    flops: float
    """Counted as the planner counts them (``calibration_kernels.attention_op``)."""
    seconds: float


@dataclass(frozen=True)
class LossTiming:
    """Cross-entropy over float32 logits, forward + backward, on the slowest rank."""

    shape: tuple[int, int]
    bytes: float
    """Counted as the planner counts its passes (``calibration_kernels.loss_op``)."""
    seconds: float


@dataclass(frozen=True)
class HostTiming:
    """What the parallel engines and rank drift add on CPU ranks (seconds, slowest rank)."""

    fsdp_s: float
    """Per FSDP2 module, forward + backward."""
    tp_s: float
    """Per tensor-parallel module, forward + backward."""
    dtensor_op_s: float
    """Per op on a DTensor."""
    skew_s: float | None
    """Per blocking collective after a compute window, beyond its back-to-back time (None on
    one rank: nothing to wait for)."""
    skew_at: tuple[tuple[int, float], ...]
    """(message bytes, skew) at the larger messages of ``Settings.skew_bytes``."""
    skew_window_s: float
    """That window."""


@dataclass(frozen=True)
class OverlapSample:
    """One GEMM window timed alone, then beside communication started with it (seconds)."""

    compute_alone_s: float
    compute_beside_s: float
    comm_s: float
    """From the common start until the communication was seen complete."""


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

def measure_rank(settings: Settings, backend: str) -> Measurements:
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    timer = _cuda_timer if backend == "nccl" else _cpu_timer
    world = dist.get_world_size()
    m = Measurements(backend=backend, nproc=world, threads=torch.get_num_threads())
    for dtype in settings.dtypes:
        if not _supports(dtype, device):
            continue
        linears = {n: linear_op(n, getattr(torch, dtype), device)
                   for n in settings.gemm_sizes or gemm_sizes(backend)}
        windows = _sustained_each(timer, {n: op for n, (_, op) in linears.items()}, settings,
                                  device)
        m.gemm_windows_s[dtype] = {n: [t / gemms for t in windows[n]]
                                   for n, (gemms, _) in linears.items()}
        m.gemm_s[dtype] = {n: statistics.median(w) for n, w in m.gemm_windows_s[dtype].items()}
    kernel_bytes = settings.memory_kernel_bytes or (256 * MiB if backend == "nccl" else 4 * MiB)
    kernels = memory_kernels(kernel_bytes, device)
    windows = _sustained_each(timer, {k: op for k, (_, op) in kernels.items()}, settings, device)
    m.memory_kernels = {k: (moved, statistics.median(windows[k]))
                        for k, (moved, _) in kernels.items()}
    m.attention = _measure_attention(settings, backend, device, timer, m)
    moved, op = loss_op(settings.loss_shape, device)
    m.loss = LossTiming(shape=settings.loss_shape, bytes=moved,
                        seconds=statistics.median(_sustained(timer, op, settings, device)))
    if backend == "gloo":
        m.host = _measure_host(settings, device, timer)
    one = torch.ones(1, device=device)
    m.floor_s = _median(timer, lambda: one.add_(1), settings)
    if world == 1:  # one device (``autopar calibrate --topology``): no link to measure
        return m
    for kind in COLLECTIVES:
        m.comm_s[kind] = {}
        for nbytes in settings.message_bytes:
            x = torch.zeros(nbytes // 4, device=device)
            size, op = _collective(kind, x, world)
            dist.barrier()
            m.comm_s[kind][size] = _median(timer, op, settings, small=nbytes < 256 * KiB)
    m.overlap = _measure_overlap(settings, device, timer)
    return m


def gemm_sizes(backend: str) -> tuple[int, ...]:
    """``Settings.gemm_sizes``' default on the backend's devices."""
    return (256, 512, 1024, 2048) + ((4096, 8192) if backend == "nccl" else ())


def _measure_attention(settings: Settings, backend: str, device: torch.device | str,
                       timer: Callable, m: Measurements) -> AttentionTiming | None:
    """Causal attention in the dtype training computes in (bfloat16 on GPUs, float32 on
    CPU), when its GEMMs were measured (the efficiency is relative to their rate)."""
    dtype = "bfloat16" if backend == "nccl" else "float32"
    if dtype not in m.gemm_s:
        return None
    flops, op = attention_op(settings.attention_shape, getattr(torch, dtype), device)
    seconds = statistics.median(_sustained(timer, op, settings, device))
    return AttentionTiming(dtype=dtype, shape=settings.attention_shape, flops=flops,
                           seconds=seconds)


def _measure_host(settings: Settings, device: torch.device | str, timer: Callable
                  ) -> HostTiming:
    """The engines' host time per module or op (``calibration_kernels.host_overhead_ops``,
    on a mesh of each rank alone, all ranks at once), and the collective skew.

    Host time is what a busy machine only adds to, so each op reads its fastest window,
    not the median: a burst that slowed the plain stack's windows more than the wrapped
    one's would otherwise read as an engine costing nothing. An overhead still not above
    zero on the slowest rank is measured again, up to ``HOST_TRIES`` times; ``fit`` refuses
    one that never was."""
    one = init_device_mesh("cpu", (dist.get_world_size(), 1),
                           mesh_dim_names=("calibrate_ranks", "calibrate_alone"))
    ops = host_overhead_ops(one["calibrate_alone"], device)
    for _ in range(HOST_TRIES):
        t = {k: min(w) for k, w in _sustained_each(timer, ops, settings, device).items()}
        overheads = torch.tensor([(t["fsdp"] - t["plain"]) / HOST_STACK,
                                  (t["tp"] - t["plain"]) / HOST_STACK,
                                  t["dtensor op"] - t["op"]], dtype=torch.float64)
        dist.all_reduce(overheads, op=dist.ReduceOp.MAX)  # the slowest rank's, as ``slowest``
        if bool((overheads > 0).all()):
            break
    fsdp_s, tp_s, dtensor_op_s = overheads.tolist()
    many = dist.get_world_size() > 1
    sizes = [n for n in settings.skew_bytes if n <= max(settings.message_bytes)] if many else []
    skew = _measure_skew(settings, device, timer, [4, *sizes]) if many else {}
    return HostTiming(fsdp_s=fsdp_s, tp_s=tp_s, dtensor_op_s=dtensor_op_s,
                      skew_s=skew.pop(4) if many else None,
                      skew_at=tuple(skew.items()),
                      skew_window_s=settings.skew_window_s)


HOST_TRIES = 3
"""Measurements of the host overheads before ``fit`` refuses one not above zero."""


def _measure_skew(settings: Settings, device: torch.device | str, timer: Callable,
                  sizes: list[int]) -> dict[int, float]:
    """Message bytes -> skew. Every rank runs ``skew_rounds`` GEMM windows of
    ``skew_window_s``, each followed by an all_reduce of that size, then as many windows
    alone; the difference per round, less the all_reduce's own time back to back
    (measured as the collectives are), is the skew: the median of ``skew_repeats`` such
    pairs, the sizes taken in turn within each repeat (as ``_sustained_each``)."""
    n = settings.overlap_gemm_size
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    window, _, _ = _window(timer, lambda: torch.mm(a, b), settings, device,
                           seconds=settings.skew_window_s)
    rounds = settings.skew_rounds
    messages = {size: torch.zeros(max(1, size // 4), device=device) for size in sizes}
    back_to_back = {size: _median(timer, lambda x=x: dist.all_reduce(x), settings,
                                  small=size < 256 * KiB) for size, x in messages.items()}

    def synced(x: torch.Tensor) -> None:
        for _ in range(rounds):
            window()
            dist.all_reduce(x)

    def alone() -> None:
        for _ in range(rounds):
            window()

    excess: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(settings.skew_repeats):
        for size, x in messages.items():
            dist.barrier()
            with_collectives = timer(lambda x=x: synced(x))
            dist.barrier()
            excess[size].append((with_collectives - timer(alone)) / rounds)
    return {size: max(0.0, statistics.median(e) - back_to_back[size])
            for size, e in excess.items()}


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


SMALL_BATCH = 8
"""Calls timed together per sample of a small message: a call takes microseconds, or a
millisecond when a rank waits out a scheduler wake-up on a loaded machine, and the median
of single calls flips between the two; the mean of a batch holds both in proportion."""


def _median(timer: Callable, op: Callable[[], object], settings: Settings, *,
            small: bool = False) -> float:
    """Median per call after warm-up; small messages are cheap and noisy, so they get 4x
    the samples, each a batch of SMALL_BATCH calls."""
    for _ in range(settings.warmup):
        op()
    batch = SMALL_BATCH if small else 1

    def calls() -> None:
        for _ in range(batch):
            op()

    times = [timer(calls) / batch for _ in range(settings.repeats * (4 if small else 1))]
    return statistics.median(times) / getattr(op, "round_trips", 1)


def _sustained(timer: Callable, op: Callable[[], object], settings: Settings,
               device: torch.device | str) -> list[float]:
    """Per-op times of ``op`` run back to back for ``settings.gemm_window_s``, one per
    window (``settings.gemm_windows`` of them); see ``_sustained_each``."""
    return _sustained_each(timer, {"": op}, settings, device)[""]


def _sustained_each(timer: Callable, ops: dict[Any, Callable[[], object]], settings: Settings,
                    device: torch.device | str) -> dict[Any, list[float]]:
    """``_sustained`` of several ops, their windows taken in turn: the first window of
    every op, then the second of every op, and so on. A shared machine can slow every
    rank's memory-bound kernels tenfold for up to a second at a time (BENCHMARKS.md); one
    op's windows back to back could all fall in one such burst, and so would their median.

    A window must measure a rank's share of the machine with every rank busy. On CPU
    ranks every rank starts each window together and runs ops until the window's time is
    up, so all stop within one op of each other: with the same count of ops instead, the
    ranks that finish first leave the last one running alone, and it reads its window
    faster than it sustains (bench/cost_fidelity.py's 2 s cross-check). GPUs share
    nothing, and their ops are timed by CUDA events: the same count on every rank.
    """
    times: dict[Any, list[float]] = {name: [] for name in ops}
    if timer is _cuda_timer:
        windows = {name: _window(timer, op, settings, device)[:2] for name, op in ops.items()}
        for _ in range(settings.gemm_windows):
            for name, (window, count) in windows.items():
                dist.barrier()
                times[name].append(timer(window) / count)
        return times
    for op in ops.values():
        for _ in range(settings.warmup):
            op()
    for _ in range(settings.gemm_windows):
        for name, op in ops.items():
            dist.barrier()
            start, count = time.perf_counter(), 0
            while time.perf_counter() - start < settings.gemm_window_s:
                op()
                count += 1
            times[name].append((time.perf_counter() - start) / count)
    return times


def _window(timer: Callable, op: Callable[[], object], settings: Settings,
            device: torch.device | str, *, seconds: float | None = None
            ) -> tuple[Callable[[], None], int, float]:
    """(A window of back-to-back ops lasting about ``seconds`` (default
    ``settings.gemm_window_s``), its count of ops, one op's time).

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
    while elapsed < (settings.gemm_window_s if seconds is None else seconds):
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


def slowest(per_rank: list[Measurements], backend: str, nproc: int) -> Measurements:
    """Every number as its slowest rank's; p2p from ranks 0 and 1 only."""
    first = per_rank[0]
    out = Measurements(backend=backend, nproc=nproc, threads=first.threads,
                       floor_s=max(r.floor_s for r in per_rank))
    out.memory_kernels = {k: (moved, max(r.memory_kernels[k][1] for r in per_rank))
                          for k, (moved, _) in first.memory_kernels.items()}
    if first.attention is not None:
        out.attention = max((r.attention for r in per_rank), key=lambda a: a.seconds)
    if first.loss is not None:
        out.loss = max((r.loss for r in per_rank), key=lambda a: a.seconds)
    if first.host is not None:
        out.host = HostTiming(**{k: max(getattr(r.host, k) for r in per_rank)
                                 for k in ("fsdp_s", "tp_s", "dtensor_op_s")},
                              skew_s=None if first.host.skew_s is None else max(
                                  r.host.skew_s for r in per_rank),
                              skew_at=tuple((n, max(dict(r.host.skew_at)[n] for r in per_rank))
                                            for n, _ in first.host.skew_at),
                              skew_window_s=first.host.skew_window_s)
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
