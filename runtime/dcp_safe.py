"""Read torch.distributed.checkpoint (DCP) directories without running code they could hold.

DCP stores two kinds of pickle: the ``.metadata`` file (read by ``FileSystemReader`` with
plain ``pickle.load``) and every non-tensor value (an optimizer's ``lr``, ``betas``; read
by ``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=False)``). Either runs
whatever a crafted file asks, and a file padded to its saved size passes any size check.
Here:

- ``.metadata`` is unpickled by an ``Unpickler`` whose ``find_class`` resolves only the
  types DCP's metadata is made of (``_METADATA_TYPES``); anything else is refused before
  it is called. (torch's ``weights_only`` unpickler would be the natural choice, but in
  torch 2.13 it reads pickle protocol 2 only, and DCP writes protocol 4: FRAME, MEMOIZE
  and STACK_GLOBAL are "unsupported operands" there.) The result must be a ``Metadata``
  whose data files lie inside the checkpoint directory.
- non-tensor values go through ``torch.load(weights_only=True)``, which admits
  primitives, containers and tensors only.

Tensors DCP already reads with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from runtime.checkpoint_errors import UnsafeCheckpointError

METADATA_FILE = ".metadata"

# What DCP's metadata pickle names (torch 2.13, seen with pickletools on saved checkpoints):
# its dataclasses, torch.Size, dtypes, layouts (via _get_layout), the memory-format enum,
# and the pathlib path DCP records as the checkpoint id.
_METADATA_TYPES: dict[tuple[str, str], Any] = {
    (obj.__module__, obj.__qualname__): obj
    for obj in (
        dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata,
        dcp_metadata.TensorProperties, dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.BytesStorageMetadata, dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo,
    )
}
_METADATA_TYPES[("torch", "Size")] = torch.Size
_METADATA_TYPES[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_METADATA_TYPES[("pathlib", "PosixPath")] = PosixPath
_METADATA_TYPES.update({("torch", str(d).removeprefix("torch.")): d for d in (
    getattr(torch, name) for name in dir(torch)) if isinstance(d, torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_TYPES.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"it names {module}.{name}, which is not one of DCP's metadata types")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("it holds a persistent reference, which DCP metadata never does")


def read_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """Unpickle a DCP ``.metadata`` file through the allow-list; check what it points at.

    Raises UnsafeCheckpointError (nothing outside the allow-list is called) or
    ``pickle.UnpicklingError`` / ``EOFError`` / ``ValueError`` for a damaged file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as e:
            raise UnsafeCheckpointError(
                f"{path} was refused: {e}; the file may be crafted to run code (nothing in it "
                "was executed). Use a checkpoint written by autopar, or re-save it") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not plain_name(name):
            raise UnsafeCheckpointError(
                f"{path} points at data file {name!r}, which is not a file of its own "
                "directory; refusing to read it")
    return metadata


def plain_name(name: object) -> bool:
    """A file name of a checkpoint directory itself: no separator, not . or .."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` unpickles through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(str(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} was refused: {e}".split("\n")[0]
                + " (nothing in it was executed)") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
