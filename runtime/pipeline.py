"""Pipeline-parallel training: stage modules run by ``torch.distributed.pipelining``.

The order, per rank, extending ``runtime.apply``'s for ``mesh.pp > 1``:

    1. validate        plan, world and stage modules; no collective yet
    2. mesh            the (pp, dp, tp) DeviceMesh; this rank's pp coordinate picks its
                       stages (``runtime.plan.stage_rank``: looped, or V for ZBVZeroBubble)
    3. tensor parallel per stage module, on the stage's tp axis       (runtime.tensor_parallel)
    4. recompute       the stage's layers' forwards checkpointed     (runtime.recompute)
    5. data parallel   FSDP2 per layer, then each stage module as a root, on the stage's
                       (dp, tp) sub-meshes, with the plan's precision (runtime.data_parallel,
                       runtime.precision)
    6. sends           with ``pipeline.scatter_sends``, each stage sends its tp rank's slice
                       to another pipeline rank and gathers what it receives over tp; a
                       boundary between two sequence-parallel layers passes each tp rank's
                       sequence shard as it is, scattered or not (runtime.pipeline_sends)
    7. schedule        one manual ``PipelineStage`` per local stage (``Pipe.build_stage``
                       hangs with V schedules on gloo: the rank holding two adjacent stages
                       sends to itself), and the plan's ``Schedule*`` class over the pp axis

Data parallelism is FSDP2 for every strategy, ``replicate`` included (the (n, 1) HSDP
mesh of ``runtime.data_parallel``), never DDP: with the zero-bubble schedules DDP skips
the all-reduce of the split weight-gradient pass and gives silently wrong gradients
(shared/TORCH_ON_CPU.md), while the schedules drive FSDP2's reduction themselves
(``PipelineStage.perform_reduce_grad``). tests/runtime/test_pipeline_numerics.py checks every
schedule with dp and tp against one process.

Loss and gradients: each dp replica splits its slice of the global batch into
``num_microbatches`` equal micro-batches; the last stage computes ``loss_fn`` (a mean) per
micro-batch. autograd sums the micro-batches' gradients, and the schedule divides them by
``num_microbatches`` (``scale_grads=True``), which gives the gradient of the replica's
mean loss; FSDP2 then averages over dp (and over identical tp copies). That is the
gradient of the global mean loss, as for ``pp == 1``.

Precision: activations cross stages in ``param_dtype`` (only the last stage casts its
output to float32, for the loss). float16 scales the last stage's loss inside the
schedule's loss function; the scaler's overflow flag is all-reduced over every rank, so
all stages skip the same steps. Across micro-batches the schedule sets the FSDP2 flags of
every stage itself: parameters stay gathered and gradients accumulate unsharded until
the last micro-batch, whatever the layer's ZeRO stage (zero1, zero2 and fsdp run the same
program here; only their memory between steps differs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from cost_models.schedule import SCHEDULES
from runtime.apply import check_world
from runtime.batch import Inputs, as_inputs, batch_size, check_splits
from runtime.data_parallel import apply_fsdp
from runtime.device import rank_device
from runtime.materialize import (
    broadcast_weights,
    check_initializable,
    common_seed,
    materialize,
    on_meta,
)
from runtime.mesh import build_mesh, data_parallel_meshes
from runtime.pipeline_sends import add_scattered_sends, sequence_sharded_boundaries
from runtime.plan import SPLIT_BACKWARD_SCHEDULES, Plan, PlanError, stage_rank
from runtime.precision import fsdp_policies, make_loss_scaler
from runtime.recompute import apply_recompute
from runtime.stage_graphs import on_rank_device, uses_a_weight_twice
from runtime.tensor_parallel import apply_tensor_parallel, validate_tp_layer
from runtime.tied import TiedGradSync, shared_across_stages
from runtime.train import LossFn, OptimizerFactory, SchedulerFactory, Trainer, _adamw

logger = logging.getLogger(__name__)

SCHEDULE_CLASSES = {name: getattr(schedules, f"Schedule{name}") for name in SCHEDULES}
"""cost_models.schedule.SCHEDULES name -> torch class; single-stage ones take one stage per
rank."""


def local_stage_ids(plan: Plan, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, in stage order."""
    return [s for s in range(plan.num_stages)
            if stage_rank(s, plan.mesh.pp, plan.pipeline) == pp_rank]


def validate_pipeline(stages: Sequence[nn.Module], plan: Plan, model: nn.Module | None = None
                      ) -> None:
    """Raise PlanError if the stage modules cannot run ``plan`` here. Local: no collective."""
    if plan.mesh.pp < 2 or plan.pipeline is None:
        raise PlanError(
            f"mesh.pp={plan.mesh.pp}: a pipeline needs pp >= 2 and a 'pipeline' section; "
            "run pp=1 plans with runtime.train.Trainer"
        )
    check_world(plan)
    if any(on_meta(m) for m in stages):
        if model is None:
            raise PlanError("stage modules on the meta device need model=, the model they "
                            "were split from, whose initialisation fills them")
        check_initializable(model)
    if len(stages) != plan.num_stages:
        raise PlanError(
            f"got {len(stages)} stage module(s) but the plan has {plan.num_stages} stages "
            "(mesh.pp × pipeline.virtual_stages); split the model with the same plan"
        )
    for layer in plan.layers:
        module = stages[layer.stage]
        try:
            module.get_submodule(layer.module)
        except AttributeError:
            raise PlanError(
                f"layer {layer.module!r} is planned on stage {layer.stage} but stage module "
                f"{layer.stage} has no such submodule; split the model with the same plan"
            ) from None
        if layer.is_tp:
            validate_tp_layer(module, layer, plan.mesh.tp)


def _no_weight_pass() -> Callable[[], None]:
    return lambda: None


def _keep_unsharded_through_step(module: nn.Module) -> None:
    """Sharded layers keep their gathered parameters from forward to the end of backward.

    The zero-bubble schedules find a stage's weights for the split weight-gradient pass
    from ``module.parameters()`` before backward starts; a layer resharded after forward
    shows its sharded parameters there, which are not in the autograd graph, so its
    weight gradients were silently never computed (seen: ``None`` for every sharded
    parameter of the last stage). Not resharding also saves one all-gather per
    micro-batch (torchtitan's default under pipelining); parameters are still resharded
    after backward, and gradients and optimizer states stay sharded.
    """
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_reshard_after_forward(False, recurse=False)


def _sendable(t: torch.Tensor, own_storage: bool) -> torch.Tensor:
    """``t`` as a point-to-point send takes it: contiguous (gloo and NCCL refuse other
    layouts, and a stage may end in a transpose or permute, as ConvNeXt's and Swin's blocks
    do), and with ``own_storage`` not a view.

    The split-backward schedules free a stage's graph by ``detach_()``-ing its outputs
    after the input-gradient pass, which raises on a view (pytorch/pytorch#142229). A
    tensor-parallel layer ending a stage returns one: ``DTensor.to_local`` is a view. A
    copy of the stage's boundary activation per micro-batch, small beside the stage's work
    (its base is freed with the view)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if not local.is_contiguous():
        return t.contiguous()
    return t.clone() if own_storage and t._is_view() else t


def _sendable_outputs(own_storage: bool):
    """A forward hook: the stage's outputs as its sends to the next stage take them."""
    def hook(module: nn.Module, args: tuple, output: object) -> object:
        return tree_map_only(torch.Tensor, lambda t: _sendable(t, own_storage), output)
    return hook


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of a stage's
    input is sent to the previous stage as autograd leaves it, and a stage that begins with
    a transpose leaves it transposed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _sendable_input_grads(module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the received activations, whose gradients are sent back."""
    return tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad
                 else a for a in args)


def _drop_root_kwargs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook for every stage but the first: torch's multi-stage schedules give
    the model's keyword inputs to each stage a rank holds (interleaved and V schedules hold
    the first stage beside a later one), but only the first stage takes them; a later stage
    receives what it reads of them from its predecessor."""
    return args, {}


def _adapt_boundaries(module: nn.Module, stage_id: int, plan: Plan) -> None:
    """What a stage receives and sends, as torch's schedules hand and take it: no root
    keyword inputs past the first stage, contiguous sends both ways (after any scattered
    send's slicing, which registers first)."""
    if stage_id > 0:
        module.register_forward_pre_hook(_drop_root_kwargs, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(_sendable_input_grads)
    split = plan.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES
    module.register_forward_hook(_sendable_outputs(own_storage=split))


class _Stage(PipelineStage):
    """torch's ``PipelineStage``, with integer values defined in its metadata run.

    Given no example inputs, a later stage infers its outputs on the first step by running
    once on buffers of the received shapes (``_forward_metadata_inference``), which torch
    leaves uninitialised (``torch.empty``). Floating activations only pass through that
    run, but an index tensor crossing a cut (T5's ``decoder_input_ids`` read by the
    decoder's embedding, positions, masks) holds arbitrary values there and an embedding
    fails on it: index out of range. Zeros are in range for every index; the real sends
    that follow are what trains, unchanged."""

    def _to_tensor(self, arg: object) -> torch.Tensor:
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
            with torch.no_grad():
                t.zero_()
        return t


def _schedule(plan: Plan, stages: list[PipelineStage], loss_fn: LossFn, scale_grads: bool):
    cls = SCHEDULE_CLASSES[plan.pipeline.schedule]
    m = plan.pipeline.num_microbatches
    if issubclass(cls, PipelineScheduleSingle):
        (stage,) = stages
        return cls(stage, m, loss_fn=loss_fn, scale_grads=scale_grads)
    assert issubclass(cls, PipelineScheduleMulti)
    return cls(stages, m, loss_fn=loss_fn, scale_grads=scale_grads)


class PipelineTrainer(Trainer):
    """``Trainer``'s API for ``mesh.pp > 1``: applies ``plan`` to the stage modules (in
    place) and trains them one step at a time with the plan's schedule.

    ``stages`` holds every stage module (index = stage id, as ``passes.split_stages``
    makes them); this rank keeps and trains only its own. ``tied``: per parameter that
    several stages hold a copy of (tied weights), {stage: its name in that stage's module}
    (``passes.split_stages.StageSplit.tied``). ``output_fn``: maps the last stage's
    output to what the model returns, before ``loss_fn`` (``StageSplit.output_fn``: an
    exported last stage returns flat tensors, as a ``PipelineStage`` requires).
    ``shard_batch``, ``step`` and ``train_step`` are ``Trainer``'s.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        plan: Plan,
        loss_fn: LossFn,
        optimizer_factory: OptimizerFactory = _adamw,
        *,
        device_type: str = "auto",
        scale_grads: bool = True,
        tied: Sequence[Mapping[int, str]] = (),
        output_fn: Callable[[object], object] | None = None,
        model: nn.Module | None = None,
        seed: int | None = None,
        lr_scheduler_factory: SchedulerFactory | None = None,
    ) -> None:
        validate_pipeline(stages, plan, model)
        self.plan = plan
        self.output_fn = output_fn
        self.loss_fn = loss_fn
        self._device = rank_device(device_type)
        self.mesh = build_mesh(plan.mesh, self._device.type)
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.dp_size = plan.mesh.dp
        self.stage_ids = local_stage_ids(plan, self.pp_rank)
        self.stages = [stages[s] for s in self.stage_ids]
        """This rank's stage modules (parallelized in place), in stage order."""
        # Copies of one parameter on several stages start equal; training them as one
        # parameter sums their gradients across those stages. The export split names its
        # copies (``tied``); stages cut by symbolic tracing still share the tensor itself,
        # found before parallelizing.
        given = [tuple(sorted(t.items())) for t in tied]
        found = [t for t in shared_across_stages(stages) if tuple(sorted(t)) not in given]
        self.tied = TiedGradSync(given + found, plan, self.mesh)
        self.module = self.stages[0] if len(self.stages) == 1 else None
        self.loss_scaler = make_loss_scaler(plan, self._device)
        if self.loss_scaler is not None:
            # Creates the scale on every rank; only the last stage scales a loss.
            self.loss_scaler.scale(torch.ones((), device=self._device))
        meta = any(on_meta(m) for m in stages)
        if not meta:  # ranks seeded differently: every stage of every rank holds rank 0's
            for module in stages:
                broadcast_weights(module)
        # torch's split backward groups a stage's weights by the autograd nodes that lead to
        # them, and does not merge the groups a weight used twice joins: its weight pass
        # then runs backward twice through one node. Such a stage computes its weight
        # gradients with its input gradients (a ``dw_builder`` whose weight pass is empty).
        whole_backward = [plan.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES
                          and uses_a_weight_twice(module) for module in self.stages]
        for s, module in zip(self.stage_ids, self.stages, strict=True):
            self._parallelize(s, module, meta)
        if meta:
            materialize(model, self._device, common_seed(seed), stages=self.stages)
        pipe_stages = [_Stage(module, s, plan.num_stages, self._device,
                              group=self.mesh.get_group("pp"), get_mesh=self._stage_mesh,
                              dw_builder=_no_weight_pass if whole else None)
                       for s, module, whole in zip(self.stage_ids, self.stages, whole_backward,
                                                   strict=True)]
        self.schedule = _schedule(plan, pipe_stages, self._scaled_loss, scale_grads)
        self.has_first = 0 in self.stage_ids
        self.has_last = plan.num_stages - 1 in self.stage_ids
        self.make_optimizer(self.grad_parameters(), optimizer_factory, lr_scheduler_factory)
        logger.info("pipeline %s: pp rank %d runs stage(s) %s, %d micro-batches",
                    plan.pipeline.schedule, self.pp_rank, self.stage_ids,
                    plan.pipeline.num_microbatches)

    def _parallelize(self, stage_id: int, module: nn.Module, meta: bool) -> None:
        """TP, recompute and FSDP2 on one stage module (in place; on meta, allocated
        afterwards by ``runtime.materialize``)."""
        plan = self.plan
        on_rank_device(module, self._device)
        if not meta:
            module.to(self._device)
        meshes = data_parallel_meshes(self.mesh["dp", "tp"], plan.hsdp_shard_size)
        self._tp_mesh = meshes.tp  # where received sequence shards live (``_stage_mesh``)
        layers = [la for la in plan.layers if la.stage == stage_id]
        sharded = sequence_sharded_boundaries(plan)
        apply_tensor_parallel(module, layers, meshes.tp, sp_before=stage_id - 1 in sharded,
                              sp_after=stage_id in sharded)
        apply_recompute(module, layers)
        layer_policy, root_policy = fsdp_policies(plan)
        last = stage_id == plan.num_stages - 1
        apply_fsdp(module, layers, meshes, mp_policy=layer_policy,
                   root_mp_policy=root_policy if last else layer_policy)
        _keep_unsharded_through_step(module)
        add_scattered_sends(module, stage_id, plan, self.mesh.get_group("tp"),
                            self.mesh.get_local_rank("tp"))
        _adapt_boundaries(module, stage_id, plan)

    def _stage_mesh(self, dim_names: tuple[str, ...], layout: object) -> DeviceMesh | None:
        """The mesh a DTensor received from a neighbouring stage lives on here: sequence
        shards (``sequence_sharded_boundaries``) are on the tp mesh, whose layout is the
        same on every pipeline rank; the pipeline finds it by names and layout."""
        tp = self._tp_mesh
        if tuple(tp.mesh_dim_names or ()) == tuple(dim_names) and tp._layout == layout:
            return tp
        return None

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.output_fn is not None:
            output = self.output_fn(output)
        loss = self.loss_fn(output, target)
        return loss if self.loss_scaler is None else self.loss_scaler.scale(loss)

    @property
    def device(self) -> torch.device:
        return self._device

    def forward_backward(self, inputs: object, targets: torch.Tensor | None) -> torch.Tensor:
        """One pipelined forward and backward of this replica's local batch over every
        micro-batch; returns the global mean loss on every rank. Collective.

        Only a rank running the first stage reads ``inputs`` and only one running the last
        reads ``targets``; the others may pass None (``runtime.data`` gives them None)."""
        self._check_roles(inputs, targets)
        batch = as_inputs(inputs) if inputs is not None else Inputs()
        if inputs is not None or targets is not None:
            check_splits(batch_size(batch, targets), self.plan.pipeline.num_microbatches,
                         self.dp_size, "pipeline.num_microbatches")
        losses: list[torch.Tensor] = []
        args = batch.args if self.has_first else ()
        # return_outputs=False: the last stage would otherwise keep every micro-batch's
        # output (the logits) until the step ends and then concatenate them into one more
        # copy, to return a value nothing here uses.
        self.schedule.step(*args, target=targets if self.has_last else None,
                           losses=losses if self.has_last else None, return_outputs=False,
                           **(batch.kwargs if self.has_first else {}))
        # Tied copies' gradients summed here, not in ``step``: forward_backward returns
        # the whole gradient, as one process has it (for clipping, inspection).
        self.tied.sync(self.stages, self.stage_ids)
        local = torch.stack(losses).mean().detach() if self.has_last else torch.zeros(())
        if self.has_last and self.loss_scaler is not None:
            local = local / self.loss_scaler.get_scale()
        total = local.to(self._device, torch.float32)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        # One pp coordinate holds the last stage: dp × tp ranks (tp copies are equal).
        return total / (self.plan.mesh.dp * self.plan.mesh.tp)

    def _check_roles(self, inputs: object, targets: object) -> None:
        for needed, given, what in ((self.has_first, inputs, "first stage needs the inputs"),
                                    (self.has_last, targets, "last stage needs the targets")):
            if needed and given is None:
                raise PlanError(
                    f"pipeline rank {self.pp_rank} runs stage(s) {self.stage_ids}: the {what}, "
                    "but got None; give every rank the batch (or use runtime.data's loader)")

    def grad_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.stages for p in m.parameters()]

    def norm_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters less the tied copies another stage counts (each copy
        holds the tie's whole gradient after ``forward_backward``)."""
        local = dict(zip(self.stage_ids, self.stages, strict=True))
        skip = {id(local[s].get_parameter(n)) for s, n in self.tied.counted_elsewhere}
        return [p for p in self.grad_parameters() if id(p) not in skip]

    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters of every stage, by the user's names, on CPU, on every rank.
        Collective: gathers across tp/dp within a stage, then across pipeline ranks."""
        mine: dict[str, torch.Tensor] = {}
        for module in self.stages:
            for name, param in module.named_parameters():
                value = param.detach()
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                mine[name] = value.cpu().clone()
        gathered: list[dict[str, torch.Tensor] | None] = [None] * self.plan.mesh.pp
        dist.all_gather_object(gathered, mine, group=self.mesh.get_group("pp"))
        out: dict[str, torch.Tensor] = {}
        for part in gathered:
            out.update(part or {})
        return out
