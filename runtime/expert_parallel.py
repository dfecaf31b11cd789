"""Expert parallelism (EP): a layer's experts split over ``expert_parallel`` dp ranks.

A layer with ``LayerPlan.expert_parallel = ep > 1`` has its MoE blocks' experts
(``runtime.moe_blocks``) split over ep consecutive data-parallel ranks: the rank at
position j of its ep group keeps experts ``[j·E/ep, (j+1)·E/ep)`` and drops the rest.
The dense parts of the layer (attention, norms, router, shared experts) follow the
layer's strategy as before. The design follows torchtitan's ``ExpertParallel``: experts
are sharded on dim 0 over an ep mesh, tokens reach them by all-to-all, and the experts
are then data-parallel (FSDP2) only over the dp ranks that hold the same experts.

The experts module's forward becomes, on each rank of an ep group (dropless):

    1. sort the (token, choice) pairs by expert; count the rows for each expert
    2. exchange counts (all-to-all of E/ep numbers per peer), then send each row to the
       rank that holds its expert (differentiable all-to-all of variable splits)
    3. regroup the received rows by local expert and run the module's own forward on
       them, as a module of E/ep experts (each row one choice, weight 1)
    4. send the results back (all-to-all) and combine: weight by the router's
       probabilities, sum the k choices of each token

Gradients: the backward of step 4's and step 2's all-to-alls carries every peer's
gradient to the expert's rank, so an expert's local gradient sums the ep group's tokens
(each against its own rank's mean loss). The ``dp / ep`` ranks that hold the same experts
(at the same position of their ep groups, the ``ep<n>_replicate`` axis) then sum theirs
and divide by dp, not by dp / ep: the mean over dp ranks of their losses, as one process
computes it. FSDP2 does this reduction (``set_gradient_divide_factor(dp)`` with sums on
the wire, since gloo has no pre-multiplied sum); 'replicate' layers use an HSDP mesh
``(dp/ep, 1)`` whose shard axis of one rank shards nothing (as ``runtime.data_parallel``),
and the sharded strategies shard the experts over the ``dp / ep`` replicas.

On a (dp, tp) mesh the experts are replicated over tp: whatever the layer's strategy,
the tokens entering a MoE block are the same on every tp rank of a dp index (attention's
row-parallel output is all-reduced), so each tp rank routes and computes the same rows
with its own copy of its experts, and their gradients need no reduction over tp. ep groups
and replicas are sub-axes of dp within one tp index.

Experts are DTensors ``Shard(0)`` on the ep mesh (FSDP2 adds its own sharding over the
replicas), so state dicts, gradient norms and checkpoints see global [E, ...] tensors.
A model built with real weights: every rank starts from rank 0's (broadcast before this
step) and keeps its slice. Refused by ``runtime.validate`` (``check_expert_parallel``):
cp or pp axes, hsdp, sequence parallelism, offload, mixed precision; and in
``runtime.apply``, a model on meta. Under gradient accumulation the experts' FSDP2 units
reduce every micro-batch (their own default), which sums right; under recompute the
recomputed forward repeats the all-to-alls, in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from runtime.moe_blocks import MoEBlock, find_moe_blocks
from runtime.plan import LayerPlan, Plan, PlanError
from runtime.precision import is_mixed
from runtime.strategies import STRATEGIES, spec

logger = logging.getLogger(__name__)

_EP_MESHES: dict[tuple, tuple[DeviceMesh, DeviceMesh, DeviceMesh, DeviceMesh]] = {}
"""(root mesh id, dp ranks, ep) -> (root, ep, replicas, hsdp); the root is kept so its id
is not reused while the entry lives."""


def ep_layers(layers: list[LayerPlan]) -> list[LayerPlan]:
    """The layers whose experts the plan splits."""
    return [layer for layer in layers if layer.expert_parallel > 1]


def expert_meshes(dp_mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(ep, replicas, replicas as HSDP (n, 1)) sub-meshes of the 1-D ``dp_mesh``: ep groups
    are runs of ``ep`` consecutive dp ranks; replicas the ``dp / ep`` ranks at one position
    of every group. Collective (``DeviceMesh._unflatten``, private in torch 2.13, as in
    ``runtime.mesh``); cached per root mesh and dp ranks, since slicing the root makes a new
    dp mesh object each time."""
    root = dp_mesh._get_root_mesh()
    key = (id(root), tuple(dp_mesh.mesh.flatten().tolist()), ep)
    if key not in _EP_MESHES:
        n = dp_mesh.size() // ep
        names = (f"ep{ep}_replicate", f"ep{ep}")
        grid = dp_mesh._unflatten(0, (n, ep), names)
        replicas = grid[names[0]]
        hsdp = replicas._unflatten(0, (n, 1), (f"ep{ep}_replicas", f"ep{ep}_one"))
        _EP_MESHES[key] = (root, grid[names[1]], replicas, hsdp)
    return _EP_MESHES[key][1:]


def apply_expert_parallel(model: nn.Module, layers: list[LayerPlan], dp_mesh: DeviceMesh,
                          *, reshard: Callable[[LayerPlan], bool]) -> list[MoEBlock]:
    """Split the experts of every layer with ``expert_parallel > 1`` (in place); returns
    the blocks split. ``reshard(layer)``: whether the layer's strategy frees gathered
    parameters after forward (FSDP's ZeRO-3), which the experts then do too."""
    done = []
    for layer in ep_layers(layers):
        ep_mesh, replicas, hsdp = expert_meshes(dp_mesh, layer.expert_parallel)
        for block in find_moe_blocks(model.get_submodule(layer.module), prefix=layer.module):
            experts = model.get_submodule(block.experts)
            _keep_local_experts(experts, block, ep_mesh)
            experts.forward = types.MethodType(_ExpertParallelForward(
                experts.forward, block, ep_mesh.get_group()), experts)
            mesh = hsdp if layer.strategy == "replicate" else replicas
            fully_shard(experts, mesh=mesh, reshard_after_forward=reshard(layer))
            _divide_gradients(experts, dp_mesh.size(), shard_ranks=mesh.size(-1))
            done.append(block)
        logger.info("expert parallel %s: experts over %d rank(s), replicated over %d",
                    layer.module, layer.expert_parallel, replicas.size())
    return done


def check_expert_parallel(model: nn.Module, plan: Plan) -> None:
    """Raise PlanError, naming the layer, if a layer's ``expert_parallel`` cannot run:
    no MoE block in it, experts not divisible by ep, or a combination not supported
    (module docstring). No collective."""
    for layer in ep_layers(list(plan.layers)):
        where = f"layer {layer.module!r} (expert_parallel={layer.expert_parallel})"
        problem = _unsupported(layer, plan)
        if problem:
            raise PlanError(f"{where}: {problem}; plan this layer with expert_parallel=1")
        blocks = find_moe_blocks(model.get_submodule(layer.module), prefix=layer.module)
        if not blocks:
            raise PlanError(
                f"{where}: no mixture-of-experts block in it (runtime.moe_blocks recognises "
                "experts as 3-D gate_up_proj/up_proj and down_proj parameters next to a "
                "router); set expert_parallel=1 or plan the layer that holds the experts")
        for block in blocks:
            if block.num_experts % layer.expert_parallel:
                raise PlanError(
                    f"{where}: {block.experts} has {block.num_experts} experts, not "
                    f"divisible by {layer.expert_parallel}; choose an expert_parallel "
                    f"that divides {block.num_experts}")


SUPPORTED_STRATEGIES = tuple(s for s in STRATEGIES if spec(s).expert_parallel)
"""Dense strategies an EP layer combines with (runtime.strategies)."""


def _unsupported(layer: LayerPlan, plan: Plan) -> str | None:
    mesh = plan.mesh
    if (mesh.cp, mesh.pp) != (1, 1):
        return (f"expert parallelism runs on a (dp, tp) mesh only (this plan's mesh is "
                f"{mesh.describe()}); use cp = pp = 1")
    if layer.strategy not in SUPPORTED_STRATEGIES:
        return (f"strategy {layer.strategy!r} does not combine with expert parallelism; "
                f"valid: {', '.join(SUPPORTED_STRATEGIES)}")
    if layer.sequence_parallel:
        return ("sequence parallelism gives each tp rank other tokens, and experts are "
                "replicated over tp; plan the layer without sequence_parallel")
    if layer.offload:
        return "offload does not combine with expert parallelism yet"
    if is_mixed(plan):
        return "mixed precision does not combine with expert parallelism yet (use float32)"
    return None


def _divide_gradients(experts: nn.Module, dp: int, *, shard_ranks: int) -> None:
    """Experts' gradients summed over their replicas and divided by dp (module docstring).

    FSDP2 (torch 2.13) with a divide factor: over a shard group of one rank it divides
    before the copy that stands in for the reduce-scatter, then all-reduces (HSDP) with
    SUM, which is right; over a larger group it asks for a pre-multiplied reduce-scatter
    that gloo lacks, unless sums are forced, which then divide after. Forcing sums over
    one rank would divide twice, so sums are forced only where a group has several."""
    experts.set_gradient_divide_factor(float(dp))
    if shard_ranks > 1:
        experts.set_force_sum_reduction_for_comms(True)


def _keep_local_experts(experts: nn.Module, block: MoEBlock, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's E/ep experts as DTensors ``Shard(0)`` on the ep mesh (so state
    dicts, norms and checkpoints see the global [E, ...] tensors), and set
    ``num_experts`` so the module's own forward runs them as a module of E/ep experts."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    local = block.num_experts // ep
    for name in block.expert_param_names:
        full = getattr(experts, name)
        part = full.detach()[rank * local:(rank + 1) * local].clone()
        shard = DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    if hasattr(experts, "num_experts"):
        experts.num_experts = local


@contextlib.contextmanager
def _local_parameters(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """The module's own forward sees its experts' local tensors (``to_local`` keeps the
    gradient path to the DTensor parameter that FSDP2 gathered for this forward)."""
    saved = {name: module._parameters[name] for name in names}
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                module._parameters[name] = param.to_local()
        yield
    finally:
        module._parameters.update(saved)


@dataclass(frozen=True)
class _Routing:
    """Where this rank's (token, choice) rows go and where the received rows come from."""

    order: torch.Tensor
    """Rows (token * k + choice) sorted by expert."""
    send: list[int]
    """Rows sent to each peer of the ep group."""
    recv: list[int]
    """Rows received from each peer."""
    recv_counts: torch.Tensor
    """[ep, E/ep]: rows from each peer for each local expert."""


class _ExpertParallelForward:
    """The experts module's forward under EP (steps in the module docstring)."""

    def __init__(self, local_forward: Callable[..., torch.Tensor], block: MoEBlock,
                 group: dist.ProcessGroup) -> None:
        self.local_forward = local_forward
        self.num_experts = block.num_experts
        self.param_names = block.expert_param_names
        self.group = group
        self.ep = dist.get_world_size(group)

    def __call__(self, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        routing = self._route(top_k_index.reshape(-1))
        token = routing.order // k
        received = self._exchange(hidden[token], routing.recv, routing.send)
        by_expert, local_index = _group_by_expert(routing.recv_counts)
        rows = received[by_expert]
        ones = rows.new_ones(rows.shape[0], 1)
        with _local_parameters(module, self.param_names):
            out = self.local_forward(rows, local_index.unsqueeze(1), ones)
        back = torch.empty_like(out).index_copy(0, by_expert, out)
        y = self._exchange(back, routing.send, routing.recv)
        y = y * top_k_weights.reshape(-1)[routing.order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(hidden).index_add(0, token, y.to(hidden.dtype))

    def _route(self, choice: torch.Tensor) -> _Routing:
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=self.num_experts)
        local = self.num_experts // self.ep
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(self.ep, local)
        send = counts.view(self.ep, local).sum(dim=1).tolist()
        return _Routing(order, send, recv_counts.sum(dim=1).tolist(), recv_counts)

    def _exchange(self, rows: torch.Tensor, out_splits: list[int],
                  in_splits: list[int]) -> torch.Tensor:
        # torch.distributed.nn.functional's all_to_all_single is deprecated in favour of
        # this one (torchtitan's choice too); it returns an async tensor: wait before use.
        out = funcol.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits,
                                                self.group)
        return funcol.wait_tensor(out)


def _group_by_expert(recv_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows come peer by peer, each peer's sorted by local expert. Returns the
    permutation that orders them by local expert (peer order kept inside one expert), and
    each reordered row's local expert."""
    ep, local = recv_counts.shape
    expert_of_row = torch.arange(local, device=recv_counts.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    return by_expert, expert_of_row[by_expert]
