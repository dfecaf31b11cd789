"""The errors of checkpoint saving, finding, verifying and loading (one module, so the
format and the safe DCP reader raise the same types without importing each other)."""

from cost_models.errors import AutoparError


class CheckpointError(AutoparError):
    """A checkpoint cannot be saved, found or loaded; the message says which file and why."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint is partial or damaged: a missing manifest, metadata or shard, a truncated file."""


class UnsafeCheckpointError(CheckpointCorruptError):
    """A checkpoint file asks to run code, or names files outside its directory; refused
    before anything in it ran."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint belongs to another model (names, global shapes or dtypes differ)."""


class CheckpointExistsError(CheckpointError):
    """The output of ``reshard`` exists already; nothing is overwritten."""
