"""Each rank's share of a map-style dataset: the data side of a user's own training loop.

``data_loader(trainer, dataset)`` wraps a ``torch.utils.data.DataLoader`` whose
``DistributedSampler`` runs over the plan's data-parallel replicas (``num_replicas`` =
mesh.dp, ``rank`` = this rank's dp index), so no rank loads the global batch:

- the tp (and cp) ranks of one replica have the same dp index, hence the same samples;
  context-parallel ranks then keep their zigzag chunks of each sequence (dim 1), as
  ``Trainer.shard_batch`` does;
- a pipeline rank gets the inputs only if it runs the first stage and the targets only
  if it runs the last; a rank running neither reads nothing from the dataset and gets
  ``(None, None)``, once per step like the others;
- the local batch is the global batch / dp, on the trainer's device, ready for
  ``trainer.train_step(inputs, targets, global_batch=False)`` or ``forward_backward``,
  which cut it into the plan's micro-batches (gradient accumulation, pipeline).

Items: with a ``loss_fn`` each item is ``(inputs, targets)``; without one (a model that
returns its own loss, e.g. a Hugging Face model given ``labels``) each item is the
model's inputs and the targets are None. Either way the loader yields ``(inputs,
targets)`` pairs of local batches.

Order: the sampler shuffles with ``seed + epoch`` (call ``set_epoch`` each epoch), the same
permutation on every rank; global batch ``k`` is permutation positions
``[k * global_batch, (k + 1) * global_batch)``, the batch one process reading the same
permutation in steps of ``global_batch`` takes (the ranks interleave within it, which a
mean loss does not see). ``drop_last`` (the default) drops the samples that do not fill a
global batch; ``drop_last=False`` keeps a last, smaller batch, for which the sampler pads
the dataset to a multiple of dp by repeating its first samples (``DistributedSampler``'s
rule), so that every replica holds as many samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from runtime.plan import PlanError


class ShardedLoader:
    """This rank's local batches of a dataset under a trainer's plan; see the module
    docstring. Iterate it for ``(inputs, targets)``; ``set_epoch`` before each epoch."""

    def __init__(self, trainer: Any, dataset: Dataset, *, global_batch: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 collate_fn: Callable | None = None, num_workers: int = 0,
                 **loader_kwargs: Any) -> None:
        plan = trainer.plan
        self.trainer = trainer
        self.global_batch = plan.global_batch if global_batch is None else global_batch
        self.local_batch = check_loader_args(dataset, self.global_batch, plan, drop_last)
        self.sampler = DistributedSampler(dataset, num_replicas=plan.mesh.dp,
                                          rank=trainer.dp_rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
        self.drop_last = drop_last
        self.pairs = trainer.loss_fn is not None
        self.reads = trainer.has_first or trainer.has_last
        self.loader = DataLoader(dataset, batch_size=self.local_batch, sampler=self.sampler,
                                 drop_last=drop_last, collate_fn=collate_fn,
                                 num_workers=num_workers, **loader_kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (the same permutation on every rank)."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if not self.reads:  # a middle pipeline stage: activations come from the previous one
            for _ in range(len(self)):
                yield None, None
            return
        for batch in self.loader:
            yield self._place(batch)

    def _place(self, batch: Any) -> tuple[Any, Any]:
        if self.pairs:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise PlanError(
                    f"with a loss_fn each dataset item must be an (inputs, targets) pair, but "
                    f"a batch came as {type(batch).__name__}"
                    + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                    + "; return (inputs, targets) from the Dataset's __getitem__")
            inputs, targets = batch
        else:
            inputs, targets = batch, None
        inputs, targets = self.trainer.local_batch(inputs, targets)
        return (inputs if self.trainer.has_first else None,
                targets if self.trainer.has_last else None)


def check_loader_args(dataset: Dataset, global_batch: int, plan: Any, drop_last: bool) -> int:
    """The local batch (global_batch / dp); PlanError, before any collective, for a
    dataset or batch the plan cannot share out evenly."""
    dp, splits = plan.mesh.dp, plan.microbatches
    what = "pipeline.num_microbatches" if plan.pipeline else "gradient_accumulation"
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise PlanError(
            f"the data helper needs a map-style Dataset (with __len__ and __getitem__), got "
            f"{type(dataset).__name__}; shard an iterable dataset yourself by the trainer's "
            "dp_rank and dp_size")
    if global_batch < 1 or global_batch % (dp * splits):
        raise PlanError(
            f"global batch {global_batch} does not split over the plan's dp={dp} replicas "
            f"into {what}={splits} equal micro-batches each; use a multiple of "
            f"dp × {what} = {dp * splits}")
    size = len(dataset)
    if size < dp:
        raise PlanError(
            f"the dataset has {size} sample(s), fewer than the plan's {dp} data-parallel "
            "replicas: some ranks would get no data; use a larger dataset or a plan with a "
            "smaller mesh.dp")
    if drop_last and size < global_batch:
        raise PlanError(
            f"the dataset has {size} sample(s), less than one global batch of {global_batch} "
            "(drop_last=True drops an incomplete batch, so no step would run); use a larger "
            "dataset or a smaller global batch")
    if not drop_last and plan.mesh.pp > 1:
        raise PlanError(
            "a pipeline runs at fixed micro-batch shapes, so its last, smaller batch cannot "
            "run: use drop_last=True")
    local = global_batch // dp
    tail = -(-size // dp) % local  # the last local batch's size when it is incomplete
    if not drop_last and tail % splits:
        raise PlanError(
            f"with drop_last=False the last local batch has {tail} samples, which do not "
            f"split into {what}={splits} equal micro-batches; use drop_last=True")
    return local


def data_loader(trainer: Any, dataset: Dataset, **kwargs: Any) -> ShardedLoader:
    """This rank's share of ``dataset`` under ``trainer``'s plan (see ``ShardedLoader``)."""
    return ShardedLoader(trainer, dataset, **kwargs)
