"""A plan as Megatron-LM's ``pretrain_gpt.py`` arguments, in an executable launch script.

Megatron-LM takes one setting per concern for the whole model; the plan's per-layer
choices map to the closest one (``autopar.exports.common``), and the rest is named in the
script's header and returned as warnings:

- degrees: tp, pp, cp and the largest expert-parallel degree; Megatron's data-parallel
  degree is what the world size leaves, the plan's dp.
- pipeline stages: ``--pipeline-model-parallel-layout``, the plan's exact cuts (``E``
  embedding, ``t`` one transformer block, ``L`` final norm, head and loss; one ``|``
  between stages, virtual stages included), so no even-split rule is assumed.
- data parallelism: the ZeRO stage of each layer's strategy spec (runtime.strategies),
  tensor-parallel or not: ZeRO-1 (``zero1``, ``tp_zero1``) is Megatron's distributed
  optimizer; ZeRO-2 and ZeRO-3 are Megatron-FSDP with sharding ``optim_grads`` /
  ``optim_grads_params``; hybrid sharding keeps one distributed-optimizer instance per
  shard group.
- recomputation: ``full`` (per block: method ``uniform`` with 1 layer when every block
  recomputes, else ``block`` with the most blocks any stage recomputes, Megatron taking
  each stage's first ones) or ``selective`` (Megatron's default module, the attention core,
  which is what the plan's ``selective`` keeps out of memory).

The transformer blocks are the plan's largest class of identical layers; the layers
before them are the embedding, the ones after them the head.
"""

from __future__ import annotations

import shlex
from collections import Counter

from autopar.errors import ConfigError
from autopar.export import launch_for
from autopar.exports.common import (
    DataParallel,
    Export,
    ExportFile,
    data_parallel,
    header_lines,
    micro_batch_size,
)
from runtime.plan import LayerPlan, Plan

SCRIPT = "megatron.sh"
MEGATRON_SCHEDULES = {1: "1F1B", None: "Interleaved1F1B"}
"""Megatron-LM's pipeline schedules by virtual stages (None: 2 or more)."""
SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
"""Megatron-FSDP's --data-parallel-sharding-strategy for each ZeRO stage it runs."""


def block_span(plan: Plan) -> tuple[int, int]:
    """Indices [first, last] of the transformer blocks in ``plan.layers``: the largest class
    of identical layers, which must be consecutive."""
    classes = Counter(layer.layer_class for layer in plan.layers if layer.layer_class)
    if not classes:
        raise ConfigError("the plan names no layer classes, so the transformer blocks "
                          "Megatron-LM counts (--num-layers) are unknown; export a plan "
                          "made by `autopar plan`")
    blocks = classes.most_common(1)[0][0]
    where = [i for i, layer in enumerate(plan.layers) if layer.layer_class == blocks]
    if where != list(range(where[0], where[-1] + 1)):
        raise ConfigError(f"the transformer blocks (layer class {blocks!r}) are not "
                          "consecutive in the plan; Megatron-LM's GPT is embedding, blocks, "
                          "head")
    return where[0], where[-1]


def megatron_args(plan: Plan) -> tuple[list[str], list[str]]:
    """``pretrain_gpt.py``'s arguments for the plan, and what they cannot express."""
    warnings: list[str] = []
    first, last = block_span(plan)
    blocks = plan.layers[first:last + 1]
    args = [*_degrees(plan, warnings), "--num-layers", str(len(blocks))]
    args += _pipeline(plan, first, last, warnings)
    args += _tensor_parallel(plan, warnings)
    dp = data_parallel(plan)
    warnings += dp.warnings
    args += _sharding(plan, dp, warnings)
    args += _recompute(plan, blocks, first, last, warnings)
    args += ["--micro-batch-size", str(micro_batch_size(plan)),
             "--global-batch-size", str(plan.global_batch)]
    if plan.seq_len:
        args += ["--seq-length", str(plan.seq_len)]
    args += _precision(plan)
    return args, warnings


def _degrees(plan: Plan, warnings: list[str]) -> list[str]:
    mesh = plan.mesh
    args = ["--tensor-model-parallel-size", str(mesh.tp),
            "--pipeline-model-parallel-size", str(mesh.pp),
            "--context-parallel-size", str(mesh.cp)]
    ep = Counter(layer.expert_parallel for layer in plan.layers)
    if max(ep) > 1:
        args += ["--expert-model-parallel-size", str(max(ep))]
        if len(ep) > 2 or (len(ep) == 2 and 1 not in ep):
            warnings.append(f"one expert-parallel degree ({max(ep)}) for every "
                            f"mixture-of-experts layer; the plan uses {sorted(ep)}")
    return args


def _pipeline(plan: Plan, first: int, last: int, warnings: list[str]) -> list[str]:
    if plan.mesh.pp == 1:
        return []
    assert plan.pipeline is not None  # Plan requires it when pp > 1
    if plan.pipeline.scatter_sends and not any(la.sequence_parallel for la in plan.layers):
        # Megatron-LM dropped SC'21's scatter/gather of pipeline tensors (no flag for it at
        # the commit megatron_flags reads); with sequence parallelism its sends are already
        # the 1/tp sequence shards, without it they are whole.
        warnings.append(f"the plan scatters pipeline sends over tp = {plan.mesh.tp}; "
                        "Megatron-LM sends each tp rank's whole activation without sequence "
                        "parallelism, so its sends take longer than the plan predicts")
    blocks = [0] * plan.num_stages
    for layer in plan.layers[first:last + 1]:
        blocks[layer.stage] += 1
    # Megatron-LM's layout names the embedding (E) once, on the first stage, and the final
    # norm, head and loss (L) once, on the last.
    split = {la.stage for la in plan.layers[:first]} | {la.stage for la in plan.layers[last + 1:]}
    if split - {0, plan.num_stages - 1}:
        warnings.append("Megatron-LM keeps the embedding on the first stage and the head on "
                        "the last; the plan cuts inside them")
    stages = ["t" * n for n in blocks]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    layout = "|".join(_compact(s) for s in stages)
    v = plan.pipeline.virtual_stages
    schedule = MEGATRON_SCHEDULES[1 if v == 1 else None]
    if plan.pipeline.schedule != schedule:
        warnings.append(f"pipeline schedule {plan.pipeline.schedule!r}: Megatron-LM runs "
                        f"{'interleaved 1F1B' if v > 1 else '1F1B'} with {v} virtual "
                        "stage(s) per rank, stage s on pipeline rank s mod pp")
    return ["--pipeline-model-parallel-layout", layout]


def _compact(stage: str) -> str:
    """'Etttt' -> 'Et*4' (Megatron's layout syntax unrolls 'x*n')."""
    n = stage.count("t")
    return stage.replace("t" * n, f"t*{n}") if n > 1 else stage


def _tensor_parallel(plan: Plan, warnings: list[str]) -> list[str]:
    if plan.mesh.tp == 1:
        return []
    plain = [layer.module for layer in plan.layers if not layer.is_tp]
    if plain:
        warnings.append(f"Megatron-LM splits every layer over tp = {plan.mesh.tp}; the plan "
                        f"keeps {len(plain)} layer(s) whole ({_names(plain)})")
    tp_layers = [layer for layer in plan.layers if layer.is_tp]
    sp = [layer.module for layer in tp_layers if layer.sequence_parallel]
    if sp and len(sp) < len(tp_layers):
        warnings.append(f"sequence parallelism for every layer; the plan uses it on {len(sp)} "
                        f"of {len(tp_layers)} tensor-parallel layers")
    overlapped = [layer.module for layer in tp_layers if layer.async_tp]
    if overlapped:
        # Megatron-LM's own TP overlap (--tp-comm-overlap, Transformer Engine's userbuffers)
        # is another mechanism, and not among the flags autopar writes (megatron_flags).
        warnings.append(f"async TP is not carried: the plan overlaps the sequence-parallel "
                        f"collectives of {len(overlapped)} layer(s) ({_names(overlapped)}) "
                        "with their matmuls (PyTorch's micro-pipelined TP), which Megatron-LM "
                        "does not run; they are exposed there")
    return ["--sequence-parallel"] if sp else []


def _sharding(plan: Plan, dp: DataParallel, warnings: list[str]) -> list[str]:
    args: list[str] = []
    if dp.zero_stage >= 1:
        args.append("--use-distributed-optimizer")
    if dp.zero_stage >= 2:
        # Megatron-FSDP saves only in its own checkpoint format (validate_args asserts it).
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                 SHARDING[dp.zero_stage], "--ckpt-format", "fsdp_dtensor"]
    if dp.hybrid:
        assert plan.hsdp_shard_size is not None  # Plan requires it for hsdp layers
        stage_ranks = plan.mesh.replicas * plan.mesh.tp
        args += ["--num-distributed-optimizer-instances",
                 str(stage_ranks // plan.hsdp_shard_size)]
    if dp.offload:
        args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
        warnings.append("Megatron-LM offloads the optimizer states and step to the CPU; the "
                        "plan also keeps parameters and gradients in host memory")
    if plan.mesh.replicas > 1:
        args.append("--overlap-grad-reduce")
        if dp.zero_stage >= 1:
            args.append("--overlap-param-gather")
    return args


def _recompute(plan: Plan, blocks: tuple[LayerPlan, ...], first: int, last: int,
               warnings: list[str]) -> list[str]:
    others = [la.module for i, la in enumerate(plan.layers)
              if not first <= i <= last and la.recompute != "none"]
    if others:
        warnings.append(f"Megatron-LM recomputes transformer blocks only; the plan also "
                        f"recomputes {_names(others)}")
    modes = Counter(b.recompute for b in blocks)
    if modes["full"]:
        return _recompute_full(blocks, warnings, selective=modes["selective"])
    if modes["selective"]:
        if modes["none"]:
            warnings.append(f"selective recomputation in every block; the plan keeps "
                            f"{modes['none']} of {len(blocks)} blocks' activations")
        return ["--recompute-granularity", "selective"]
    return []


def _recompute_full(blocks: tuple[LayerPlan, ...], warnings: list[str],
                    selective: int) -> list[str]:
    if selective:
        warnings.append(f"one recomputation granularity: full; the plan recomputes "
                        f"{selective} block(s) selectively")
    if all(b.recompute == "full" for b in blocks):
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    # Megatron's 'block' method recomputes the first N blocks of every (virtual) stage.
    per_stage: dict[int, list[bool]] = {}
    for b in blocks:
        per_stage.setdefault(b.stage, []).append(b.recompute == "full")
    n = max(sum(full) for full in per_stage.values())
    if any(full != [i < n for i in range(len(full))] for full in per_stage.values()):
        warnings.append(f"Megatron-LM recomputes the first {n} block(s) of every stage; the "
                        "plan recomputes other blocks")
    return ["--recompute-granularity", "full", "--recompute-method", "block",
            "--recompute-num-layers", str(n)]


def _precision(plan: Plan) -> list[str]:
    if plan.param_dtype == "float32":
        return []
    args = ["--bf16" if plan.param_dtype == "bfloat16" else "--fp16"]
    if plan.reduce_dtype == "float32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    elif plan.param_dtype == "bfloat16":
        args.append("--grad-reduce-in-bf16")
    return args  # float16's dynamic loss scaling is Megatron's default (no --loss-scale)


def _names(modules: list[str], most: int = 3) -> str:
    shown = ", ".join(modules[:most])
    return shown + (f" and {len(modules) - most} more" if len(modules) > most else "")


def export_megatron(plan: Plan, plan_path: str, *, nodes: int | None = None,
                    nproc_per_node: int | None = None) -> Export:
    """``megatron.sh``: torchrun starting ``$MEGATRON_LM/pretrain_gpt.py`` with the plan's
    arguments, then the job's own (model, data, tokenizer, optimizer) given to the script."""
    args, warnings = megatron_args(plan)
    launch = launch_for(plan, nodes, nproc_per_node)
    torchrun = ["torchrun", f"--nnodes={launch.nodes}",
                f"--nproc-per-node={launch.nproc_per_node}"]
    rendezvous = ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:${MASTER_PORT:-29500}",
                  "--rdzv-id=${SLURM_JOB_ID:-autopar}"] if launch.nodes > 1 else ["--standalone"]
    lines = ["#!/bin/bash", *(f"# {line}" for line in header_lines(
        plan, plan_path, "Megatron-LM", warnings)), "set -euo pipefail",
        ': "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (it holds pretrain_gpt.py)}"']
    if launch.nodes > 1:
        lines.append(': "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"')
    if (plan.mesh.tp > 1 or plan.mesh.cp > 1) and "--use-megatron-fsdp" not in args:
        # Megatron-LM's validate_args requires it for tp or cp > 1 before Blackwell (one
        # CUDA stream queue orders its TP communication behind compute); Megatron-FSDP
        # requires it unset.
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1")
    lines += ["AUTOPAR_ARGS=(", *_arg_lines(args), ")",
              "# the model's, data's, tokenizer's and optimizer's arguments follow the script's "
              "name (a later flag overrides one above)",
              "exec " + " ".join([*map(shlex.quote, torchrun), *rendezvous,
                                  '"$MEGATRON_LM/pretrain_gpt.py"', '"${AUTOPAR_ARGS[@]}"',
                                  '"$@"']), ""]
    return Export(engine="megatron", warnings=tuple(warnings),
                  files=(ExportFile(name=SCRIPT, text="\n".join(lines), executable=True),))


def _arg_lines(args: list[str]) -> list[str]:
    """One flag (with its value) per line."""
    lines: list[str] = []
    for a in args:
        if a.startswith("--"):
            lines.append(f"  {a}")
        else:
            lines[-1] += f" {shlex.quote(a)}"
    return lines
