"""The Megatron-LM command-line flags autopar writes and reads, as Megatron-LM declares them.

Names, destinations and kinds are those of ``megatron/training/arguments.py`` in
NVIDIA/Megatron-LM (commit d98e8a64ddf34856e74b24714e3bedb2f5a39553, 2026-08-22), where
the parallelism flags come from ``_add_distributed_args`` and ``ModelParallelConfig``'s
fields, recomputation from ``TransformerConfig``'s, batch sizes from
``_add_training_args`` and precision from ``_add_mixed_precision_args``. Megatron builds
its parser with ``allow_abbrev=False``; so does ``parser`` here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

Kind = Literal["int", "str", "true"]


@dataclass(frozen=True)
class Flag:
    dest: str
    kind: Kind
    choices: tuple[str, ...] | None = None


FLAGS: dict[str, Flag] = {
    "--tensor-model-parallel-size": Flag("tensor_model_parallel_size", "int"),
    "--pipeline-model-parallel-size": Flag("pipeline_model_parallel_size", "int"),
    "--context-parallel-size": Flag("context_parallel_size", "int"),
    "--expert-model-parallel-size": Flag("expert_model_parallel_size", "int"),
    "--num-layers": Flag("num_layers", "int"),
    "--pipeline-model-parallel-layout": Flag("pipeline_model_parallel_layout", "str"),
    "--num-layers-per-virtual-pipeline-stage": Flag("num_layers_per_virtual_pipeline_stage",
                                                    "int"),
    "--num-virtual-stages-per-pipeline-rank": Flag("num_virtual_stages_per_pipeline_rank", "int"),
    "--decoder-first-pipeline-num-layers": Flag("decoder_first_pipeline_num_layers", "int"),
    "--decoder-last-pipeline-num-layers": Flag("decoder_last_pipeline_num_layers", "int"),
    "--sequence-parallel": Flag("sequence_parallel", "true"),
    "--use-distributed-optimizer": Flag("use_distributed_optimizer", "true"),
    "--num-distributed-optimizer-instances": Flag("num_distributed_optimizer_instances", "int"),
    "--use-megatron-fsdp": Flag("use_megatron_fsdp", "true"),
    "--use-torch-fsdp2": Flag("use_torch_fsdp2", "true"),
    "--data-parallel-sharding-strategy": Flag(
        "data_parallel_sharding_strategy", "str",
        ("no_shard", "optim", "optim_grads", "optim_grads_params")),
    "--ckpt-format": Flag("ckpt_format", "str", ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")),
    "--optimizer-cpu-offload": Flag("optimizer_cpu_offload", "true"),
    "--use-precision-aware-optimizer": Flag("use_precision_aware_optimizer", "true"),
    "--recompute-granularity": Flag("recompute_granularity", "str", ("full", "selective")),
    "--recompute-method": Flag("recompute_method", "str", ("uniform", "block")),
    "--recompute-num-layers": Flag("recompute_num_layers", "int"),
    "--recompute-activations": Flag("recompute_activations", "true"),
    "--micro-batch-size": Flag("micro_batch_size", "int"),
    "--global-batch-size": Flag("global_batch_size", "int"),
    "--seq-length": Flag("seq_length", "int"),
    "--bf16": Flag("bf16", "true"),
    "--fp16": Flag("fp16", "true"),
    "--grad-reduce-in-bf16": Flag("grad_reduce_in_bf16", "true"),
    "--accumulate-allreduce-grads-in-fp32": Flag("accumulate_allreduce_grads_in_fp32", "true"),
    "--overlap-grad-reduce": Flag("overlap_grad_reduce", "true"),
    "--overlap-param-gather": Flag("overlap_param_gather", "true"),
}
"""Every flag autopar writes or reads (``autopar.exports.megatron``, ``megatron_import``)."""

DEFAULTS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1, "expert_model_parallel_size": 1,
            "num_distributed_optimizer_instances": 1,
            "data_parallel_sharding_strategy": "optim_grads_params"}
"""Megatron-LM's defaults for the flags above that have one other than None / False."""


def parser() -> argparse.ArgumentParser:
    """A parser of the flags above, with Megatron-LM's names, types and defaults."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    for name, flag in FLAGS.items():
        if flag.kind == "true":
            p.add_argument(name, dest=flag.dest, action="store_true")
        else:
            p.add_argument(name, dest=flag.dest, type=int if flag.kind == "int" else str,
                           choices=flag.choices, default=DEFAULTS.get(flag.dest))
    return p
