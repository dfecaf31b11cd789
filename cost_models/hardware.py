"""The machine: devices, links, and clusters of nodes.

Units are in the field names: bytes, seconds, FLOP/s, GB/s (10^9 bytes per second).
Presets live in ``cost_models/presets/*.toml`` (the same format users write) and cite
their sources there. Optional tables: ``[device.matmul_half_dim]`` (the GEMM efficiency
curve of ``cost_models.compute``) and ``[overlap]`` (the slowdown factors of
``cost_models.overlap``) and ``[collective_links.<kind>]`` (a calibrated intra-node link
per collective).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from cost_models.errors import ConfigError
from cost_models.optimizer import ADAM_KERNELS, DEFAULT_OPTIMIZER, AdamKernels
from cost_models.software import OVERLAP_PATTERNS, software_names, with_software

DTYPES = ("float32", "tf32", "bfloat16", "float16")
LINK_KINDS = ("nvlink", "pcie", "network", "loopback")
GiB = 1024**3
MiB = 1024**2

DEFAULT_MATMUL_HALF_DIM = 0.0
"""Smallest GEMM dimension (elements) at which a GEMM runs at half the large-GEMM efficiency,
for dtypes a device does not list: none, i.e. every GEMM at ``matmul_efficiency``, until
``autopar calibrate`` fits the curve on the device. The presets list the curves fitted to
published GEMM timings of their GPUs (autopar.planner.gemm_published), for the dtypes those
timings measured and those running on the same tensor cores at the same rate (A100's bf16
takes its fp16 curve): a half-dimension guessed (from cuBLAS's tile width, 128) once put
Megatron-LM's rows 3-15% low (bench/megatron_table.py, BENCHMARKS.md)."""

DEFAULT_OVERLAP_SLOWDOWN = 1.1
"""Compute slows by this factor while a collective runs beside it. An assumed default (NCCL
kernels take SMs and memory bandwidth from the compute they overlap), to be calibrated by
timing a GEMM with and without a concurrent collective."""

DDP_BUCKET_BYTES = 25 * MiB
"""torch.nn.parallel.DistributedDataParallel's default gradient bucket (bucket_cap_mb=25,
in MiB)."""


MAX_NODES = 100_000
MAX_DEVICES_PER_NODE = 1024
MAX_DEVICES = 2**20
"""Far beyond any real cluster; a larger count is a typo (and would make the planner's
enumeration of mesh shapes run for minutes or hours)."""

RANGES: dict[str, tuple[float, float]] = {
    # field (SI units): (lowest, highest) a file may give; far beyond real hardware both
    # ways, so that every derived time stays a finite, non-zero float.
    "peak_flops": (1e3, 1e21),
    "memory_bytes": (MiB, 2.0**60),
    "memory_bandwidth_GBps": (1e-6, 1e9),
    "bandwidth_GBps": (1e-6, 1e9),
    "nvls_bus_GBps": (0.0, 1e9),
    "latency_s": (0.0, 1e3),
    "kernel_floor_s": (1e-12, 1.0),
    "host_overhead_s": (0.0, 1e3),
    "ddp_bucket_bytes": (1, 2.0**50),
    "matmul_half_dim": (0.0, 1e9),
    "skew_bytes": (1e-9, 1e18),
    "skew_us": (0.0, 1e9),
}
"""Bounds on every number of a cluster file, checked when it is read."""


HOST_OVERHEADS = ("collective_skew_s", "fsdp_overhead_s", "tp_overhead_s",
                  "dtensor_op_overhead_s")
"""Device fields that CPU ranks measure and GPUs hide (0 unless calibrated)."""


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or one CPU process of the local 'cluster')."""

    name: str
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per compute dtype (keys from DTYPES)."""
    memory_bytes: int
    """Memory capacity per device."""
    memory_bandwidth_GBps: float
    """Main-memory bandwidth (HBM or DRAM), GB/s."""
    matmul_efficiency: float = 0.7
    """Achievable fraction of peak for large matrix multiplies: the asymptote of the GEMM
    efficiency curve (``cost_models.compute.gemm_efficiency``). In the GPU presets, what
    the device's largest GEMMs reach alone (a published GEMM benchmark); a training step
    keeps ``software_efficiency`` of it."""
    software_efficiency: float = 1.0
    """Fraction of the GEMM rate the training software keeps (launch gaps, unfused kernels,
    its attention kernel, clocks under sustained load): set from the cluster's software
    generation (``cost_models.software``). 1: the device's figures are the whole rate, as a
    calibrated profile measures them through the stack that runs it."""
    matmul_half_dim: dict[str, float] = field(default_factory=dict)
    """Per compute dtype: the smallest GEMM dimension at which efficiency is half the
    asymptote; dtypes not listed use DEFAULT_MATMUL_HALF_DIM."""
    kernel_floor_s: float = 5e-6
    """Smallest time of one kernel (launch and tail)."""
    collective_skew_s: float = 0.0
    """Time a blocking collective waits beyond its α-β cost when ranks come to it from
    computing: they arrive apart. CPU processes sharing cores drift apart by a share of a
    scheduler slice between collectives; GPUs queue kernels ahead and barely drift.
    ``autopar calibrate`` measures it on CPU ranks (a GEMM window, then a one-element
    all_reduce, against the window alone); 0 until then. Larger messages wait longer:
    ``collective_skew_at``."""
    collective_skew_at: tuple[tuple[float, float], ...] = ()
    """(message bytes S, skew seconds) at larger messages, S ascending: on CPU ranks each
    step of a ring collective waits for a rank to be scheduled again, so the skew grows
    with the message (4 ranks of 2 cores: about 2 ms at one element, 5-7 at 1 MiB and
    4 MiB; BENCHMARKS.md). ``skew_s`` interpolates linearly in S from (0, ``collective_skew_s``), and
    keeps the last point's past it. Measured by ``autopar calibrate`` with the skew."""
    fsdp_overhead_s: float = 0.0
    """Host time FSDP2 adds per wrapped module per micro-batch (its forward and backward
    hooks, with their allocations and bookkeeping), beyond the copies and collectives the
    cost model prices. It adds to the step on CPU ranks, where host and kernels share a
    core; on GPUs the host mostly runs ahead and hides it (0), unless the cluster's software
    generation states what its FSDP leaves unhidden there (``cost_models.software``).
    Measured by ``autopar calibrate``."""
    tp_overhead_s: float = 0.0
    """Host time a tensor-parallel module (DTensor parameters, input and output hooks) adds
    per micro-batch, as ``fsdp_overhead_s``."""
    dtensor_op_overhead_s: float = 0.0
    """Host time DTensor's dispatch adds to one op on a DTensor (the optimizer's ops on
    FSDP2's and TP's parameters), as ``fsdp_overhead_s``."""
    attention_efficiency: float = 1.0
    """Fused attention's (``F.scaled_dot_product_attention``) FLOP rate as a fraction of the
    large-GEMM rate, its FLOPs counted as FlopCounterMode counts them (4·b·h·s_q·s_kv·d
    forward whether causal or not, backward twice that): below 1 where its kernels are
    slower than GEMMs (CPU flash attention at small head dims), above 1 where a causal kernel
    skips the masked half. ``autopar calibrate`` measures it; 1 until then."""
    loss_efficiency: float = 1.0
    """Cross-entropy's rate over the float32 logits (log-softmax and the target gather,
    forward and backward, bytes counted as ``autopar.planner.loss_costs`` counts its passes)
    as a fraction of ``memory_bandwidth_GBps``: below 1 where log-softmax's exp and row
    reductions run slower than the memory-bound kernel mix (CPU ranks). ``autopar
    calibrate`` measures it; 1 until then."""

    cuda_capability: str = ""
    """The CUDA compute capability of an NVIDIA GPU, "major.minor" (the A100's "8.0", the
    H100's "9.0"), as ``torch.cuda.get_device_capability`` reports it; empty for a device
    that is not one (CPU processes) or whose capability is not known. What the device can
    run depends on it (``runtime.async_tp``: PyTorch's async tensor parallelism)."""

    def peak(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(
                f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; it lists "
                f"{', '.join(self.peak_flops) or 'none'}"
            ) from None

    def skew_s(self, nbytes: float) -> float:
        """A blocking collective's skew at message size ``nbytes`` (comm.py's S)."""
        if not self.collective_skew_at:
            return self.collective_skew_s
        sizes, skews = zip(*self.collective_skew_at, strict=True)
        return float(np.interp(nbytes, (0.0, *sizes), (self.collective_skew_s, *skews)))

    def half_dim(self, dtype: str) -> float:
        return self.matmul_half_dim.get(dtype, DEFAULT_MATMUL_HALF_DIM)

    @property
    def capability(self) -> tuple[int, int] | None:
        """``cuda_capability`` as (major, minor); None when it is empty."""
        if not self.cuda_capability:
            return None
        major, minor = self.cuda_capability.split(".")
        return int(major), int(minor)


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """How communication overlaps compute (``cost_models.overlap``), per pattern.

    A slowdown σ >= 1 stretches compute while communication runs beside it: overlap is
    never free. Patterns have separate factors because their kernels differ (ring
    collectives on many channels, send/recv on few) and are calibrated separately:
    ``autopar calibrate`` times a GEMM window alone and beside each pattern's
    communication and writes σ to the profile's ``[overlap]``
    (``cost_models.calibrate.fit_overlap_slowdown``).
    """

    dp_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    """Backward compute beside the data-parallel gradient reduction (DDP buckets)."""
    fsdp_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    """A layer's compute beside the next layer's prefetched all-gather (and, in backward,
    the previous layer's reduce-scatter)."""
    pp_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    """A pipeline stage's compute beside its send/recv of activations or gradients."""
    ddp_bucket_bytes: int = DDP_BUCKET_BYTES
    """Gradient bucket size; the last bucket's reduction is always exposed."""
    exposed: tuple[str, ...] = ()
    """Patterns (of OVERLAP_PATTERNS) whose communication never overlaps compute, because
    the software waits for it: FSDP2 on CPU issues its collectives synchronously (it
    overlaps through CUDA streams only), and Megatron-LM (2021) all-reduced gradients
    after backward."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """A class of link: one device's share of bandwidth, per direction, and latency."""

    kind: str
    bandwidth_GBps: float
    latency_s: float


@dataclass(frozen=True, kw_only=True)
class Host:
    """The host memory beside one device, where offloaded layers keep their states
    (``autopar.planner.costs``: parameter and gradient copies over ``link``, the optimizer
    step at ``memory_bandwidth_GBps``). Defaults: a DGX A100's share per GPU."""

    offload: bool = True
    """The devices have a memory apart from the host's, so states can be offloaded. False
    for CPU processes, whose memory is the host's: offloading there moves nothing and saves
    nothing."""
    link: Link = field(default_factory=lambda: Link(kind="pcie", bandwidth_GBps=25.0,
                                                    latency_s=10e-6))
    """Device <-> host copies: PCIe 4.0 x16, 32 GB/s per direction on paper, about 25
    achieved (NVIDIA A100 datasheet; a DGX A100 has one x16 link per GPU)."""
    memory_bandwidth_GBps: float = 50.0
    """Host DRAM bandwidth one device's offloaded optimizer step gets: a DGX A100's two
    EPYC 7742 sockets have 8 DDR4-3200 channels each (2 × 205 GB/s), shared by 8 GPUs."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` × ``devices_per_node`` identical devices, NVLink/PCIe inside, network between."""

    name: str
    device: Device
    nodes: int = 1
    devices_per_node: int = 8
    intra_node: Link
    inter_node: Link
    memory_margin_fraction: float = 0.1
    """Extra memory kept free for allocator fragmentation, as a fraction of the modelled use."""
    overlap: Overlap = field(default_factory=Overlap)
    """Slowdown factors of communication overlapped with compute."""
    collective_links: dict[str, Link] = field(default_factory=dict)
    """Inside a node, per collective (one of COLLECTIVES): the link a calibration fitted
    on that collective itself, used instead of ``intra_node``. gloo's all_gather is not a
    ring and runs at about half its all_reduce's bandwidth (``autopar calibrate``)."""
    optimizer: str = DEFAULT_OPTIMIZER
    """The Adam kernels the training runs (a key of ``cost_models.optimizer.ADAM_KERNELS``):
    torch's AdamW takes its foreach kernels on GPUs and steps one tensor at a time on CPU
    processes; Megatron-LM runs a fused kernel."""
    host: Host = field(default_factory=Host)
    """The host memory beside each device, for offloaded layers."""
    nvls_bus_GBps: float = 0.0
    """NVLink SHARP (NVLS): the NVSwitch reduces in the switch, and NCCL runs a node's
    all_reduce on it where that is faster than its ring (cost_models.comm). The all_reduce
    bus bandwidth nccl-tests measure on it inside one node, GB/s; 0: the node has none."""
    fsdp_bandwidth_share: float = 1.0
    """Share of the links' bandwidth that sharded data parallelism's all-gathers and
    reduce-scatters reach (their bandwidth term; latencies unchanged): set by a software
    generation whose collectives ran below what NCCL's rings allow (cost_models.software);
    1 otherwise."""
    software: str = ""
    """The software generation applied (``cost_models.software``): its efficiency is in
    ``device.software_efficiency``, its exposed patterns in ``overlap.exposed``. '' if none."""
    source: str = ""
    """Where the numbers came from."""
    provenance: str = "modelled"
    """'modelled' (datasheet figures) or 'calibrated' (measured on this machine)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def fsdp_links(self) -> Cluster:
        """This cluster with its links at ``fsdp_bandwidth_share`` of their bandwidth: where
        sharded data parallelism's collectives are priced."""
        share = self.fsdp_bandwidth_share
        if share == 1.0:
            return self

        def slower(link: Link) -> Link:
            return replace(link, bandwidth_GBps=link.bandwidth_GBps * share)

        return replace(self, intra_node=slower(self.intra_node),
                       inter_node=slower(self.inter_node),
                       collective_links={k: slower(v) for k, v in self.collective_links.items()},
                       fsdp_bandwidth_share=1.0)

    @property
    def adam_kernels(self) -> AdamKernels:
        return ADAM_KERNELS[self.optimizer]

    def with_nodes(self, nodes: int) -> Cluster:
        _check_positive_int("nodes", nodes, self.name)
        _check_world(nodes, self.devices_per_node, self.name)
        return replace(self, nodes=nodes)

    # -- constructors ---------------------------------------------------------------------

    @staticmethod
    def preset_names() -> list[str]:
        folder = resources.files("cost_models") / "presets"
        return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))

    @classmethod
    def preset(cls, name: str, *, nodes: int | None = None) -> Cluster:
        if name == "local":
            return cls.local()
        names = cls.preset_names()
        if name not in names:
            raise ConfigError(
                f"unknown cluster preset {name!r}; presets: {', '.join(names + ['local'])}, "
                "or give a path to a .toml cluster file"
            )
        text = (resources.files("cost_models") / "presets" / f"{name}.toml").read_text()
        cluster = cls.from_toml_text(text, source=f"preset {name}")
        return cluster.with_nodes(nodes) if nodes is not None else cluster

    @classmethod
    def from_toml(cls, path: str | os.PathLike, *, nodes: int | None = None) -> Cluster:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read cluster file {path}: {e.strerror}") from e
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"cluster file {path} is not UTF-8 text (byte {e.start}); "
                              "save it as UTF-8") from None
        cluster = cls.from_toml_text(text, source=str(path))
        return cluster.with_nodes(nodes) if nodes is not None else cluster

    @classmethod
    def from_toml_text(cls, text: str, *, source: str = "cluster") -> Cluster:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: not valid TOML: {e}") from e
        return cluster_from_dict(data, source)

    @classmethod
    def load(cls, name_or_path: str, *, nodes: int | None = None) -> Cluster:
        """A preset name, 'local', or a path to a .toml file."""
        if isinstance(name_or_path, os.PathLike):
            return cls.from_toml(name_or_path, nodes=nodes)
        if not isinstance(name_or_path, str):
            raise ConfigError(f"a cluster is a preset name or a .toml path, got "
                              f"{type(name_or_path).__name__} {name_or_path!r}; presets: "
                              f"{', '.join(cls.preset_names() + ['local'])}")
        if name_or_path.endswith(".toml") or os.sep in name_or_path:
            return cls.from_toml(name_or_path, nodes=nodes)
        return cls.preset(name_or_path, nodes=nodes)

    @classmethod
    def local(cls, nproc: int | None = None) -> Cluster:
        """The CPU processes of this machine, one 'device' per process.

        Uncalibrated defaults: a process's share of a commodity x86 core (fp32 FMA),
        DRAM bandwidth, and loopback gloo figures measured on a 2-core machine
        (TORCH_ON_CPU.md: latency 0.05-0.2 ms, all_reduce ~1.5 GB/s at 2 ranks).
        """
        nproc = nproc or os.cpu_count() or 1
        _check_positive_int("nproc", nproc, "local")
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            ram = 16 * GiB
        loopback = Link(kind="loopback", bandwidth_GBps=1.5, latency_s=1e-4)
        return cls(
            name="local",
            device=Device(
                name="cpu-process",
                peak_flops={"float32": 50e9, "bfloat16": 25e9},
                memory_bytes=ram // nproc,
                memory_bandwidth_GBps=10.0,
                matmul_efficiency=0.5,
                kernel_floor_s=2e-5,
            ),
            nodes=1,
            devices_per_node=nproc,
            intra_node=loopback,
            inter_node=loopback,
            # FSDP2 overlaps its gathers and reduce-scatters through CUDA streams; on CPU it
            # issues them synchronously. DDP's and the pipeline's are async here too.
            overlap=Overlap(exposed=("fsdp",)),
            optimizer="adamw-for-loop",
            host=Host(offload=False),
            source="uncalibrated defaults for local CPU processes",
        )


# -- parsing and validation ---------------------------------------------------------------

_UNITS = {
    # file key: (field name, multiplier to the field's unit)
    "memory_gib": ("memory_bytes", GiB),
    "memory_gb": ("memory_bytes", 1e9),
    "latency_us": ("latency_s", 1e-6),
    "kernel_floor_us": ("kernel_floor_s", 1e-6),
    "collective_skew_us": ("collective_skew_s", 1e-6),
    "fsdp_overhead_us": ("fsdp_overhead_s", 1e-6),
    "tp_overhead_us": ("tp_overhead_s", 1e-6),
    "dtensor_op_overhead_us": ("dtensor_op_overhead_s", 1e-6),
    "ddp_bucket_mib": ("ddp_bucket_bytes", MiB),
}


def cluster_from_dict(data: dict[str, Any], source: str) -> Cluster:
    top = _known(data, {f.name for f in fields(Cluster)}, source)
    for key in ("name", "device", "intra_node", "inter_node"):
        if key not in top:
            raise ConfigError(f"{source}: missing field {key!r}")
    device = _device_from_dict(top.pop("device"), f"{source}: [device]")
    intra = _link_from_dict(top.pop("intra_node"), f"{source}: [intra_node]")
    inter = _link_from_dict(top.pop("inter_node"), f"{source}: [inter_node]")
    if "overlap" in top:
        top["overlap"] = _overlap_from_dict(top["overlap"], f"{source}: [overlap]")
    if "collective_links" in top:
        links = _table(top["collective_links"], f"{source}: [collective_links]")
        for kind in links:
            if kind not in COLLECTIVES:
                raise ConfigError(f"{source}: [collective_links.{kind}] is not a collective; "
                                  f"valid: {', '.join(COLLECTIVES)}")
        top["collective_links"] = {
            kind: _link_from_dict(value, f"{source}: [collective_links.{kind}]")
            for kind, value in links.items()}
    for key in ("nodes", "devices_per_node"):
        if key in top:
            _check_positive_int(key, top[key], source)
    _check_world(top.get("nodes", 1), top.get("devices_per_node", 8), source)
    if "optimizer" in top and (not isinstance(top["optimizer"], str)
                               or top["optimizer"] not in ADAM_KERNELS):
        raise ConfigError(f"{source}: optimizer = {top['optimizer']!r} is not one of "
                          f"{', '.join(ADAM_KERNELS)}")
    if "host" in top:
        top["host"] = _host_from_dict(top["host"], f"{source}: [host]")
    for key in ("name", "source", "provenance"):
        if key in top and not isinstance(top[key], str):
            raise ConfigError(f"{source}: {key} must be a string, got {top[key]!r}")
    if "extra" in top and not isinstance(top["extra"], dict):
        raise ConfigError(f"{source}: [extra] must be a table, got {top['extra']!r}")
    if "nvls_bus_GBps" in top:
        _check_range("nvls_bus_GBps", top["nvls_bus_GBps"], source, "nvls_bus_GBps")
    chosen = top.pop("software", None)
    if chosen is not None and not isinstance(chosen, str):
        raise ConfigError(f"{source}: software must be a generation's name, got {chosen!r}; "
                          f"valid: {', '.join(software_names())}")
    if chosen is not None and "software_efficiency" in data["device"]:
        raise ConfigError(f"{source}: software = {chosen!r} sets the device's "
                          "software_efficiency; give either it or [device] "
                          "software_efficiency (a measured one), not both")
    margin = top.get("memory_margin_fraction", 0.1)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ConfigError(f"{source}: memory_margin_fraction must be in [0, 1), got {margin!r}")
    cluster = Cluster(device=device, intra_node=intra, inter_node=inter, **top)
    try:
        return with_software(cluster, chosen) if chosen is not None else cluster
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _device_from_dict(data: Any, where: str) -> Device:
    d = _known(_table(data, where), {f.name for f in fields(Device)}, where)
    peak = d.pop("peak_tflops", None)
    if not isinstance(peak, dict) or not peak:
        raise ConfigError(f"{where}: missing table 'peak_tflops' (e.g. float32 = 19.5)")
    for dtype in peak:
        if dtype not in DTYPES:
            raise ConfigError(
                f"{where}: peak_tflops.{dtype} is not a known dtype; valid: {', '.join(DTYPES)}"
            )
    d["peak_flops"] = {k: _check_range(f"peak_tflops.{k}", v, where, "peak_flops", scale=1e12)
                       for k, v in peak.items()}
    for key in ("name", "memory_bytes", "memory_bandwidth_GBps"):
        if key not in d:
            raise ConfigError(f"{where}: missing field {key!r}")
    if not isinstance(d["name"], str):
        raise ConfigError(f"{where}: name must be a string, got {d['name']!r}")
    capability = d.get("cuda_capability", "")
    if not isinstance(capability, str) or (capability and not _CAPABILITY.fullmatch(capability)):
        raise ConfigError(f"{where}: cuda_capability must be a string \"major.minor\" such as "
                          f"\"9.0\" (an H100), or empty for a device that is no CUDA GPU; got "
                          f"{capability!r}")
    for key in ("memory_bytes", "memory_bandwidth_GBps", "kernel_floor_s"):
        if key in d:
            d[key] = _check_range(key, d[key], where, key)
    for key in HOST_OVERHEADS:
        if key in d:
            d[key] = _check_range(key, d[key], where, "host_overhead_s")
    d["memory_bytes"] = int(d["memory_bytes"])
    if "collective_skew_at" in d:
        d["collective_skew_at"] = _skew_points(d["collective_skew_at"], where)
    for key in ("attention_efficiency", "loss_efficiency"):
        value = d.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 < value <= 10):
            raise ConfigError(f"{where}: {key} must be in (0, 10], got {value!r}")
    for key, default in (("matmul_efficiency", 0.7), ("software_efficiency", 1.0)):
        eff = d.get(key, default)
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise ConfigError(f"{where}: {key} must be in (0, 1], got {eff!r}")
    if "matmul_half_dim" in d:
        d["matmul_half_dim"] = _half_dims(d["matmul_half_dim"], where)
    return Device(**d)


_CAPABILITY = re.compile(r"[0-9]{1,2}\.[0-9]{1,2}")


def _skew_points(data: Any, where: str) -> tuple[tuple[float, float], ...]:
    """``[device.collective_skew_at]``: ``bytes = [...]`` ascending and ``us = [...]``."""
    table = _known(_table(data, f"{where} collective_skew_at"), {"bytes", "us", "measured_us"},
                   f"{where} collective_skew_at")  # measured_us: what the curve was fitted to
    sizes, times = table.get("bytes"), table.get("us")
    if (not isinstance(sizes, list) or not isinstance(times, list) or len(sizes) != len(times)
            or not sizes or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0
                                or not math.isfinite(x) or x > RANGES["skew_bytes"][1]
                                for x in sizes + times)
            or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)) or sizes[0] <= 0):
        raise ConfigError(f"{where} collective_skew_at: bytes and us must be lists of equal "
                          f"length, bytes positive and ascending, us non-negative; got "
                          f"bytes = {sizes!r}, us = {times!r}")
    return tuple((float(b), float(t) * 1e-6) for b, t in zip(sizes, times, strict=True))


def _half_dims(data: Any, where: str) -> dict[str, float]:
    """``[device.matmul_half_dim]``: dtype = elements (0 means GEMMs of any size saturate)."""
    table = _table(data, f"{where} matmul_half_dim")
    for dtype, value in table.items():
        if dtype not in DTYPES:
            raise ConfigError(
                f"{where}: matmul_half_dim.{dtype} is not a known dtype; valid: {', '.join(DTYPES)}"
            )
        _check_range(f"matmul_half_dim.{dtype}", value, where, "matmul_half_dim")
    return {k: float(v) for k, v in table.items()}


def _overlap_from_dict(data: Any, where: str) -> Overlap:
    d = _known(_table(data, where), {f.name for f in fields(Overlap)}, where)
    for key in ("dp_slowdown", "fsdp_slowdown", "pp_slowdown"):
        value = d.get(key, DEFAULT_OVERLAP_SLOWDOWN)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < 10:
            raise ConfigError(
                f"{where}: {key} must be a number in [1, 10) (compute never speeds up while "
                f"communication runs beside it), got {value!r}")
    if "ddp_bucket_bytes" in d:
        d["ddp_bucket_bytes"] = int(_check_range("ddp_bucket_bytes", d["ddp_bucket_bytes"],
                                                  where, "ddp_bucket_bytes"))
    if "exposed" in d:
        value = d["exposed"]
        if not isinstance(value, list) or any(p not in OVERLAP_PATTERNS for p in value):
            raise ConfigError(
                f"{where}: exposed must be a list of patterns from "
                f"{', '.join(OVERLAP_PATTERNS)}, got {value!r}")
        d["exposed"] = tuple(value)
    return Overlap(**d)


def _host_from_dict(data: Any, where: str) -> Host:
    d = _known(_table(data, where), {f.name for f in fields(Host)}, where)
    if not isinstance(d.get("offload", True), bool):
        raise ConfigError(f"{where}: offload must be true or false, got {d['offload']!r}")
    if "memory_bandwidth_GBps" in d:
        d["memory_bandwidth_GBps"] = _check_range("memory_bandwidth_GBps",
                                                  d["memory_bandwidth_GBps"], where,
                                                  "memory_bandwidth_GBps")
    if "link" in d:
        d["link"] = _link_from_dict(d["link"], f"{where[:-1]}.link]")
    return Host(**d)


def _link_from_dict(data: Any, where: str) -> Link:
    d = _known(_table(data, where), {f.name for f in fields(Link)}, where)
    for key in ("kind", "bandwidth_GBps", "latency_s"):
        if key not in d:
            raise ConfigError(f"{where}: missing field {key!r}")
    if not isinstance(d["kind"], str) or d["kind"] not in LINK_KINDS:
        raise ConfigError(
            f"{where}: kind = {d['kind']!r} is not one of {', '.join(LINK_KINDS)}"
        )
    return Link(kind=d["kind"],
                bandwidth_GBps=_check_range("bandwidth_GBps", d["bandwidth_GBps"], where,
                                            "bandwidth_GBps"),
                latency_s=_check_range("latency_s", d["latency_s"], where, "latency_s"))


def _table(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    return data


def _known(data: dict[str, Any], valid: set[str], where: str) -> dict[str, Any]:
    """Apply unit-suffixed aliases (memory_gib, latency_us, ...) and reject unknown keys.

    An alias is accepted only in a table whose fields include its target, so each table's
    error lists the keys that table takes.
    """
    aliases = {k: v for k, v in _UNITS.items() if v[0] in valid}
    if "peak_flops" in valid:
        aliases["peak_tflops"] = ("peak_flops", 1.0)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "peak_tflops" and key in aliases:
            out[key] = value  # a table, converted by _device_from_dict
        elif key in aliases:
            name, scale = aliases[key]
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0 or value * scale > 1e30):
                raise ConfigError(f"{where}: {key} must be a finite non-negative number, "
                                  f"got {value!r}")
            out[name] = value * scale
        elif key in valid:
            out[key] = value
        else:
            allowed = sorted((valid - {"peak_flops", "extra"}) | set(aliases))
            raise ConfigError(f"{where}: unknown field {key!r}; valid fields: {', '.join(allowed)}")
    return out


def _check_positive(key: str, value: Any, where: str) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ConfigError(f"{where}: {key} must be a positive finite number, got {value!r}")


def _check_positive_int(key: str, value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    limit = MAX_DEVICES_PER_NODE if key in ("devices_per_node", "nproc") else MAX_NODES
    if value > limit:
        raise ConfigError(f"{where}: {key} = {value} is beyond the limit of {limit}; "
                          "is it a typo?")


def _check_world(nodes: int, devices_per_node: int, where: str) -> None:
    if nodes * devices_per_node > MAX_DEVICES:
        raise ConfigError(f"{where}: {nodes} nodes × {devices_per_node} devices = "
                          f"{nodes * devices_per_node} devices is beyond the limit of "
                          f"{MAX_DEVICES}; is a count a typo?")


def _check_range(key: str, value: Any, where: str, limits: str, *, scale: float = 1.0,
                 low_open: bool = False) -> float:
    """``value`` × ``scale`` as a float, if finite and within ``RANGES[limits]``."""
    low, high = RANGES[limits]
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    scaled = float(value) * scale if ok and math.isfinite(value) else math.nan
    if not ok or not math.isfinite(scaled) or scaled > high or scaled < low or (
            low_open and scaled <= low):
        lo, hi = f"{low / scale:g}", f"{high / scale:g}"
        bounds = f"finite and at most {hi}" if low == 0 else f"from {lo} to {hi}"
        raise ConfigError(f"{where}: {key} must be a {'non-negative' if low == 0 else 'positive'}"
                          f" number, {bounds}, got {value!r}")
    return scaled
