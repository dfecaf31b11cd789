"""One device, planned and trained: predicted against measured peak memory and step time.

    python bench/single_device.py --profile h100.toml    # on a GPU: gpt2-xl, bfloat16
    python bench/single_device.py                        # on CPU: gpt-small, float32
    python bench/single_device.py --model gpt2-xl --batch 4 --seq 1024 --dtype float32

1. Cluster: ``--profile`` (e.g. written by ``autopar calibrate --nproc 1 --topology
   dgx-h100``), cut to one device; without it, ``autopar calibrate``'s one-device
   measurement runs first (``autopar.calibrate.calibrate(1, topology=--topology)``: the
   links do not matter to one device, the host memory for offloading does).
2. Plan: ``autopar.plan`` for that one device, so the search decides recomputation (and
   what else one device allows) from the model's memory against the device's.
3. Measure: one rank (NCCL on CUDA, gloo on CPU) trains with the plan
   (``autopar.lower.make_trainer``); the median step after ``--warmup``; then the peak over
   one more step. On CUDA: ``torch.cuda.max_memory_allocated`` since
   ``reset_peak_memory_stats`` (bytes the caching allocator handed out: parameters,
   gradients, optimizer states, activations, temporaries), with the reserved peak beside it
   for the allocator margin. On CPU: ``MemTracker``'s peak of live tensor bytes, as
   bench/cost_fidelity.py measures it.

Predicted memory is the plan's peak without its allocator margin
(``Cluster.memory_margin_fraction``); the margin is printed against what the allocator
reserved beyond what it handed out. Errors are (predicted − measured) / measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from cost_fidelity import tracked_peak
from step_timing import median_step_s

from autopar.api import search_plans
from autopar.calibrate import Settings, calibrate, write_profile
from autopar.lower import make_trainer
from autopar.zoo import get_model
from cost_models.compute import gemm_efficiency
from cost_models.hardware import Cluster
from runtime.launch import spawn
from runtime.plan import Plan, option_label

MiB, GiB = 1024**2, 1024**3
DEFAULTS = {True: ("gpt2-xl", 8, 1024, "bfloat16"), False: ("gpt-small", 8, 128, "float32")}
"""On a GPU / on CPU: (model, global batch, sequence, precision)."""


def one_device(args: argparse.Namespace, cuda: bool) -> Cluster:
    """The profile (or a one-device calibration of this machine), cut to one device."""
    if args.profile:
        cluster = Cluster.from_toml(args.profile)
    else:
        vocab = get_model(args.model).config.vocab_size
        settings = Settings(loss_shape=(args.batch * args.seq, vocab))
        cal = calibrate(1, backend="nccl" if cuda else "gloo", settings=settings,
                        topology=Cluster.load(args.topology))
        with tempfile.TemporaryDirectory() as tmp:
            cluster = write_profile(cal, Path(tmp) / "profile.toml")
    return replace(cluster, nodes=1, devices_per_node=1)


def measure_job(model: str, plan_json: str, batch: int, seq: int, steps: int, warmup: int,
                cuda: bool) -> tuple[float, int, int | None, dict[str, int]]:
    """On the one rank: (median step s, peak bytes, peak reserved bytes on CUDA, MemTracker's
    categories at the peak on CPU)."""
    spec = get_model(model)
    trainer = make_trainer(spec.build(seed=0), Plan.from_json(plan_json), spec.loss_fn,
                           spec.example_inputs(batch, seq, device="meta"),
                           device_type="cuda" if cuda else "cpu")
    step_s = median_step_s(trainer, lambda step: spec.make_batch(batch, seq, seed=step),
                           warmup=warmup, steps=steps)
    inputs, targets = spec.make_batch(batch, seq, seed=warmup + steps)
    if not cuda:
        peak, parts = tracked_peak(trainer, inputs, targets)
        return step_s, peak, None, parts
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(inputs, targets)
    torch.cuda.synchronize()
    return step_s, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), {}


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


def main() -> None:
    cuda = torch.cuda.is_available()
    model, batch, seq, dtype = DEFAULTS[cuda]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a cluster profile (.toml) instead of calibrating")
    parser.add_argument("--topology", default="dgx-h100" if cuda else "local",
                        help="without --profile: the cluster whose host the device has")
    parser.add_argument("--model", default=model)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    t0 = time.perf_counter()
    cluster = one_device(args, cuda)
    spec = get_model(args.model)
    result = search_plans(spec.build("meta"), cluster,
                          spec.example_inputs(args.batch, args.seq, device="meta"),
                          precision=args.dtype, model_name=spec.name, seq_len=args.seq)
    plan = result.plan
    step_s, peak, reserved, parts = spawn(
        measure_job, 1, spec.name, plan.to_json(), args.batch, args.seq, args.steps,
        args.warmup, cuda, backend="nccl" if cuda else "gloo", timeout_s=1800)[0]

    mem = plan.prediction.memory
    predicted = mem.total_bytes - mem.margin_bytes
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    device = torch.cuda.get_device_name(0) if cuda else "one CPU process (gloo)"
    print(f"{spec.name}, global batch {args.batch}, seq {args.seq}, {args.dtype}, AdamW; "
          f"{device}; {platform.node()}, {when}")
    print(f"cluster: {cluster.source}")
    d = cluster.device
    print(f"  {d.name}: memory {d.memory_bytes / GiB:.1f} GiB, large-GEMM rate "
          + ", ".join(f"{k} {v * gemm_efficiency(d, k) / 1e12:.3g} TFLOP/s"
                      for k, v in d.peak_flops.items())
          + f", memory-bound kernels {d.memory_bandwidth_GBps:.0f} GB/s")
    options = [option_label(la.strategy, la.recompute, la.offload, la.sequence_parallel)
               for la in plan.layers]
    print(f"plan: {plan.mesh.describe()}; "
          + ", ".join(f"{options.count(o)} x {o}" for o in dict.fromkeys(options)))
    head = f"{'':<22} {'predicted':>10} {'measured':>10} {'error':>8}"
    print(head)
    print("-" * len(head))
    print(f"{'step time, ms':<22} {plan.prediction.step_time_s * 1e3:>10.1f} "
          f"{step_s * 1e3:>10.1f} {error(plan.prediction.step_time_s, step_s):>8}")
    print(f"{'peak memory, MiB':<22} {predicted / MiB:>10.1f} {peak / MiB:>10.1f} "
          f"{error(predicted, peak):>8}")
    print(f"  modelled: params {mem.params_bytes / MiB:.1f}, grads {mem.grads_bytes / MiB:.1f}, "
          f"optimizer {mem.optimizer_bytes / MiB:.1f}, activations "
          f"{mem.activations_bytes / MiB:.1f}, buffers {mem.buffers_bytes / MiB:.1f} MiB")
    if reserved is not None:
        print(f"  allocator: reserved {reserved / MiB:.1f} MiB at peak, "
              f"{(reserved - peak) / MiB:.1f} beyond what it handed out; the model's margin "
              f"{mem.margin_bytes / MiB:.1f}")
    if parts:
        print("  MemTracker at the peak: " + ", ".join(
            f"{k} {v / MiB:.1f}" for k, v in parts.items() if k != "Total" and v))
    print(f"(time: median of {args.steps} steps after {args.warmup} warm-up; memory: one more "
          f"step; total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
