"""What every engine export shares: the file record, the header, the one data-parallel
setting closest to a plan that mixes them per layer, and the atomic write.

An engine that takes one setting for the whole model gets the one that keeps the plan
feasible: the strongest sharding any layer uses (a layer the plan left less sharded then
costs communication, never memory), CPU offload when any layer offloads. Every layer that
the engine then runs differently from the plan is named in a warning.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from runtime.files import write_atomic
from runtime.plan import Plan
from runtime.strategies import StrategySpec


@dataclass(frozen=True, kw_only=True)
class ExportFile:
    """One file of an export."""

    name: str
    text: str
    executable: bool = False


@dataclass(frozen=True, kw_only=True)
class Export:
    """What an engine export writes, and what of the plan the engine cannot express."""

    engine: str
    files: tuple[ExportFile, ...]
    warnings: tuple[str, ...] = ()

    def file(self, name: str) -> ExportFile:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def write(self, directory: str | os.PathLike) -> list[Path]:
        """Write every file into ``directory`` (created if missing), each atomically."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        return [write_atomic(out / f.name, f.text, mode=0o755 if f.executable else 0o644)
                for f in self.files]


def autopar_version() -> str:
    try:
        return importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def header_lines(plan: Plan, plan_path: str, engine: str, warnings: list[str]) -> list[str]:
    """The comment lines (without the comment sign) every export starts with."""
    lines = [f"{engine} settings written by autopar {autopar_version()} from plan {plan_path}",
             f"model {plan.model or '?'} on {plan.cluster or '?'}: {plan.world_size} ranks, "
             f"mesh {plan.mesh.describe()}, global batch {plan.global_batch}"]
    if warnings:
        lines.append(f"what {engine} cannot express of the plan:")
        lines += [f"  - {w}" for w in warnings]
    # A name holding a line break would end the comment and start a command: each header
    # line stays one line.
    return [" ".join(line.splitlines()) for line in lines]


@dataclass(frozen=True, kw_only=True)
class DataParallel:
    """The one data-parallel setting for the whole model."""

    zero_stage: int
    hybrid: bool
    offload: bool
    warnings: list[str] = field(default_factory=list)


def data_parallel(plan: Plan, *, per_module: bool = False) -> DataParallel:
    """The strongest sharding any layer uses, with offload when any layer offloads; the
    layers that differ from it named in warnings. ``per_module``: the engine's ZeRO-3
    gathers module by module (DeepSpeed); otherwise it shards a layer as one unit (FSDP
    wrapped per block), and ``fsdp_modules`` layers, which would then hold a whole layer
    gathered, are named too. (Per-layer units run per module under DeepSpeed: less memory
    than planned, which needs no warning.)"""
    specs = [layer.spec for layer in plan.layers]
    stage = max((s.zero_stage for s in specs), default=0)
    hybrid = bool(specs) and all(s.hybrid for s in specs if s.zero_stage == stage) and stage > 0
    offload = any(layer.offload for layer in plan.layers)
    warnings = []
    differ = Counter(layer.strategy for layer in plan.layers
                     if not _same(layer.spec, stage, hybrid))
    if differ:
        warnings.append(
            "one data-parallel setting for every layer (ZeRO stage "
            f"{stage}{', hybrid' if hybrid else ''}): the plan gives "
            + ", ".join(f"{n} layer(s) {s}" for s, n in sorted(differ.items()))
            + ", which then shard more than planned (more communication, no more memory)")
    per_layer = sum(layer.spec.units == "modules" for layer in plan.layers)
    if per_layer and not per_module:
        warnings.append(
            f"one FSDP unit per layer: the plan shards {per_layer} layer(s) one unit per "
            "weight matrix (fsdp_modules), which then hold a whole layer's parameters "
            "gathered at a time, more memory than planned")
    kept = sum(not layer.offload for layer in plan.layers)
    if offload and kept:
        warnings.append(f"CPU offload for every layer: the plan offloads "
                        f"{len(plan.layers) - kept} layer(s) and keeps {kept} on the device")
    return DataParallel(zero_stage=stage, hybrid=hybrid, offload=offload, warnings=warnings)


def _same(spec: StrategySpec, stage: int, hybrid: bool) -> bool:
    return spec.zero_stage == stage and spec.hybrid == hybrid


def micro_batch_size(plan: Plan) -> int:
    """Samples per micro-batch on one data-parallel rank."""
    return plan.global_batch // (plan.mesh.dp * plan.microbatches)


