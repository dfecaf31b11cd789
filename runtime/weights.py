"""Load a model's weights into its shards: each rank reads only what its shards cover.

Two sources, both read without unpickling anything:

- a directory of Hugging Face safetensors shards (``model.safetensors`` or
  ``model-0000k-of-0000n.safetensors``): ``torch.distributed.checkpoint``'s
  ``HuggingFaceStorageReader``, whose metadata is the files' JSON headers;
- an autopar checkpoint (``runtime.checkpoint``): its manifest is verified first
  (``checkpoint_format.verify``), which proves the DCP metadata beside it was written by
  autopar, and only the model's tensors are read.

The target tensors are the model's own (DTensor shards under FSDP2 and TP, a pipeline
rank's stages only), from ``get_model_state_dict``, so DCP copies each chunk straight
into the shard that holds it: no rank ever holds the full model. A tied weight saved
once (Hugging Face writes ``lm_head.weight`` only as ``transformer.wte.weight``) is read
under its first name (``runtime.materialize.first_names``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from runtime.checkpoint_format import CheckpointError, verify
from runtime.dcp_safe import SafeFileSystemReader, SafeLoadPlanner

logger = logging.getLogger(__name__)


def load_weights(modules: Sequence[nn.Module], path: str | os.PathLike,
                 first: Mapping[str, str] | None = None) -> None:
    """Fill the parameters and persistent buffers of ``modules`` (the parallelized model,
    or a pipeline rank's stages, keeping the user's names) from ``path``. ``first`` maps a
    tied weight's other names to its first name. Raises CheckpointError naming the
    missing key or the unreadable source. Every rank calls it."""
    first = first or {}
    states = [get_model_state_dict(m) for m in modules]
    by_key: dict[str, list[torch.Tensor]] = {}
    for state in states:
        for name, t in state.items():
            by_key.setdefault(first.get(name, name), []).append(t)
    reader, prefix, saved = _source(Path(path))
    missing = sorted(k for k in by_key if prefix + k not in saved)
    if missing:
        raise CheckpointError(
            f"{path}: no weights for {len(missing)} tensor(s) of the model (first: "
            f"{missing[0]!r}; the file has e.g. {sorted(saved)[:3]}); the weights are of "
            "another model or another naming"
        )
    # One tensor per key is read; a second copy of a tied weight on this rank is copied.
    target = {k: ts[0] for k, ts in by_key.items()}
    tree = {"model": target} if prefix else target
    try:
        dcp.load(tree, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=True))
    except Exception as e:  # noqa: BLE001 - DCP wraps every rank's error in its own types
        raise CheckpointError(f"{path}: reading the weights failed: {e}") from e
    for ts in by_key.values():
        for copy in ts[1:]:
            copy.copy_(ts[0])
    for module, state in zip(modules, states, strict=True):
        set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    logger.info("loaded %d tensor(s) from %s", len(target), path)


def check_source(path: str | os.PathLike) -> None:
    """Raise CheckpointError unless ``path`` is a directory of safetensors shards or an
    autopar checkpoint whose manifest verifies. Local: no collective, no tensor read."""
    _source(Path(path))


def _source(path: Path) -> tuple[object, str, set[str]]:
    """(DCP storage reader, key prefix, the keys the source holds)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir() and any(path.glob("*.safetensors")):
        return HuggingFaceStorageReader(str(path)), "", _safetensors_keys(path)
    ckpt, _, metadata = verify(path)  # an autopar checkpoint, or CheckpointError
    return SafeFileSystemReader(str(ckpt)), "model.", set(metadata.state_dict_metadata)


def _safetensors_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys
