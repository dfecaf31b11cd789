"""torchtitan 0.3's command line, as ``torchtitan.train`` reads it, for the fields autopar
prices: a strict reader of ``--module M --config C`` and ``--section.field value``
overrides (tyro's syntax: ``-`` or ``_`` in names, booleans as ``--section.name`` /
``--section.no-name``, the activation-checkpointing policy as the subcommand
``activation-checkpoint:<policy>`` after every flag).

``PARALLELISM``, ``TRAINING`` and ``COMPILE`` are every field of torchtitan 0.3.0's
``ParallelismConfig``, ``TrainingConfig`` and ``CompileConfig`` (``torchtitan/config/configs.py``)
with its kind and default, so a misspelt field of those sections is refused; the other
sections of ``Trainer.Config`` (optimizer, data, checkpointing, ...) are accepted and not
read.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.errors import ConfigError

INT, FLOAT, STR, BOOL, FQN_LISTS, STR_LIST = "int", "float", "str", "bool", "fqn_lists", "str_list"
OPTIONAL_INT, OPTIONAL_STR = "int|None", "str|None"

PARALLELISM: dict[str, tuple[str, object]] = {
    "data_parallel_replicate_degree": (INT, 1),
    "data_parallel_shard_degree": (INT, -1),
    "fsdp_reshard_after_forward": (("default", "always", "never"), "default"),
    "enable_fsdp_symm_mem": (BOOL, False),
    "tensor_parallel_degree": (INT, 1),
    "enable_sequence_parallel": (BOOL, True),
    "spmd_backend": (("partial_dtensor", "full_dtensor", "spmd_types"), "spmd_types"),
    "pipeline_parallel_degree": (INT, 1),
    "module_fqns_per_model_part": (FQN_LISTS, None),
    "pipeline_parallel_first_stage_less_layers": (INT, 1),
    "pipeline_parallel_last_stage_less_layers": (INT, 1),
    "pipeline_parallel_layers_per_stage": (OPTIONAL_INT, None),
    "pipeline_parallel_schedule": (STR, "1F1B"),
    "pipeline_parallel_schedule_csv": (OPTIONAL_STR, ""),
    "pipeline_parallel_microbatch_size": (INT, 1),
    "context_parallel_degree": (INT, 1),
    "context_parallel_load_balancer": (OPTIONAL_STR, "headtail"),
    "context_parallel_ptrr_mask_key": (OPTIONAL_STR, None),
    "expert_parallel_degree": (INT, 1),
}
"""torchtitan 0.3.0's ParallelismConfig: field -> (kind or choices, default)."""

TRAINING: dict[str, tuple[str, object]] = {
    "local_batch_size": (INT, 8),
    "global_batch_size": (INT, -1),
    "seq_len": (INT, 2048),
    "max_norm": (FLOAT, 1.0),
    "steps": (INT, 10000),
    "enable_cpu_offload": (BOOL, False),
    "disable_cuda_graphs": (BOOL, False),
    "dtype": (("bfloat16", "float32"), "float32"),
    "mixed_precision_param": (("bfloat16", "float32"), "bfloat16"),
    "mixed_precision_reduce": (("float32",), "float32"),
    "gc_freq": (INT, 50),
    "gc_debug": (BOOL, False),
}
"""torchtitan 0.3.0's TrainingConfig: field -> (kind or choices, default)."""

COMPILE: dict[str, tuple[str, object]] = {
    "enable": (BOOL, False),
    "enable_async_tensor_parallel": (BOOL, False),
    "components": (STR_LIST, ["model", "loss"]),
    "backend": (STR, "inductor"),
}
"""torchtitan 0.3.0's CompileConfig: read for async TP, which torchtitan 0.3 moved here from
``parallelism`` (it runs only with ``enable`` and 'model' in ``components``)."""

SECTIONS = {"parallelism": PARALLELISM, "training": TRAINING, "compile": COMPILE}
OTHER_SECTIONS = ("hf_assets_path", "dump_folder", "profiler", "metrics", "tokenizer",
                  "dataloader", "optimizer", "lr_scheduler", "checkpoint", "activation_checkpoint",
                  "comm", "validator", "debug", "override", "loss")
"""The rest of torchtitan 0.3.0's Trainer.Config: accepted, not read."""
MOVED = {"parallelism.enable_async_tensor_parallel":
         "--compile.enable --compile.enable_async_tensor_parallel"}
"""Flags of earlier torchtitan releases that 0.3 spells otherwise."""
AC_POLICIES = ("selective", "full", "memory-budget", "none")
_SUBCOMMAND = re.compile(r"activation[-_]checkpoint:(.*)")


@dataclass
class TorchtitanArgs:
    """The arguments, read: the registry named, and the overrides of the two sections."""

    module: str | None = None
    config: str | None = None
    overrides: dict[str, dict[str, object]] = field(
        default_factory=lambda: {name: {} for name in SECTIONS})
    activation_checkpoint: str | None = None
    """The subcommand's policy, None when not given."""


def read_args(argv: str | Sequence[str]) -> TorchtitanArgs:
    """``argv`` (a list, or one shell-quoted string split by ``shlex``), read strictly."""
    words = shlex.split(argv) if isinstance(argv, str) else list(argv)
    out = TorchtitanArgs()
    i = 0
    while i < len(words):
        word = words[i]
        values = _values(words, i + 1)
        i += 1 + len(values)
        if (m := _SUBCOMMAND.fullmatch(word)) is not None:
            out.activation_checkpoint = _policy(m.group(1))
        elif not word.startswith("--"):
            raise ConfigError(f"unexpected word {word!r} in the torchtitan arguments: give "
                              "--section.field value, or activation-checkpoint:<policy> last")
        else:
            _read_flag(out, word[2:].split("=", 1), values)
    return out


def _values(words: list[str], start: int) -> list[str]:
    end = start
    while end < len(words) and not words[end].startswith("--") \
            and not _SUBCOMMAND.fullmatch(words[end]):
        end += 1
    return words[start:end]


def _policy(name: str) -> str:
    if name not in AC_POLICIES:
        raise ConfigError(f"activation-checkpoint:{name} is not a torchtitan 0.3 policy; one "
                          f"of {', '.join(AC_POLICIES)}")
    return name


def _read_flag(out: TorchtitanArgs, name_value: list[str], values: list[str]) -> None:
    name = name_value[0].replace("-", "_")
    if len(name_value) == 2:
        values = [name_value[1], *values]
    if name in ("module", "config"):
        if len(values) != 1:
            raise ConfigError(f"--{name} takes one value, got {values}")
        setattr(out, name, values[0])
        return
    section, _, key = name.partition(".")
    if section in SECTIONS:
        out.overrides[section].update([_field(section, key, values)])
    elif section not in OTHER_SECTIONS:
        raise ConfigError(f"--{name_value[0]} is not a torchtitan 0.3 option: its sections are "
                          f"{', '.join([*SECTIONS, *OTHER_SECTIONS])}")


def _field(section: str, key: str, values: list[str]) -> tuple[str, object]:
    table = SECTIONS[section]
    negated = key.startswith("no_") and table.get(key[3:], ("",))[0] == BOOL
    name = key[3:] if negated else key
    if f"{section}.{name}" in MOVED:
        raise ConfigError(f"--{section}.{key} is not a torchtitan 0.3 option: 0.3 spells it "
                          f"{MOVED[section + '.' + name]}")
    if name not in table:
        raise ConfigError(f"--{section}.{key} is not a field of torchtitan 0.3's {section} "
                          f"config; its fields: {', '.join(table)}")
    kind = table[name][0]
    flag = f"--{section}.{key}"
    if kind == BOOL:
        if values:
            raise ConfigError(f"{flag} is a switch and takes no value (got {values}); use "
                              f"--{section}.{name} or --{section}.no-{name}")
        return name, not negated
    if kind not in (FQN_LISTS, STR_LIST) and len(values) != 1:
        raise ConfigError(f"{flag} takes one value, got {values}")
    return name, _parse(flag, kind, values)


def _parse(flag: str, kind: object, values: list[str]) -> object:
    text = values[0] if values else ""
    if kind == FQN_LISTS:
        return None if values == ["None"] else [v.split(",") for v in values]
    if kind == STR_LIST:
        return list(values)
    if isinstance(kind, tuple):
        if text not in kind:
            raise ConfigError(f"{flag} {text}: one of {', '.join(kind)}")
        return text
    if kind in (OPTIONAL_INT, OPTIONAL_STR) and text == "None":
        return None
    if kind in (STR, OPTIONAL_STR):
        return text
    try:
        return float(text) if kind == FLOAT else int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a number") from None
