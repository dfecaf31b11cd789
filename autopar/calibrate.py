"""``autopar calibrate``: measure this machine and write a cluster profile.

One launch of ``nproc`` local ranks (gloo on CPU; NCCL with CUDA events on GPUs) measures,
in order: GEMM throughput by size and dtype — an n → n Linear's forward and backward on n
tokens, its three GEMMs as training runs them — with *every rank running at once* (on a
shared CPU that is what one rank gets during training), a mix of memory-bound kernels
(memory bandwidth), causal fused attention (its rate against the GEMMs') and cross-entropy
over float32 logits (its rate against the memory-bound mix's), all in windows like the
GEMMs (``autopar.calibration_kernels``); on CPU ranks the host time of FSDP2, TP and
DTensor and the skew of a collective after compute, by message size; the smallest op
(kernel floor), then all_reduce / all_gather by message size and a send/recv ping-pong
between ranks 0 and 1, then the overlap slowdown σ of each pattern of
``cost_models.overlap`` (a GEMM window alone, and again beside that pattern's
communication). Each number is the median of repeats after a warm-up; a rank's result is
the slowest rank's median. GEMM windows are repeated and their spread recorded: on a
shared machine the rate moves by tens of percent between runs. ``cost_models.calibrate``
fits them; ``write_profile`` writes a TOML file that ``Cluster.from_toml`` loads. Its
``software_efficiency`` (``cost_models.software``) is 1 where the device is measured whole
(the GEMM rates through torch's eager autograd are already the runtime's rate); a GPU
calibrated with ``--topology`` keeps that preset's published hardware (datasheet peak, GEMM
ceiling) and gets the measured share of it as its software efficiency. The
measuring itself is ``autopar.calibration_measure``'s; the kernels besides GEMMs and
collectives are ``autopar.calibration_kernels``'.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.calibration_measure import (
    COLLECTIVES,
    HOST_TRIES,
    OVERLAP_PATTERNS,
    AttentionTiming,
    HostTiming,
    LossTiming,
    Measurements,
    OverlapSample,
    Settings,
    measure_rank,
    overlap_slowdowns,
    slowest,
)
from autopar.generated import comment, toml_value
from cost_models.calibrate import (
    AlphaBeta,
    CalibrationError,
    GemmCurve,
    Spread,
    fit_alpha_beta,
    fit_gemm_curve,
    fit_matmul,
    kernel_mix_bandwidth_GBps,
    nondecreasing_fit,
    predict_s,
    relative_error,
    split_software_efficiency,
    spread,
)
from cost_models.hardware import Cluster, Device, GiB, Host, Link
from runtime import files
from runtime.files import write_atomic

__all__ = ["COLLECTIVES", "OVERLAP_PATTERNS", "Measurements", "OverlapSample", "Settings",
           "calibrate", "fit", "write_profile"]  # measured in autopar.calibration_measure

KiB, MiB = 1024, 1024**2
BACKENDS = ("auto", "gloo", "nccl")
MAX_SLOWDOWN = 10.0
"""``Cluster.from_toml`` refuses an ``[overlap]`` slowdown this large (a typo, or a broken
measurement: compute at a tenth of its speed)."""
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
    reference: Device | None = None
    """The ``--topology`` cluster's device: its datasheet peaks, beside which the table
    puts the measured GEMM rates (the efficiency curve of the device at hand)."""


# -- the calibration that can run ----------------------------------------------------------

def resolve_backend(backend: str, nproc: int, *, topology: bool = False) -> str:
    """The backend to use, or a CalibrationError saying why this calibration cannot run.
    ``topology``: the links come from another cluster, and one rank measures the device."""
    if nproc < 2 and not topology:
        raise CalibrationError(
            f"--nproc {nproc}: collectives need a second rank; use --nproc 2 or more, or "
            "--topology PRESET|PROFILE to measure this one device and take the nodes, links "
            "and overlap from that cluster")
    if nproc > 1 and topology:
        raise CalibrationError(
            f"--topology is for a one-device calibration (--nproc 1); with --nproc {nproc} "
            "the links are measured")
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
              name: str | None = None, topology: Cluster | None = None) -> Calibration:
    """Measure ``nproc`` local ranks and fit. With ``topology`` (one rank): measure this
    device alone, and take the nodes, devices per node, links and overlap from that
    cluster (a preset or profile): a GPU calibrated on its own, planned for a cluster of
    them."""
    from runtime.launch import spawn

    settings = settings or Settings()
    backend = resolve_backend(backend, nproc, topology=topology is not None)
    per_rank = spawn(measure_rank, nproc, settings, backend, backend=backend,
                     timeout_s=settings.timeout_s)
    m = slowest(per_rank, backend, nproc)
    return fit(m, settings, name=name, topology=topology)


def fit(m: Measurements, settings: Settings, *, name: str | None = None,
        topology: Cluster | None = None) -> Calibration:
    if m.host is not None:
        _check_host_overheads(m.host)
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
    text = profile_text(m, settings, fits, name=name, overlap=overlap, gemm_spread=gemm_spread,
                        topology=topology)
    return Calibration(measurements=m, cluster_text=text, fits=fits, rows=rows, notes=notes,
                       overlap=overlap, gemm_spread=gemm_spread,
                       reference=topology.device if topology is not None else None)



def _check_host_overheads(host: HostTiming) -> None:
    """A profile never records an engine as free on CPU ranks: that would be the
    measurement lost in noise (``calibration_measure._measure_host`` tries again)."""
    lost = [name for name, s in (("FSDP2", host.fsdp_s), ("TP", host.tp_s),
                                 ("DTensor", host.dtensor_op_s)) if s <= 0]
    if lost:
        raise CalibrationError(
            f"the host overhead of {', '.join(lost)} measured {HOST_TRIES} times was never "
            "above zero: the plain ops ran as slow as the wrapped ones, so other work on "
            "this machine swamped the measurement; calibrate again when it is idle")


# -- the profile -----------------------------------------------------------------------------

def profile_text(m: Measurements, settings: Settings, fits: dict[str, AlphaBeta], *,
                 name: str | None = None, overlap: dict[str, Spread] | None = None,
                 gemm_spread: dict[str, dict[int, Spread]] | None = None,
                 topology: Cluster | None = None) -> str:
    """The cluster profile as TOML (the format of cost_models/presets/). With ``topology``
    its nodes, links and overlap, and this machine's measured device."""
    overlap, gemm_spread = overlap or {}, gemm_spread or {}
    host = platform.node() or "this-machine"
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    curves = {d: fitted_gemm_curve(t, m.floor_s) for d, t in m.gemm_s.items()}
    # Device has one efficiency: float32's. Other dtypes fold theirs into their peak, so that
    # peak x efficiency is each dtype's fitted large-GEMM rate.
    eff = _efficiency(curves.get("float32"), m.gemm_s.get("float32", {}))
    peaks = {d: c.asymptote_flops / eff for d, c in curves.items()}
    software, split = 1.0, None
    gpu = m.backend == "nccl"
    if gpu and topology is not None:  # a GPU of a preset's kind: its published hardware
        eff = topology.device.matmul_efficiency
        peaks, software, ref = split_software_efficiency(
            {d: c.asymptote_flops for d, c in curves.items()}, topology.device.peak_flops, eff)
        split = (f"# software_efficiency: measured. {ref} GEMMs through torch's eager autograd "
                 f"(the stack autopar's runtime is) reached {software:.1%} of",
                 f"# {topology.name}'s published ceiling (peak x matmul_efficiency, its "
                 "datasheet and GEMM benchmark): matmul_efficiency and that peak are the",
                 "# preset's; other dtypes fold their measured rates into their peaks.")
    bandwidth = kernel_mix_bandwidth_GBps(*zip(*m.memory_kernels.values(), strict=True))
    attention = _attention_efficiency(m.attention, curves)
    loss = _loss_efficiency(m.loss, bandwidth)
    memory = (torch.cuda.get_device_properties(0).total_memory if gpu
              else _ram_bytes() // m.nproc)
    gemm_sizes = sorted({n for t in m.gemm_s.values() for n in t})
    source = (f"autopar calibrate on {host}, {when}: {m.backend}, {m.nproc} local ranks, "
              f"{m.threads} threads each; GEMM {'/'.join(peaks)} "
              f"{gemm_sizes[0]}..{gemm_sizes[-1]} on all ranks at once; "
              f"memory-bound kernel mix ({len(m.memory_kernels)}); "
              + (f"{m.attention.dtype} causal attention {_shape(m.attention.shape)}; "
                 if attention is not None else "")
              + (f"cross-entropy {_loss_shape(m.loss.shape)}; " if loss is not None else "")
              + (_measured_links_source(m) if topology is None else
                 f"nodes, links and overlap from {topology.name} ({topology.source})")
              + (f"; overlap slowdown measured ({', '.join(overlap)}) on float32 GEMM "
                 f"{settings.overlap_gemm_size}" if overlap else ""))
    lines = [
        f"# Calibrated by `autopar calibrate` on {comment(host)}, {when}.",
        f"# Backend {m.backend}, {m.nproc} ranks. GEMM throughput was measured with all {m.nproc}",
        "# ranks multiplying at once (ranks share the machine, so that is what a rank gets), as",
        "# an n -> n Linear's forward and backward on n tokens (three n x n x n GEMMs).",
        "# GEMM times fitted per dtype to t = floor + 2n^3 (n + d_half) / (n R_inf)",
        "# (cost_models/compute.py's efficiency curve): matmul_half_dim := d_half; float32:",
        "# peak_tflops := the larger of R_inf and the best rate measured, matmul_efficiency :=",
        "# R_inf / that peak; other dtypes: peak := their R_inf / that efficiency. So peak x",
        "# efficiency is each dtype's fitted large-GEMM rate.",
        "# memory_bandwidth_GBps: the harmonic mean of memory-bound kernels' bytes read +",
        "# written over time ([extra.memory]: copy, add, GELU, layer norm, softmax, AdamW's",
        "# lerp_ and addcdiv_), all ranks at once. attention_efficiency: causal",
        "# F.scaled_dot_product_attention forward + backward ([extra.attention]), FLOPs counted",
        "# as the planner does, over the same dtype's fitted large-GEMM rate. loss_efficiency:",
        "# F.cross_entropy forward + backward on float32 logits ([extra.loss]), bytes counted as",
        "# the planner counts its passes over the logits, over memory_bandwidth_GBps.",
        f"# GEMM rates are the median of {settings.gemm_windows} windows of "
        f"{settings.gemm_window_s:g} s; [extra.gemm.<dtype>]",
        "# tflops_min/tflops_max give the windows' spread (the rate of a shared machine moves).",
        f"name = {toml_value(f'calibrated-{_bare(host)}')}",
        f"source = {toml_value(source)}",
        'provenance = "calibrated"',
        f"nodes = {1 if topology is None else topology.nodes}",
        f"devices_per_node = {m.nproc if topology is None else topology.devices_per_node}",
        "# torch's AdamW steps CPU tensors one at a time and CUDA tensors with foreach kernels.",
        f'optimizer = "{"adamw-foreach" if gpu else "adamw-for-loop"}"',
        "",
        "[device]",
        f"name = {toml_value(torch.cuda.get_device_name(0) if gpu else 'cpu-process')}",
        f"memory_gib = {memory / GiB:.3f}",
        f"memory_bandwidth_GBps = {bandwidth:.4g}",
        f"matmul_efficiency = {eff:.4f}",
        *(split or ("# software_efficiency: the GEMM rates were measured through torch's eager",
                    "# autograd (the stack autopar's runtime is): they are already its rate, and",
                    "# no software generation's factor (cost_models/software.py) applies on top.")),
        f"software_efficiency = {software:.4f}",
        f"kernel_floor_us = {m.floor_s * 1e6:.3f}",
        *([f"attention_efficiency = {attention:.4g}"] if attention is not None else []),
        *([f"loss_efficiency = {loss:.4g}"] if loss is not None else []),
        *_host_lines(m.host),
        "",
        "[device.peak_tflops]",
        *(f"{d} = {p / 1e12:.6g}" for d, p in peaks.items()),
        "",
        "[device.matmul_half_dim]",
        *(f"{d} = {c.half_dim:.4g}" for d, c in curves.items()),
    ]
    lines += (_measured_link_lines(fits, "pcie" if gpu else "loopback")
              + _overlap_lines(m, settings, overlap) if topology is None
              else _topology_lines(topology))
    lines += _host_table(topology.host if topology is not None else Host(), gpu)
    for k, v in m.comm_s.items():  # what the fits were made from, S as in comm.py
        lines += ["", f"[extra.measured.{k}]", f"sizes_bytes = {list(v)}",
                  f"times_s = [{', '.join(f'{t:.4g}' for t in v.values())}]"]
    lines += ["", "[extra.memory]", f"kernels = {list(m.memory_kernels)}",
              "GBps = [" + ", ".join(f"{b / t / 1e9:.4g}" for b, t in m.memory_kernels.values())
              + "]"]
    if attention is not None:
        a = m.attention
        lines += ["", "[extra.attention]", f"dtype = {toml_value(a.dtype)}", f"shape = {list(a.shape)}",
                  f"tflops = {a.flops / a.seconds / 1e12:.4g}"]
    if loss is not None:
        lines += ["", "[extra.loss]", f"shape = {list(m.loss.shape)}",
                  f"GBps = {m.loss.bytes / m.loss.seconds / 1e9:.4g}"]
    for dtype, times in m.gemm_s.items():
        lines += ["", f"[extra.gemm.{dtype}]", f"sizes = {list(times)}",
                  f"tflops = [{', '.join(f'{2 * n**3 / t / 1e12:.4g}' for n, t in times.items())}]"]
        if dtype in gemm_spread:
            for end in ("low", "high"):
                rates = (getattr(gemm_spread[dtype][n], end) for n in times)
                lines.append(f"tflops_{'min' if end == 'low' else 'max'} = "
                             f"[{', '.join(f'{r / 1e12:.4g}' for r in rates)}]")
    return "\n".join(lines) + "\n"


def _measured_links_source(m: Measurements) -> str:
    sizes = sorted(next(iter(m.comm_s.values())))
    return (f"all_reduce/all_gather/send-recv {_size(sizes[0])}..{_size(sizes[-1])}; "
            "link fitted on all_reduce")


def _measured_link_lines(fits: dict[str, AlphaBeta], kind: str) -> list[str]:
    """[intra_node] and [inter_node] from the all_reduce fit, [collective_links] from the
    others'."""
    links = {t: fits["all_reduce"] for t in ("intra_node", "inter_node")}
    links |= {f"collective_links.{k}": f for k, f in fits.items() if k != "all_reduce"}
    return ["",
            "# intra_node: alpha-beta fitted on all_reduce to cost_models/comm.py's ring formula;",
            "# inter_node repeats it (one machine: no network was measured). [collective_links]:",
            "# all_gather and send/recv on their own fits inside the node (gloo's all_gather is",
            "# not a ring: it costs more); reduce_scatter, not measured, uses intra_node.",
            *(line for table, f in links.items()
              for line in _link_table(table, Link(kind=kind, bandwidth_GBps=f.bandwidth_GBps,
                                                  latency_s=f.latency_s)))]


def _link_table(table: str, link: Link) -> list[str]:
    """``[table]`` of one link, as ``Cluster.from_toml`` reads it."""
    return ["", f"[{table}]", f"kind = {toml_value(link.kind)}",
            f"bandwidth_GBps = {link.bandwidth_GBps:.6g}",
            f"latency_us = {link.latency_s * 1e6:.6g}"]


def _topology_lines(topology: Cluster) -> list[str]:
    """The links, per-collective links and overlap of ``topology``, as its own file gives
    them (nothing of them was measured here)."""
    o = topology.overlap
    links = {"intra_node": topology.intra_node, "inter_node": topology.inter_node,
             **{f"collective_links.{k}": x for k, x in topology.collective_links.items()}}
    lines = ["", f"# Links and overlap: {comment(topology.name)} ({comment(topology.source)}), "
             "not measured here."]
    lines += [line for table, x in links.items() for line in _link_table(table, x)]
    return lines + ["", "[overlap]", f"dp_slowdown = {o.dp_slowdown:.6g}",
                    f"fsdp_slowdown = {o.fsdp_slowdown:.6g}", f"pp_slowdown = {o.pp_slowdown:.6g}",
                    f"ddp_bucket_bytes = {o.ddp_bucket_bytes}",
                    f"exposed = {list(o.exposed)}".replace("'", '"')]


def _host_table(host: Host, gpu: bool) -> list[str]:
    """[host]: CPU processes have no memory apart from the host's; a GPU keeps the host
    of its topology, or the default (a DGX A100's share: nothing of it is measured)."""
    if not gpu:
        return ["", "# CPU processes: their memory is the host's, nothing to offload to.",
                "[host]", "offload = false"]
    return ["", "# Host memory for offloaded layers: not measured.", "[host]",
            f"offload = {str(host.offload).lower()}",
            f"memory_bandwidth_GBps = {host.memory_bandwidth_GBps:.6g}",
            *_link_table("host.link", host.link)]


def _host_lines(host: HostTiming | None) -> list[str]:
    """[device] host overheads, measured on CPU ranks (GPUs keep the default 0)."""
    if host is None:
        return []
    lines = ["# Host overheads on CPU ranks (autopar/calibration_kernels.py): FSDP2 and TP "
             "per module",
             "# per forward + backward, DTensor per op, and a blocking collective's skew after "
             f"{host.skew_window_s * 1e3:g} ms",
             "# of compute.",
             f"fsdp_overhead_us = {host.fsdp_s * 1e6:.4g}",
             f"tp_overhead_us = {host.tp_s * 1e6:.4g}",
             f"dtensor_op_overhead_us = {host.dtensor_op_s * 1e6:.4g}"]
    if host.skew_s is None:
        return lines
    measured = [host.skew_s] + [t for _, t in host.skew_at]
    skew, *at = nondecreasing_fit(measured)
    lines.append(f"collective_skew_us = {skew * 1e6:.4g}")
    if host.skew_at:
        lines += ["# By message size: the nearest non-decreasing curve to the skews measured "
                  "at one",
                  "# element and at bytes = [...] (measured_us, in that order).",
                  "[device.collective_skew_at]", f"bytes = {[n for n, _ in host.skew_at]}",
                  "us = [" + ", ".join(f"{t * 1e6:.4g}" for t in at) + "]",
                  "measured_us = [" + ", ".join(f"{t * 1e6:.4g}" for t in measured) + "]"]
    return lines


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


def _attention_efficiency(timing: AttentionTiming | None, curves: dict[str, GemmCurve]
                          ) -> float | None:
    """Attention's counted FLOP rate over its dtype's fitted large-GEMM rate."""
    if timing is None or timing.dtype not in curves:
        return None
    return timing.flops / timing.seconds / curves[timing.dtype].asymptote_flops


def _loss_efficiency(timing: LossTiming | None, bandwidth_GBps: float) -> float | None:
    """Cross-entropy's counted bytes per second over the memory-bound mix's bandwidth,
    within the range a profile accepts (``Device.loss_efficiency``)."""
    if timing is None:
        return None
    return min(10.0, timing.bytes / timing.seconds / (bandwidth_GBps * 1e9))


def _efficiency(curve: GemmCurve | None, times: dict[int, float]) -> float:
    """R∞ over the peak, where peak := the larger of R∞ and the best rate measured."""
    if curve is None:
        return 1.0
    best = max((2 * n**3 / t for n, t in times.items()), default=curve.asymptote_flops)
    return curve.asymptote_flops / max(best, curve.asymptote_flops)


def write_profile(cal: Calibration, path: str | os.PathLike, *, force: bool = False) -> Cluster:
    """Write the profile atomically (refusing to overwrite unless ``force``) and load it back."""
    check_output(path, force=force)
    write_atomic(path, cal.cluster_text)
    return Cluster.from_toml(path)


def check_output(path: str | os.PathLike, *, force: bool = False) -> None:
    """Before measuring: ``path`` can be written (``runtime.files.check_output``)."""
    files.check_output(path, force=force, what="--out")


def format_table(cal: Calibration) -> str:
    m = cal.measurements
    lines = []
    if cal.rows:
        lines = [f"{'collective':<11} {'S':>8} {'measured ms':>12} {'fitted ms':>10} "
                 f"{'error':>7}"]
        lines.append("-" * len(lines[0]))
    for kind, s, t, p in cal.rows:
        lines.append(f"{kind:<11} {_size(s):>8} {t * 1e3:>12.3f} {p * 1e3:>10.3f} "
                     f"{relative_error(p, t):>+7.0%}")
    lines.append("")
    for k, f in cal.fits.items():
        lines.append(f"{k:<11} alpha {f.latency_s * 1e6:8.1f} us  B {f.bandwidth_GBps:7.3f} GB/s"
                     + ("   <- the profile's link" if k == "all_reduce" else ""))
    lines += [*cal.notes, ""]
    ref = cal.reference
    lines.append(f"{'GEMM':<11} {'n':>8} {'GFLOP/s per rank, ' + str(m.nproc) + ' ranks at once':>40}"
                 f"   {'windows min..max':>16} {'spread':>6} {'fitted':>9}"
                 + (f"   of {ref.name}'s peak" if ref is not None else ""))
    for dtype, times in m.gemm_s.items():
        curve = fitted_gemm_curve(times, m.floor_s)
        for n, t in times.items():
            rate = 2 * n**3 / t
            row = f"{dtype:<11} {n:>8} {rate / 1e9:>40.1f}"
            s = cal.gemm_spread.get(dtype, {}).get(n)
            if s is not None:
                row += f"   {f'{s.low / 1e9:.1f}..{s.high / 1e9:.1f}':>16} {s.relative:>6.0%}"
            fitted = 2 * n**3 / (m.floor_s + 2 * n**3 / curve.rate(n))
            row += f" {fitted / 1e9:>9.1f}"
            if ref is not None and dtype in ref.peak_flops:
                row += f"   {rate / ref.peak(dtype):>6.1%}"
            lines.append(row)
    rates = {k: b / t / 1e9 for k, (b, t) in m.memory_kernels.items()}
    mix = kernel_mix_bandwidth_GBps(*zip(*m.memory_kernels.values(), strict=True))
    lines.append("memory-bound kernels GB/s: " + ", ".join(f"{k} {r:.2f}" for k, r in rates.items())
                 + f";  harmonic mean {mix:.2f} (the profile's);  kernel floor "
                 f"{m.floor_s * 1e6:.1f} us")
    if m.host is not None:
        h = m.host
        lines.append(f"host overheads: FSDP2 {h.fsdp_s * 1e6:.0f} us and TP {h.tp_s * 1e6:.0f} us "
                     f"per module (forward + backward), DTensor {h.dtensor_op_s * 1e6:.1f} us "
                     "per op" + (f"; collective skew {h.skew_s * 1e6:.0f} us after "
                                 f"{h.skew_window_s * 1e3:g} ms of compute"
                                 if h.skew_s is not None else "")
                     + "".join(f", {t * 1e6:.0f} us at {_size(n)}" for n, t in h.skew_at))
    if m.attention is not None:
        a = m.attention
        lines.append(f"causal attention {a.dtype} {_shape(a.shape)}, forward + backward: "
                     f"{a.flops / a.seconds / 1e9:.1f} GFLOP/s counted")
    if m.loss is not None:
        lines.append(f"cross-entropy float32 {_loss_shape(m.loss.shape)}, forward + backward: "
                     f"{m.loss.bytes / m.loss.seconds / 1e9:.2f} GB/s counted")
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


def _shape(shape: tuple[int, int, int]) -> str:
    return "(batch x heads, seq, head dim) = ({}, {}, {})".format(*shape)


def _loss_shape(shape: tuple[int, int]) -> str:
    return "(tokens, vocabulary) = ({}, {})".format(*shape)


def _bare(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in host)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GiB
