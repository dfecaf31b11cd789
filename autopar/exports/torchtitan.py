"""A plan as torchtitan 0.3 command-line settings, in an executable launch script.

torchtitan 0.3 reads no job file. ``python -m torchtitan.train --module M --config C`` calls
the Python function ``C`` of M's config registry for the whole job (model, data,
optimizer) and then applies command-line overrides ``--section.field value``, parsed by
tyro against torchtitan's config dataclasses (``torchtitan/config/manager.py``). The
activation-checkpointing policy is a tyro subcommand (``activation-checkpoint:none``,
``:selective``, ``:full``), which must follow every flag. So the export is
``torchtitan.sh``: torchrun starting ``torchtitan.train`` with the job's own arguments
first (``--module llama3 --config llama3_8b ...``) and the plan's after them, where they
win (a later flag overrides an earlier one).

What the plan sets:

- degrees: the plan's dp as ``data_parallel_replicate_degree`` × ``data_parallel_shard_degree``
  (DDP: all replicate; ZeRO: all shard; hybrid: shard inside ``hsdp_shard_size`` ranks),
  ``context_parallel_degree``, ``tensor_parallel_degree``, ``pipeline_parallel_degree``,
  ``expert_parallel_degree``; and ``enable_sequence_parallel``;
- async TP: ``compile.enable_async_tensor_parallel`` with ``compile.enable`` (torchtitan 0.3
  compiles each block and turns on Inductor's micro-pipeline pass, as autopar's runtime
  does: runtime/async_tp.py), or that switch off;
- ``fsdp_reshard_after_forward``: ``always`` for ZeRO-3, ``never`` otherwise (FSDP2 then
  keeps the gathered parameters through the step, as autopar's runtime runs ZeRO-1/2);
- the pipeline: schedule, micro-batch size and the exact stage layout
  (``module_fqns_per_model_part`` in the names of torchtitan's decoder: ``tok_embeddings``,
  ``layers.<k>``, ``norm``, ``lm_head``), so no even-split rule is assumed; and CUDA
  graphs off (``Trainer.Config`` refuses them with pipelining, and they are on by default);
- activation checkpointing of every transformer block: ``none``, ``selective`` or ``full``
  (always given: torchtitan's default is selective);
- ``training``: ``local_batch_size`` (per data-parallel rank and accumulation step) and
  ``global_batch_size`` (torchtitan accumulates their ratio over dp), ``seq_len``, CPU
  offload, mixed precision (param and reduce dtypes), and ``dtype`` float32 (the plan keeps
  float32 master weights).

The transformer blocks are the plan's largest class of identical layers
(``autopar.exports.megatron.block_span``); the layers before them are torchtitan's
embedding, the ones after them its final norm and output head.
"""

from __future__ import annotations

import shlex
from collections import Counter

from autopar.errors import ConfigError
from autopar.export import ENDPOINT, RDZV_ID, launch_for
from autopar.exports.common import (
    DataParallel,
    Export,
    ExportFile,
    data_parallel,
    header_lines,
    micro_batch_size,
)
from autopar.exports.megatron import block_span
from autopar.generated import comment
from runtime.plan import Plan

SCRIPT = "torchtitan.sh"
MIXED_PRECISION = ("bfloat16", "float32")
"""The param dtypes torchtitan 0.3's ``training.mixed_precision_param`` takes."""
AC_SUBCOMMAND = "activation-checkpoint:{}"

Setting = tuple[str, ...]
"""One flag with its values (or the checkpointing subcommand): one line of the script."""


def torchtitan_settings(plan: Plan) -> tuple[list[Setting], list[str]]:
    """The plan's settings, the checkpointing subcommand last, and what they cannot express."""
    warnings: list[str] = []
    block_span(plan)  # first: a plan without one run of identical blocks is refused
    dp = data_parallel(plan)
    warnings += dp.warnings
    shard = _shard_degree(plan, dp, warnings)
    settings = [*_degrees(plan, dp, shard, warnings), *_async_tp(plan, warnings),
                *_pipeline(plan, warnings), *_training(plan, dp, warnings),
                _checkpointing(plan, warnings)]
    return settings, warnings


def torchtitan_args(plan: Plan) -> tuple[list[str], list[str]]:
    """The arguments ``torchtitan.train`` gets after the job's own, and the warnings."""
    settings, warnings = torchtitan_settings(plan)
    return [word for setting in settings for word in setting], warnings


def _flag(field: str, value: object) -> Setting:
    return (f"--{field.replace('_', '-')}", str(value))


def _switch(field: str, on: bool) -> Setting:
    """A tyro boolean: ``--section.name`` or ``--section.no-name``."""
    section, name = field.split(".")
    return (f"--{section}.{'' if on else 'no-'}{name.replace('_', '-')}",)


def _shard_degree(plan: Plan, dp: DataParallel, warnings: list[str]) -> int:
    """torchtitan's ``data_parallel_shard_degree``: the data-parallel ranks one state is
    sharded over (its FSDP mesh is dp_shard × cp, inside dp_replicate)."""
    mesh = plan.mesh
    if not dp.zero_stage:
        return 1
    if not dp.hybrid:
        return mesh.dp
    assert plan.hsdp_shard_size is not None  # Plan requires it for hsdp layers
    inner = mesh.cp * mesh.tp
    shard = plan.hsdp_shard_size // inner if plan.hsdp_shard_size % inner == 0 else 0
    if not shard or mesh.dp % shard:
        warnings.append(f"hybrid sharding over {plan.hsdp_shard_size} ranks does not fit "
                        f"torchtitan's mesh (dp = {mesh.dp}, cp × tp = {inner}): sharded "
                        "over every data-parallel rank")
        return mesh.dp
    return shard


def _degrees(plan: Plan, dp: DataParallel, shard: int, warnings: list[str]) -> list[Setting]:
    mesh = plan.mesh
    if not dp.zero_stage and mesh.cp > 1:
        warnings.append(f"torchtitan's FSDP spans the {mesh.cp} context-parallel ranks, so it "
                        "shards the states over them; the plan replicates them")
    if mesh.tp > 1:
        _tensor_parallel_warnings(plan, warnings)
    sp = any(la.sequence_parallel for la in plan.layers)
    return [
        _flag("parallelism.data_parallel_replicate_degree", mesh.dp // shard),
        _flag("parallelism.data_parallel_shard_degree", shard),
        _flag("parallelism.fsdp_reshard_after_forward",
              "always" if dp.zero_stage == 3 else "never"),
        _flag("parallelism.context_parallel_degree", mesh.cp),
        _flag("parallelism.tensor_parallel_degree", mesh.tp),
        _switch("parallelism.enable_sequence_parallel", sp),
        _flag("parallelism.expert_parallel_degree", _expert_degree(plan, shard, warnings)),
    ]


def _tensor_parallel_warnings(plan: Plan, warnings: list[str]) -> None:
    plain = [la.module for la in plan.layers if not la.is_tp]
    if plain:
        warnings.append(f"torchtitan splits every layer over tp = {plan.mesh.tp}; the plan "
                        f"keeps {len(plain)} layer(s) whole ({_names(plain)})")
    tp_layers = [la for la in plan.layers if la.is_tp]
    sp = sum(la.sequence_parallel for la in tp_layers)
    if 0 < sp < len(tp_layers):
        warnings.append(f"sequence parallelism for every layer; the plan uses it on {sp} of "
                        f"{len(tp_layers)} tensor-parallel layers")


def _async_tp(plan: Plan, warnings: list[str]) -> list[Setting]:
    """torchtitan 0.3's async TP (``compile.enable_async_tensor_parallel``, which needs
    ``compile.enable``), always given: a registry may turn it on."""
    sp = [la for la in plan.layers if la.sequence_parallel]
    overlapped = sum(la.async_tp for la in sp)
    if not overlapped:
        return [_switch("compile.enable_async_tensor_parallel", False)]
    if overlapped < len(sp):
        warnings.append(f"async TP for every layer; the plan uses it on {overlapped} of "
                        f"{len(sp)} sequence-parallel layers")
    return [_switch("compile.enable", True),
            _switch("compile.enable_async_tensor_parallel", True)]


def _expert_degree(plan: Plan, shard: int, warnings: list[str]) -> int:
    """torchtitan takes the expert-parallel ranks from dp_shard × cp × tp (innermost)."""
    degrees = Counter(la.expert_parallel for la in plan.layers)
    ep = max(degrees, default=1)
    if ep == 1:
        return 1
    if len(set(degrees) - {1}) > 1:
        warnings.append(f"one expert-parallel degree ({ep}) for every mixture-of-experts "
                        f"layer; the plan uses {sorted(degrees)}")
    dense = shard * plan.mesh.cp * plan.mesh.tp
    if dense % ep:
        warnings.append(f"expert parallelism (ep = {ep}) left out: torchtitan takes its ranks "
                        f"from dp_shard × cp × tp = {dense}, which ep does not divide")
        return 1
    if plan.mesh.cp * plan.mesh.tp > 1:
        warnings.append(f"torchtitan's expert-parallel groups are {ep} consecutive ranks of "
                        "dp_shard × cp × tp; the plan's are data-parallel ranks, cp × tp apart")
    return ep


def _pipeline(plan: Plan, warnings: list[str]) -> list[Setting]:
    settings = [_flag("parallelism.pipeline_parallel_degree", plan.mesh.pp)]
    if plan.mesh.pp == 1:
        return settings
    assert plan.pipeline is not None  # Plan requires it when pp > 1
    if plan.pipeline.scatter_sends:
        warnings.append(f"the plan scatters pipeline sends over tp = {plan.mesh.tp} (each tp "
                        "rank sends its slice, the next stage all-gathers them); torchtitan "
                        "sends the whole activation from every tp rank, so its sends take "
                        "longer than the plan predicts")
    return settings + [
        _flag("parallelism.pipeline_parallel_schedule", plan.pipeline.schedule),
        _flag("parallelism.pipeline_parallel_microbatch_size", micro_batch_size(plan)),
        ("--parallelism.module-fqns-per-model-part",
         *(",".join(part) for part in stage_modules(plan, warnings))),
        # Trainer.Config refuses pipelining with CUDA graph capture, its default.
        _switch("training.disable_cuda_graphs", True),
    ]


def stage_modules(plan: Plan, warnings: list[str]) -> list[list[str]]:
    """Per stage (torchtitan's global stage order, which is autopar's), its modules by
    torchtitan's decoder names: the embedding with the plan's first layer, the final norm
    and head with its last, block k as ``layers.<k>``."""
    first, last = block_span(plan)
    layers = plan.layers
    parts: list[list[str]] = [[] for _ in range(plan.num_stages)]
    if len({la.stage for la in layers[:first]}) > 1 or \
            len({la.stage for la in layers[last + 1:]}) > 1:
        warnings.append("torchtitan keeps the embedding in the first stage and the final "
                        "norm and head in the last; the plan cuts inside them")
    parts[layers[0].stage].append("tok_embeddings")
    for k, block in enumerate(layers[first:last + 1]):
        parts[block.stage].append(f"layers.{k}")
    parts[layers[-1].stage] += ["norm", "lm_head"]
    empty = [s for s, part in enumerate(parts) if not part]
    if empty:
        raise ConfigError(f"pipeline stage(s) {empty} of the plan hold only part of the "
                          "embedding or head, which torchtitan runs as one module each: no "
                          "torchtitan stage can be empty; re-plan, or edit the stages")
    return parts


def _training(plan: Plan, dp: DataParallel, warnings: list[str]) -> list[Setting]:
    mesh = plan.mesh
    accumulation = 1 if plan.pipeline else plan.gradient_accumulation
    settings = [
        _flag("training.local_batch_size", plan.global_batch // (mesh.dp * accumulation)),
        _flag("training.global_batch_size", plan.global_batch),
    ]
    if accumulation > 1 and dp.zero_stage < 2 and mesh.dp * mesh.cp > 1:
        warnings.append(f"torchtitan reduces gradients after each of the {accumulation} "
                        "accumulation steps; the plan accumulates them and reduces once per "
                        "step")
    if plan.seq_len:
        settings.append(_flag("training.seq_len", _integer(plan.seq_len, "seq_len")))
    settings.append(_switch("training.enable_cpu_offload", dp.offload))
    return settings + _precision(plan, warnings)


def _precision(plan: Plan, warnings: list[str]) -> list[Setting]:
    param = plan.param_dtype
    if param not in MIXED_PRECISION:
        warnings.append(f"{param} compute with dynamic loss scaling: torchtitan's mixed "
                        f"precision takes {' or '.join(MIXED_PRECISION)}; exported as bfloat16 "
                        "(the same bytes and speed, a wider range, no loss scaling)")
        param = "bfloat16"
    if plan.reduce_dtype != "float32":
        warnings.append(f"gradients reduced in float32: torchtitan reduces in float32 only; "
                        f"the plan reduces them in {plan.reduce_dtype} (twice the bytes)")
    return [_flag("training.dtype", "float32"),
            _flag("training.mixed_precision_param", param),
            _flag("training.mixed_precision_reduce", "float32")]


def _checkpointing(plan: Plan, warnings: list[str]) -> Setting:
    """One policy for every transformer block: the strongest any block uses."""
    first, last = block_span(plan)
    others = [la.module for i, la in enumerate(plan.layers)
              if not first <= i <= last and la.recompute != "none"]
    if others:
        warnings.append(f"torchtitan checkpoints transformer blocks only; the plan also "
                        f"recomputes {_names(others)}")
    modes = Counter(la.recompute for la in plan.layers[first:last + 1])
    mode = "full" if modes["full"] else "selective" if modes["selective"] else "none"
    if mode != "none" and len(modes) > 1:
        warnings.append(f"{mode} activation checkpointing for every transformer block; the "
                        "plan gives " + ", ".join(f"{n} block(s) {m}"
                                                  for m, n in sorted(modes.items())))
    if mode == "selective":
        warnings.append("torchtitan's selective checkpointing also keeps the attention "
                        "output and recomputes every second matmul; autopar's keeps every "
                        "matmul and recomputes attention")
    return (AC_SUBCOMMAND.format(mode),)


def _integer(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"the plan's {field} is {value!r}, not an integer; fix the plan")
    return value


def _names(modules: list[str], most: int = 3) -> str:
    shown = ", ".join(modules[:most])
    return shown + (f" and {len(modules) - most} more" if len(modules) > most else "")


def export_torchtitan(plan: Plan, plan_path: str, *, nodes: int | None = None,
                      nproc_per_node: int | None = None) -> Export:
    """``torchtitan.sh``: torchrun starting ``torchtitan.train`` with the job's arguments
    (given to the script: ``--module``, ``--config`` and the rest), then the plan's."""
    settings, warnings = torchtitan_settings(plan)
    launch = launch_for(plan, nodes, nproc_per_node)
    first, last = block_span(plan)
    header = [*header_lines(plan, plan_path, "torchtitan", warnings),
              f"for a model of {last - first + 1} transformer blocks; the job's arguments "
              "(--module, --config, data, optimizer) come first, the plan's follow and win"]
    torchrun = ["torchrun", f"--nnodes={launch.nodes}",
                f"--nproc-per-node={launch.nproc_per_node}"]
    rendezvous = ["--rdzv-backend=c10d", ENDPOINT, RDZV_ID] if launch.nodes > 1 \
        else ["--standalone"]
    lines = ["#!/bin/bash", *(f"# {comment(line)}" for line in header), "set -euo pipefail",
             ': "${1:?usage: torchtitan.sh --module MODULE --config CONFIG [ARGS]}"']
    if launch.nodes > 1:
        lines.append(': "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"')
    lines += ["AUTOPAR_ARGS=(", *(f"  {shlex.join(s)}" for s in settings), ")",
              "exec " + " ".join([*map(shlex.quote, torchrun), *rendezvous,
                                  "-m", "torchtitan.train", '"$@"', '"${AUTOPAR_ARGS[@]}"']),
              ""]
    return Export(engine="torchtitan", warnings=tuple(warnings),
                  files=(ExportFile(name=SCRIPT, text="\n".join(lines), executable=True),))
