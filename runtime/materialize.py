"""Give a model built on the meta device its weights, each rank only its own shards.

A model too large for one device is built with ``with torch.device("meta"): model = …``;
``runtime.apply`` parallelizes it on meta (TP, recompute, FSDP2 all accept meta
parameters) and then calls ``materialize``: ``to_empty`` allocates each rank's local
shards on its device, and the model's own initialisation fills them —

    1. ``model.init_weights()`` when the model has one (torchtitan's convention; a Hugging
       Face ``PreTrainedModel`` has it too and re-runs its ``_init_weights`` per module),
    2. else every module's ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``,
       norms, ``BatchNorm``'s running statistics …).

A module that owns meta parameters or buffers and has neither is refused before anything
is allocated (``check_initializable``), naming the module.

**The same weights on every rank, whatever its seed, equal to one process's.** Each
random fill of a parameter or buffer (``normal_``, ``uniform_`` … as ``nn.init`` calls
them) is intercepted (``SeededInit``, a ``TorchFunctionMode``) and drawn on the CPU from a
generator seeded by ``(seed, the tensor's fully-qualified name, how many fills it had)``;
each rank keeps the slice its shard covers (``distribute_tensor`` with no source rank:
every rank holds the same full tensor, so it only slices). So a parameter's values depend
on the seed and its name only: not on the rank, the plan, the device, or the order the
ranks initialise in, and a pipeline rank initialises only its own stages. One process
calling ``materialize(model, "cpu", seed)`` gets exactly the weights the ranks hold
together. The cost is one full parameter at a time in host memory: the stated overhead
of ``bench/materialize.py``. DTensor's own random-number tracker would avoid it but runs
on CUDA only and gives values that depend on the sharding.

**Writes into part of a sharded parameter** (``nn.Embedding`` zeroing
``weight[padding_idx]``, Hugging Face's ``init.zeros_(weight[padding_idx])``,
``weight[a:b] = …``) land as in one process too. DTensor makes a view that cuts across
shards by gathering that part into a new tensor, so a write through it would be lost;
such a view (``PARTIAL``) is taken instead of the parameter's full value, gathered on its
device (a collective over its mesh, whose ranks all run the same init). While a view of
it lives, every op on the parameter acts on that full value, and each write into it is
copied into this rank's shard.

A model built with real weights is broadcast from rank 0 instead (``broadcast_weights``),
so ranks seeded differently still train one model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode

from runtime.plan import PlanError

logger = logging.getLogger(__name__)

RANDOM_FILLS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_, torch.Tensor.random_,
})
"""In-place random fills: every ``nn.init`` initialiser ends in one of these."""


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


def _initializer(model: nn.Module) -> str:
    """How ``model`` initialises itself: 'init_weights' or 'reset_parameters'."""
    return "init_weights" if callable(getattr(model, "init_weights", None)) else "reset_parameters"


def check_initializable(model: nn.Module) -> None:
    """Raise PlanError, before anything is allocated, when a meta parameter or buffer has
    no initialisation: the model has no ``init_weights()`` and the module owning it no
    ``reset_parameters()``."""
    if _initializer(model) == "init_weights":
        return
    for path, module in model.named_modules():
        if callable(getattr(module, "reset_parameters", None)):
            continue
        owned = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        meta = [name for name, t in owned if t is not None and t.is_meta]
        if meta:
            raise PlanError(
                f"module {path or '(root)'!r} ({type(module).__name__}) holds {meta[0]!r} on "
                "the meta device and has no reset_parameters(), and the model has no "
                "init_weights(); give the model an init_weights() that initialises every "
                "parameter and buffer (as torchtitan's models do), or build it with real "
                "weights"
            )


def _address(t: torch.Tensor) -> int:
    """Where a tensor's values live: the same for a parameter, its ``.data`` and its
    DTensor's local shard, so a fill through any of them is recognised."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.data_ptr()


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


PARTIAL = frozenset({
    "__getitem__", "__setitem__", "select", "narrow", "split", "split_with_sizes",
    "tensor_split", "chunk", "unbind", "diagonal", "as_strided", "fill_diagonal_",
    "index_fill_", "index_copy_", "index_put_", "masked_fill_",
})
"""Ops that reach part of a tensor. On a sharded DTensor, one that cuts across the shards
makes a new tensor (a write through it is lost) or is refused."""


class _Full(NamedTuple):
    """A sharded parameter's full value, gathered for a view of part of it."""

    ref: weakref.ref  # alive while a view of it is
    param: DTensor
    name: str


def _sharded(t: object) -> bool:
    return isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements)


class SeededInit(TorchFunctionMode):
    """Random fills of the named tensors drawn from per-name generators, and writes into
    part of a sharded one made on its full value (module docstring).

    ``names`` maps ``_address(tensor)`` to the tensor's fully-qualified name. A fill of
    anything else (a temporary an initialiser makes) uses the global generator, which
    ``materialize`` seeds alike on every rank.
    """

    def __init__(self, names: Mapping[int, str], seed: int) -> None:
        super().__init__()
        self.names = dict(names)
        self.seed = seed
        self.fulls: dict[int, _Full] = {}  # by the parameter's address

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        args, kwargs = self._redirect(func, args, kwargs)
        target = _target(args, kwargs)
        owner = self._owner(target)
        full = owner.ref() if owner else None  # held: ``target`` may not keep it alive
        version = target._version if owner else None
        result = self._fill(func, target, args, kwargs)
        if owner and target._version != version:  # written: into this rank's shard
            _copy_local_shard(owner.param, full)
        return result

    def _fill(self, func, target, args, kwargs):
        name = None
        if _is_fill(func) and isinstance(target, torch.Tensor) and target.numel():
            name = self._name(target)
        if name is None:
            return func(*args, **kwargs)
        full = torch.empty(target.shape, dtype=target.dtype)
        args, kwargs = _retarget(args, kwargs, full)
        if _takes_generator(func):
            kwargs["generator"] = torch.Generator().manual_seed(_seed_for(self.seed, name))
        func(*args, **kwargs)
        with torch.no_grad():
            if isinstance(target, DTensor):
                _copy_local_shard(target, full)
            else:
                target.copy_(full)
        return target

    def _name(self, t: torch.Tensor) -> str | None:
        """The name a fill of ``t`` draws under: a parameter's, or a full value's (one
        process names a view that starts where the parameter starts)."""
        owner = self._owner(t)
        if owner is None:
            return self.names.get(_address(t))
        return owner.name if t.data_ptr() == owner.ref().data_ptr() else None

    def _redirect(self, func, args, kwargs):
        """Point an op on a sharded named parameter at its full value: a ``PARTIAL`` op
        (gathering the full value), or any op while a view of the full value lives, so
        that the full value stays the parameter's."""
        t = _target(args, kwargs)
        if not _sharded(t) or (name := self.names.get(_address(t))) is None:
            return args, kwargs
        full = self._live(_address(t))
        if full is None:
            if getattr(func, "__name__", None) not in PARTIAL:
                return args, kwargs
            # Collective over the parameter's mesh: every rank of it runs this init.
            full = t.full_tensor()
            if full._base is not None:  # a view's views keep only its base alive
                full = full.clone()
            self.fulls[_address(t)] = _Full(weakref.ref(full), t, name)
        return _retarget(args, kwargs, full)

    def _live(self, address: int) -> torch.Tensor | None:
        entry = self.fulls.get(address)
        return None if entry is None else entry.ref()

    def _owner(self, t: object) -> _Full | None:
        """The full value ``t`` is (a view of), while it lives."""
        if (not self.fulls or type(t) is not torch.Tensor or t.is_meta
                or t.layout != torch.strided):
            return None
        storage = t.untyped_storage().data_ptr()
        for address, entry in list(self.fulls.items()):
            full = entry.ref()
            if full is None:
                del self.fulls[address]
            elif full.untyped_storage().data_ptr() == storage:
                return entry
        return None


def _target(args: tuple, kwargs: dict) -> object:
    """The tensor an op acts on. ``nn.init`` functions reach a mode as themselves (they
    check for overrides first) with ``tensor``, a direct ``p.data.normal_()`` as the tensor
    method with the tensor first."""
    return kwargs.get("tensor", args[0] if args else None)


def _retarget(args: tuple, kwargs: dict, t: torch.Tensor) -> tuple[tuple, dict]:
    """``args``, ``kwargs`` with ``t`` in place of the op's target."""
    if "tensor" in kwargs:
        return args, {**kwargs, "tensor": t}
    return (t, *args[1:]), kwargs


def _copy_local_shard(target: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of ``full`` into ``target``'s local tensor, slicing ``full``
    in place as ``torch.chunk`` does: no copy of the shard (``bench/materialize.py``
    measures what compile holds). FSDP2's strided shard over a TP shard (2-D) splits the
    TP shard, so plain shards are cut first; anything else goes through
    ``distribute_tensor``."""
    local = target._local_tensor
    mesh, coordinate = target.device_mesh, target.device_mesh.get_coordinate()
    order = sorted(range(len(target.placements)),
                   key=lambda d: type(target.placements[d]) is _StridedShard)
    view = full
    for mesh_dim in order:
        placement = target.placements[mesh_dim]
        if type(placement) in (Shard, _StridedShard):
            chunks = torch.chunk(view, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            view = chunks[index] if index < len(chunks) else view.narrow(placement.dim, 0, 0)
        elif not placement.is_replicate():
            view = None
            break
    if view is None or view.shape != local.shape:
        view = distribute_tensor(full.to(target.device), mesh, target.placements,
                                 src_data_rank=None).to_local()
    local.copy_(view)


INITIALISERS = frozenset(name for name in dir(nn.init)
                         if name.endswith("_") and not name.startswith("_"))
"""``nn.init``'s initialisers by name: a library may patch them (Hugging Face's
``guard_torch_init_functions`` puts its own ``normal_`` in ``torch.nn.init`` while it
initialises), and the patched function is what reaches the mode."""


def _is_fill(func) -> bool:
    """A random fill, or any ``nn.init`` initialiser (deterministic ones are harmless to
    run on the full tensor: they only write)."""
    return func in RANDOM_FILLS or getattr(func, "__name__", None) in INITIALISERS


@functools.cache
def _takes_generator(func) -> bool:
    if func in RANDOM_FILLS:
        return True
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def materialize(model: nn.Module, device: torch.device | str, seed: int,
                stages: Sequence[nn.Module] | None = None) -> None:
    """Allocate ``model``'s meta tensors on ``device`` (each rank its own shards) and
    initialise them with the model's own initialisation, drawn as the module docstring
    says. Raises PlanError naming a module that has no initialisation, before allocating.

    ``stages``: a pipeline rank's own stage modules, split from ``model`` and keeping its
    fully-qualified names (``passes.split_stages``); only they are allocated. Their
    tensors are put in ``model`` under those names, so the model's own ``init_weights()``
    reaches them, while the other stages' tensors stay on meta, where every fill is free.
    """
    check_initializable(model)
    first = first_names(model)
    if stages is None:
        model.to_empty(device=device)
        _retie(model, first)
        copies = []
    else:
        constants = [name for stage in stages for name in _allocate(stage, device)]
        copies = _graft(model, stages, first, constants)
    addresses = {
        _address(t): first.get(name, name)
        for name, t in _named_tensors(model) if not t.is_meta and t.numel()
    }
    how = _initializer(model)
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        with SeededInit(addresses, seed):
            if how == "init_weights":
                _forget_hf_initialized(model)
                with _own_class(model):
                    model.init_weights()
            else:
                for module in model.modules():
                    if callable(getattr(module, "reset_parameters", None)):
                        module.reset_parameters()
        for copy, source in copies:
            _local(copy).copy_(_local(source))
    logger.info("materialized %s on %s (%s, seed %d)",
                "the model" if stages is None else f"{len(stages)} stage(s)", device, how, seed)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every name of every parameter and buffer (a tied tensor under each of its names)."""
    return [(n, t) for n, t in [*model.named_parameters(remove_duplicate=False),
                                *model.named_buffers(remove_duplicate=False)] if t is not None]


def first_names(model: nn.Module) -> dict[str, str]:
    """Each name of a tensor to the tensor's first name: the copies a pipeline makes of a
    tied weight (``lm_head.weight`` on the last stage of ``wte.weight``) are filled under
    one name, so they start equal, and equal to the one tensor of one process."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(t), name) for name, t in _named_tensors(model)}


def _retie(model: nn.Module, first: Mapping[str, str]) -> None:
    """``to_empty`` gives each name of a tied parameter its own tensor; share them again."""
    for name, first_name in first.items():
        if name != first_name:
            source = _slots(model, first_name, first_name)[first_name.rpartition(".")[2]]
            _slots(model, name, name)[name.rpartition(".")[2]] = source


def _allocate(stage: nn.Module, device: torch.device | str) -> list[str]:
    """Allocate ``stage``'s meta tensors on ``device``, and move its others there with their
    values: the constants an export lifted from ``forward`` (Falcon's ``torch.tensor([-2])``),
    which the model does not hold. A tensor several module objects hold stays one tensor
    (``to_empty`` gives each holder its own): an export unflattens a module run at several
    depths into one module per call (ALBERT's one layer, as ``attention`` and
    ``attention@1``), all holding its tensors. Returns the names of the moved tensors."""
    holders: dict[int, list[tuple[dict, str]]] = {}
    kept: dict[int, torch.Tensor] = {}
    for module in stage.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is not None:
                    holders.setdefault(id(t), []).append((slots, name))
                    if not t.is_meta:
                        kept[id(t)] = t
    moved = [name for name, t in _named_tensors(stage) if id(t) in kept]
    stage.to_empty(device=device)
    with torch.no_grad():
        for key, ((slots, name), *others) in holders.items():
            if key in kept:
                slots[name].copy_(kept[key])
            for other_slots, other_name in others:
                other_slots[other_name] = slots[name]
    return moved


def _graft(model: nn.Module, stages: Sequence[nn.Module], first: Mapping[str, str],
           constants: Sequence[str] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Put the stages' tensors into ``model`` under their names. A tied weight goes in
    under every name it has, so that whichever of its modules fills it last (a tied head's
    ``reset_parameters`` after the embedding's) fills this rank's copy, as in one process.
    A stage's constant (``_allocate``) the model has no slot for stays the stage's only.
    Returns (copy, source) for a second copy of one weight on this rank, to be copied from
    the grafted one once it is filled."""
    aliases: dict[str, list[str]] = {}
    for name, first_name in first.items():
        aliases.setdefault(first_name, []).append(name)
    grafted: dict[str, torch.Tensor] = {}
    copies = []
    for stage in stages:
        for name, t in _stage_tensors(stage, first):
            key = first.get(name, name)
            if key in grafted:
                if grafted[key] is not t:
                    copies.append((t, grafted[key]))
                continue
            grafted[key] = t
            if name in constants and _find_slots(model, name) is None:
                continue
            for alias in aliases.get(key, [name]):
                _slots(model, alias, name)[alias.rpartition(".")[2]] = t
    return copies


def _stage_tensors(stage: nn.Module, first: Mapping[str, str]
                   ) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``stage`` once, under a name the model has where one does: an export
    names a module run at several depths once per call (ALBERT's one layer, as
    ``attention`` and ``attention@1``), all holding the same tensors."""
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in _named_tensors(stage):
        if id(t) not in named or (name in first and named[id(t)][0] not in first):
            named[id(t)] = (name, t)
    return list(named.values())


def _find_slots(model: nn.Module, name: str) -> dict | None:
    prefix, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(prefix)
    except AttributeError:
        return None
    return next((slots for slots in (owner._parameters, owner._buffers) if leaf in slots),
                None)


def _slots(model: nn.Module, name: str, stage_name: str) -> dict:
    """The parameter or buffer dict of ``model`` that holds ``name``."""
    slots = _find_slots(model, name)
    if slots is not None:
        return slots
    raise PlanError(
        f"pipeline stage tensor {stage_name!r} has no counterpart in the model, so the "
        "model's initialisation cannot reach it; build the model with real weights for "
        "this plan, or plan it without a pipeline"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@contextlib.contextmanager
def _own_class(model: nn.Module) -> Iterator[None]:
    """The model seen as its own class while it initialises. FSDP2 gives a sharded module a
    class of its own (``FSDPGPT2LMHeadModel``) defined outside the model's library; a
    Hugging Face model of such a class counts as remote code, and its ``init_weights()``
    then skips every module that holds no parameter itself (GPT-2's attention, whose
    scaled init of ``c_proj`` would not run)."""
    wrapped = type(model)
    if isinstance(model, FSDPModule):
        model.__class__ = next(c for c in wrapped.__mro__ if not issubclass(c, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = wrapped


def _forget_hf_initialized(model: nn.Module) -> None:
    """Hugging Face models skip modules and tensors flagged as initialised; after
    ``to_empty`` nothing is, whatever the flags say."""
    for module in model.modules():
        if "_is_hf_initialized" in module.__dict__:
            del module._is_hf_initialized
    for t in _tensors(model):
        if "_is_hf_initialized" in t.__dict__:
            del t._is_hf_initialized


def common_seed(seed: int | None) -> int:
    """``seed``, or rank 0's ``torch.initial_seed()`` shared with every rank. Collective
    when ``seed`` is None."""
    if seed is not None:
        return seed
    shared = [torch.initial_seed() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return int(shared[0])


def broadcast_weights(model: nn.Module) -> None:
    """Every rank gets rank 0's parameters and buffers (a model built with real weights
    on ranks seeded differently). Collective over the default group."""
    with torch.no_grad():
        for t in _tensors(model):
            dist.broadcast(t.data, src=0)
