"""The on-disk format of an autopar checkpoint, its integrity checks, and atomic commit.

A checkpoint *root* holds committed checkpoints and a pointer to the newest::

    ROOT/
      latest                 the name of the newest committed checkpoint (replaced atomically)
      step_00000003/         one committed checkpoint: a DCP directory plus our manifest
        .metadata            DCP: every key's global shape, dtype and where its chunks lie
        __0_0.distcp …       DCP: the data, one file per writing rank
        autopar.json         the manifest (below)
      .tmp-step_00000006/    a save in progress, or one that crashed: never read

The manifest (``autopar.json``, plain JSON) records the format version, the step, the
plan the checkpoint was saved under, the world size, the model name, the model
fingerprint (every state-dict key with its global shape and dtype), the caller's
data-loader position, and the name and size of every file the save wrote.

Keys inside the DCP state (DCP flattens nested dicts with dots), all by the user's
fully-qualified names and global shapes, so no key depends on the plan or world size:

    model.<fqn>                      parameters and persistent buffers
    optim.state.<fqn>.<name>         optimizer state per parameter (e.g. exp_avg, step)
    optim.param_groups.<fqn>.<name>  hyper-parameters per parameter (lr, betas, …)
    rng.rank<r>.cpu / .cuda          rank r's generator states (restored at equal world size)

Because every key is per parameter, a rank may save or load any subset (a pipeline
stage's parameters) and DCP reshards on load: chunks saved under one plan are read into
the shards of another.

Commit protocol (rank 0, after every rank's data and DCP's ``.metadata`` are written):
write the manifest into the temp directory, fsync, ``rename`` it to ``step_N`` (atomic on
one POSIX file system), fsync the root, replace ``latest`` by rename, then prune. A crash
at any point leaves either the old state or the new one; a temp directory is ignored by
readers and deleted by the next save.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.checkpoint_errors import (  # re-exported: callers import them from here
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,  # noqa: F401
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from runtime.dcp_safe import plain_name, read_metadata
from runtime.files import fsync_dir, write_atomic
from runtime.plan import Plan, PlanError

FORMAT_VERSION = 1
MANIFEST = "autopar.json"
DCP_METADATA = ".metadata"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# -- fingerprint ---------------------------------------------------------------------------


def fingerprint(state_dict: dict[str, Any]) -> list[list]:
    """``[[fqn, [global shape], dtype], …]`` sorted by name, for the tensors of a model state dict."""
    rows = []
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            rows.append([name, list(value.shape), str(value.dtype).removeprefix("torch.")])
    return sorted(rows)


def fingerprint_digest(rows: list[list]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def compare_fingerprints(saved: list[list], current: list[list], where: str) -> None:
    """Raise CheckpointMismatchError naming what differs between a checkpoint and a model."""
    if saved == current:
        return
    have = {row[0]: row[1:] for row in saved}
    want = {row[0]: row[1:] for row in current}
    problems = []
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        problems.append(f"{len(missing)} of the model's tensors are not in it (first: {missing[0]!r})")
    if extra:
        problems.append(f"it has {len(extra)} tensors the model lacks (first: {extra[0]!r})")
    for name in sorted(set(have) & set(want)):
        if have[name] != want[name]:
            (s_shape, s_dtype), (m_shape, m_dtype) = have[name], want[name]
            problems.append(
                f"{name!r} is {s_dtype}{s_shape} in the checkpoint but {m_dtype}{m_shape} in the model"
            )
            break
    raise CheckpointMismatchError(
        f"{where} was saved from a different model: " + "; ".join(problems)
        + " (the checkpoint's manifest names the model it came from)"
    )


# -- manifest ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``autopar.json`` holds; see the module docstring."""

    version: int = FORMAT_VERSION
    step: int
    world_size: int
    plan: dict[str, Any]
    """The plan the checkpoint was saved under (Plan.to_dict())."""
    model: str = ""
    """Model name (e.g. a built-in model), used by ``autopar reshard`` to rebuild it."""
    fingerprint: list[list] = field(default_factory=list)
    loader_state: dict[str, Any] = field(default_factory=dict)
    """The caller's data-loader position, opaque to autopar (JSON)."""
    files: dict[str, int] = field(default_factory=dict)
    """Every file the save wrote, with its size in bytes."""
    resharded_from: str = ""
    """For a checkpoint written by ``reshard``: the source checkpoint."""

    @property
    def fingerprint_digest(self) -> str:
        return fingerprint_digest(self.fingerprint)

    def get_plan(self) -> Plan:
        try:
            return Plan.from_dict(self.plan, source=f"the plan in {MANIFEST}")
        except PlanError as e:
            raise CheckpointCorruptError(str(e)) from e

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1) + "\n"

    @classmethod
    def read(cls, ckpt: Path) -> Manifest:
        path = ckpt / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{ckpt} is not a complete autopar checkpoint: {MANIFEST} is missing "
                "(a save that never committed, or a damaged copy)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointCorruptError(f"{path} is unreadable or not valid JSON ({e})") from e
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            version = data.get("version") if isinstance(data, dict) else None
            raise CheckpointCorruptError(
                f"{path}: checkpoint format version {version!r} is not supported (this autopar "
                f"reads version {FORMAT_VERSION})"
            )
        try:
            manifest = cls(**data)
        except TypeError as e:
            raise CheckpointCorruptError(f"{path}: malformed manifest ({e})") from e
        manifest.check(path)
        return manifest

    def check(self, path: Path) -> None:
        """Every field has its type (a damaged or hand-edited manifest is named, not a
        traceback later): counts are integers, files map plain names to sizes."""
        def bad(name: str, want: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(f"{path}: malformed manifest: {name} must be {want}, "
                                          f"got {getattr(self, name)!r}"[:400])

        for name in ("step", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (
                    0 if name == "step" else 1):
                raise bad(name, "a non-negative integer" if name == "step" else "a positive integer")
        for name, kind, want in (("plan", dict, "an object"), ("model", str, "a string"),
                                 ("fingerprint", list, "a list"),
                                 ("loader_state", dict, "an object"), ("files", dict, "an object"),
                                 ("resharded_from", str, "a string")):
            if not isinstance(getattr(self, name), kind):
                raise bad(name, want)
        if not all(isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                   for row in self.fingerprint):
            raise bad("fingerprint", "a list of [name, shape, dtype]")
        for name, size in self.files.items():
            if (not plain_name(name) or isinstance(size, bool) or not isinstance(size, int)
                    or size < 0):
                raise bad("files", "an object of plain file names and sizes in bytes")


def list_files(ckpt: Path) -> dict[str, int]:
    """Name and size of every regular file of a checkpoint directory, manifest excluded."""
    return {p.name: p.stat().st_size for p in sorted(ckpt.iterdir())
            if p.is_file() and p.name != MANIFEST}


# -- finding and verifying -----------------------------------------------------------------


def committed(root: Path) -> list[tuple[int, Path]]:
    """The committed checkpoints under ``root``, oldest step first (symlinks are skipped:
    a checkpoint lives in its root)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``root/latest`` names, else the committed one with the highest step.

    ``latest`` must name a ``step_N`` directory of ``root`` itself: a pointer elsewhere
    (a path, ``..``, a symlink) is refused, so a planted pointer cannot make a run load
    a checkpoint from outside its root.
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_symlink():
        raise CheckpointCorruptError(
            f"{pointer} is a symbolic link; it must be a file naming a step_N directory of "
            f"{root} (delete it: the newest checkpoint is then found by its step)")
    if pointer.is_file():
        name = _read_pointer(pointer)
        target = root / name
        if not _STEP_DIR.match(name) or target.is_symlink():
            raise CheckpointCorruptError(
                f"{pointer} names {name!r}, which is not a step_N directory inside {root}; "
                "refusing to look outside the checkpoint root (delete the file: the newest "
                "checkpoint is then found by its step)")
        if (target / MANIFEST).is_file():
            return target
    found = committed(root)
    return found[-1][1] if found else None


def _read_pointer(pointer: Path) -> str:
    try:
        return pointer.read_bytes()[:256].decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointCorruptError(
            f"{pointer} is not UTF-8 text; it must name a step_N directory (delete it: the "
            "newest checkpoint is then found by its step)") from None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory given itself or a root holding checkpoints."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (path / DCP_METADATA).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"no checkpoint at {path}: neither a checkpoint directory ({MANIFEST}) nor a "
            f"root holding step_* checkpoints"
        )
    return found


def verify(path: str | os.PathLike) -> tuple[Path, Manifest, Any]:
    """Check a checkpoint's files without loading tensors; return (dir, manifest, DCP metadata).

    Catches a missing manifest or ``.metadata``, a missing or truncated shard file, and
    any DCP chunk that points past the end of its file. ``.metadata`` is read through
    ``runtime.dcp_safe`` (no code in it runs; UnsafeCheckpointError if it asks to). Local:
    no collective.
    """
    ckpt = resolve(path)
    manifest = Manifest.read(ckpt)
    for name, size in manifest.files.items():
        f = ckpt / name
        if not f.is_file():
            raise CheckpointCorruptError(f"{ckpt} is incomplete: file {name} is missing")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointCorruptError(
                f"{ckpt}: file {name} is truncated or damaged ({actual} bytes, {size} when saved)"
            )
    if not (ckpt / DCP_METADATA).is_file():
        raise CheckpointCorruptError(f"{ckpt} is incomplete: DCP metadata {DCP_METADATA} is missing")
    try:
        metadata = read_metadata(ckpt / DCP_METADATA)
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises anything
        raise CheckpointCorruptError(f"{ckpt}: DCP metadata {DCP_METADATA} is unreadable ({e})") from e
    for info in (metadata.storage_data or {}).values():
        f = ckpt / info.relative_path
        if not f.is_file():
            raise CheckpointCorruptError(f"{ckpt} is incomplete: shard file {info.relative_path} is missing")
        if info.offset + info.length > f.stat().st_size:
            raise CheckpointCorruptError(
                f"{ckpt}: shard file {info.relative_path} is truncated "
                f"({f.stat().st_size} bytes, data runs to {info.offset + info.length})"
            )
    return ckpt, manifest, metadata


def check_keys(metadata: Any, state: dict[str, Any], ckpt: Path) -> None:
    """Every tensor the caller will load exists in the checkpoint with its global shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    have = metadata.state_dict_metadata
    for key, value in _flatten(state):
        if key not in have:
            kind = "optimizer state" if key.startswith("optim.") else "entry"
            raise CheckpointMismatchError(
                f"{ckpt} has no {kind} {key!r} (was it saved with another optimizer?)"
            )
        meta = have[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata) or list(meta.size) != list(value.shape):
                got = list(meta.size) if isinstance(meta, TensorStorageMetadata) else "a non-tensor"
                raise CheckpointMismatchError(
                    f"{ckpt}: {key!r} is {got} in the checkpoint but {list(value.shape)} here"
                )


def _flatten(state: dict[str, Any], prefix: str = ""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# -- atomic commit -------------------------------------------------------------------------


def commit(tmp: Path, final: Path, manifest: Manifest, *, update_latest: bool = True) -> None:
    """Write the manifest into ``tmp`` and rename it to ``final`` (see the module docstring)."""
    manifest = Manifest(**{**manifest.__dict__, "files": list_files(tmp)})
    write_atomic(tmp / MANIFEST, manifest.to_json())
    fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving a step: move the old one aside, never delete first
        old = final.with_name(f"{OLD_PREFIX}{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if update_latest:
        write_atomic(final.parent / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep: int | None, current: Path) -> list[Path]:
    """After a commit: delete leftover temp dirs and all but the ``keep`` newest checkpoints.

    ``current`` (just committed, and what ``latest`` names) is always kept.
    """
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)
    if keep is None:
        return []
    others = [p for _, p in reversed(committed(root)) if p != current]
    doomed = others[max(keep - 1, 0):]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed

