"""What the ``autopar`` command does with the engine exports, as functions the CLI calls:
``autopar export PLAN --format megatron|deepspeed|accelerate [--out DIR]`` and
``autopar plan --model M --cluster C --from-megatron "ARGS"``."""

from __future__ import annotations

from pathlib import Path

from autopar.errors import ConfigError
from autopar.exports import EXPORTERS, Export
from autopar.exports.compare import compare_megatron, format_comparison
from autopar.exports.megatron_import import read_megatron_args
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from passes.layer_graph import build_layer_graph
from runtime.plan import Plan


def engine_export(fmt: str, plan_path: str, *, nodes: int | None = None,
                  nproc_per_node: int | None = None) -> Export:
    """The export of the plan saved at ``plan_path`` for engine ``fmt``; files name the plan
    by its absolute path."""
    if fmt not in EXPORTERS:
        raise ConfigError(f"unknown engine {fmt!r}; one of {', '.join(EXPORTERS)}")
    plan = Plan.load(plan_path)
    return EXPORTERS[fmt](plan, str(Path(plan_path).resolve()), nodes=nodes,
                          nproc_per_node=nproc_per_node)


def export_output(export: Export, out: str | None) -> list[str]:
    """Lines for stdout: the files' text, or (with ``out``, a directory) where they went.
    The warnings are the caller's to print on stderr."""
    if out is None:
        if len(export.files) == 1:
            return [export.files[0].text.rstrip("\n")]
        return [line for f in export.files for line in (f"==> {f.name} <==", f.text)]
    return [f"wrote {path}" for path in export.write(out)]


def megatron_comparison(megatron_args: str, model: str, cluster: Cluster, *,
                        seq: int | None = None, time_limit_s: float = 10.0) -> str:
    """``autopar plan --from-megatron``: the job priced next to autopar's plan for the same
    built-in model, captured at the job's global batch and sequence length."""
    job = read_megatron_args(megatron_args, cluster.world_size)
    spec = get_model(model)
    seq = job.seq_len or seq
    inputs = spec.example_inputs(job.global_batch, seq, device="meta")
    seq_len = inputs[0].shape[1] if spec.kind == "gpt" else None
    graph = build_layer_graph(spec.build("meta"), inputs, model_name=spec.name, seq_len=seq_len)
    return format_comparison(compare_megatron(megatron_args, graph, cluster,
                                              time_limit_s=time_limit_s))
