"""The training software around the GEMMs: named generations and what each loses.

A device's ``matmul_efficiency`` is what its GEMM kernels reach alone (the hardware: the
largest GEMMs cuBLAS runs on it, a published measurement in the preset). A training step
reaches less: framework launch gaps, unfused elementwise kernels, the attention kernel of
its day, clocks under sustained load. That loss is the software's, and it differs by
generation: Megatron-LM in 2021, llm-foundry's FSDP1 in 2023, torchtitan's FSDP2 in 2024
ran on the same kind of GPU at different shares of it. A ``Software`` profile states one
generation's efficiency factor (the GEMM rate is peak × matmul_efficiency × this factor)
and which communication its software never overlaps with compute. Where the data demand it,
a generation also states the host time its FSDP leaves unhidden on a device
(``fsdp_host_s_by_device``): per wrapped module per micro-batch, a fixed cost that the
device's kernels no longer cover once they are fast enough; and the share of the links'
bandwidth its sharded-data-parallel collectives reached where they ran below NCCL's rings
(``fsdp_bandwidth_share``: DeepSpeed's ZeRO-3 of 2021).

The generations live in ``software.toml`` beside this module. A fitted efficiency is
fitted on NAMED calibration rows of its own published source (``calibrated_on``), never on
the rows that check it (tests/cost_models/test_software.py, test_fsdp_scaling.py), or, where
its source has nothing to hold out, on all its rows (megatron-lm-2021); torch-eager keeps the
0.7 of A100 peak the cost model was tuned with, and ``calibrated_on`` says so. A generation
measured on several GPUs may carry one value per device (``efficiency_by_device``): the same
software keeps a different share of a different chip (on the H100, FlashAttention-2 ran at
35% of peak against the A100's 50-73%: Shah et al., FlashAttention-3, 2024, abstract; Dao,
FlashAttention-2, 2023, abstract), and the device model has no term for that.

A cluster selects its software by name (``software = "..."`` in its TOML, or
``with_software``); a cluster that selects none keeps the device's figures whole, as a
calibrated profile measures them through the stack that runs it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from cost_models.errors import ConfigError

if TYPE_CHECKING:  # hardware imports this module to parse a cluster's ``software`` key
    from cost_models.hardware import Cluster

DEFAULT_SOFTWARE = "torch-eager"
"""The planner's default: the eager PyTorch stack autopar's runtime is."""
OVERLAP_PATTERNS = ("dp", "fsdp", "pp")
"""The communication patterns whose overlap with compute a software or a cluster can deny:
data-parallel gradient reduction, FSDP's gathers and reduce-scatters, pipeline sends
(cost_models/overlap.py). Here, not in hardware.py, because hardware imports this module."""


@dataclass(frozen=True, kw_only=True)
class Software:
    """One software generation: its efficiency factor and what it leaves exposed."""

    name: str
    efficiency: float
    """Fraction of the device's GEMM rate (peak × matmul_efficiency) a training step keeps,
    on a device without its own entry in ``efficiency_by_device``."""
    efficiency_by_device: dict[str, float] = field(default_factory=dict)
    """Device name (``Device.name``) -> the factor fitted on that device's rows."""
    fsdp_host_s: float | None = None
    """Host time (s) its FSDP adds per wrapped module per micro-batch that the device does not
    hide, fitted with the efficiency; it becomes the device's ``fsdp_overhead_s``. None: the
    device keeps its own (0 on GPU presets)."""
    fsdp_host_s_by_device: dict[str, float] = field(default_factory=dict)
    """Device name -> ``fsdp_host_s`` fitted on that device's rows."""
    fsdp_bandwidth_share: float = 1.0
    """Share of the links' bandwidth its sharded-data-parallel collectives reach
    (``Cluster.fsdp_bandwidth_share``), where they ran below NCCL's rings; fitted."""
    exposed: tuple[str, ...] = ()
    """Communication patterns (``OVERLAP_PATTERNS``) this software waits
    for: it never overlaps them with compute."""
    optimizer: str | None = None
    """The Adam kernels it runs (cost_models.optimizer.ADAM_KERNELS), if it fixes them."""
    source: str = ""
    """What ran: framework, version, where its published numbers are."""
    calibrated_on: str = ""
    """The published rows the efficiency was fitted on, and why those."""

    def efficiency_on(self, device_name: str) -> float:
        return self.efficiency_by_device.get(device_name, self.efficiency)

    def fsdp_host_on(self, device_name: str) -> float | None:
        """The unhidden FSDP host time on ``device_name``, None where the generation states
        none."""
        return self.fsdp_host_s_by_device.get(device_name, self.fsdp_host_s)


def software_names() -> list[str]:
    return list(_table())


def software(name: str) -> Software:
    """The named generation of ``software.toml``; a ConfigError lists the names."""
    table = _table()
    if not isinstance(name, str) or name not in table:
        raise ConfigError(f"unknown software generation {name!r}; valid: "
                          f"{', '.join(table)}")
    return table[name]


def with_software(cluster: Cluster, chosen: str | Software) -> Cluster:
    """``cluster`` running ``chosen``: its device's software_efficiency set to the
    generation's factor on that device (and its fsdp_overhead_s to the generation's host
    time there, if it states one; its sharded collectives' bandwidth share), the
    generation's exposed patterns added to the
    cluster's own (a CPU cluster's FSDP2 stays exposed), its optimizer if it fixes one."""
    sw = software(chosen) if isinstance(chosen, str) else chosen
    name = cluster.device.name
    host = sw.fsdp_host_on(name)
    device = replace(cluster.device, software_efficiency=sw.efficiency_on(name),
                     fsdp_overhead_s=cluster.device.fsdp_overhead_s if host is None else host)
    exposed = tuple(dict.fromkeys((*cluster.overlap.exposed, *sw.exposed)))
    return replace(cluster, device=device, software=sw.name,
                   fsdp_bandwidth_share=sw.fsdp_bandwidth_share,
                   overlap=replace(cluster.overlap, exposed=exposed),
                   optimizer=sw.optimizer or cluster.optimizer)


def with_fitted_values(cluster: Cluster, *, efficiency: float | None = None,
                       fsdp_host_s: float | None = None,
                       fsdp_bandwidth_share: float | None = None) -> Cluster:
    """``cluster`` with the values a generation fits replaced by these (None: kept), for
    fitting them (``cost_models.calibrate.fit_software_efficiency_with``)."""
    device = cluster.device
    if efficiency is not None:
        device = replace(device, software_efficiency=efficiency)
    if fsdp_host_s is not None:
        device = replace(device, fsdp_overhead_s=fsdp_host_s)
    share = cluster.fsdp_bandwidth_share if fsdp_bandwidth_share is None else \
        fsdp_bandwidth_share
    return replace(cluster, device=device, fsdp_bandwidth_share=share)


@cache
def _table() -> dict[str, Software]:
    text = (resources.files("cost_models") / "software.toml").read_text()
    return {name: software_from_dict(name, entry, "cost_models/software.toml")
            for name, entry in tomllib.loads(text).items()}


def software_from_dict(name: str, data: Any, where: str) -> Software:
    """One ``[<name>]`` table of software.toml, checked."""
    where = f"{where}: [{name}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    valid = {"efficiency", "efficiency_by_device", "fsdp_host_us", "fsdp_host_us_by_device",
             "fsdp_bandwidth_share", "exposed", "optimizer", "source", "calibrated_on"}
    unknown = set(data) - valid
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; valid: "
                          f"{', '.join(sorted(valid))}")
    if "efficiency" not in data:
        raise ConfigError(f"{where}: missing field 'efficiency'")
    by_device = data.get("efficiency_by_device", {})
    if not isinstance(by_device, dict):
        raise ConfigError(f"{where}: efficiency_by_device must be a table of device name = "
                          f"factor, got {by_device!r}")
    for key, value in [("efficiency", data["efficiency"]), *by_device.items(),
                       ("fsdp_bandwidth_share", data.get("fsdp_bandwidth_share", 1.0))]:
        _check_factor(key, value, where)
    host = data.get("fsdp_host_us_by_device", {})
    if not isinstance(host, dict):
        raise ConfigError(f"{where}: fsdp_host_us_by_device must be a table of device name = "
                          f"microseconds, got {host!r}")
    for key, value in [("fsdp_host_us", data.get("fsdp_host_us", 0)), *host.items()]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 <= value < 1e6):
            raise ConfigError(f"{where}: {key} must be microseconds in [0, 1e6), got {value!r}")
    default_host = data.get("fsdp_host_us")
    exposed = data.get("exposed", [])
    if not isinstance(exposed, list) or any(p not in OVERLAP_PATTERNS for p in exposed):
        raise ConfigError(f"{where}: exposed must be a list of patterns from "
                          f"{', '.join(OVERLAP_PATTERNS)}, got {exposed!r}")
    return Software(name=name, efficiency=float(data["efficiency"]),
                    efficiency_by_device={k: float(v) for k, v in by_device.items()},
                    fsdp_host_s=None if default_host is None else float(default_host) * 1e-6,
                    fsdp_host_s_by_device={k: float(v) * 1e-6 for k, v in host.items()},
                    fsdp_bandwidth_share=float(data.get("fsdp_bandwidth_share", 1.0)),
                    exposed=tuple(exposed), optimizer=data.get("optimizer"),
                    source=str(data.get("source", "")),
                    calibrated_on=str(data.get("calibrated_on", "")))


def _check_factor(key: str, value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{where}: {key} must be a number in (0, 1], got {value!r}")
