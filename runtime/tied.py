"""Tied (shared) parameters: which planned modules share one, and the pipeline's gradient sum.

A parameter is tied when the model reaches it under more than one name
(``named_parameters(remove_duplicate=False)``), e.g. a language model's
``lm_head.weight = wte.weight``. Two consequences for the runtime:

- **One data-parallel unit.** FSDP2 lets a parameter belong to one ``fully_shard`` group
  only, so the planned modules sharing a parameter are sharded together,
  ``fully_shard([wte, lm_head])`` (``runtime.data_parallel``), and must therefore have one
  strategy; tensor parallelism would replace the parameter of one module and silently
  untie it, so tied modules take a data-parallel strategy (``check_ties``).
- **Pipelines (Megatron's embedding group).** When the modules sharing a parameter sit on
  different stages, each stage holds its own copy (equal at build). autograd gives each
  copy only its stage's part of the gradient; ``TiedGradSync`` sums the copies'
  gradients over the pipeline ranks holding them, per (dp, tp) coordinate, before the
  optimizer steps, so every copy takes the same update and they stay equal. The copies'
  layers must share one strategy, so that their gradient shards line up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from runtime.plan import LayerPlan, Plan, PlanError, stage_rank


@dataclass(frozen=True)
class Tie:
    """Planned modules that share parameters, and the shared parameters' names."""

    modules: tuple[str, ...]
    """Planned module FQNs ('' for the root: a user outside every planned module)."""
    params: tuple[str, ...]
    """Every name the shared parameters have in the model."""
    numels: tuple[int, ...] = ()
    """Elements of each shared parameter (each tensor once): what a pipeline stage holding
    a copy of them holds."""
    registered_at: tuple[str, ...] = ()
    """When the sharing is one module object registered at several paths
    (``ModuleList([b, c, b])``): those paths. The plan names such a module once, at its
    first path, so its other paths belong to no planned module."""

    def describe(self) -> str:
        if self.registered_at:
            places = " and ".join(map(repr, self.registered_at))
            return (f"one module is registered at {places}, and the plan names it once, as "
                    f"{self.registered_at[0]!r}, so its parameters "
                    f"({', '.join(map(repr, self.params))}) are also reached from outside it")
        names = ", ".join(repr(m) if m else "the root (no planned module)" for m in self.modules)
        return f"{names} share parameter {' = '.join(map(repr, self.params))}"


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Names of each parameter the model reaches under more than one name, in model order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(n) for n in names.values() if len(n) > 1]


def owner(name: str, modules: Iterable[str]) -> str:
    """The planned module holding the parameter or submodule ``name`` ('' for none)."""
    planned = set(modules)
    path = name.rpartition(".")[0]
    while path:
        if path in planned:
            return path
        path = path.rpartition(".")[0]
    return ""


def tie_groups(model: nn.Module, modules: Iterable[str]) -> list[Tie]:
    """The planned ``modules`` sharing parameters, merged transitively (a chain a–b, b–c is
    one group); ties inside one module are no concern of the plan and left out."""
    modules = list(modules)
    groups: list[tuple[set[str], list[str], list[int]]] = []
    for names in tied_parameters(model):
        users = {owner(n, modules) for n in names}
        if len(users) < 2:
            continue
        joined = [g for g in groups if g[0] & users]
        merged = (users.union(*(g[0] for g in joined)),
                  [n for g in joined for n in g[1]] + list(names),
                  [k for g in joined for k in g[2]] + [model.get_parameter(names[0]).numel()])
        groups = [g for g in groups if g not in joined] + [merged]
    order = {m: i for i, m in enumerate(["", *modules])}
    return [Tie(tuple(sorted(users, key=order.__getitem__)), tuple(params), tuple(numels),
                _registered_at(model, params))
            for users, params, numels in groups]


def _registered_at(model: nn.Module, params: Sequence[str]) -> tuple[str, ...]:
    """The paths of one module object that every name in ``params`` is reached through
    (the highest such module), or () when the names reach different modules."""
    paths = list(dict.fromkeys(name.rpartition(".")[0] for name in params))
    if len(paths) < 2 or len({id(model.get_submodule(p)) for p in paths}) > 1:
        return ()
    while all(paths) and len({id(model.get_submodule(p.rpartition(".")[0]))
                              for p in paths}) == 1:
        parents = list(dict.fromkeys(p.rpartition(".")[0] for p in paths))
        if len(parents) < 2:
            break
        paths = parents
    return tuple(paths)


def check_ties(model: nn.Module, layers: Sequence[LayerPlan]) -> list[Tie]:
    """Raise PlanError unless the modules sharing a parameter can be one FSDP2 unit: one
    strategy, one offload choice, no tensor parallelism; 'replicate' when the root (no
    planned module) uses the parameter too. Local: no collective."""
    by_name = {layer.module: layer for layer in layers}
    ties = tie_groups(model, by_name)
    for tie in ties:
        planned = [by_name[m] for m in tie.modules if m]
        if "" in tie.modules and any(la.strategy != "replicate" for la in planned):
            raise PlanError(
                f"{tie.describe()}: the root's parameters are replicated, so a module sharing "
                f"one with the root must be 'replicate' too (it joins the root's FSDP2 unit); "
                f"plan {[la.module for la in planned]} as 'replicate', or add every module "
                "using the parameter to the plan with one strategy")
        kinds = {(la.strategy, la.offload) for la in planned}
        if len(kinds) > 1:
            given = ", ".join(f"{la.module!r}: {la.strategy}{' offloaded' if la.offload else ''}"
                              for la in planned)
            raise PlanError(
                f"{tie.describe()}, so they are sharded as one FSDP2 unit and need one "
                f"strategy, but the plan gives {given}; give them the same strategy "
                "(and offload), e.g. all 'fsdp' or all 'replicate'")
        if planned[0].is_tp:
            raise PlanError(
                f"{tie.describe()}: tensor parallelism would split the parameter in one "
                f"module and untie it from the other; give them a data-parallel strategy "
                "(replicate, zero2, fsdp, ...)")
        if planned[0].spec.units == "modules":
            raise PlanError(
                f"{tie.describe()}, so they are one FSDP2 unit, which "
                f"{planned[0].strategy!r} would split into their modules; give them 'fsdp' "
                "(one unit) or another data-parallel strategy")
    return ties


def shared_across_stages(stages: Sequence[nn.Module]) -> list[tuple[tuple[int, str], ...]]:
    """Parameters held by more than one stage module, found by identity (stage modules cut
    from one model share its tensors until parallelized): per parameter, its
    (stage id, name in that stage) for every stage holding it."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters(remove_duplicate=False):
            places = holders.setdefault(id(p), [])
            if all(stage != s for stage, _ in places):
                places.append((s, name))
    return [tuple(places) for places in holders.values() if len(places) > 1]


class TiedGradSync:
    """Sum the gradients of a tied parameter's copies over the pipeline ranks holding them.

    Built on every rank with the same arguments (it makes process groups: collective).
    ``ties``: per shared parameter, (stage id, name in that stage's module) of each copy.
    """

    def __init__(self, ties: Sequence[Sequence[tuple[int, str]]], plan: Plan,
                 mesh: DeviceMesh) -> None:
        me = mesh.get_local_rank("pp")
        self._copies: list[tuple[int, str, dist.ProcessGroup]] = []
        self.counted_elsewhere: list[tuple[int, str]] = []
        """(stage, name) of this rank's copies that are not their tie's first: left out of
        a global gradient norm, which counts each tied parameter once."""
        for places in ties:
            _check_one_strategy(places, plan)
            first = min(s for s, _ in places)
            self.counted_elsewhere += [
                (s, n) for s, n in places
                if s != first and stage_rank(s, plan.mesh.pp, plan.pipeline) == me]
            ranks = sorted({stage_rank(s, plan.mesh.pp, plan.pipeline) for s, _ in places})
            if len(ranks) != len(places):
                raise PlanError(
                    f"tied parameter {places[0][1]!r}: stages {[s for s, _ in places]} put two "
                    "of its copies on one pipeline rank (a looped or V schedule); plan a "
                    "schedule that keeps each copy on its own rank, or keep the tied modules "
                    "on one stage")
            group = _pipeline_groups(mesh, ranks)
            if group is not None and me in ranks:
                (stage, name), = [(s, n) for s, n in places
                                  if stage_rank(s, plan.mesh.pp, plan.pipeline) == me]
                self._copies.append((stage, name, group))

    def sync(self, stages: Sequence[nn.Module], stage_ids: Sequence[int]) -> None:
        """After backward, before the optimizer: sum this rank's copies' gradients with the
        other stages' (their local shards, which line up under one strategy). Collective
        over each tie's pipeline group."""
        local = dict(zip(stage_ids, stages, strict=True))
        for stage, name, group in self._copies:
            grad = local[stage].get_parameter(name).grad
            if grad is None:  # a stage that did not use the copy this step contributes zero
                param = local[stage].get_parameter(name)
                grad = param.grad = torch.zeros_like(param)
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad,
                            op=dist.ReduceOp.SUM, group=group)


def _check_one_strategy(places: Sequence[tuple[int, str]], plan: Plan) -> None:
    """The copies' layers must shard the parameter alike for their shards to line up."""
    layers = [la for s, name in places for la in plan.layers
              if la.stage == s and (name.startswith(la.module + ".") or not la.module)]
    kinds = {(la.strategy, la.offload) for la in layers}
    if len(kinds) > 1 or any(la.is_tp for la in layers):
        given = ", ".join(f"{la.module!r} (stage {la.stage}): {la.strategy}" for la in layers)
        raise PlanError(
            f"tied parameter {places[0][1]!r} has copies on stages {[s for s, _ in places]} "
            f"whose layers are planned {given}; give them one data-parallel strategy so "
            "the copies' gradient shards line up")


def _pipeline_groups(mesh: DeviceMesh, pp_ranks: list[int]) -> dist.ProcessGroup | None:
    """One process group per (dp, tp) coordinate over the pipeline ranks ``pp_ranks``;
    every rank creates all of them (torch requires it) and keeps its own."""
    grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # (pp, dp × tp) of global ranks
    world = dist.group.WORLD
    key = (id(world), tuple(grid.flatten().tolist()), tuple(pp_ranks))
    cached = _PIPELINE_GROUPS.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    mine = None
    me = dist.get_rank()
    for column in range(grid.shape[1]):
        ranks = [int(grid[p, column]) for p in pp_ranks]
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    _PIPELINE_GROUPS[key] = (world, mine)
    return mine


_PIPELINE_GROUPS: dict[tuple, tuple[object, dist.ProcessGroup | None]] = {}
"""(world id, mesh ranks, pipeline ranks) -> (world, this rank's group): groups cost time
and sockets and live until the world is destroyed, so each is made once per world."""
