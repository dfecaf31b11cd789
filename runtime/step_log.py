"""A training log line every N steps, through ``logging`` (logger ``autopar.steps``).

One plain line per report, no carriage returns, so a SLURM log or a file reads as well as
a terminal::

    step 20 | loss 2.314159 | 8192 tokens/s | 0.125 s/step (plan 0.100 s) | mfu 31.2% (plan 39.0%) | peak memory 1.52 GiB (rss)

- throughput: the plan's global batch per step over the wall time since the last report
  (tokens when the samples have a sequence length: ``tokens_per_sample`` or the plan's
  ``seq_len``, else samples);
- MFU (model FLOPs utilisation, PaLM's definition, Chowdhery et al. 2022, appendix B):
  the model's forward + backward FLOPs per step, without recomputation, over the step
  time and the peak FLOP/s of every rank (``Plan.rationale``); beside it what the plan's
  modelled step time (``Plan.prediction.step_time_s``) would give, so the line says how
  far the run is from the plan's prediction;
- peak memory of this rank: the CUDA allocator's high-water mark on a GPU, else the
  process's resident-set high-water mark (``resource.getrusage``), which includes
  Python and torch themselves.

The level is the caller's (``logging.basicConfig``, or ``autopar``'s ``--log-level``);
lines are written at INFO, by rank 0 only unless ``all_ranks``.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("autopar.steps")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """This process's peak memory in bytes, and what was measured."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "rss"  # Linux reports KiB


class StepLog:
    """Call ``log(step, loss)`` after every step; every ``every``-th call writes a line.

    ``trainer``: anything with ``plan`` and ``device`` (both trainers). ``clock``: seconds,
    monotonic (a test may pass its own).
    """

    def __init__(self, trainer: Any, every: int = 10, *, tokens_per_sample: int | None = None,
                 all_ranks: bool = False, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        self.plan = trainer.plan
        self.device = trainer.device
        self.every = every
        self.tokens_per_sample = tokens_per_sample or self.plan.seq_len
        self.clock = clock
        self.quiet = not all_ranks and dist.is_initialized() and dist.get_rank() != 0
        self._since = clock()
        self._steps = 0

    def __call__(self, step: int, loss: float) -> str | None:
        """Count a step; every ``every`` steps log (and return) the line."""
        self._steps += 1
        if self._steps < self.every:
            return None
        now = self.clock()
        line = self.format(step, float(loss), (now - self._since) / self._steps)
        self._since, self._steps = now, 0
        if not self.quiet:
            logger.info(line)
        return line

    log = __call__

    def format(self, step: int, loss: float, step_s: float) -> str:
        """The report of ``step`` given the measured seconds per step."""
        parts = [f"step {step}", f"loss {loss:.6f}", self._throughput(step_s)]
        predicted = self.plan.prediction.step_time_s if self.plan.prediction else None
        parts.append(f"{step_s:.3f} s/step"
                     + (f" (plan {predicted:.3f} s)" if predicted is not None else ""))
        parts.append(self._mfu(step_s, predicted))
        used, what = peak_memory(self.device)
        parts.append(f"peak memory {used / 2**30:.2f} GiB ({what})")
        return " | ".join(parts)

    def _throughput(self, step_s: float) -> str:
        samples = self.plan.global_batch / max(step_s, 1e-12)
        if self.tokens_per_sample:
            return f"{samples * self.tokens_per_sample:.0f} tokens/s"
        return f"{samples:.1f} samples/s"

    def _mfu(self, step_s: float, predicted_s: float | None) -> str:
        why = self.plan.rationale
        if why is None or not why.model_flops_per_step or not why.peak_flops_per_device:
            return "mfu n/a (the plan has no FLOP count)"
        peak = why.peak_flops_per_device * self.plan.world_size

        def mfu(seconds: float) -> str:
            percent = 100 * why.model_flops_per_step / (max(seconds, 1e-12) * peak)
            return f"{percent:.1f}" if percent >= 1 else f"{percent:.2g}"  # small models

        text = f"mfu {mfu(step_s)}%"
        return text + (f" (plan {mfu(predicted_s)}%)" if predicted_s else "")
