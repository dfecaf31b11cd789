"""Save and load a Trainer with torch.distributed.checkpoint (DCP); reshard offline.

    path = save(trainer, "ckpts", step=3, loader_state={"next_batch": 4}, keep=2)
    restored = load(trainer, "ckpts")           # newest; any plan, any world size
    restored.step, restored.loader_state

What a checkpoint holds and how it is committed atomically is in
``runtime.checkpoint_format``. Model and optimizer go through
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``, which
turn DDP, FSDP2 and DTensor (TP) parameters into keys by the user's fully-qualified names
with global shapes; DCP then writes each rank's shards and, on load, reads whatever
chunks overlap this rank's shards, so a checkpoint saved under one plan loads under any
other (load-time resharding).

Trainer contract (duck-typed): either ``.applied.model`` (the
user's module, parallelized in place) and ``.optimizer``, or ``.model_parts`` and
``.optimizers`` (one optimizer per part; a pipeline rank's stage modules, each keeping
the user's FQNs). ``runtime.pipeline.PipelineTrainer`` with one stage per rank fits the
first form through its ``.module``; a rank holding several stages under one optimizer is
seen through ``merged_view`` (``get_state_dict`` names an optimizer's parameters
through one module). Every rank of the default process group calls ``save`` and ``load``.

Collectives of this module run on a dedicated gloo group, so an asynchronous save can
exchange its plans in a background thread while training uses the default group (DCP
requires a CPU backend for ``async_save``; with NCCL the default group has none).

Loading never half-succeeds: the manifest, every file's size, the model fingerprint and
every key are checked on every rank first (the ranks agree on the verdict, so none waits
in a collective for a rank that gave up); tensors are then read into scratch copies, and
only when DCP has read everything are they copied into the model and optimizer.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from runtime.checkpoint_format import (
    TMP_PREFIX,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    Manifest,
    check_keys,
    commit,
    compare_fingerprints,
    fingerprint,
    latest,
    prune,
    step_dir_name,
    verify,
)
from runtime.dcp_safe import SafeFileSystemReader, SafeLoadPlanner
from runtime.plan import Plan
from runtime.stage_graphs import state_aliases, tensor_names

logger = logging.getLogger(__name__)

# Caught alongside Exception: DCP's CheckpointException (one rank's failure, raised on every
# rank) derives from BaseException.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_GROUPS: dict[int, tuple[Any, dist.ProcessGroup]] = {}
_PENDING: list[AsyncSave] = []

__all__ = [
    "AsyncSave", "CheckpointCorruptError", "CheckpointError", "CheckpointExistsError",
    "CheckpointMismatchError", "Restored", "latest", "load", "reshard", "save", "verify",
    "wait_pending",
]


@dataclass(frozen=True)
class Restored:
    """What ``load`` restored, besides the model and optimizer."""

    path: Path
    step: int
    loader_state: dict[str, Any]
    plan: Plan
    """The plan the checkpoint was saved under."""
    resharded: bool
    """The checkpoint was saved under another plan or world size."""
    rng_restored: bool
    """RNG states are restored only at the world size they were saved at."""


# -- parts, groups, fingerprints -----------------------------------------------------------


def _parts(trainer: Any) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
    stages = getattr(trainer, "stages", ())
    if (len(stages) > 1 or any(map(state_aliases, stages))) and \
            not hasattr(trainer, "model_parts"):
        # get_state_dict names an optimizer's parameters through one module: give it one
        # that holds every stage's parameters under their full names (and the names the
        # model has for them that no stage has a module for).
        return [(merged_view(stages), getattr(trainer, "optimizer", None))]
    if hasattr(trainer, "model_parts"):
        optimizers = list(getattr(trainer, "optimizers", []) or [None] * len(trainer.model_parts))
        return list(zip(trainer.model_parts, optimizers, strict=True))
    applied = getattr(trainer, "applied", None)
    model = applied.model if applied is not None else trainer.module
    return [(model, getattr(trainer, "optimizer", None))]


def merged_view(stages: list[nn.Module]) -> nn.Module:
    """One module whose state dict is that of ``stages`` together (the same objects, not
    copies), for the stages one rank holds: a tensor under each name a stage saves it by
    or records for it (``runtime.stage_graphs.state_aliases``), and no buffer a stage does
    not save."""
    root = nn.Module()
    for stage in stages:
        for name, value in _with_aliases(stage).items():
            *path, leaf = name.split(".")
            owner = root
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            if isinstance(value, nn.Parameter):
                owner.register_parameter(leaf, value)
            else:
                owner.register_buffer(leaf, value)
    return root


def _with_aliases(stage: nn.Module) -> dict[str, torch.Tensor]:
    """``stage``'s state dict, each of its aliases beside its source in the model's order."""
    aliases = state_aliases(stage)
    out: dict[str, torch.Tensor] = {}
    for name, value in stage.state_dict(keep_vars=True).items():
        ahead = [a for a, alias in aliases.items() if alias.source == name]
        out.update((a, value) for a in ahead if aliases[a].first)
        out[name] = value
        out.update((a, value) for a in ahead if not aliases[a].first)
    return out


def _group() -> dist.ProcessGroup:
    """A gloo group over the world for checkpoint collectives (one per world). Collective."""
    world = dist.group.WORLD
    cached = _GROUPS.get(id(world))
    if cached is None or cached[0] is not world:
        cached = (world, dist.new_group(backend="gloo"))
        _GROUPS[id(world)] = cached
    return cached[1]


def _model_fingerprint(parts, group) -> list[list]:
    """Union over ranks of every part's (fqn, global shape, dtype): pipeline ranks differ."""
    local = []
    for model, _ in parts:
        local += fingerprint(get_model_state_dict(model, options=_OPTIONS))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return sorted({tuple(map(str, r)): r for rows in gathered for r in rows}.values())


def _agree(error: BaseException | None, group) -> None:
    """Raise the first rank's error on every rank (so none waits in a later collective)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if error is None else (type(error), str(error)), group=group)
    for item in gathered:
        if item is not None:
            cls, message = item
            if error is not None:
                raise error
            raise cls(message)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state(parts) -> tuple[dict[str, Any], list[tuple[set, set]]]:
    """The DCP state dict of every part merged, and each part's (model, optim) key sets."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for model, optimizer in parts:
        if optimizer is None:
            msd, osd = get_model_state_dict(model, options=_OPTIONS), {}
        else:
            msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
        model_sd.update(msd)
        optim_sd.update(osd)
        keys.append((set(msd), set(osd)))
    state = {"model": model_sd, "optim": optim_sd,
             "rng": {f"rank{dist.get_rank()}": _rng_state()}}
    return state, keys


# -- save ----------------------------------------------------------------------------------


class AsyncSave:
    """A save in flight. ``wait()`` (every rank) returns the committed path or raises."""

    def __init__(self, future, commit_fn, group) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._path: Path | None = None
        self._group = group
        self._waited = False

        def finish(fut) -> None:
            try:
                fut.result()
                self._path = commit_fn()
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                self._error = e
            finally:
                self._done.set()

        future.add_done_callback(finish)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Path:
        self._done.wait()
        if not self._waited:
            self._waited = True
            if self in _PENDING:
                _PENDING.remove(self)
            _agree(self._error, self._group)
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path


def wait_pending() -> None:
    """Wait for (and commit) any asynchronous save still in flight. Every rank calls it."""
    while _PENDING:
        _PENDING[0].wait()


def save(
    trainer: Any,
    root: str | os.PathLike,
    *,
    step: int,
    loader_state: dict[str, Any] | None = None,
    model_name: str = "",
    keep: int | None = None,
    async_save: bool = False,
) -> Path | AsyncSave:
    """Save model, optimizer, step, RNG and ``loader_state`` to ``root/step_<step>``.

    Every rank calls it. ``loader_state`` must be JSON (rank 0's is kept). After the
    commit, all but the ``keep`` newest checkpoints are deleted. With ``async_save`` the
    state is copied to CPU memory now, written by a background thread, and committed by
    rank 0 when done: returns an AsyncSave; the next save or load waits for it first.
    """
    wait_pending()
    root = Path(root)
    group = _group()
    parts = _parts(trainer)
    manifest = Manifest(
        step=step, world_size=dist.get_world_size(), plan=trainer.plan.to_dict(),
        model=model_name or trainer.plan.model,
        fingerprint=_model_fingerprint(parts, group), loader_state=dict(loader_state or {}),
    )
    try:
        manifest.to_json()
    except TypeError as e:
        raise CheckpointError(f"loader_state must be JSON-serialisable: {e}") from None
    state, _ = _state(parts)
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    rank0 = dist.get_rank() == 0
    error = None
    if rank0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            tmp.mkdir(parents=True)
        except OSError as e:
            error = CheckpointError(f"cannot create {tmp}: {e.strerror}")
    _agree(error, group)

    def commit_fn() -> Path:
        if rank0:
            commit(tmp, final, manifest)
            prune(root, keep, final)
            logger.info("checkpoint step %d committed to %s", step, final)
        return final

    writer = dcp.FileSystemWriter(str(tmp))
    if async_save:
        future = dcp.async_save(state, storage_writer=writer, process_group=group)
        pending = AsyncSave(future, commit_fn, group)
        _PENDING.append(pending)
        return pending
    error = None
    try:
        dcp.save(state, storage_writer=writer, process_group=group)
        commit_fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - shared with every rank below
        error = CheckpointError(f"saving step {step} to {root} failed: {e}")
    _agree(error, group)
    return final


# -- load ----------------------------------------------------------------------------------


def _scratch(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _scratch(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    return state


def _check(path, parts, group):
    """verify + fingerprint on every rank; returns (dir, manifest, DCP metadata)."""
    found, error = None, None
    try:
        found = verify(path)
    except CheckpointError as e:
        error = e
    current = _model_fingerprint(parts, group)
    if error is None:
        try:
            compare_fingerprints(found[1].fingerprint, current, str(found[0]))
        except CheckpointError as e:
            error = e
    _agree(error, group)
    return found


def load(trainer: Any, path: str | os.PathLike) -> Restored:
    """Restore model, optimizer and RNG from a checkpoint (or the newest under a root).

    The checkpoint may come from any plan and world size; DCP reshards. Raises
    CheckpointError (on every rank) and leaves the trainer untouched when the checkpoint
    is missing, partial, damaged, or from another model.
    """
    wait_pending()
    group = _group()
    parts = _parts(trainer)
    ckpt, manifest, metadata = _check(path, parts, group)
    # get_state_dict initialises a fresh optimizer's state (a zero-lr step); undo that if
    # the load fails, so a failed load leaves a fresh optimizer fresh.
    fresh = [opt is not None and not opt.state for _, opt in parts]
    try:
        state, keys = _state(parts)
        rng_key = f"rank{dist.get_rank()}"
        rng_ok = manifest.world_size == dist.get_world_size() and any(
            k.startswith(f"rng.{rng_key}.") for k in metadata.state_dict_metadata)
        state["rng"] = {rng_key: state["rng"][rng_key]} if rng_ok else {}
        optim_keys = list(state["optim"])
        read_as = _optimizer_keys_by_first_name(state["optim"], metadata, _names(trainer))
        state["optim"] = {read_as.get(k, k): v for k, v in state["optim"].items()}
        error = None
        try:
            check_keys(metadata, state, ckpt)
        except CheckpointError as e:
            error = e
        _agree(error, group)
        scratch = _scratch(state)
        try:
            dcp.load(scratch, storage_reader=SafeFileSystemReader(str(ckpt)),
                     planner=SafeLoadPlanner(), process_group=group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises CheckpointException on every rank
            raise CheckpointCorruptError(f"{ckpt}: reading the data failed: {e}") from e
        scratch["optim"] = {k: scratch["optim"][read_as.get(k, k)] for k in optim_keys}
    except BaseException:
        for (_, opt), was_fresh in zip(parts, fresh, strict=True):
            if was_fresh:
                opt.state.clear()
        raise
    for (model, optimizer), (mkeys, okeys) in zip(parts, keys, strict=True):
        msd = {k: scratch["model"][k] for k in mkeys}
        if optimizer is None:
            set_model_state_dict(model, msd, options=_OPTIONS)
            continue
        osd = {k: scratch["optim"][k] for k in okeys}
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=_OPTIONS)
    if rng_ok:
        _set_rng(scratch["rng"][rng_key])
    plan = manifest.get_plan()
    resharded = plan.to_dict() != trainer.plan.to_dict()
    logger.info("restored step %d from %s%s", manifest.step, ckpt, " (resharded)" if resharded else "")
    return Restored(ckpt, manifest.step, manifest.loader_state, plan, resharded, rng_ok)


def _names(trainer: Any) -> dict[str, tuple[str, ...]]:
    """Every name the model has for each tied weight a pipeline rank's stages hold
    (``runtime.stage_graphs.tensor_names``)."""
    out: dict[str, tuple[str, ...]] = {}
    for stage in getattr(trainer, "stages", ()):
        out.update(tensor_names(stage))
    return out


def _optimizer_keys_by_first_name(optim: dict[str, Any], metadata: Any,
                                  names: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Flat optimizer keys (``state.<fqn>.<field>``) to read under another of the
    parameter's names: DCP keys a parameter's optimizer state by its first name, so a
    checkpoint saved where one parameter held a tied weight (one process, FSDP) has none
    for the copy a pipeline's later stage holds under another name. The copies take the
    same updates, so their states are equal."""
    have = metadata.state_dict_metadata
    out = {}
    for key in optim:
        section, _, rest = key.partition(".")
        fqn, _, fld = rest.rpartition(".")
        if f"optim.{key}" in have or fqn not in names:
            continue
        for other in names[fqn]:
            alt = f"{section}.{other}.{fld}"
            if f"optim.{alt}" in have and alt not in optim:
                out[key] = alt
                break
    return out


def _set_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- offline resharding --------------------------------------------------------------------


def check_reshard_out(out: str | os.PathLike) -> Path:
    """``out`` can become a new checkpoint root: it does not exist, its parent does and is
    writable. Checked before anything is read."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise CheckpointExistsError(f"{out} exists; choose a new --out directory (nothing was written)")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {out}: directory {out.parent} does not exist or is "
                              "not writable (nothing was read)")
    return out


def reshard(src: str | os.PathLike, out: str | os.PathLike, plan: Plan, model: nn.Module) -> Path:
    """Rewrite checkpoint ``src`` as a checkpoint root ``out`` labelled with ``plan``.

    Offline: no process group (DCP's ``no_dist`` path, one process), so it runs anywhere
    the files are, without ports or a launcher. ``model`` (real or on the meta device) is
    what the checkpoint must fit: its fingerprint is compared with the checkpoint's and
    ``plan`` is validated against it. The state is read whole into this process's memory
    and written as one shard file; ``out`` must not exist. Returns the new checkpoint.

    Any autopar checkpoint already loads under any plan (DCP reshards at load time);
    this makes the plan switch explicit and checked before any cluster is allocated,
    records ``plan`` so a resumed run uses it, and consolidates the shard files.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from runtime.validate import check_plan

    out = check_reshard_out(out)
    ckpt, manifest, metadata = verify(src)
    compare_fingerprints(manifest.fingerprint, fingerprint(model.state_dict()), str(ckpt))
    check_plan(model, plan)
    state: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        is_tensor = isinstance(meta, TensorStorageMetadata)
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if is_tensor else None
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)),
                     planner=SafeLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise CheckpointCorruptError(f"{ckpt}: reading the data failed: {e}") from e
    # A fresh directory of an unpredictable name (mkdtemp fails rather than follow a
    # planted symlink), beside ``out`` so the final rename stays on one file system.
    tmp_root = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{TMP_PREFIX}{out.name}."))
    final = tmp_root / step_dir_name(manifest.step)
    tmp = tmp_root / f"{TMP_PREFIX}{final.name}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
        new = Manifest(**{**manifest.__dict__, "plan": plan.to_dict(), "resharded_from": str(ckpt)})
        commit(tmp, final, new)
        os.chmod(tmp_root, 0o755)  # mkdtemp's 0o700 is for while it is being written
        os.rename(tmp_root, out)  # fails if out appeared meanwhile: still nothing overwritten
    except BaseException:
        shutil.rmtree(tmp_root, ignore_errors=True)
        raise
    return out / final.name
