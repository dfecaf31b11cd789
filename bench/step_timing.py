"""Timing one trainer's steps on every rank of a gloo job (shared by the bench scripts)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def step_times_s(trainer, make_batch: Callable[[int], tuple], *, warmup: int, steps: int
                 ) -> list[float]:
    """Per measured step, the slowest rank's wall time (all ranks start together; on CUDA
    from an idle device to the step's last kernel)."""
    import torch
    import torch.distributed as dist

    cuda = trainer.device.type == "cuda"
    times = []
    for step in range(warmup + steps):
        inputs, targets = make_batch(step)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(inputs, targets)
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64,
                               device=trainer.device)  # NCCL reduces device tensors only
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(elapsed.item())
    return times


def median_step_s(trainer, make_batch: Callable[[int], tuple], *, warmup: int, steps: int
                  ) -> float:
    return statistics.median(step_times_s(trainer, make_batch, warmup=warmup, steps=steps))
